"""Deploy a model that uses kt_regroup: an AOTInductor package (and, the legacy path, a
TorchScript file) that runs where only torch and kt_regroup's compiled op library are
loaded (no Python kt_regroup, no torchrec), e.g. in a C++ predictor.

    python examples/deploy.py OUT_DIR [--torchscript]

writes ``OUT_DIR/model.pt2`` (``torch.export`` + AOTInductor, dynamic batch) and, with
``--torchscript``, ``OUT_DIR/model.pt`` (traced with torchrec's fx tracer, then scripted;
TorchScript is deprecated from torch 2.13), and prints how to run them. Load them with::

    torch.ops.load_library(LIB)          # LIB = kt_regroup.library_path()
    torch._inductor.aoti_load_package("model.pt2")   # or torch.jit.load("model.pt")

or from C++ with ``examples/cpp_predictor`` (``AOTIModelPackageLoader``, or
``torch::jit::load`` for model.pt).
"""

import argparse
import pathlib
from typing import List, Optional, Tuple

import torch
import torchrec.fx
from torchrec.sparse.jagged_tensor import KeyedTensor

import kt_regroup

# The pooled embeddings of an EmbeddingBagCollection and the dense features, as the
# over-arch receives them: two tensors, one column block per feature.
SPARSE = {"user_id": 16, "item_id": 16, "context": 8, "unused": 4}
DENSE = {"dense": 13}
GROUPS = [["dense", "user_id", "context"], ["item_id", "context", "user_id"]]
GROUP_NAMES = ["user", "item"]


class OverArchInput(torch.nn.Module):
    """Builds KeyedTensors from plain tensors and regroups them into two towers' inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.regroup = kt_regroup.KTRegroupAsDict(GROUPS, GROUP_NAMES)

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        kts = [
            KeyedTensor(keys=list(SPARSE), length_per_key=list(SPARSE.values()), values=sparse),
            KeyedTensor(keys=list(DENSE), length_per_key=list(DENSE.values()), values=dense),
        ]
        groups = self.regroup(kts)
        return groups["user"], groups["item"]


def example_inputs(batch: int) -> List[torch.Tensor]:
    """Integer-valued inputs (``i % 17 - 8``): any exact copy keeps checksums exact."""
    widths = [sum(SPARSE.values()), sum(DENSE.values())]
    return [(torch.arange(batch * w, dtype=torch.float32) % 17 - 8).reshape(batch, w) for w in widths]


def checksums(outputs) -> List[int]:
    """Per output: sum of values weighted by (i % 101 + 1); what the C++ predictor prints."""
    sums = []
    for out in outputs:
        weights = torch.arange(out.numel(), dtype=torch.float64) % 101 + 1
        sums.append(int((out.double().flatten() * weights).sum().item()))
    return sums


def build(warm: bool = True) -> OverArchInput:
    """The model; ``warm`` runs one batch first so the plan is cached in the graph."""
    model = OverArchInput().eval()
    if warm:
        model(*example_inputs(2))
    return model


def save_torchscript(model: torch.nn.Module, path: pathlib.Path) -> None:
    torch.jit.script(torchrec.fx.symbolic_trace(model)).save(str(path))


def save_aoti(model: torch.nn.Module, path: pathlib.Path) -> None:
    batch = torch.export.Dim("batch", min=1, max=65536)
    program = torch.export.export(
        model, tuple(example_inputs(4)), dynamic_shapes=({0: batch}, {0: batch})
    )
    torch._inductor.aoti_compile_and_package(program, package_path=str(path))


def main(argv: Optional[List[str]] = None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=pathlib.Path)
    parser.add_argument("--torchscript", action="store_true",
                        help="also write a TorchScript file (legacy: deprecated from torch 2.13)")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model = build()
    save_aoti(model, args.out_dir / "model.pt2")
    if args.torchscript:
        save_torchscript(model, args.out_dir / "model.pt")
    print(f"wrote {args.out_dir}/model.pt2" + (" and model.pt" if args.torchscript else ""))
    print(f"op library: {kt_regroup.library_path()}")
    print(f"C++: build/predictor/predictor {args.out_dir}/model.pt2 LIB 8x44 8x13 "
          "(examples/cpp_predictor)")
    return args.out_dir


if __name__ == "__main__":
    main()
