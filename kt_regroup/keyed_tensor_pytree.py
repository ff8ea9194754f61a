"""``KeyedTensor`` as a ``torch.export`` input.

torchrec registers ``KeyedTensor`` as a pytree node (leaf ``_values``, context
``(keys, length_per_key)``) without the ``flatten_with_keys_fn`` that ``torch.export``
needs for every input container, and without a context (de)serializer (a saved
program's context loads back as a list, and the loaded program rejects every input).
:func:`register_keyed_tensor_pytree` (called by :func:`kt_regroup.patch_torchrec`, or by
you before exporting) adds only what is missing, keeping torchrec's flatten, unflatten
and serialized name (saved files are unchanged), registers a node of torchrec's layout
where there is none, and allows ``KeyedTensor`` in ``torch.load(weights_only=True)``
(an exported program saves its example inputs that way). This module imports
``torchrec.sparse.jagged_tensor`` first, so it never registers before torchrec does.
"""

import json
import logging
from typing import Any, List, Tuple

import torch
import torch.utils._pytree as pytree
from torchrec.sparse.jagged_tensor import KeyedTensor

logger = logging.getLogger(__name__)

__all__ = ["register_keyed_tensor_pytree"]

_Context = Tuple[List[str], List[int]]


def _flatten_with_keys(kt: KeyedTensor) -> Tuple[List[Tuple[Any, Any]], Any]:
    # Whichever flatten the node has (torchrec's), each leaf is named by the attribute
    # holding it, so that the key path's get() finds it again.
    leaves, context = pytree.SUPPORTED_NODES[KeyedTensor].flatten_fn(kt)
    attrs = vars(kt)
    named = [
        (pytree.GetAttrKey(next(n for n, v in attrs.items() if v is leaf)), leaf) for leaf in leaves
    ]
    return named, context


def _flatten(kt: KeyedTensor) -> Tuple[List[torch.Tensor], _Context]:
    return [kt._values], (kt._keys, kt._length_per_key)


def _unflatten(values: List[torch.Tensor], context: _Context) -> KeyedTensor:
    return KeyedTensor(list(context[0]), list(context[1]), values[0])


def _context_to_json(context: _Context) -> str:
    return json.dumps(list(context))  # the text pytree's default writes


def _context_from_json(text: str) -> _Context:
    # pytree's default would give a list, which never equals the flatten's tuple.
    return tuple(json.loads(text))


def register_keyed_tensor_pytree() -> bool:
    """Completes ``KeyedTensor``'s pytree registration where it lacks what export needs.

    Returns True when this call changed anything. Never replaces a function that torchrec
    (or anyone) registered.
    """
    changed = False
    with pytree._NODE_REGISTRY_LOCK:
        node = pytree.SUPPORTED_NODES.get(KeyedTensor)
        serial = pytree.SUPPORTED_SERIALIZED_TYPES.get(KeyedTensor)
        if node is not None and node.flatten_with_keys_fn is None:
            # Public registration refuses a registered class: fill the one field in place.
            pytree.SUPPORTED_NODES[KeyedTensor] = node._replace(
                flatten_with_keys_fn=_flatten_with_keys
            )
            changed = True
        if (
            serial is not None
            and serial.to_dumpable_context is None
            and serial.from_dumpable_context is None
        ):
            pytree.SUPPORTED_SERIALIZED_TYPES[KeyedTensor] = serial._replace(
                to_dumpable_context=_context_to_json, from_dumpable_context=_context_from_json
            )
            changed = True
    if node is None:
        pytree.register_pytree_node(
            KeyedTensor,
            _flatten,
            _unflatten,
            serialized_type_name="KeyedTensor",
            to_dumpable_context=_context_to_json,
            from_dumpable_context=_context_from_json,
            flatten_with_keys_fn=_flatten_with_keys,
        )
        changed = True
    if KeyedTensor not in torch.serialization.get_safe_globals():
        torch.serialization.add_safe_globals([KeyedTensor])
        changed = True
    if changed:
        logger.info("kt_regroup: completed KeyedTensor's pytree registration for torch.export")
    return changed
