"""torchrec's IR serializer round-trips ``kt_regroup.KTRegroupAsDict``.

encapsulate -> ``torch.export`` -> unflatten -> decapsulate gives back a
``kt_regroup.KTRegroupAsDict`` (not a generic ``InterpreterModule``) computing the
same outputs. Needs ``torchrec.ir``, which the torchrec 1.9.2 wheel does not ship.
"""

from typing import Dict

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.types import DataType

import kt_regroup
from kt_regroup.torchrec_ir import register_ir_serializer

ir_utils = pytest.importorskip(
    "torchrec.ir.utils", reason="the installed torchrec has no torchrec.ir (1.9.2's wheel has none)"
)
from torchrec.ir.serializer import JsonSerializer  # noqa: E402

GROUPS = [["f1", "f3", "f5"], ["f2", "f4"]]


class _Model(torch.nn.Module):
    def __init__(self, emb_dtype) -> None:
        super().__init__()
        tables = [("t1", 3, ["f1", "f2"]), ("t2", 4, ["f3", "f4"]), ("t3", 5, ["f5"])]
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=10, feature_names=f)
                for n, d, f in tables[:2]
            ]
        )
        self.ebc2 = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="t3", embedding_dim=5, num_embeddings=10, feature_names=["f5"]
                )
            ]
        )
        self.regroup = kt_regroup.KTRegroupAsDict(GROUPS, ["odd", "even"], emb_dtype=emb_dtype)

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
        return self.regroup([self.ebc(features), self.ebc2(features)])


def _features() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_offsets_sync(
        keys=["f1", "f2", "f3", "f4", "f5"],
        values=torch.tensor([0, 1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 1, 1, 2]),
        offsets=torch.tensor([0, 2, 2, 3, 4, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15]),
    )


@pytest.mark.parametrize("emb_dtype", [None, DataType.BF16], ids=["no-cast", "bf16"])
def test_encapsulate_export_decapsulate_round_trip(emb_dtype):
    assert register_ir_serializer() is True
    torch.manual_seed(0)
    model = _Model(emb_dtype)
    eager = model(_features())
    state = model.state_dict()

    model, fqns = ir_utils.encapsulate_ir_modules(model, JsonSerializer)
    assert "regroup" in fqns
    ep = torch.export.export(
        model, (_features(),), {}, strict=False, preserve_module_call_signature=tuple(fqns)
    )
    want = torch.float32 if emb_dtype is None else torch.bfloat16
    metas = [
        m
        for n in ep.graph.nodes
        if n.op == "call_function" and n.target == torch.ops.torchrec.ir_kt_regroup.default
        for m in n.meta["val"]
    ]
    assert [m.dtype for m in metas] == [want, want]

    restored = ir_utils.decapsulate_ir_modules(torch.export.unflatten(ep), JsonSerializer)
    assert type(restored.regroup) is kt_regroup.KTRegroupAsDict
    assert restored.regroup._groups == GROUPS and restored.regroup._keys == ["odd", "even"]
    restored.load_state_dict(state)
    got = restored(_features())
    assert list(got) == list(eager)
    for key in eager:
        torch.testing.assert_close(got[key], eager[key], rtol=0, atol=0)


def test_float64_emb_dtype_has_no_torchrec_data_type():
    register_ir_serializer()
    model = _Model(torch.float64)
    with pytest.raises(ValueError, match="emb_dtype=torch.float64"):
        ir_utils.encapsulate_ir_modules(model, JsonSerializer)


def test_model_written_with_torchrec_names_round_trips_under_the_patch():
    import torchrec.modules.regroup as tr_regroup

    torch.manual_seed(0)
    features = _features()
    with kt_regroup.patch_torchrec():  # registers the serializer too
        model = _Model(None)
        model.regroup = tr_regroup.KTRegroupAsDict(GROUPS, ["odd", "even"])
        eager = model(features)
        state = model.state_dict()
        model, fqns = ir_utils.encapsulate_ir_modules(model, JsonSerializer)
        ep = torch.export.export(
            model, (features,), {}, strict=False, preserve_module_call_signature=tuple(fqns)
        )
        restored = ir_utils.decapsulate_ir_modules(torch.export.unflatten(ep), JsonSerializer)
    assert type(restored.regroup) is kt_regroup.KTRegroupAsDict
    restored.load_state_dict(state)
    got = restored(features)
    for key in eager:
        torch.testing.assert_close(got[key], eager[key], rtol=0, atol=0)
