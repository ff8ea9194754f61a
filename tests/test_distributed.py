"""KTRegroupAsDict inside a sharded torchrec model: 2 processes, gloo on loopback, CPU.

The model is EmbeddingBagCollection -> kt_regroup.KTRegroupAsDict -> Linear, wrapped in
torchrec's DistributedModelParallel. Each rank checks that

* the sharded model's output equals an unsharded copy (same weights) on its batch,
* kt_regroup's groups equal torchrec's own KTRegroupAsDict on the same sharded
  KeyedTensor, inside the same forward,
* after backward, the data-parallel Linear gradients equal the mean of the unsharded
  model's gradients over both ranks' batches.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port

WORLD_SIZE = 2
BATCH = 6
GROUPS = [["t0", "t2"], ["t1", "t0"]]  # t0 used twice, t3 unused
GROUP_NAMES = ["user", "item"]
DIMS = {"t0": 8, "t1": 4, "t2": 12, "t3": 4}
ROWS = 20


def _build_model():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.regroup import KTRegroupAsDict as TorchrecKTRegroupAsDict

    import kt_regroup

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name=f"table_{name}",
                        embedding_dim=dim,
                        num_embeddings=ROWS,
                        feature_names=[name],
                    )
                    for name, dim in DIMS.items()
                ],
                device=torch.device("cpu"),
            )
            self.regroup = kt_regroup.KTRegroupAsDict(GROUPS, GROUP_NAMES)
            self.torchrec_regroup = TorchrecKTRegroupAsDict(GROUPS, GROUP_NAMES)
            self.over = torch.nn.Linear(DIMS["t0"] + DIMS["t2"] + DIMS["t1"] + DIMS["t0"], 1)

        def forward(self, features) -> dict[str, torch.Tensor]:
            pooled = self.ebc(features)
            ours = self.regroup([pooled])
            with torch.no_grad():
                theirs = self.torchrec_regroup([pooled])
            out = self.over(torch.cat([ours["user"], ours["item"]], dim=1))
            return {
                "out": out,
                "user": ours["user"],
                "item": ours["item"],
                "torchrec_user": theirs["user"],
                "torchrec_item": theirs["item"],
            }

    return Model()


def _batch(rank: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(100 + rank)
    keys = list(DIMS)
    lengths = torch.randint(0, 4, (len(keys) * BATCH,), generator=gen)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)


def _copy_weights(
    sharded_state: dict[str, torch.Tensor], full_state: dict[str, torch.Tensor]
) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for name, target in sharded_state.items():
        source = full_state[name]
        with torch.no_grad():
            if isinstance(target, ShardedTensor):
                for shard in target.local_shards():
                    (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(source[r : r + h, c : c + w])
            else:
                target.copy_(source)


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)  # two processes on a shared machine
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        from torchrec.distributed.model_parallel import (
            DistributedModelParallel,
            get_default_sharders,
        )
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.planner.types import ParameterConstraints
        from torchrec.distributed.types import ShardingEnv, ShardingType

        torch.manual_seed(0)  # the same unsharded reference weights on every rank
        reference = _build_model()
        full_state = {k: v.detach().clone() for k, v in reference.state_dict().items()}

        # Force table-wise sharding (the planner would make tables this small
        # data-parallel): the pooled KeyedTensor then comes out of an all-to-all.
        model = _build_model()
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=WORLD_SIZE, compute_device="cpu"),
            constraints={
                f"table_{name}": ParameterConstraints(
                    sharding_types=[ShardingType.TABLE_WISE.value]
                )
                for name in DIMS
            },
        )
        plan = planner.collective_plan(model, get_default_sharders(), dist.group.WORLD)
        dmp = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=torch.device("cpu"),
            plan=plan,
        )
        assert type(dmp.module.ebc).__name__ == "ShardedEmbeddingBagCollection"
        ranks = {p.ranks[0] for p in plan.plan["ebc"].values()}
        assert ranks == {0, 1}, plan  # tables live on both ranks
        _copy_weights(dmp.state_dict(), full_state)

        got = dmp(_batch(rank))
        want = reference(_batch(rank))
        for key in ("user", "item"):
            torch.testing.assert_close(got[key], got[f"torchrec_{key}"], rtol=0, atol=0)
            torch.testing.assert_close(got[key], want[key])
        torch.testing.assert_close(got["out"], want["out"])

        # Backward through the regroup: the DDP-averaged dense gradients must equal the
        # mean of the reference gradients over both ranks' batches.
        got["out"].square().sum().backward()
        for r in range(WORLD_SIZE):
            reference(_batch(r))["out"].square().sum().backward()
        dense = dict(dmp.named_parameters())
        for name, param in reference.over.named_parameters():
            mine = next(p for n, p in dense.items() if n.endswith(f"over.{name}"))
            torch.testing.assert_close(mine.grad, param.grad / WORLD_SIZE)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available"
)
def test_ktregroupasdict_in_distributed_model_parallel():
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD_SIZE, join=True)
