"""Pipelined sharded training with kt_regroup: torchrec's TrainPipelineSparseDist, 2 CPU ranks.

    KeyedJaggedTensor -> EmbeddingBagCollection      -> kt_regroup.KTRegroupAsDict -> Linear -> loss
                         (table-wise sharded over       ("user" / "item"; "unused"
                          the 2 ranks by DMP)            is in no group)

``TrainPipelineSparseDist`` overlaps the input all-to-all of the next batch with the
forward and backward of this one. Two processes talk over gloo on 127.0.0.1; nothing
else is reached. The "unused" table is looked up every step but feeds no group: its
gradient is exactly zero with kt_regroup, so its weights never move.

Run it:

    python examples/train_pipeline.py --steps 8
"""

import argparse
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

import kt_regroup

WORLD_SIZE = 2
ROWS = 32
# Embedding dims: multiples of 4, which torchrec's table-wise sharding requires.
DIMS = {"user_id": 8, "user_hist": 4, "item_id": 12, "context": 4, "unused": 8}
GROUPS = [["user_id", "user_hist", "context"], ["item_id", "context"]]
GROUP_NAMES = ["user", "item"]
UNUSED_TABLE = "t_unused"


@dataclass
class Batch(Pipelineable):
    """What the pipeline moves between devices and streams: features and labels."""

    features: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(
            self.features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.features.record_stream(stream)
        self.labels.record_stream(stream)


def make_batches(rank: int, steps: int, batch_size: int, seed: int) -> List[Batch]:
    """Each rank's own synthetic batches (multi-hot bags of 0 to 3 ids per feature)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    batches = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (len(DIMS) * batch_size,), generator=gen)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
        features = KeyedJaggedTensor.from_lengths_sync(
            keys=list(DIMS), values=values, lengths=lengths
        )
        labels = torch.randint(0, 2, (batch_size,), generator=gen).float()
        batches.append(Batch(features, labels))
    return batches


class Model(torch.nn.Module):
    """Returns ``(loss, output)``, the pair TrainPipelineSparseDist expects.

    The pipeline backpropagates ``loss`` and hands back ``output`` alone: it carries
    the detached loss too, for logging.
    """

    def __init__(
        self, regroup_cls: Callable[..., torch.nn.Module] = kt_regroup.KTRegroupAsDict
    ) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"t_{f}", embedding_dim=d, num_embeddings=ROWS, feature_names=[f]
                )
                for f, d in DIMS.items()
            ],
            device=torch.device("cpu"),
        )
        self.regroup = regroup_cls(GROUPS, GROUP_NAMES)
        self.over = torch.nn.Linear(sum(DIMS[f] for g in GROUPS for f in g), 1)

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        groups = self.regroup([self.ebc(batch.features)])
        logits = self.over(torch.cat([groups["user"], groups["item"]], dim=1)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach())


def shard(model: Model, lr: float = 0.1) -> Tuple[DistributedModelParallel, KeyedOptimizerWrapper]:
    """DMP with every table on one rank (table-wise) and fused SGD; SGD for the dense part."""
    sharders = [
        EmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr}
        )
    ]
    # Tables this small would be made data-parallel: ask for table-wise explicitly.
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
        constraints={
            f"t_{f}": ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value])
            for f in DIMS
        },
    )
    plan = planner.collective_plan(model, sharders, dist.group.WORLD)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=plan,
        sharders=sharders,
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=lr),
    )
    return dmp, dense


def table_weight(dmp: DistributedModelParallel, table: str) -> Optional[torch.Tensor]:
    """A copy of ``table``'s weights on the rank that holds it (table-wise), else None."""
    for name, tensor in dmp.state_dict().items():
        if name.endswith(f"embedding_bags.{table}.weight"):
            shards = tensor.local_shards()
            return shards[0].tensor.detach().clone() if shards else None
    raise KeyError(table)


def train(
    dmp: DistributedModelParallel,
    optimizer: KeyedOptimizerWrapper,
    batches: List[Batch],
    pipelined: bool,
) -> List[float]:
    """Trains on ``batches``; returns this rank's loss of each step."""
    losses = []
    if pipelined:
        pipeline = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))
        batch_iter = iter(batches)
        for _ in batches:
            # progress() trains one batch and returns its output: (loss, logits).
            losses.append(pipeline.progress(batch_iter)[0].item())
    else:
        for batch in batches:
            optimizer.zero_grad()
            loss, _ = dmp(batch)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def init_process_group(rank: int, port: int) -> None:
    """gloo on loopback; a collective that waits over 2 minutes fails instead of hanging."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=120)
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, steps: int, batch_size: int, seed: int, results) -> None:
    init_process_group(rank, port)
    try:
        torch.manual_seed(seed)  # the same initial weights on both ranks
        dmp, optimizer = shard(Model())
        before = table_weight(dmp, UNUSED_TABLE)
        losses = train(dmp, optimizer, make_batches(rank, steps, batch_size, seed), pipelined=True)
        after = table_weight(dmp, UNUSED_TABLE)
        unchanged = None if before is None else torch.equal(before, after)
        results.put((rank, losses, unchanged))
    finally:
        dist.destroy_process_group()


def main(steps: int = 8, batch_size: int = 32, seed: int = 0) -> List[List[float]]:
    """Trains on 2 ranks with the pipeline; returns each rank's losses."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.spawn(_worker, args=(free_port(), steps, batch_size, seed, results), nprocs=WORLD_SIZE)
    losses, unchanged = {}, {}
    for _ in range(WORLD_SIZE):
        rank, rank_losses, rank_unchanged = results.get()
        losses[rank] = rank_losses
        if rank_unchanged is not None:  # the rank holding the table
            unchanged[rank] = rank_unchanged
    for step in range(steps):
        line = "  ".join(f"rank {r} loss {losses[r][step]:.4f}" for r in range(WORLD_SIZE))
        print(f"step {step:3d}  {line}")
    for rank, same in unchanged.items():
        print(f"table {UNUSED_TABLE!r} (rank {rank}) unchanged by training: {same}")
    return [losses[r] for r in range(WORLD_SIZE)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(steps=args.steps, batch_size=args.batch_size, seed=args.seed)
