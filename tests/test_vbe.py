"""Variable-batch (VBE) regroup: ``permute_multi_embedding_vbe`` against the reference
(``index_select`` per input, then the slices of ``tests/reference.py``)."""

from __future__ import annotations

import pickle
import subprocess
import sys
from typing import Dict, List

import pytest
import torch
from conftest import intra_op_threads
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import permute_multi_embedding_reference
from torch.utils._python_dispatch import TorchDispatchMode

import kt_regroup  # noqa: F401
from kt_regroup.ops import kt_regroup_arguments, permute_multi_embedding_vbe

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
OP = torch.ops.kt_regroup.permute_multi_embedding_vbe


def _reference(pooled, indices, permutes, in_shapes, out_shapes, out_lengths):
    expanded = [p if ix is None else p.index_select(0, ix) for p, ix in zip(pooled, indices)]
    return permute_multi_embedding_reference(expanded, permutes, in_shapes, out_shapes, out_lengths)


@st.composite
def layouts(draw):
    """``(pooled, indices, keys, lengths, groups)``: inputs of 1-3 keys, each input indexed
    (rows shared by samples) or not (one row per sample)."""
    batch = draw(st.sampled_from((0, 1, 2, 5)))
    dtype = draw(st.sampled_from(DTYPES))
    n_in = draw(st.integers(1, 4))
    keys, lengths, pooled, indices = [], [], [], []
    for i in range(n_in):
        keys.append([f"f{i}_{k}" for k in range(draw(st.integers(1, 3)))])
        lengths.append([draw(st.sampled_from((0, 1, 3, 4))) for _ in keys[-1]])
        width = sum(lengths[-1])
        indexed = draw(st.booleans())
        rows = draw(st.integers(1, 4)) if indexed else batch
        mode = draw(st.sampled_from(("random", "one_row", "strided", "transposed")))
        if mode == "strided":  # rows and columns strided
            p = torch.randn(rows * 2, width * 2 + 1)[::2, 1::2][:, :width]
        elif mode == "transposed":
            p = torch.randn(width, rows).t()
        else:
            p = torch.randn(rows, width)
        pooled.append(p.to(dtype))
        if not indexed:
            indices.append(None)
            continue
        if mode == "one_row":  # every sample on one row; the others unused
            ix = torch.full((batch,), draw(st.integers(0, rows - 1)))
        else:
            ix = torch.tensor([draw(st.integers(0, rows - 1)) for _ in range(batch)], dtype=torch.long)
        if draw(st.booleans()):
            ix = ix.int()
        if draw(st.booleans()) and batch > 0:  # a strided index
            ix = torch.stack([ix, torch.zeros_like(ix)], 1)[:, 0]
        indices.append(ix)
    every = [k for ks in keys for k in ks]
    n_groups = draw(st.integers(1, 3))
    # duplicates across and within groups; keys used by no group too
    groups = [draw(st.lists(st.sampled_from(every), max_size=5)) for _ in range(n_groups)]
    return pooled, indices, keys, lengths, groups


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_vbe_matches_reference_forward_and_backward(layout):
    pooled, indices, keys, lengths, groups = layout
    plan = kt_regroup_arguments(pooled[0], keys, lengths, groups)
    before = [p.clone() for p in pooled], [None if i is None else i.clone() for i in indices]
    leaves = [p.detach().requires_grad_() for p in pooled]
    ref_leaves = [p.detach().requires_grad_() for p in pooled]
    outs = permute_multi_embedding_vbe(leaves, indices, *plan)
    expected = _reference(ref_leaves, indices, *plan)
    assert len(outs) == len(expected)
    for o, e in zip(outs, expected):
        assert torch.equal(o, e)  # a copy: exact
    grads = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, leaves, grads, allow_unused=True)
    live = [(e, g) for e, g in zip(expected, grads) if e.requires_grad]  # a group of no rows: none
    want = (torch.autograd.grad([e for e, _ in live], ref_leaves, [g for _, g in live],
                                allow_unused=True) if live else [None] * len(pooled))
    half = pooled[0].dtype in (torch.float16, torch.bfloat16)
    for g, w, p in zip(got, want, pooled):
        assert g is not None and g.dtype == p.dtype and g.shape == p.shape
        w = torch.zeros_like(p) if w is None else w
        torch.testing.assert_close(g, w, **({"atol": 2e-2, "rtol": 2e-2} if half else {}))
    # unused rows get exact zeros; the same call gives the same bits
    for g, ix in zip(got, indices):
        if ix is not None:
            unused = torch.ones(g.size(0), dtype=torch.bool)
            unused[ix.long()] = False
            assert torch.equal(g[unused], torch.zeros_like(g[unused]))
    again = torch.autograd.grad(
        permute_multi_embedding_vbe(leaves, indices, *plan), leaves, grads, allow_unused=True
    )
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    # the input gradients share one allocation
    storages = {g.untyped_storage().data_ptr() for g in got if g.numel() > 0}
    assert len(storages) <= 1
    # inputs unmodified
    assert all(torch.equal(a, b) for a, b in zip(pooled, before[0]))
    assert all(a is None or torch.equal(a, b) for a, b in zip(indices, before[1]))


