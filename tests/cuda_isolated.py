"""Checks of the op library's own CUDA kernels (``kt_regroup/csrc/cuda``).

Run by ``test_cuda_kernel.py`` in a fresh interpreter that loaded only torch and the
library, the way a TorchScript or AOTInductor deployment runs: in a process that imports
``kt_regroup``, its Python module registers the Triton kernels for the CUDA dispatch
key over the library's. Usage::

    python -I tests/cuda_isolated.py LIBRARY CHECK [ARG...]

Every check asserts (``torch.equal`` against ``tests/reference.py``, bit for bit) and
fails with a traceback; ``main`` also asserts that ``kt_regroup`` was never imported.
"""

from __future__ import annotations

import pathlib
import sys
from typing import List

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from reference import (  # noqa: E402
    permute_multi_embedding_backward_reference,
    permute_multi_embedding_reference,
    permute_multi_embedding_to_reference,
)

CUDA = torch.device("cuda")
# Odd widths, keys duplicated inside a group (a) and across groups (b, e), unused keys
# (d, g), a single-key group: what regroup kernels get wrong.
KEYS = [["a", "b", "c", "d"], ["e", "f"], ["g", "h", "i"]]
LENGTHS = [[1, 3, 7, 127], [5, 16], [2, 64, 9]]
GROUPS = [["e", "a", "i", "a"], ["c", "b", "h", "e"], ["f"], ["b"]]
UNUSED = {"d", "g"}
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def ops():
    return torch.ops.kt_regroup


def plan(index_dtype=torch.int32, device=CUDA, keys=KEYS, lengths=LENGTHS, groups=GROUPS):
    permutes, in_shapes, out_shapes, out_lengths = ops().kt_regroup_arguments(
        torch.empty(0), keys, lengths, groups
    )
    return (
        permutes.to(device, index_dtype),
        in_shapes.to(device),
        out_shapes.to(device),
        list(out_lengths),
    )


def values(batch: int, width: int, dtype: torch.dtype, memory: str = "contiguous", seed: int = 0):
    """``[batch, width]`` on CUDA: contiguous, a column slice of a wider tensor (row
    stride > width, unaligned start) or a transposed view (column stride > 1)."""
    g = torch.Generator().manual_seed(seed)
    shape = {"contiguous": (batch, width), "sliced": (batch, width + 5), "transposed": (width, batch)}[memory]
    if dtype.is_floating_point or dtype.is_complex:
        x = torch.randn(shape, generator=g).to(dtype)
        if dtype.is_complex:
            x = x + 1j * torch.randn(shape, generator=g).to(dtype)
    elif dtype == torch.bool:
        x = torch.randint(0, 2, shape, generator=g).bool()
    else:
        x = torch.randint(-1000, 1000, shape, generator=g).to(dtype)
    x = x.to(CUDA)
    return {"contiguous": x, "sliced": x[:, 3 : width + 3] if width else x[:, :0], "transposed": x.t()}[memory]


def inputs(batch: int, dtype: torch.dtype, memory: str = "contiguous", lengths=LENGTHS) -> List[torch.Tensor]:
    return [values(batch, sum(w), dtype, memory, seed=i) for i, w in enumerate(lengths)]


def assert_equal_lists(got, expected, what: str) -> None:
    assert len(got) == len(expected), (what, len(got), len(expected))
    for j, (g, e) in enumerate(zip(got, expected)):
        assert g.device == e.device and g.dtype == e.dtype and g.shape == e.shape, (
            what, j, g.device, g.dtype, g.shape, e.device, e.dtype, e.shape)
        assert torch.equal(g, e), (what, j, (g.float() - e.float()).abs().max() if g.numel() else None)


# --- checks ---------------------------------------------------------------------------------


def check_forward() -> None:
    """Every dtype the byte copy moves, odd batches, three memory layouts, int32 and int64
    plans on the device and on the CPU."""
    dtypes = FLOATS + [torch.int64, torch.int32, torch.bool, torch.complex64, torch.complex128]
    for dtype in dtypes:
        for batch in (0, 1, 5, 257):
            for memory in ("contiguous", "sliced", "transposed"):
                xs = inputs(batch, dtype, memory)
                for index_dtype in (torch.int32, torch.int64):
                    for device in (CUDA, torch.device("cpu")):
                        p, i, o, n = plan(index_dtype, device)
                        got = ops().permute_multi_embedding(xs, p, i, o, n)
                        expected = permute_multi_embedding_reference(xs, p, i, o, n)
                        assert_equal_lists(got, expected, (dtype, batch, memory, index_dtype, device))
    # A lazily conjugated input is copied with its conjugation resolved.
    xs = [x.conj() for x in inputs(5, torch.complex64)]
    p, i, o, n = plan()
    assert_equal_lists(
        ops().permute_multi_embedding(xs, p, i, o, n),
        permute_multi_embedding_reference([x.resolve_conj() for x in xs], p, i, o, n), "conj")


