"""A small DLRM-like recommender using kt_regroup, trained on synthetic clicks (CPU).

    EmbeddingBagCollection  ->  kt_regroup.KTRegroupAsDict  ->  interaction  ->  MLP
    (one pooled KeyedTensor)    ("user" / "item" groups;       (dot product of
                                 "context" feeds both)          the two towers + concat)

Run it:

    python examples/train_dlrm_like.py --steps 30

The labels come from hidden "true" user and item vectors, so the model has something to
learn and the printed loss goes down.
"""

from __future__ import annotations

import argparse

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import kt_regroup

# feature -> (embedding dim, number of ids)
FEATURES: dict[str, tuple] = {
    "user_id": (16, 64),
    "user_history": (8, 64),  # several item ids per user: a multi-hot bag
    "item_id": (16, 64),
    "item_category": (7, 8),
    "context": (3, 4),  # time of day etc.: used by both towers
    "unused_feature": (5, 4),  # computed but consumed by no group (gradient must be 0)
}
GROUPS = [["user_id", "user_history", "context"], ["item_id", "item_category", "context"]]
GROUP_NAMES = ["user", "item"]
TOWER_DIM = 16


def _group_width(group: list[str]) -> int:
    return sum(FEATURES[f][0] for f in group)


class DLRMLike(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"t_{name}", embedding_dim=dim, num_embeddings=rows, feature_names=[name]
                )
                for name, (dim, rows) in FEATURES.items()
            ],
            device=torch.device("cpu"),
        )
        self.regroup = kt_regroup.KTRegroupAsDict(GROUPS, GROUP_NAMES)
        self.towers = torch.nn.ModuleDict(
            {
                name: torch.nn.Sequential(
                    torch.nn.Linear(_group_width(g), TOWER_DIM), torch.nn.ReLU()
                )
                for name, g in zip(GROUP_NAMES, GROUPS)
            }
        )
        self.over = torch.nn.Sequential(
            torch.nn.Linear(2 * TOWER_DIM + 1, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(features)  # KeyedTensor [B, sum(dims)]
        groups = self.regroup([pooled])  # {"user": [B, 27], "item": [B, 26]}
        user = self.towers["user"](groups["user"])
        item = self.towers["item"](groups["item"])
        dot = (user * item).sum(dim=1, keepdim=True)  # the pairwise interaction
        return self.over(torch.cat([user, item, dot], dim=1)).squeeze(1)


class SyntheticClicks:
    """Batches of (features, label); a click is likelier when hidden vectors agree."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.true_user = torch.randn(FEATURES["user_id"][1], 4, generator=self.gen)
        self.true_item = torch.randn(FEATURES["item_id"][1], 4, generator=self.gen)

    def batch(self, batch_size: int):
        g = self.gen
        ids = {
            name: torch.randint(0, rows, (batch_size,), generator=g)
            for name, (_, rows) in FEATURES.items()
        }
        history_len = torch.randint(1, 4, (batch_size,), generator=g)
        history = torch.randint(
            0, FEATURES["user_history"][1], (int(history_len.sum()),), generator=g
        )
        keys, lengths, values = [], [], []
        for name in FEATURES:
            keys.append(name)
            if name == "user_history":
                lengths.append(history_len)
                values.append(history)
            else:
                lengths.append(torch.ones(batch_size, dtype=torch.long))
                values.append(ids[name])
        features = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
        )
        score = (self.true_user[ids["user_id"]] * self.true_item[ids["item_id"]]).sum(1)
        labels = (torch.rand(batch_size, generator=g) < torch.sigmoid(2 * score)).float()
        return features, labels


def main(steps: int = 30, batch_size: int = 256, seed: int = 0, log_every: int = 5) -> list[float]:
    """Trains for ``steps`` steps; returns the loss of every step."""
    torch.manual_seed(seed)
    model = DLRMLike()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    data = SyntheticClicks(seed)
    # A fixed pool of batches, cycled: the loss on it must go down.
    batches = [data.batch(batch_size) for _ in range(4)]
    losses: list[float] = []
    for step in range(steps):
        features, labels = batches[step % len(batches)]
        logits = model(features)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % log_every == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    first = sum(losses[: len(batches)]) / len(batches)
    last = sum(losses[-len(batches) :]) / len(batches)
    print(
        f"mean loss over the first {len(batches)} steps {first:.4f}, last {len(batches)} {last:.4f}"
    )
    print(f"kt_regroup op library: {kt_regroup.library_path()}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(steps=args.steps, batch_size=args.batch_size, seed=args.seed)
