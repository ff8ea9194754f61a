"""Run models written against torchrec's names on kt_regroup: :func:`patch_torchrec`.

``patch_torchrec()`` rebinds, in ``torchrec*`` modules, torchrec's ``KTRegroupAsDict``,
``KeyedTensor.regroup`` / ``regroup_as_dict``, the ``jagged_tensor`` regroup helpers and
``_kt_regroup_arguments`` to kt_regroup's, and installs the variable-batch forwards of
:mod:`kt_regroup.vbe` (the ``EmbeddingBagCollection``'s and the sharded one's wait).
Names are swapped, not objects: patch before building the model. ``unpatch_torchrec()``
restores every original. What is and is not swapped: docs/torchrec.md.

Every replacement stays traceable: each calls kt_regroup's functions through names that
are ``torch.fx.wrap``-ed here (fx and torchrec's tracer record one call, as for
torchrec's), the ``jagged_tensor`` helpers keep torchrec's own wrapping, and all of them
are TorchScript-able, compile and export.
"""

import logging
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Dict, List, Tuple

import torch
import torchrec.distributed.embeddingbag as _tr_sharded
import torchrec.modules.embedding_modules as _tr_ebc
import torchrec.modules.regroup as _tr_regroup
import torchrec.sparse.jagged_tensor as _tr_jagged
from torchrec.sparse.jagged_tensor import KeyedTensor

from kt_regroup.functional import regroup, regroup_as_dict
from kt_regroup.keyed_tensor_pytree import register_keyed_tensor_pytree
from kt_regroup.module import KTRegroupAsDict
from kt_regroup.ops import kt_regroup_arguments
from kt_regroup.torchrec_ir import register_ir_serializer
from kt_regroup.vbe import ebc_forward, sharded_wait

logger = logging.getLogger(__name__)

__all__ = ["patch_torchrec", "unpatch_torchrec"]

# Called from the replacements below: wrapped here, fx records one call to each.
torch.fx.wrap("regroup")
torch.fx.wrap("regroup_as_dict")


def _on_kt_regroup(original: Callable, name: str = "") -> Callable:
    """A replacement of torchrec's ``original(keyed_tensors, groups)`` that calls
    :func:`kt_regroup.regroup`, with torchrec's name and annotations (torchrec's
    API-compatibility check compares them; TorchScript reads the source's, the same types)."""

    def replacement(
        keyed_tensors: List[KeyedTensor], groups: List[List[str]]
    ) -> List[torch.Tensor]:
        return regroup(keyed_tensors, groups)

    replacement.__name__ = replacement.__qualname__ = name or original.__name__
    replacement.__annotations__ = dict(original.__annotations__)
    replacement.__doc__ = f"torchrec's ``{original.__qualname__}`` on ``torch.ops.kt_regroup``."
    return replacement


def _keyed_tensor_regroup_as_dict(
    keyed_tensors: List["KeyedTensor"], groups: List[List[str]], keys: List[str]
) -> Dict[str, torch.Tensor]:
    """``KeyedTensor.regroup_as_dict`` on ``torch.ops.kt_regroup`` (``patch_torchrec``)."""
    return regroup_as_dict(keyed_tensors, groups, keys)


def _kt_regroup_arguments(
    value: torch.Tensor,
    keys: List[List[str]],
    key_lengths: List[List[int]],
    groups: List[List[str]],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int]]:
    return kt_regroup_arguments(value, keys, key_lengths, groups)


# Module-level objects of torchrec -> kt_regroup's, rebound wherever a torchrec* module
# holds them. jagged_tensor wraps its helpers with torch.fx.wrap by name, so the
# replacements bound under those names are recorded as single calls by fx as well.
# name -> (the torchrec module defining it, kt_regroup's replacement)
_MODULE_LEVEL: Dict[str, Tuple[ModuleType, Any]] = {
    "KTRegroupAsDict": (_tr_regroup, KTRegroupAsDict),
    **{
        name: (_tr_jagged, _on_kt_regroup(getattr(_tr_jagged, name)))
        for name in (
            "_regroup_keyed_tensors", "permute_multi_embedding", "regroup_kts",
            "_fbgemm_permute_pooled_embs",
        )
    },
    "_kt_regroup_arguments": (_tr_jagged, _kt_regroup_arguments),
}
# Class attributes: (class, name, replacement).
_CLASS_LEVEL: List[Tuple[type, str, Any]] = [
    (KeyedTensor, "regroup",
     staticmethod(_on_kt_regroup(KeyedTensor.regroup, "_keyed_tensor_regroup"))),
    (KeyedTensor, "regroup_as_dict", staticmethod(_keyed_tensor_regroup_as_dict)),
    (_tr_ebc.EmbeddingBagCollection, "forward", ebc_forward()),
    (_tr_sharded.VariableBatchEmbeddingBagCollectionAwaitable, "_wait_impl", sharded_wait()),
]