@pytest.mark.parametrize("threads", (1, 4))
def test_vbe_on_threads_matches_reference_bit_for_bit(threads):
    """Work above the kernels' 128 KiB grain goes to threads (below it runs inline): the
    same outputs and the same gradient bits as one thread, duplicates summed in order."""
    with intra_op_threads(threads):
        g = torch.Generator().manual_seed(3)
        batch, widths, rows = 1024, [64, 32, 64, 16, 64, 8], [50, 1024, 7, 300, 1, 64]
        pooled = [torch.randn(r, w, generator=g) for r, w in zip(rows, widths)]
        indices = [None if r == batch else torch.randint(r, (batch,), generator=g) for r in rows]
        keys = [[f"k{i}"] for i in range(len(rows))]
        groups = [["k0", "k2", "k1", "k5"], ["k3", "k0", "k4"], ["k2"]]  # k0, k2 duplicated
        plan = kt_regroup_arguments(pooled[0], keys, [[w] for w in widths], groups)
        assert batch * sum(widths) * 4 > 128 * 1024
        leaves = [p.clone().requires_grad_() for p in pooled]
        outs = permute_multi_embedding_vbe(leaves, indices, *plan)
        for o, e in zip(outs, _reference(pooled, indices, *plan)):
            assert torch.equal(o, e)
        grads = [torch.randn(o.shape, generator=g) for o in outs]
        got = torch.autograd.grad(outs, leaves, grads)
        torch.set_num_threads(1)
        one = torch.autograd.grad(permute_multi_embedding_vbe(leaves, indices, *plan), leaves, grads)
        assert all(torch.equal(a, b) for a, b in zip(got, one))
        ref = [p.clone().requires_grad_() for p in pooled]
        want = torch.autograd.grad(_reference(ref, indices, *plan), ref, grads)
        torch.testing.assert_close(list(got), list(want))


def test_vbe_backward_gives_torchrecs_bits():
    """The backward sums as unpatched torchrec does (``group_index_select_dim0``, then its
    ``KTRegroupAsDict``): per sample over a key's groups in plan order, then per row in
    sample order. Non-integer weights, many samples per row and a key in three groups,
    where another order changes the bits; an unindexed input too."""
    import fbgemm_gpu  # noqa: F401  (torch.ops.fbgemm.group_index_select_dim0)
    import torchrec.modules.regroup as tr_regroup
    from torchrec.sparse.jagged_tensor import KeyedTensor

    batch = 3000
    dims, rows = {"a": 8, "b": 4, "c": 16, "d": 5}, {"a": 2, "b": 3, "c": 50, "d": batch}
    pooled = {k: torch.randn(rows[k], dims[k], requires_grad=True) for k in dims}
    index = {k: torch.randint(0, rows[k], (batch,)) for k in dims}
    groups = [["a", "b", "c", "d"], ["b", "a", "d"], ["a"]]
    weights = [torch.randn(batch, sum(dims[k] for k in g)) for g in groups]
    keys = list(dims)
    leaves = [pooled[k] for k in keys]

    def loss(outs):
        return sum((o * w).sum() for o, w in zip(outs, weights))

    expanded = torch.ops.fbgemm.group_index_select_dim0(
        leaves[:3], [index[k] for k in keys[:3]]) + [leaves[3]]
    kt = KeyedTensor(keys, [dims[k] for k in keys], torch.cat(expanded, 1))
    want = torch.autograd.grad(
        loss(tr_regroup.KTRegroupAsDict(groups, ["x", "y", "z"])([kt]).values()), leaves)
    plan = kt_regroup_arguments(leaves[0], [[k] for k in keys], [[dims[k]] for k in keys], groups)
    outs = permute_multi_embedding_vbe(leaves, [index[k] for k in keys[:3]] + [None], *plan)
    got = torch.autograd.grad(loss(outs), leaves)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # the portable kernel (every device without its own) sums in the same order
    backward = torch.ops.kt_regroup.permute_multi_embedding_vbe_backward.default
    args = (list(torch.autograd.grad(loss(outs), outs)), [index[k] for k in keys[:3]] + [None],
            *plan[:3], [dims[k] for k in keys], [rows[k] for k in keys], torch.float32)
    flat = torch.cat([w.reshape(-1) for w in want])
    assert torch.equal(backward(*args), flat)
    portable = backward._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args)
    assert torch.equal(portable, flat)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vbe_backward_of_many_inputs_sums_in_torchrecs_order(dtype):
    """Enough indexed inputs that the CPU backward splits them over several tasks (each
    owns about 512 KiB of rows), keys in two groups, a key in none and an unindexed input:
    float32 gives the portable kernel's bits (index_add_, torchrec's order) and bfloat16
    the float32 sums of the same gradients, rounded once."""
    g = torch.Generator().manual_seed(5)
    batch, n, rows, width = 700, 40, 300, 64
    pooled = [torch.randn(rows, width, generator=g) for _ in range(n)]
    pooled.append(torch.randn(batch, 16, generator=g))
    indices = [torch.randint(rows, (batch,), generator=g) for _ in range(n)] + [None]
    keys = [[f"k{i}"] for i in range(n + 1)]
    order = torch.randperm(n + 1, generator=g).tolist()
    groups = [[f"k{i}" for i in order[:30]], [f"k{i}" for i in order[10:n]]]  # 20 in both
    assert f"k{order[n]}" not in groups[0] + groups[1]
    plan = kt_regroup_arguments(pooled[0], keys, [[p.size(1)] for p in pooled], groups)
    outs = permute_multi_embedding_vbe([p.to(dtype) for p in pooled], indices, *plan)
    grads = [torch.randn(o.shape, generator=g).to(dtype) for o in outs]
    backward = torch.ops.kt_regroup.permute_multi_embedding_vbe_backward.default
    lengths, in_rows = [p.size(1) for p in pooled], [p.size(0) for p in pooled]

    def run(gs, dt, key=None):
        args = (gs, indices, *plan[:3], lengths, in_rows, dt)
        return backward(*args) if key is None else backward._op_dk(key, *args)

    got = run(grads, dtype)
    if dtype == torch.float32:
        assert torch.equal(got, run(grads, dtype, torch._C.DispatchKey.CompositeExplicitAutograd))
    else:
        assert torch.equal(got, run([x.float() for x in grads], torch.float32).to(dtype))