def check_many_tensors() -> None:
    """More inputs and outputs than one launch addresses (32): chunked launches."""
    keys = [[f"k{t}_{j}" for j in range(2)] for t in range(40)]
    lengths = [[1 + t % 5, 3] for t in range(40)]
    groups = [[f"k{(g * 7 + j) % 40}_{j % 2}" for j in range(3)] for g in range(37)]
    groups[0].append(groups[1][0])  # a duplicate across groups
    for dtype in (torch.float32, torch.bfloat16):
        xs = inputs(9, dtype, lengths=lengths)
        p, i, o, n = plan(keys=keys, lengths=lengths, groups=groups)
        got = ops().permute_multi_embedding(xs, p, i, o, n)
        assert_equal_lists(got, permute_multi_embedding_reference(xs, p, i, o, n), ("many", dtype))
        grads = [torch.randn(9, w, device=CUDA).to(dtype) for w in n]
        in_lengths = [sum(w) for w in lengths]
        got = ops().permute_multi_embedding_backward(grads, p, i, o, in_lengths, 9, dtype)
        expected = permute_multi_embedding_backward_reference(grads, p, i, o, in_lengths, 9, dtype)
        assert_equal_lists(got, expected, ("many backward", dtype))


def check_gaps_and_bad_rows() -> None:
    """Columns no row writes are zeros; rows outside their tensors are clipped or no-ops
    (reads outside an input give zeros), never an access outside a tensor."""
    batch = 6
    x0 = values(batch, 4, torch.float32, seed=1)
    x1 = values(batch, 3, torch.float32, seed=2)
    rows = [
        [0, 0, 0, 0, 3, 0],  # out0[:, 0:3] = x0[:, 0:3]
        [0, 0, 1, 10, 2, 0],  # out0[:, 10:12] = x0[:, 1:3]; columns 3..9 no row writes
        [5, 0, 0, 12, 2, 0],  # no input 5: out0[:, 12:14] stay zeros
        [1, 0, 1, 14, 100, 0],  # clipped to out0[:, 14:16] = x1[:, 1:3]
        [0, 7, 0, 0, 1, 0],  # no output 7: nothing
        [1, 1, 0, -2, 5, 0],  # clipped to out1[:, 0:3] = x1[:, 2:5]; x1 has no columns 3, 4
        [0, 1, 2, 4, 2**40, 0],  # clipped to out1[:, 4:6] = x0[:, 2:4]
        [0, 2, 2**62, 0, 2, 0],  # reads far outside x0: out2 zeros
        [0, 2, -(2**62), 0, 2, 0],  # the same block, from far before x0
    ]
    permutes = torch.tensor(rows, dtype=torch.int64, device=CUDA)
    in_shapes = torch.tensor([4, 3], device=CUDA)
    out_shapes = torch.tensor([16, 6, 2], device=CUDA)
    out0 = torch.zeros(batch, 16, device=CUDA)
    out0[:, 0:3] = x0[:, 0:3]
    out0[:, 10:12] = x0[:, 1:3]
    out0[:, 14:16] = x1[:, 1:3]
    out1 = torch.zeros(batch, 6, device=CUDA)
    out1[:, 0] = x1[:, 2]
    out1[:, 4:6] = x0[:, 2:4]
    out2 = torch.zeros(batch, 2, device=CUDA)
    # Freed NaN blocks of the outputs' sizes, which the outputs likely reuse: an element
    # left unwritten would show.
    for w in (16, 6, 2):
        torch.full((batch, w), float("nan"), device=CUDA)
    got = ops().permute_multi_embedding([x0, x1], permutes, in_shapes, out_shapes, [16, 6, 2])
    torch.cuda.synchronize()
    assert_equal_lists(got, [out0, out1, out2], "bad rows")


