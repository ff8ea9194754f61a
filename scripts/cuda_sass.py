"""The machine code a GPU would run, read without a GPU.

Compiles ``kt_regroup/csrc/cuda/permute.cu`` for one architecture (device code only, with
torch's nvcc flags and ptxas' resource report), disassembles it with ``cuobjdump -sass``
and prints per kernel: registers, spill bytes, stack, and the global loads and stores by
width. The kernels named in ``VECTOR`` must issue 128-bit loads and stores (``LDG.E.128``
/ ``STG.E.128``, or the generic ``LD.E.128`` / ``ST.E.128``) and no kernel may spill; the
exit status says whether that holds.

    python scripts/cuda_sass.py [--arch sm_90] [--json]

Needs ``nvcc``, ``cuobjdump`` and ``nvdisasm`` (PyPI ``nvidia-cuda-cuobjdump`` and
``nvidia-cuda-nvdisasm``, pinned in requirements/cpu.txt; found on PATH, beside nvcc or in
site-packages). Against a CPU build
of torch, the one header a CUDA build generates is stubbed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "kt_regroup" / "csrc" / "cuda" / "permute.cu"
# Kernels whose aligned paths move 16 bytes per thread: the forward copies and the
# backward sums (the fused cast converts element by element).
VECTOR = ("permute_copy_kernel", "vbe_copy_kernel", "permute_backward_kernel",
          "vbe_backward_kernel")
# Global (LDG/STG), generic (LD/ST: the compiler could not prove the pointer global) and
# local-memory (LDL/STL: stack arrays, spills) accesses.
# The backward's instantiations that cast (a float16/bfloat16/float32 gradient computed in
# float64): element by element by design.
CAST = re.compile(r"<(Half|BFloat16|float), double>")
MEMORY = re.compile(r"\b(LDG|STG|LD|ST)\.E(\.[A-Z0-9]+)*|\b(LDL|STL)(\.[A-Z0-9]+)*")


def kernel_name(mangled: str) -> str:
    """``permute_copy_kernel<16>``-like short names from the mangled symbol."""
    proc = subprocess.run(["c++filt", mangled], capture_output=True, text=True)
    name = proc.stdout.strip() or mangled
    name = re.sub(r"kt_regroup::cuda::\(anonymous namespace\)::", "", name)
    name = re.sub(r"c10::", "", name)
    return re.sub(r"^void ", "", name.split("(")[0])


def find_tool(name: str, nvcc: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(nvcc).resolve().parent))
    if found:
        return found
    for site in (sysconfig.get_paths()["purelib"], *sys.path):
        for hit in sorted(Path(site).glob(f"nvidia/*/bin/{name}")):
            return str(hit)
    raise SystemExit(f"cuda_sass: no {name} (pip install -r requirements/cpu.txt: "
                     "nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)")


def compile_cubin(arch: str, out: Path, nvcc: str) -> str:
    """Builds the cubin; returns ptxas' report (its -v output)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    stub = out.parent / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "cuda_cmake_macros.h").write_text("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cmd = [nvcc, "-cubin", f"-arch={arch}", "-std=c++20", "-O3", *COMMON_NVCC_FLAGS,
           "-Xptxas", "-v", f"-I{out.parent / 'stub'}",
           *(f"-I{p}" for p in include_paths()), f"-I{sysconfig.get_paths()['include']}",
           f"-I{REPO / 'kt_regroup' / 'csrc'}", str(SOURCE), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"cuda_sass: nvcc failed\n{proc.stderr[-4000:]}")
    return proc.stderr


def resources(report: str) -> Dict[str, dict]:
    """Per mangled kernel: registers, spill store/load bytes and stack bytes."""
    out: Dict[str, dict] = {}
    current = None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
            out[current] = {}
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m:
            out[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[current]["registers"] = int(m.group(1))
    return out


def memory_instructions(sass: str) -> Dict[str, Dict[str, int]]:
    """Per mangled kernel: its global loads and stores by opcode (``LDG.E.128``: 1)."""
    out: Dict[str, Dict[str, int]] = {}
    current = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\w+)", line)
        if m:
            current = m.group(1)
            out[current] = {}
            continue
        if current is not None:
            for op in MEMORY.finditer(line):
                out[current][op.group(0)] = out[current].get(op.group(0), 0) + 1
    return out


def records(arch: str, nvcc: str) -> List[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "permute.cubin"
        report = compile_cubin(arch, cubin, nvcc)
        # cuobjdump -sass runs nvdisasm, which it looks for on PATH
        path = f"{Path(find_tool('nvdisasm', nvcc)).parent}:{os.environ.get('PATH', '')}"
        proc = subprocess.run([find_tool("cuobjdump", nvcc), "-sass", str(cubin)],
                              capture_output=True, text=True, env={**os.environ, "PATH": path})
        if proc.returncode != 0:
            raise SystemExit(f"cuda_sass: cuobjdump failed\n{proc.stderr[-2000:]}")
        sass = proc.stdout
    res, mem = resources(report), memory_instructions(sass)
    rows = []
    for mangled in sorted(mem):
        ops = mem[mangled]
        name = kernel_name(mangled)
        vector = name.split("<")[0] in VECTOR and not CAST.search(name)
        wide = (ops.get("LDG.E.128", 0) + ops.get("LD.E.128", 0),
                ops.get("STG.E.128", 0) + ops.get("ST.E.128", 0))
        r = res.get(mangled, {})
        spills = r.get("spill_stores", 0) + r.get("spill_loads", 0)
        rows.append({"kernel": name, "arch": arch, **r, "loads_128": wide[0], "stores_128": wide[1],
                     "memory": ops, "vector": vector,
                     "ok": spills == 0 and (not vector or min(wide) > 0)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--nvcc", default=shutil.which("nvcc") or "nvcc")
    parser.add_argument("--json", action="store_true", help="one JSON record per kernel")
    args = parser.parse_args()
    rows = records(args.arch, args.nvcc)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(f"| kernel ({args.arch}) | registers | spill bytes | stack | 128-bit loads "
              "| 128-bit stores | other loads/stores | ok |")
        print("|---|---:|---:|---:|---:|---:|---|---|")
        for r in rows:
            other = ", ".join(f"{k} {v}" for k, v in sorted(r["memory"].items())
                              if not k.endswith(".128"))
            spills = r.get("spill_stores", 0) + r.get("spill_loads", 0)
            print(f"| {r['kernel']} | {r.get('registers', '?')} | {spills} | "
                  f"{r.get('stack', '?')} | {r['loads_128']} | {r['stores_128']} | {other} | "
                  f"{'yes' if r['ok'] else 'NO'} |")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