def _sample(batch=4, dtype=torch.float32, idx_dtype=torch.long, requires_grad=False):
    a = torch.randn(3, 4, dtype=dtype, requires_grad=requires_grad)
    b = torch.randn(batch, 2, dtype=dtype, requires_grad=requires_grad)
    c = torch.randn(2, 3, dtype=dtype, requires_grad=requires_grad)
    ia = torch.tensor([2, 0, 2, 1][:batch] + [0] * max(0, batch - 4), dtype=idx_dtype)
    ic = torch.tensor([1] * batch, dtype=idx_dtype)
    keys, lengths = [["a"], ["b"], ["c"]], [[4], [2], [3]]
    plan = kt_regroup_arguments(a, keys, lengths, [["c", "a"], ["b", "a", "c"]])
    return [a, b, c], [ia, None, ic], plan


@pytest.mark.parametrize("dtype", DTYPES[:2])
@pytest.mark.parametrize("batch", (0, 1, 4))
def test_vbe_opcheck(dtype, batch):
    pooled, indices, plan = _sample(batch, dtype, requires_grad=True)
    torch.library.opcheck(OP.default, (pooled, indices, *plan))
    backward = torch.ops.kt_regroup.permute_multi_embedding_vbe_backward.default
    grads = [torch.randn(batch, n, dtype=dtype) for n in plan[3]]
    rows, widths = [p.size(0) for p in pooled], [p.size(1) for p in pooled]
    torch.library.opcheck(backward, (grads, indices, *plan[:3], widths, rows, dtype))
    torch.library.opcheck(backward, ([None, grads[1]], indices, *plan[:3], widths, rows, dtype))


def test_vbe_gradcheck_float64():
    pooled, indices, plan = _sample(5, torch.float64, torch.int32, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *p: permute_multi_embedding_vbe(list(p), indices, *plan), pooled
    )