def check_to() -> None:
    """The fused cast: inputs of mixed float dtypes into each float dtype, rounded as
    .to() rounds; an integer input takes .to() first."""
    p, i, o, n = plan()
    for dtype in FLOATS:
        for memory in ("contiguous", "transposed"):
            mixed = [values(33, sum(w), d, memory, seed=k)
                     for k, (w, d) in enumerate(zip(LENGTHS, [torch.bfloat16, torch.float64, torch.float16]))]
            got = ops().permute_multi_embedding_to(mixed, p, i, o, n, dtype)
            assert_equal_lists(got, permute_multi_embedding_to_reference(mixed, p, i, o, n, dtype), (dtype, memory))
        same = inputs(33, dtype)
        assert_equal_lists(
            ops().permute_multi_embedding_to(same, p, i, o, n, None),
            permute_multi_embedding_reference(same, p, i, o, n), ("no cast", dtype))
    ints = [values(4, sum(w), torch.int64, seed=k) for k, w in enumerate(LENGTHS)]
    assert_equal_lists(
        ops().permute_multi_embedding_to(ints, p, i, o, n, torch.float32),
        permute_multi_embedding_to_reference(ints, p, i, o, n, torch.float32), "int64 -> float32")


def check_backward() -> None:
    """Duplicates accumulate in row order (float32 for half types), unused keys get exact
    zeros, None gradients count as zeros, expanded gradients are read in place."""
    in_lengths = [sum(w) for w in LENGTHS]
    unused = []  # (input, first column, width) of the keys no group uses
    for t, (ks, ws) in enumerate(zip(KEYS, LENGTHS)):
        off = 0
        for k, w in zip(ks, ws):
            if k in UNUSED:
                unused.append((t, off, w))
            off += w
    for index_dtype, device in ((torch.int32, CUDA), (torch.int64, CUDA), (torch.int32, torch.device("cpu"))):
        p, i, o, n = plan(index_dtype, device)
        for grad_dtype in FLOATS:
            for dtype in FLOATS:
                for batch in (0, 1, 130):
                    grads = [values(batch, w, grad_dtype, seed=10 + j) for j, w in enumerate(n)]
                    grads[2] = None
                    if batch:
                        grads[3] = torch.ones(1, 1, device=CUDA, dtype=grad_dtype).expand(batch, n[3])
                    got = ops().permute_multi_embedding_backward(grads, p, i, o, in_lengths, batch, dtype)
                    expected = permute_multi_embedding_backward_reference(
                        grads, p, i, o, in_lengths, batch, dtype)
                    assert_equal_lists(got, expected, (grad_dtype, dtype, batch, index_dtype, device))
                    for t, off, w in unused:
                        assert torch.equal(got[t][:, off : off + w], torch.zeros_like(got[t][:, off : off + w]))
        # One key 20 times: longer than the chain a block keeps in shared memory.
        lp, li, lo, ln = plan(index_dtype, device, [["a", "b"]], [[3, 5]], [["a"] * 12 + ["b"], ["a"] * 8])
        for dtype in FLOATS:
            grads = [values(70, w, dtype, seed=j) for j, w in enumerate(ln)]
            assert_equal_lists(
                ops().permute_multi_embedding_backward(grads, lp, li, lo, [8], 70, dtype),
                permute_multi_embedding_backward_reference(grads, lp, li, lo, [8], 70, dtype),
                ("long chain", dtype))
        none = ops().permute_multi_embedding_backward([None] * len(n), p, i, o, in_lengths, 3, torch.float32)
        # (With the plan on the CPU and no gradient the CPU kernel serves: no CUDA argument.)
        assert_equal_lists(none, [torch.zeros(3, w, device=p.device) for w in in_lengths], "all None")


def training_step(xs, p, i, o, n, weights):
    outs = ops().permute_multi_embedding(xs, p, i, o, n)
    loss = sum((out * w).sum() for out, w in zip(outs, weights))
    loss.backward()
    return outs


def check_autograd() -> None:
    """A training step: the library's autograd calls the backward op on CUDA."""
    p, i, o, n = plan()
    for dtype in FLOATS:
        xs = [x.requires_grad_() for x in inputs(64, dtype)]
        weights = [values(64, w, dtype, seed=20 + j) for j, w in enumerate(n)]
        outs = training_step(xs, p, i, o, n, weights)
        assert_equal_lists(outs, permute_multi_embedding_reference([x.detach() for x in xs], p, i, o, n), "fwd")
        # The gradient of sum(out * w) is w; the backward op sums w's blocks per key.
        expected = permute_multi_embedding_backward_reference(
            weights, p, i, o, [x.size(1) for x in xs], 64, dtype)
        assert_equal_lists([x.grad for x in xs], expected, ("grad", dtype))


