"""Benchmark of kt_regroup against torchrec, FBGEMM and the copy limit.

Run ``python -m kt_regroup.bench`` (``--help`` for options, ``--quick`` for a
seconds-long smoke run). See ``benchmarks/README.md`` for what the columns mean.

Modules: ``layout`` (what is regrouped), ``providers`` (who regroups it),
``harness`` (round-robin timing and memory probes), ``report`` (tables, JSON, CSV,
PNG), ``cli`` (the command line).
"""

from kt_regroup.bench.cli import main

__all__ = ["main"]