def test_vbe_without_indices_is_the_regroup():
    pooled, _, plan = _sample(3)
    pooled = [p[:1].expand(3, -1).contiguous() for p in pooled]
    for indices in ([], [None, None, None]):
        got = permute_multi_embedding_vbe(pooled, indices, *plan)
        want = torch.ops.kt_regroup.permute_multi_embedding(pooled, *plan)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_vbe_compiles_with_a_dynamic_batch():
    pooled, indices, plan = _sample(4)
    fn = torch.compile(lambda p, i: permute_multi_embedding_vbe(p, i, *plan), dynamic=True,
                       fullgraph=True, backend="aot_eager")
    for batch in (4, 6):
        idx = [torch.randint(0, p.size(0), (batch,)) if i is not None else None
               for p, i in zip(pooled, indices)]
        p = [pooled[0], torch.randn(batch, 2), pooled[2]]
        got, want = fn(p, idx), _reference(p, idx, *plan)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda i: [i[0], None, torch.tensor([1, 1, 5, 1])], IndexError,
         r"indices\[2\]\[2\] = 5 is out of range for input 2, which has 2 rows"),
        (lambda i: [torch.tensor([0, -1, 0, 0]), None, i[2]], IndexError,
         r"indices\[0\]\[1\] = -1 is out of range for input 0"),
        (lambda i: [i[0], None, i[2][:3]], ValueError,
         r"^kt_regroup.permute_multi_embedding_vbe: input 2 has 3 samples \(the length of "
         r"indices\[2\]\) but the batch has 4 \(from input 0\)$"),
        (lambda i: [i[0], None, i[2].float()], TypeError, r"indices\[2\] must be int32 or int64"),
        (lambda i: [i[0], None, i[2][None]], ValueError, r"indices\[2\] must be 1-D"),
        (lambda i: [i[0], None], ValueError, r"indices has 2 entries but there are 3 inputs"),
        (lambda i: [i[0], torch.tensor([4, 0, 0, 0]), i[2]], IndexError,
         r"indices\[1\]\[0\] = 4 is out of range for input 1, which has 4 rows"),
    ],
)
def test_vbe_bad_indices_name_the_input_and_sample(change, error, match):
    pooled, indices, plan = _sample(4)
    with pytest.raises(error, match=match):
        permute_multi_embedding_vbe(pooled, change(indices), *plan)


def test_vbe_unindexed_input_with_another_batch_raises():
    pooled, indices, plan = _sample(4)
    pooled[1] = torch.randn(3, 2)
    with pytest.raises(ValueError, match=r"input 1 has 3 rows and no index \(indices\[1\] is "
                       r"None\) but the batch has 4 \(from input 0\)$"):
        permute_multi_embedding_vbe(pooled, indices, *plan)


def test_vbe_index_changed_in_place_after_the_forward_is_autograds_error():
    """The indices are saved with a version check, as ``index_select`` saves its index: a
    buffer reused for the next batch before the backward is an error, not wrong rows."""
    pooled, indices, plan = _sample(4, requires_grad=True)
    outs = permute_multi_embedding_vbe(pooled, indices, *plan)
    indices[0].fill_(0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad([o.sum() for o in outs], pooled)


def test_vbe_inference_mode_index_trains():
    """An index made under ``inference_mode`` (which autograd cannot save) is copied."""
    pooled, indices, plan = _sample(4, requires_grad=True)
    with torch.inference_mode():
        frozen = [None if i is None else i.clone() for i in indices]
    outs = permute_multi_embedding_vbe(pooled, frozen, *plan)
    grads = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, pooled, grads)
    want = torch.autograd.grad(permute_multi_embedding_vbe(pooled, indices, *plan), pooled, grads)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_vbe_stride0_index_of_a_huge_batch_fails_at_once():
    """An expanded (stride-0) index holds one value: it is checked once, so a batch of 2^40
    reaches the allocation error at once instead of after 2^40 checks (minutes)."""

    code = (
        "import torch, kt_regroup\n"
        "from kt_regroup.ops import kt_regroup_arguments, permute_multi_embedding_vbe\n"
        "p = torch.randn(3, 4)\n"
        "plan = kt_regroup_arguments(p, [['a']], [[4]], [['a']])\n"
        "for value in (1, 3):\n"
        "    try:\n"
        "        permute_multi_embedding_vbe([p], [torch.tensor([value]).expand(2 ** 40)], *plan)\n"
        "    except (RuntimeError, IndexError) as e:\n"
        "        print(type(e).__name__, str(e).splitlines()[0])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stderr
    assert lines[0].startswith("RuntimeError") and "allocate" in lines[0], lines[0]
    assert lines[1] == (
        "IndexError kt_regroup.permute_multi_embedding_vbe: indices[0][0] = 3 is out of range "
        "for input 0, which has 3 rows"
    )


def test_vbe_backward_checks_dtype_and_rows():
    pooled, indices, plan = _sample(4)
    backward = torch.ops.kt_regroup.permute_multi_embedding_vbe_backward
    grads = [torch.randn(4, n) for n in plan[3]]
    with pytest.raises(TypeError, match=r"grad_outputs\[0\] is Float but dtype is Long"):
        backward(grads, indices, *plan[:3], [4, 2, 3], [3, 4, 2], torch.long)
    with pytest.raises(IndexError, match=r"indices\[0\]\[0\] = 2 is out of range for input 0, which has 2"):
        backward(grads, indices, *plan[:3], [4, 2, 3], [2, 4, 2], torch.float32)


# --- patch_torchrec(): the EmbeddingBagCollection with a variable-batch KJT ---------------

import copy  # noqa: E402

import torchrec.modules.regroup as tr_regroup  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor  # noqa: E402

from kt_regroup.vbe import VariableBatchKeyedTensor  # noqa: E402

FEATURES = {"user": (4, 3), "hist": (8, 2), "item": (6, 5), "ctx": (3, 1)}  # name: (dim, rows)
GROUPS = [["hist", "user"], ["item", "hist", "ctx"]]


def vbe_kjt(batch: int = 6, seed: int = 0) -> KeyedJaggedTensor:
    """A variable-batch KJT: feature k has ``rows`` unique rows, each sample one of them."""
    g = torch.Generator().manual_seed(seed)
    keys = list(FEATURES)
    lengths, values, inverse = [], [], []
    for k in keys:
        rows = FEATURES[k][1]
        n = torch.randint(0, 3, (rows,), generator=g)
        lengths.append(n)
        values.append(torch.randint(0, 10, (int(n.sum()),), generator=g))
        inverse.append(torch.randint(0, rows, (batch,), generator=g))
    return KeyedJaggedTensor(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths),
        stride_per_key_per_rank=[[FEATURES[k][1]] for k in keys],
        inverse_indices=(keys, torch.stack(inverse)),
    )