def check_no_host_sync() -> None:
    """The forward, the fused cast, the backward and a training step with the plan on the
    device never synchronise with the host."""
    p, i, o, n = plan()
    xs = inputs(128, torch.float32)
    grads = [torch.randn(128, w, device=CUDA) for w in n]
    in_lengths = [x.size(1) for x in xs]
    train = [x.clone().requires_grad_() for x in xs]
    weights = [torch.randn(128, w, device=CUDA) for w in n]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops().permute_multi_embedding(xs, p, i, o, n)
        ops().permute_multi_embedding_to(xs, p, i, o, n, torch.bfloat16)
        ops().permute_multi_embedding_backward(grads, p, i, o, in_lengths, 128, torch.float32)
        training_step(train, p, i, o, n, weights)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # And the results are right (the mode must not have skipped anything).
    expected = permute_multi_embedding_backward_reference(weights, p, i, o, in_lengths, 128, torch.float32)
    assert_equal_lists([x.grad for x in train], expected, "training step")


def cuda_kernels(fn) -> List[str]:
    """Names of the CUDA kernels (and memsets, memcopies) that ``fn()`` runs."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm: the first call may load modules
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def check_launches() -> None:
    """One launch per call: forward, fused cast, backward (with duplicates and unused keys)."""
    p, i, o, n = plan()
    xs = inputs(1000, torch.float32)
    grads = [torch.randn(1000, w, device=CUDA) for w in n]
    in_lengths = [x.size(1) for x in xs]
    calls = {
        "forward": lambda: ops().permute_multi_embedding(xs, p, i, o, n),
        "to": lambda: ops().permute_multi_embedding_to(xs, p, i, o, n, torch.bfloat16),
        "backward": lambda: ops().permute_multi_embedding_backward(
            grads, p, i, o, in_lengths, 1000, torch.float32),
    }
    for name, fn in calls.items():
        kernels = cuda_kernels(fn)
        assert len(kernels) == 1 and "permute_" in kernels[0], (name, kernels)


class Regroup(torch.nn.Module):
    """A deployed model: the plan in buffers, the op called on the inputs."""

    def __init__(self, p, i, o, n: List[int], device: str = "cuda"):
        super().__init__()
        self.register_buffer("permutes", p)
        self.register_buffer("in_shapes", i)
        self.register_buffer("out_shapes", o)
        self.out_lengths = n
        self.device = torch.device(device)

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> List[torch.Tensor]:
        return torch.ops.kt_regroup.permute_multi_embedding(
            [a, b, c], self.permutes, self.in_shapes, self.out_shapes, self.out_lengths)


class RegroupOnCuda(Regroup):
    """Takes CPU inputs (as the C++ predictor makes them), regroups on CUDA, returns CPU."""

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> List[torch.Tensor]:
        outs = torch.ops.kt_regroup.permute_multi_embedding(
            [a.to(self.device), b.to(self.device), c.to(self.device)],
            self.permutes, self.in_shapes, self.out_shapes, self.out_lengths)
        return [out.cpu() for out in outs]


def save_torchscript(folder: str) -> None:
    """Scripted and traced models, their inputs and eager outputs, under ``folder``."""
    out = pathlib.Path(folder)
    p, i, o, n = plan()
    model = Regroup(p, i, o, n)
    xs = inputs(77, torch.float32)
    torch.jit.script(model).save(str(out / "scripted.pt"))
    torch.jit.trace(model, tuple(xs), strict=False).save(str(out / "traced.pt"))
    torch.jit.script(RegroupOnCuda(p, i, o, n)).save(str(out / "on_cuda.pt"))
    torch.save({"inputs": [x.cpu() for x in xs], "outputs": [y.cpu() for y in model(*xs)]}, out / "io.pt")


def run_torchscript(folder: str) -> None:
    """Each saved model, loaded here, equals eager and runs one kernel per call."""
    out = pathlib.Path(folder)
    io = torch.load(out / "io.pt")
    xs = [x.to(CUDA) for x in io["inputs"]]
    for name in ("scripted.pt", "traced.pt"):
        model = torch.jit.load(str(out / name))
        got = model(*xs)
        assert_equal_lists([g.cpu() for g in got], io["outputs"], name)
        kernels = cuda_kernels(lambda m=model: m(*xs))
        assert len(kernels) == 1 and "permute_" in kernels[0], (name, kernels)


def main(argv: List[str]) -> None:
    library, check, *args = argv
    torch.ops.load_library(library)
    assert torch.cuda.is_available()
    globals()[check](*args)
    torch.cuda.synchronize()
    loaded = [m for m in ("kt_regroup", "torchrec", "fbgemm_gpu") if m in sys.modules]
    assert not loaded, f"{loaded} imported: the library's CUDA kernels may not be the ones tested"


if __name__ == "__main__":
    main(sys.argv[1:])
