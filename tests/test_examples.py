"""The examples run and learn."""

import importlib.util
import math
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_dlrm_like_runs_and_loss_decreases(capsys):
    example = _load("train_dlrm_like")
    losses = example.main(steps=24, batch_size=128, seed=0, log_every=8)
    assert len(losses) == 24
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < first, (first, last)
    printed = capsys.readouterr().out
    assert "step   0  loss" in printed and "step  23  loss" in printed


def test_train_dlrm_like_unused_feature_gets_zero_gradient():
    import torch

    example = _load("train_dlrm_like")
    torch.manual_seed(0)
    model = example.DLRMLike()
    features, labels = example.SyntheticClicks(1).batch(16)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(features), labels)
    loss.backward()
    grad = model.ebc.embedding_bags["t_unused_feature"].weight.grad
    assert torch.equal(grad, torch.zeros_like(grad))
    used = model.ebc.embedding_bags["t_context"].weight.grad
    assert used.abs().sum() > 0


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_has_a_main(script):
    assert "def main(" in (EXAMPLES / script).read_text()
