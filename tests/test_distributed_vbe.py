"""patch_torchrec() and the sharded EmbeddingBagCollection's variable-batch (VBE) output:
2 processes, gloo on loopback, CPU, real torchrec DistributedModelParallel.

The model is EmbeddingBagCollection -> KTRegroupAsDict (kt_regroup's, or torchrec's
patched). Sharded table-wise, column-wise mixed with table-wise, and row-wise mixed with
table-wise, each rank checks against the unsharded, unpatched torchrec model with the
same weights:

* the groups on its variable-batch KJT, and that the EBC's output was the lazy
  ``VariableBatchKeyedTensor``, regrouped from its rows without being expanded;
* the embedding gradients: the fused EXACT_SGD step (learning rate 1) moves every shard by
  minus the mean of the reference gradients over both ranks' batches (as unpatched);
* that ``unpatch_torchrec()`` gives back torchrec's expansion, data-parallel shards fail as
  in torchrec, and fx tracing and export of the sharded model do what they do unpatched.
"""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port
from torch.utils._python_dispatch import TorchDispatchMode

WORLD_SIZE = 2
BATCH = 6
FEATURES = {"user": (4, 3), "hist": (8, 2), "item": (16, 5), "ctx": (12, 1)}  # dim, rows
GROUPS = [["hist", "user"], ["item", "hist", "ctx"]]  # hist twice; every key used
ROWS = 10  # per table


