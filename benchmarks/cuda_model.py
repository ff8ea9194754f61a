"""A device-free cost model of the CUDA kernels: what a GPU would pay per op call.

The kernels run in the emulation (``tests/cuda_emulation.cpp``: the device code of
``kt_regroup/csrc/cuda`` on the CPU, planned by the same host code as ``permute.cu``),
which records per call:

* ``launches``: our kernel launches plus the ATen ops the host code calls (each counted
  as one launch: a lower bound for a sort, which is several on a GPU);
* ``blocks`` launched and ``idle_blocks``, those that load or store no data;
* ``bytes``: data bytes loaded and stored (the distinct bytes of each warp instruction;
  plan rows, read through the cache by every block, are ``plan_bytes`` apart);
* ``sectors``: per warp memory instruction, the 32-byte sectors it touches, summed, and
  ``min_sectors``, the fewest that hold its bytes (sector efficiency: their ratio);
* ``copies`` and ``copy_bytes``: host-to-device copies (the variable-batch ops' table of
  tensors, from pinned memory; not kernels, so not in ``launches``).

The plan is on the device (no host copy). One record per (layout, dtype, op) of the bench
layouts; the batch is the bench's where the emulation can afford it, smaller elsewhere
(``batch`` in each record): launches, idle fractions and sector efficiency hardly depend
on it. ``python -m benchmarks.cuda_model --json`` prints the records as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from functools import partial
from typing import Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kt_regroup
from benchmarks.harness import NARROW, SEED, make_layout

ROOT = pathlib.Path(__file__).resolve().parent.parent
VBE_UNIQUE = 256  # unique rows of each sparse key (benchmarks/step.py)

# name: (sizes, scattered, dtypes, batch, vbe)
LAYOUTS = {
    "seed": (SEED, False, ("float32", "bfloat16"), 8, False),
    "scattered": (SEED, True, ("float32",), 8, False),
    "narrow": (NARROW, True, ("bfloat16",), 32, False),
    "odd_width": (dict(n_dense=20, dim_dense=63, n_sparse=1000, dim_sparse=127), True,
                  ("bfloat16",), 8, False),  # fmt: skip
    "10k_keys": (dict(n_dense=1, dim_dense=64, n_sparse=10_000, dim_sparse=16), True,
                 ("float32",), 32, False),  # fmt: skip
    "vbe": (SEED, True, ("float32",), 8, True),  # 1,001 inputs: the dense one, a key each
}
OPS = ("forward", "backward", "_into")
VBE_OPS = ("vbe_forward", "vbe_backward")


def emulation():
    """The emulation, built once into ``build/cuda_model`` (optimised: it runs big grids)."""
    from torch.utils.cpp_extension import load

    build = ROOT / "build" / "cuda_model"
    build.mkdir(parents=True, exist_ok=True)
    return load(
        name="kt_regroup_cuda_model",
        sources=[str(ROOT / "tests" / "cuda_emulation.cpp")],
        extra_include_paths=[str(ROOT / "kt_regroup" / "csrc" / "cuda")],
        extra_cflags=["-std=c++20", "-O2"],
        build_directory=str(build),
    )


def _launches(func) -> bool:
    """Whether an ATen op would launch a kernel: not a view, an alias or an allocation."""
    if any(r.alias_info is not None for r in func._schema.returns):
        return False
    return func.overloadpacket.__name__ not in ("empty", "empty_strided", "empty_like")


class _AtenOps(TorchDispatchMode):
    """The ATen ops called under it that launch a kernel on a device."""

    def __init__(self):
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _launches(func):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _traced(ext, call) -> Dict[str, int]:
    with _AtenOps() as aten:
        ext.trace_begin()
        try:
            call()
        finally:
            counts = ext.trace_end()
    counts["aten_ops"] = len(aten.ops)
    counts["launches"] += len(aten.ops)
    return counts


def _layout_args(name: str, dtype: torch.dtype, seed: int = 0):
    sizes, scattered, _, batch, vbe = LAYOUTS[name]
    keys, lengths, groups = make_layout(**sizes, scattered=scattered, duplicates=False, seed=seed)
    if vbe:
        keys, lengths = [keys[0]] + [[k] for k in keys[1]], [lengths[0]] + [[w] for w in lengths[1]]
    p, i, o, n = kt_regroup.kt_regroup_arguments(torch.empty(0), keys, lengths, groups)
    return lengths, p, list(n), batch


def records(ext, layouts: Optional[List[str]] = None) -> List[Dict]:
    """One record per (layout, dtype, op)."""
    out = []
    gen = torch.Generator().manual_seed(0)
    for name in layouts or list(LAYOUTS):
        _, _, dtypes, _, vbe = LAYOUTS[name]
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            lengths, p, n, batch = _layout_args(name, dtype)
            widths = [sum(w) for w in lengths]
            grads = [torch.randn(batch, w, generator=gen).to(dtype) for w in n]
            if vbe:
                unique = min(VBE_UNIQUE, batch)
                rows = [batch] + [unique] * (len(widths) - 1)
                xs = [torch.randn(r, w, generator=gen).to(dtype) for r, w in zip(rows, widths)]
                indices = [None] + [torch.randint(unique, (batch,), generator=gen)
                                    for _ in widths[1:]]  # fmt: skip
                calls = {
                    "vbe_forward": partial(ext.vbe_forward, xs, indices, p, n, batch),
                    "vbe_backward": partial(ext.vbe_backward, grads, indices, p, widths, rows,
                                            batch, dtype),  # fmt: skip
                }
            else:
                xs = [torch.randn(batch, w, generator=gen).to(dtype) for w in widths]
                outs = [torch.empty(batch, w, dtype=dtype) for w in n]
                calls = {
                    "forward": partial(ext.forward, xs, p, n, None),
                    "backward": partial(ext.backward, grads, p, widths, batch, dtype),
                    "_into": partial(ext.into, xs, p, outs),
                }
            for op, call in calls.items():
                counts = _traced(ext, call)
                out.append(dict(layout=name, dtype=dtype_name, op=op, batch=batch,
                                rows=int(p.size(0)), **counts))  # fmt: skip
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="JSON lines, one record each")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help="comma-separated, of: " + ", ".join(LAYOUTS))  # fmt: skip
    args = parser.parse_args(argv)
    ext = emulation()
    for r in records(ext, args.layouts.split(",")):
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            eff = r["min_sectors"] / r["sectors"] if r["sectors"] else 1.0
            idle = r["idle_blocks"] / r["blocks"] if r["blocks"] else 0.0
            print(f"{r['layout']:10} {r['dtype']:9} {r['op']:13} launches {r['launches']:3} "
                  f"blocks {r['blocks']:7} idle {idle:6.1%} bytes {r['bytes']:11} "
                  f"sector efficiency {eff:.3f} copies {r.get('copies', 0)}",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
