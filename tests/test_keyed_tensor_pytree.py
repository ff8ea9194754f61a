"""``KeyedTensor`` as a ``torch.export`` input (``kt_regroup.keyed_tensor_pytree``).

A model whose ``forward`` takes ``List[KeyedTensor]`` (regrouped by
``kt_regroup.KTRegroupAsDict``) exports strict and non-strict with a dynamic batch, runs
other batch sizes, and round-trips through ``torch.export.save`` / ``load``. The
registration itself is checked in fresh interpreters: what torchrec leaves, what ours
adds, and that ours never replaces a registration that is already complete.
"""

import io
import json
import logging
import subprocess
import sys
import textwrap
from typing import Dict, List

import pytest
import torch
from conftest import SMALL_LAYOUT, assert_same_list, expected_regroup, keyed_tensors, make_values
from torchrec.sparse.jagged_tensor import KeyedTensor

import kt_regroup
from kt_regroup.keyed_tensor_pytree import register_keyed_tensor_pytree

# What users do before exporting with KeyedTensor inputs (patch_torchrec() does it too).
register_keyed_tensor_pytree()

NAMES = ["g0", "g1", "g2"]


class _TakesKeyedTensors(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.regroup = kt_regroup.KTRegroupAsDict(SMALL_LAYOUT.groups, NAMES)

    def forward(self, kts: List[KeyedTensor]) -> Dict[str, torch.Tensor]:
        return self.regroup(kts)


def _check(out: Dict[str, torch.Tensor], values) -> None:
    assert list(out) == NAMES
    assert_same_list([out[n] for n in NAMES], expected_regroup(values, SMALL_LAYOUT))


def _export(strict: bool) -> torch.export.ExportedProgram:
    batch = torch.export.Dim("batch")
    example = keyed_tensors(SMALL_LAYOUT, make_values(SMALL_LAYOUT, 4))
    # One spec per KeyedTensor leaf (its values): dim 0 is the batch.
    dynamic = ([[{0: batch}] for _ in example],)
    model = _TakesKeyedTensors()
    model(example)  # warm: the plan goes into the program as constants (a cold module's
    # graph builds it with kt_regroup_arguments, whose str[][] arguments export cannot save)
    return torch.export.export(model, (example,), dynamic_shapes=dynamic, strict=strict)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_export_with_keyed_tensor_inputs_dynamic_batch_and_save_load(strict, caplog):
    ep = _export(strict)
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "kt_regroup.permute_multi_embedding.default" in ops, ops
    for batch in (1, 7):
        values = make_values(SMALL_LAYOUT, batch, seed=batch)
        _check(ep.module()(keyed_tensors(SMALL_LAYOUT, values)), values)

    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    with caplog.at_level(logging.WARNING):
        loaded = torch.export.load(buffer)
    # KeyedTensor example inputs load with weights_only=True (no unsafe fallback).
    assert "Fallback to weights_only=False" not in caplog.text
    assert loaded.call_spec.in_spec == ep.call_spec.in_spec  # context types survive json
    for batch in (0, 9):
        values = make_values(SMALL_LAYOUT, batch, seed=batch)
        _check(loaded.module()(keyed_tensors(SMALL_LAYOUT, values)), values)


def test_keys_path_names_the_values_attribute():
    import torch.utils._pytree as pytree

    kts = keyed_tensors(SMALL_LAYOUT, make_values(SMALL_LAYOUT, 2))
    leaves, _ = pytree.tree_flatten_with_path(kts)
    assert [pytree.keystr(path) for path, _ in leaves] == ["[0]._values", "[1]._values"]
    for (path, leaf), kt in zip(leaves, kts):
        assert leaf is kt.values() and path[-1].get(kt) is leaf


def test_registration_is_idempotent():
    register_keyed_tensor_pytree()
    assert register_keyed_tensor_pytree() is False


def _run_fresh(code: str) -> dict:
    """Runs ``code`` in a new interpreter; it prints one JSON object as its last line."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_fresh_process_import_order_and_what_export_needed():
    facts = _run_fresh(
        """
        import json, sys
        import torch
        import torch.utils._pytree as pytree
        import kt_regroup
        facts = {"torchrec_after_import_kt_regroup": "torchrec" in sys.modules}
        from torchrec.sparse.jagged_tensor import KeyedTensor
        node = pytree.SUPPORTED_NODES.get(KeyedTensor)
        facts["torchrec_node"] = node is not None
        facts["torchrec_keys_fn"] = node is not None and node.flatten_with_keys_fn is not None

        class M(torch.nn.Module):
            def forward(self, kts):
                return [kt.values() * 2 for kt in kts]

        kts = [KeyedTensor(["a", "b"], [1, 2], torch.randn(3, 3))]

        def exports():
            try:
                torch.export.export(M(), (kts,), strict=False)
                return "ok"
            except Exception as e:
                return type(e).__name__ + ": " + str(e).splitlines()[0]

        facts["export_before"] = exports()
        from kt_regroup import KTRegroupAsDict  # noqa: F401  (registers nothing)
        facts["export_after_module_import"] = exports()
        kt_regroup.register_keyed_tensor_pytree()  # the explicit call (patch_torchrec makes it)
        after = pytree.SUPPORTED_NODES[KeyedTensor]
        facts["keys_fn_after"] = after.flatten_with_keys_fn is not None
        facts["flatten_kept"] = node is None or after.flatten_fn is node.flatten_fn
        facts["unflatten_kept"] = node is None or after.unflatten_fn is node.unflatten_fn
        name = pytree.SUPPORTED_SERIALIZED_TYPES[KeyedTensor].serialized_type_name
        facts["serialized_name"] = name
        facts["export_after"] = exports()
        print(json.dumps(facts))
        """
    )
    assert facts["torchrec_after_import_kt_regroup"] is False  # import kt_regroup stays light
    assert facts["keys_fn_after"] and facts["export_after"] == "ok", facts
    assert facts["flatten_kept"] and facts["unflatten_kept"], facts
    assert facts["serialized_name"] == "KeyedTensor"
    if facts["torchrec_node"] and not facts["torchrec_keys_fn"]:
        # torchrec 1.9.2: its node has no keys function and export refuses the input.
        assert facts["export_before"] != "ok", facts
        assert "flatten_with_keys" in facts["export_before"], facts
        assert facts["export_after_module_import"] == facts["export_before"], facts


def test_fresh_process_never_replaces_a_complete_registration():
    facts = _run_fresh(
        """
        import json
        import torch.utils._pytree as pytree
        from torchrec.sparse.jagged_tensor import KeyedTensor

        # A later torchrec: its node already comes with a keys function.
        def theirs(kt):
            return [(pytree.GetAttrKey("_values"), kt._values)], (kt._keys, kt._length_per_key)

        node = pytree.SUPPORTED_NODES[KeyedTensor]
        pytree.SUPPORTED_NODES[KeyedTensor] = node._replace(flatten_with_keys_fn=theirs)
        from kt_regroup.keyed_tensor_pytree import register_keyed_tensor_pytree
        facts = {"kept": pytree.SUPPORTED_NODES[KeyedTensor].flatten_with_keys_fn is theirs}

        # No node at all: ours is registered, under torchrec's serialized name.
        pytree._deregister_pytree_node(KeyedTensor)
        facts["changed"] = register_keyed_tensor_pytree()
        kt = KeyedTensor(["a", "b"], [1, 2], __import__("torch").ones(2, 3))
        leaves, spec = pytree.tree_flatten(kt)
        back = pytree.tree_unflatten(leaves, pytree.treespec_loads(pytree.treespec_dumps(spec)))
        facts["round_trip"] = [back.keys(), back.length_per_key(), bool((back.values() == 1).all())]
        facts["name"] = pytree.SUPPORTED_SERIALIZED_TYPES[KeyedTensor].serialized_type_name
        print(json.dumps(facts))
        """
    )
    assert facts["kept"] is True
    assert facts["changed"] is True
    assert facts["round_trip"] == [["a", "b"], [1, 2], True]
    assert facts["name"] == "KeyedTensor"