_lock = threading.Lock()
# name -> torchrec's original, taken once (before any patch) so unpatch can always restore.
_ORIGINALS: Dict[str, Any] = {name: getattr(mod, name) for name, (mod, _) in _MODULE_LEVEL.items()}
_CLASS_ORIGINALS: List[Any] = [cls.__dict__[name] for cls, name, _ in _CLASS_LEVEL]
_holders = 0  # patch_torchrec() calls not yet given back (a with block gives its call back)
_generation = 0  # patches so far: unpatch_torchrec() ends one


def _torchrec_modules() -> List[ModuleType]:
    # torchrec.ir keeps torchrec's names: its serializer rebuilds torchrec's own modules
    # by that name and checks their type (kt_regroup's class has a serializer of its own).
    return [
        m
        for name, m in list(sys.modules.items())
        if m is not None
        and (name == "torchrec" or name.startswith("torchrec."))
        and not (name == "torchrec.ir" or name.startswith("torchrec.ir."))
    ]


def _rebind(swap: Dict[int, Tuple[Any, Any]]) -> List[str]:
    """Sets ``mod.attr = new`` wherever a torchrec* module holds ``old`` (by identity)."""
    done = []
    for mod in _torchrec_modules():
        for attr, value in list(vars(mod).items()):
            hit = swap.get(id(value))
            if hit is not None and hit[0] is value:
                setattr(mod, attr, hit[1])
                done.append(f"{mod.__name__}.{attr} -> {hit[1].__module__}.{hit[1].__name__}")
    return done


class _TorchrecPatch:
    """Returned by :func:`patch_torchrec`; as a context manager it gives back its own hold
    on the patch at exit. torchrec is unpatched when no call holds it any more: a plain
    ``patch_torchrec()`` holds it until :func:`unpatch_torchrec`, even one made inside a
    ``with patch_torchrec():`` block."""

    def __init__(self, generation: int) -> None:
        self._generation = generation  # of the patch this call holds
        self._held = True

    def __enter__(self) -> "_TorchrecPatch":
        return self

    def __exit__(self, *exc: object) -> None:
        global _holders
        done: List[str] = []
        with _lock:
            if self._held and self._generation == _generation:  # else unpatch_torchrec() ended it
                self._held = False
                _holders -= 1
                if _holders == 0:
                    done = _restore()
        _log_restored(done)


def patch_torchrec() -> _TorchrecPatch:
    """Routes torchrec's ``KTRegroupAsDict`` and ``KeyedTensor`` regroups to kt_regroup.

    Idempotent (a second call only rebinds ``torchrec*`` modules imported since) and
    undone by :func:`unpatch_torchrec`. As a context manager, the block's exit undoes it
    unless another call still holds it (an outer ``with`` block, or a plain call made
    before or inside the block). Each rebinding is logged at INFO. See the module docs
    for what is and is not swapped.

    Example::

        >>> with kt_regroup.patch_torchrec():
        ...     m = torchrec.modules.regroup.KTRegroupAsDict([["f1"]], ["g"])
        >>> type(m) is kt_regroup.KTRegroupAsDict
        True
    """
    global _holders
    register_ir_serializer()  # torchrec.ir, where installed, must know the swapped-in class
    register_keyed_tensor_pytree()  # KeyedTensor inputs of torch.export
    with _lock:
        swap = {id(_ORIGINALS[n]): (_ORIGINALS[n], new) for n, (_, new) in _MODULE_LEVEL.items()}
        done = _rebind(swap)
        for cls, name, new in _CLASS_LEVEL:
            if cls.__dict__[name] is not new:
                setattr(cls, name, new)
                done.append(f"{cls.__module__}.{cls.__qualname__}.{name} -> kt_regroup")
        _holders += 1
        held = _TorchrecPatch(_generation)
    for line in done:
        logger.info("kt_regroup.patch_torchrec: %s", line)
    return held


def unpatch_torchrec() -> None:
    """Restores every torchrec original :func:`patch_torchrec` replaced, whoever holds the
    patch. Idempotent."""
    with _lock:
        done = _restore()
    _log_restored(done)


def _restore() -> List[str]:
    """unpatch_torchrec's work; the caller holds _lock."""
    global _holders, _generation
    done = []
    for mod in _torchrec_modules():
        for attr, value in list(vars(mod).items()):
            entry = _MODULE_LEVEL.get(attr)
            if entry is not None and value is entry[1]:
                setattr(mod, attr, _ORIGINALS[attr])
                done.append(f"{mod.__name__}.{attr}")
    for (cls, name, new), original in zip(_CLASS_LEVEL, _CLASS_ORIGINALS):
        if cls.__dict__[name] is new:
            setattr(cls, name, original)
            done.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    if _holders:
        _holders, _generation = 0, _generation + 1
    return done


def _log_restored(done: List[str]) -> None:
    for line in done:
        logger.info("kt_regroup.unpatch_torchrec: restored %s", line)
