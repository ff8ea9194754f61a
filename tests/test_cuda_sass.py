"""scripts/cuda_sass.py reads ptxas' report and cuobjdump's SASS per kernel (a canned
excerpt of each here; the script itself compiles the kernels, which takes a minute)."""

import importlib.util
import pathlib

spec = importlib.util.spec_from_file_location(
    "cuda_sass", pathlib.Path(__file__).parents[1] / "scripts" / "cuda_sass.py")
cuda_sass = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cuda_sass)

PTXAS = """\
ptxas info    : Compiling entry function '_ZN1a1kE' for 'sm_90'
ptxas info    : Function properties for _ZN1a1kE
    104 bytes stack frame, 96 bytes spill stores, 64 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 528 bytes smem
ptxas info    : Compiling entry function '_ZN1a1jE' for 'sm_90'
ptxas info    : Function properties for _ZN1a1jE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 60 registers
"""

SASS = """\
\t\tFunction : _ZN1a1kE
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   LD.E.128 R8, desc[UR4][R6.64] ;
        /*0030*/                   STL.64 [R1], R4 ;
        /*0040*/                   STG.E.U16 desc[UR4][R2.64], R4 ;
\t\tFunction : _ZN1a1jE
        /*0010*/                   LDG.E.64 R4, desc[UR4][R2.64] ;
        /*0020*/                   STG.E.128 desc[UR4][R2.64], R4 ;
"""


def test_resources_are_read_per_kernel():
    assert cuda_sass.resources(PTXAS) == {
        "_ZN1a1kE": {"stack": 104, "spill_stores": 96, "spill_loads": 64, "registers": 80},
        "_ZN1a1jE": {"stack": 0, "spill_stores": 0, "spill_loads": 0, "registers": 60},
    }


def test_memory_instructions_are_counted_per_kernel_by_width_and_space():
    assert cuda_sass.memory_instructions(SASS) == {
        "_ZN1a1kE": {"LDG.E.128": 1, "LD.E.128": 1, "STL.64": 1, "STG.E.U16": 1},
        "_ZN1a1jE": {"LDG.E.64": 1, "STG.E.128": 1},
    }


def test_kernel_names_drop_the_return_type_and_namespaces():
    mangled = ("_ZN10kt_regroup4cuda43_GLOBAL__N__4e4bd84d_10_permute_cu_e0c7df1a19permute_copy"
               "_kernelILi16EEEvNS1_6LaunchENS1_7TensorsILi32EEES5_")
    assert cuda_sass.kernel_name(mangled) == "permute_copy_kernel<16>"
    assert cuda_sass.CAST.search("permute_backward_kernel<Half, double>")
    assert not cuda_sass.CAST.search("permute_backward_kernel<double, double>")