class VbeModel(torch.nn.Module):
    def __init__(self, regroup_cls) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            [EmbeddingBagConfig(num_embeddings=10, embedding_dim=d, name=f"t_{k}", feature_names=[k])
             for k, (d, _) in FEATURES.items()]
        )
        self.regroup = regroup_cls(GROUPS, ["a", "b"])

    def forward(self, kjt: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
        return self.regroup([self.ebc(kjt)])


def _run(model, kjt):
    outs = model(kjt)
    loss = sum((o * torch.arange(o.numel()).view_as(o)).sum() for o in outs.values())
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return [o.detach() for o in outs.values()], list(grads)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("regroup", ["torchrec", "kt_regroup"])
def test_patched_vbe_ebc_equals_unpatched_torchrec(regroup):
    torch.manual_seed(0)
    reference = VbeModel(tr_regroup.KTRegroupAsDict)
    kjt = vbe_kjt()
    want = _run(reference, kjt)
    with kt_regroup.patch_torchrec():
        cls = tr_regroup.KTRegroupAsDict if regroup == "torchrec" else kt_regroup.KTRegroupAsDict
        model = VbeModel(cls)
        model.ebc.load_state_dict(reference.ebc.state_dict())
        kt = model.ebc(kjt)
        assert isinstance(kt, VariableBatchKeyedTensor) and kt._expanded is None
        got = _run(model, kjt)
        assert kt._expanded is None  # the regroup read the pooled rows
    _same(got[0], want[0])
    _same(got[1], want[1])


def test_patched_vbe_weighted_ebc_with_shared_features_equals_unpatched_torchrec():
    """The rows forward is torchrec's own forward code: per-sample weights and a feature
    read by two tables (torchrec's ``feature@table`` names) come out as torchrec's."""

    def model():
        torch.manual_seed(1)
        ebc = EmbeddingBagCollection(
            [EmbeddingBagConfig(num_embeddings=10, embedding_dim=3, name="t0", feature_names=["user", "item"]),
             EmbeddingBagConfig(num_embeddings=10, embedding_dim=2, name="t1", feature_names=["user"])],
            is_weighted=True,
        )
        return ebc, tr_regroup.KTRegroupAsDict([["item", "user@t1"], ["user@t0"]], ["a", "b"])

    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([1, 2, 0, 2, 1])  # user: 3 rows, item: 2 rows
    kjt = KeyedJaggedTensor(
        keys=["user", "item"], values=torch.randint(0, 10, (6,), generator=g),
        lengths=lengths, weights=torch.rand(6, generator=g),
        stride_per_key_per_rank=[[3], [2]],
        inverse_indices=(["user", "item"], torch.tensor([[0, 2, 1, 2], [1, 0, 0, 1]])),
    )
    ebc, regroup = model()
    want = regroup([ebc(kjt)])
    with kt_regroup.patch_torchrec():
        ebc, regroup = model()
        kt = ebc(kjt)
        assert isinstance(kt, VariableBatchKeyedTensor) and kt._expanded is None
        got = regroup([kt])
        assert kt._expanded is None
    _same(list(got.values()), list(want.values()))


def test_patched_vbe_keyed_tensor_expands_when_read():
    torch.manual_seed(0)
    ebc = VbeModel(tr_regroup.KTRegroupAsDict).ebc
    kjt = vbe_kjt(batch=5, seed=1)
    want = ebc(kjt)
    with kt_regroup.patch_torchrec():
        got = ebc(kjt)
        assert type(got) is VariableBatchKeyedTensor and isinstance(got, KeyedTensor)
        assert got.keys() == want.keys() and got.length_per_key() == want.length_per_key()
        assert torch.equal(got.values(), want.values())
        assert got.to_dict().keys() == want.to_dict().keys()
        for k in want.keys():
            assert torch.equal(got[k], want[k])
        (g,) = torch.autograd.grad(got.values().sum(), [ebc.embedding_bags["t_hist"].weight])
        (w,) = torch.autograd.grad(want.values().sum(), [ebc.embedding_bags["t_hist"].weight])
        assert torch.equal(g, w)
        # plain KJTs take torchrec's path unchanged
        plain = KeyedJaggedTensor.from_lengths_sync(
            list(FEATURES), torch.arange(8), torch.ones(8, dtype=torch.long)
        )
        assert type(ebc(plain)) is KeyedTensor
    assert type(ebc(kjt)) is KeyedTensor  # unpatched again


def test_per_key_outputs_of_a_plain_kjt_equal_the_ebc():
    """The bench's no-cat row (issue 23, item 3): ``forward_rows`` on a KJT without
    inverse indices is the EBC's output, per key, indices None."""
    from kt_regroup.vbe import forward_rows

    torch.manual_seed(0)
    ebc = VbeModel(tr_regroup.KTRegroupAsDict).ebc
    plain = KeyedJaggedTensor.from_lengths_sync(
        list(FEATURES), torch.arange(12) % 10, torch.tensor([1, 2, 0] * 4)
    )
    got, want = forward_rows(ebc, plain), ebc(plain)
    assert got.indices == [None] * len(FEATURES) and got._expanded is None
    out = kt_regroup.KTRegroupAsDict(GROUPS, ["a", "b"])([got])
    ref = tr_regroup.KTRegroupAsDict(GROUPS, ["a", "b"])([want])
    _same(list(out.values()), list(ref.values()))
    assert torch.equal(got.values(), want.values())


def test_patched_vbe_bad_index_names_the_key_and_sample():
    torch.manual_seed(0)
    kjt = vbe_kjt()
    inverse = kjt.inverse_indices()[1].clone()
    inverse[1, 4] = 99
    bad = KeyedJaggedTensor(
        keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank(),
        inverse_indices=(kjt.keys(), inverse),
    )
    with kt_regroup.patch_torchrec():
        model = VbeModel(kt_regroup.KTRegroupAsDict)
        with pytest.raises(IndexError, match=r"key 'hist', sample 4: .*indices\[1\]\[4\] = 99"):
            model(bad)


def _export(ebc, kjt):
    """``(exported program's output values, None)`` or ``(None, the error's type)``."""
    try:
        return torch.export.export(ebc, (kjt,), strict=False).module()(kjt).values(), None
    except Exception as exc:  # noqa: BLE001  (compared with unpatched torchrec's outcome)
        return None, type(exc)


def test_patched_vbe_under_fx_torchscript_compile_and_export_is_torchrec():
    import torchrec.fx

    torch.manual_seed(0)
    ebc = VbeModel(tr_regroup.KTRegroupAsDict).ebc
    kjt = vbe_kjt()
    want = ebc(kjt).values().detach()
    fx_code = torchrec.fx.symbolic_trace(copy.deepcopy(ebc)).code
    script_code = torch.jit.script(copy.deepcopy(ebc)).code
    exported = _export(copy.deepcopy(ebc), kjt)
    with kt_regroup.patch_torchrec():
        traced = torchrec.fx.symbolic_trace(copy.deepcopy(ebc))
        assert traced.code == fx_code and "process_pooled_embeddings" in fx_code
        out = traced(kjt)
        assert type(out) is KeyedTensor and torch.equal(out.values(), want)
        scripted = torch.jit.script(copy.deepcopy(ebc))
        assert scripted.code == script_code
        assert torch.equal(scripted(kjt).values(), want)
        out = torch.compile(copy.deepcopy(ebc), backend="eager")(kjt)
        assert type(out) is KeyedTensor and torch.equal(out.values(), want)
        got = _export(copy.deepcopy(ebc), kjt)
    assert got[1] == exported[1]
    if exported[1] is None:
        assert torch.equal(got[0], exported[0])


# --- the lazy KeyedTensor behaves as torchrec's (issue 35, item 1) ------------------------


def _weights(o):  # non-integer: the summation order shows in the bits
    return torch.linspace(0.1, 1.7, o.numel()).view_as(o)


def _twin_ebcs():
    """Unpatched torchrec's EBC and a copy for the patched one, same weights."""
    torch.manual_seed(0)
    ebc = VbeModel(tr_regroup.KTRegroupAsDict).ebc
    return ebc, copy.deepcopy(ebc)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_first_read_without_grad_keeps_the_gradients(mode):
    """A metrics hook reads values() under no_grad / inference_mode first; the model's
    later grad-mode reads and regroup still train every table, as torchrec's do."""
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode

    def step(ebc, kjt):
        kt = ebc(kjt)
        with context():
            metric = kt.values().norm()
        outs = tr_regroup.KTRegroupAsDict(GROUPS, ["a", "b"])([kt])
        loss = (kt.values() * _weights(kt.values())).sum() + kt["item"].sum()
        loss = loss + sum((o * _weights(o)).sum() for o in outs.values())
        return metric, torch.autograd.grad(loss, list(ebc.parameters()))

    reference, patched = _twin_ebcs()
    kjt = vbe_kjt(batch=5, seed=1)
    want = step(reference, kjt)
    with kt_regroup.patch_torchrec():
        got = step(patched, kjt)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    _same(got[1], want[1])


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_made_without_grad_read_in_grad_mode_is_torchrecs(mode):
    """Made under no_grad / inference_mode, the values are what torchrec's would be: no
    graph, and an inference tensor where torchrec's is one."""
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    reference, patched = _twin_ebcs()
    kjt = vbe_kjt(batch=5, seed=1)
    with context():
        want = reference(kjt)
    with kt_regroup.patch_torchrec():
        with context():
            got = patched(kjt)
        assert type(got) is VariableBatchKeyedTensor
        values = got.values()  # read in grad mode
    assert values.requires_grad == want.values().requires_grad == False  # noqa: E712
    assert values.is_inference() == want.values().is_inference() == (mode == "inference_mode")
    assert torch.equal(values, want.values())


@pytest.mark.parametrize("change", ["mul_", "clamp_", "dropout"])
def test_in_place_change_to_values_is_seen_by_every_consumer(change):
    """torchrec's regroup reads values(); after an in-place change to them, so does ours."""

    def edit(values):
        if change == "mul_":
            values.mul_(10.0)
        elif change == "clamp_":
            values.clamp_(min=0.05)
        else:
            torch.manual_seed(3)
            torch.nn.functional.dropout(values, 0.5, training=True, inplace=True)

    def step(ebc, regroup_cls, kjt):
        kt = ebc(kjt)
        edit(kt.values())
        outs = regroup_cls(GROUPS, ["a", "b"])([kt])
        regrouped = KeyedTensor.regroup([kt], GROUPS)
        outs = list(outs.values()) + regrouped + [kt["hist"]]
        loss = sum((o * _weights(o)).sum() for o in outs)
        return [o.detach() for o in outs], list(torch.autograd.grad(loss, list(ebc.parameters())))

    reference, patched = _twin_ebcs()
    kjt = vbe_kjt(batch=6, seed=2)
    want = step(reference, tr_regroup.KTRegroupAsDict, kjt)
    with kt_regroup.patch_torchrec():
        for regroup_cls in (tr_regroup.KTRegroupAsDict, kt_regroup.KTRegroupAsDict):
            got = step(copy.deepcopy(patched), regroup_cls, kjt)
            _same(got[0], want[0])
            _same(got[1], want[1])


def _observe(kt):
    """What user code sees of a KeyedTensor, in a form two runs can compare."""
    values = kt.values()
    seen = {
        "same tensor": kt.values() is values and kt._values is values,
        "requires_grad": values.requires_grad,
        "grad_fn": values.grad_fn is not None,
        "detach": torch.equal(values.detach(), values) and not values.detach().requires_grad,
        "size_in_bytes": kt.size_in_bytes(),
        "device": kt.device(),
        "offset_per_key": kt.offset_per_key(),
    }
    version = values._version
    values.add_(0.5)
    seen["version step"] = values._version - version
    seen["key sees it"] = kt["user"].detach().clone()
    moved = kt.to(torch.device("cpu"))
    seen["to"] = (type(moved), moved.keys(), moved.values().detach().clone())
    leaves, spec = torch.utils._pytree.tree_flatten([kt])
    back = torch.utils._pytree.tree_unflatten(leaves, spec)[0]
    seen["pytree"] = (len(leaves), leaves[0] is values, type(back), back.values() is values)
    detached = KeyedTensor(kt.keys(), kt.length_per_key(), values.detach())
    for name, obj in (("pickle", kt), ("pickle detached", detached)):
        try:
            back = pickle.loads(pickle.dumps(obj))
            seen[name] = (type(back), back.keys(), back.length_per_key(), back.values().detach())
        except Exception as exc:  # noqa: BLE001  (compared with torchrec's outcome)
            seen[name] = type(exc)
    return seen


def _assert_same(a, b, name):
    if isinstance(b, tuple):
        assert isinstance(a, tuple) and len(a) == len(b), name
        for x, y in zip(a, b):
            _assert_same(x, y, name)
    elif isinstance(b, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    else:
        assert a == b, name


def test_keyed_tensor_methods_behave_as_torchrecs():
    reference, patched = _twin_ebcs()
    kjt = vbe_kjt(batch=5, seed=4)
    want = _observe(reference(kjt))
    with kt_regroup.patch_torchrec():
        kt = patched(kjt)
        assert type(kt) is VariableBatchKeyedTensor
        got = _observe(kt)
        # pickled as a plain KeyedTensor: it loads where kt_regroup is not imported
        frozen = pickle.dumps(patched(kjt))
    assert got.keys() == want.keys()
    for name in want:
        _assert_same(got[name], want[name], name)
    script = (
        "import pickle, sys; kt = pickle.loads(sys.stdin.buffer.read()); "
        "assert 'kt_regroup' not in sys.modules, 'kt_regroup was imported'; "
        "print(type(kt).__name__, tuple(kt.values().shape))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], input=frozen, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().split() == ["KeyedTensor", "(5,", "21)"]


# --- KTRegroupAsDict keeps a plan for variable-batch inputs (issue 35, item 8) ----------


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_module_keeps_a_plan_for_variable_batch_inputs():
    """Warm steps run the fused op and nothing else: no kt_regroup_arguments, no casts;
    outputs and gradients stay torchrec's as the inputs flip between rows and values."""
    torch.manual_seed(0)
    reference = VbeModel(tr_regroup.KTRegroupAsDict)
    with kt_regroup.patch_torchrec():
        model = VbeModel(kt_regroup.KTRegroupAsDict)
        model.ebc.load_state_dict(reference.ebc.state_dict())
        plans = []
        read_first = [False, False, False, True, False, False]
        for step in range(len(read_first)):
            kjt = vbe_kjt(batch=4 + step, seed=step)
            kt = model.ebc(kjt)
            if read_first[step]:  # the values exist: the regroup reads them (a plain plan)
                kt.values()
            with _OpLog() as log:
                outs = model.regroup([kt])
            if step in (1, 2, 5):  # warm
                assert log.ops == ["kt_regroup.permute_multi_embedding_vbe.default"], log.ops
            plans.append(model.regroup._plan)
            got = [o.detach() for o in outs.values()]
            loss = sum((o * _weights(o)).sum() for o in outs.values())
            got_grads = torch.autograd.grad(loss, list(model.parameters()))
            want_outs = reference.regroup([reference.ebc(kjt)])
            want = [o.detach() for o in want_outs.values()]
            loss = sum((o * _weights(o)).sum() for o in want_outs.values())
            _same(got, want)
            _same(got_grads, torch.autograd.grad(loss, list(reference.parameters())))
    assert plans[0] is plans[1] is plans[2] and len(plans[0].rows) == 1
    assert plans[3].rows == [] and plans[4] is not plans[3] and plans[4].rows == [True]
    assert plans[5] is plans[4]


def test_module_promotes_variable_batch_inputs_of_mixed_dtypes():
    """As torchrec's EBC output (its torch.cat promotes), with and without a warm plan."""
    g = torch.Generator().manual_seed(5)
    pooled = [torch.randn(3, 2, generator=g), torch.randn(2, 4, generator=g, dtype=torch.float64)]
    indices = [torch.tensor([0, 2, 1, 1]), None]
    with pytest.raises(ValueError):  # 2 rows of an unindexed input against a batch of 4
        kt_regroup.KTRegroupAsDict([["b", "a"]], ["g"])(
            [VariableBatchKeyedTensor(["a", "b"], [2, 4], pooled, indices)]
        )
    indices[1] = torch.tensor([1, 0, 0, 1])
    module = kt_regroup.KTRegroupAsDict([["b", "a"], ["a"]], ["g", "h"])
    for _ in range(2):
        kt = VariableBatchKeyedTensor(["a", "b"], [2, 4], pooled, indices)
        got = module([kt])
        want = torch.cat([pooled[0][indices[0]].double(), pooled[1][indices[1]]], 1)
        assert got["g"].dtype == torch.float64
        torch.testing.assert_close(got["g"], torch.cat([want[:, 2:], want[:, :2]], 1), rtol=0, atol=0)
        torch.testing.assert_close(got["h"], want[:, :2], rtol=0, atol=0)