def _kjt(rank: int, vary: bool = True):
    """Rank ``rank``'s variable-batch KJT: feature k has ``rows`` (+ ``rank``, ``vary``)
    unique rows."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(10 + rank)
    keys = list(FEATURES)
    lengths, values, inverse, strides = [], [], [], []
    for k in keys:
        rows = FEATURES[k][1] + (rank if vary else 0)
        n = torch.randint(0, 3, (rows,), generator=g)
        lengths.append(n)
        values.append(torch.randint(0, ROWS, (int(n.sum()),), generator=g))
        inverse.append(torch.randint(0, rows, (BATCH,), generator=g))
        strides.append([rows])
    return KeyedJaggedTensor(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths),
        stride_per_key_per_rank=strides, inverse_indices=(keys, torch.stack(inverse)),
    )


class _Model(torch.nn.Module):
    def __init__(self, regroup_cls) -> None:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        super().__init__()
        self.ebc = EmbeddingBagCollection(
            [EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=d, name=f"t_{k}",
                                feature_names=[k]) for k, (d, _) in FEATURES.items()],
            device=torch.device("cpu"),
        )
        self.regroup = regroup_cls(GROUPS, ["a", "b"])
        self.pooled = []  # the EBC's last output (a LazyAwaitable under DMP)

    def forward(self, kjt):
        pooled = self.ebc(kjt)
        self.pooled = [pooled]
        return self.regroup([pooled])


def _loss(outs) -> torch.Tensor:
    return sum((o * torch.arange(o.numel()).view_as(o)).sum() for o in outs.values())


def _regroup_cls(name: str):
    import torchrec.modules.regroup as tr_regroup

    import kt_regroup

    return kt_regroup.KTRegroupAsDict if name == "kt_regroup" else tr_regroup.KTRegroupAsDict


def _specs():
    from torchrec.distributed.sharding_plan import column_wise, data_parallel, row_wise, table_wise

    fused = {"compute_kernel": "fused"}  # the dense kernel has no variable batch
    return {
        # in the KJT's order (torchrec permutes neither the indices nor the columns)
        "table_wise": {"t_user": table_wise(rank=0, **fused), "t_hist": table_wise(rank=0, **fused),
                       "t_item": table_wise(rank=1, **fused), "t_ctx": table_wise(rank=1, **fused)},
        # hist: 2 shards, the second on rank 0; item: 4 shards, ranks reused; ctx: uneven
        "column_wise": {"t_user": table_wise(rank=1, **fused),
                        "t_hist": column_wise(ranks=[1, 0], **fused),
                        "t_item": column_wise(ranks=[0, 1, 1, 0], **fused),
                        "t_ctx": column_wise(ranks=[0, 1], size_per_rank=[4, 8], **fused)},
        "row_wise": {"t_user": row_wise(**fused), "t_hist": table_wise(rank=1, **fused),
                     "t_item": row_wise(**fused), "t_ctx": table_wise(rank=0, **fused)},
        "data_parallel": {f"t_{k}": data_parallel() for k in FEATURES},
    }


def _shard(model, spec):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 1.0}
    )
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(
        model.ebc, spec, sharder=sharder, world_size=WORLD_SIZE, device_type="cpu"
    )})
    return DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"), plan=plan, sharders=[sharder],
    )


def _copy_weights(dmp, full_state) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for name, target in dmp.state_dict().items():
        if isinstance(target, ShardedTensor):
            for shard in target.local_shards():
                (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                with torch.no_grad():
                    shard.tensor.copy_(full_state[name][r : r + h, c : c + w])


def _check_weights(dmp, want_state) -> int:
    """Every local shard equals ``want_state``'s block; returns how many were checked."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    checked = 0
    for name, target in dmp.state_dict().items():
        if isinstance(target, ShardedTensor):
            for shard in target.local_shards():
                (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                torch.testing.assert_close(
                    shard.tensor, want_state[name][r : r + h, c : c + w], msg=name
                )
                checked += 1
    return checked


class _Ops(TorchDispatchMode):
    """The names of the ops that reach the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


# torchrec's expansion of the rows and its permute of the expanded columns
EXPANSION = {"fbgemm::batch_index_select_dim0_forward_cpu_impl", "fbgemm::permute_pooled_embs"}


def _lazy(model):
    """The EBC's waited output: the lazy form, and whether it was expanded."""
    from torchrec.distributed.types import LazyAwaitable

    (pooled,) = model.pooled
    return LazyAwaitable._wait_async(pooled)


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two processes on a shared machine
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        _check(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check(rank: int) -> None:
    import torchrec.distributed.embeddingbag as tr_sharded
    import torchrec.fx
    from torchrec.distributed.types import LazyAwaitable
    from torchrec.sparse.jagged_tensor import KeyedTensor

    import kt_regroup

    original_wait = tr_sharded.VariableBatchEmbeddingBagCollectionAwaitable.__dict__["_wait_impl"]
    # the unsharded, unpatched reference: outputs on this rank's batch, and the SGD step
    # of both ranks' batches (the sharded backward averages the embedding gradients)
    torch.manual_seed(0)
    reference = _Model(_regroup_cls("torchrec"))
    full = {f"ebc.{k}": v.detach().clone() for k, v in reference.ebc.state_dict().items()}
    names = [f"ebc.{n}" for n, _ in reference.ebc.named_parameters()]

    def expected(vary: bool):
        want = {k: v.detach() for k, v in reference(_kjt(rank, vary)).items()}
        stepped = {k: v.clone() for k, v in full.items()}
        for r in range(WORLD_SIZE):
            loss = _loss(reference(_kjt(r, vary)))
            for n, g in zip(names, torch.autograd.grad(loss, list(reference.ebc.parameters()))):
                stepped[n] -= g / WORLD_SIZE
        return want, stepped

    specs = _specs()
    for sharding in ("table_wise", "column_wise", "row_wise"):
        # torchrec's row-wise backward (an all_gather) needs one row count on every rank
        vary = sharding != "row_wise"
        want, stepped = expected(vary)
        for regroup in ("kt_regroup", "torchrec"):
            with kt_regroup.patch_torchrec():
                dmp = _shard(_Model(_regroup_cls(regroup)), specs[sharding])
                assert type(dmp.module.regroup) is kt_regroup.KTRegroupAsDict
                _copy_weights(dmp, full)
                with _Ops() as ops:
                    got = dmp(_kjt(rank, vary))
                    kt = _lazy(dmp.module)
                assert type(kt) is kt_regroup.VariableBatchKeyedTensor, (sharding, regroup)
                assert kt._expanded is None  # regrouped straight from the rows
                with torch.no_grad():  # KeyedTensor.regroup of the awaitable, from the rows
                    pooled = dmp.module.ebc(_kjt(rank, vary))
                    regrouped = KeyedTensor.regroup([pooled], GROUPS)
                    assert LazyAwaitable._wait_async(pooled)._expanded is None
                with ops:
                    _loss(got).backward()
                assert "kt_regroup::permute_multi_embedding_vbe" in ops.names
                assert not EXPANSION & ops.names, ops.names
            for k, r in zip(want, regrouped):
                torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
                torch.testing.assert_close(r, want[k], rtol=0, atol=0)
            assert _check_weights(dmp, stepped) > 0
            sharded_ebc = dmp.module.ebc
            permuted = sharded_ebc._inverse_indices_permute_indices is not None
            assert permuted == (sharding != "table_wise"), sharding
            if sharding == "column_wise":  # a key's columns come from both ranks
                assert len(dmp.plan.plan["ebc"]["t_hist"].sharding_spec.shards) == 2
        # unpatched: torchrec's expansion again, in the same sharded model (weights stepped)
        assert tr_sharded.VariableBatchEmbeddingBagCollectionAwaitable.__dict__[
            "_wait_impl"] is original_wait
        with _Ops() as ops:
            again = dmp(_kjt(rank, vary))
            assert type(_lazy(dmp.module)) is KeyedTensor
        assert EXPANSION <= ops.names, ops.names
        expanded = dmp.module.ebc(_kjt(rank, vary)).wait()
        with kt_regroup.patch_torchrec():
            lazy_out = dmp(_kjt(rank, vary))
            lazy = dmp.module.ebc(_kjt(rank, vary)).wait()
        for k in want:
            torch.testing.assert_close(lazy_out[k], again[k], rtol=0, atol=0)
        # the lazy form's keys, values and to_dict are the expanded KeyedTensor's
        assert type(lazy) is kt_regroup.VariableBatchKeyedTensor and type(expanded) is KeyedTensor
        assert lazy.keys() == expanded.keys() and lazy.length_per_key() == expanded.length_per_key()
        torch.testing.assert_close(lazy.values(), expanded.values(), rtol=0, atol=0)
        for k, v in expanded.to_dict().items():
            torch.testing.assert_close(lazy.to_dict()[k], v, rtol=0, atol=0)

    want, _ = expected(True)

    # data-parallel shards with a variable batch fail inside torchrec; patched, the same
    outcomes = []
    for patched in (False, True):
        with kt_regroup.patch_torchrec() if patched else contextlib.nullcontext():
            dmp = _shard(_Model(_regroup_cls("torchrec")), specs["data_parallel"])
            with pytest.raises(RuntimeError) as err:
                dmp(_kjt(rank))
            outcomes.append(str(err.value))
    assert outcomes[0] == outcomes[1] and "split_with_sizes" in outcomes[0], outcomes

    # Graphs record what they record unpatched. torchrec's tracer cannot trace a sharded
    # EBC's input_dist, and export fails on its collectives, patched or not. Traced with
    # the sharded EBC as a leaf (as torchrec's train pipeline does), the graph is the same
    # and runs to the same outputs.
    def capture(patched: bool):
        with kt_regroup.patch_torchrec() if patched else contextlib.nullcontext():
            dmp = _shard(_Model(_regroup_cls("kt_regroup")), specs["column_wise"])
            _copy_weights(dmp, full)
            tracer = torchrec.fx.Tracer(leaf_modules=["ShardedEmbeddingBagCollection"])
            graph = torch.fx.GraphModule(dmp.module, tracer.trace(dmp.module))
            outs = graph(_kjt(rank))
            failures = []
            for capture in (lambda: torchrec.fx.symbolic_trace(dmp),
                            lambda: torch.export.export(dmp.module, (_kjt(rank),), strict=False)):
                try:
                    capture()
                    failures.append(None)
                except Exception as exc:  # noqa: BLE001  (compared with unpatched torchrec's)
                    failures.append(type(exc))
            return graph.code, outs, failures

    code, outs, failures = capture(True)
    want_code, _, want_failures = capture(False)
    assert code == want_code and failures == want_failures, (failures, want_failures)
    for k in want:
        torch.testing.assert_close(outs[k], want[k], rtol=0, atol=0)


@pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available"
)
def test_patched_sharded_vbe_ebc_equals_unsharded_torchrec():
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD_SIZE, join=True)
