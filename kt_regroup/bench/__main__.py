import sys

from kt_regroup.bench.cli import main

sys.exit(main())
