"""Run models written against torchrec's names on kt_regroup: :func:`patch_torchrec`.

``patch_torchrec()`` routes torchrec's regroup entry points to kt_regroup, in place:

* ``KTRegroupAsDict``, in ``torchrec.modules.regroup`` and in every imported ``torchrec*``
  module that bound the name -> ``kt_regroup.KTRegroupAsDict``;
* ``KeyedTensor.regroup`` / ``regroup_as_dict`` -> ``kt_regroup.regroup`` /
  ``kt_regroup.regroup_as_dict``;
* ``jagged_tensor._regroup_keyed_tensors``, ``permute_multi_embedding``, ``regroup_kts``,
  ``_fbgemm_permute_pooled_embs`` -> ``kt_regroup.regroup``;
* ``_kt_regroup_arguments`` (``jagged_tensor``, ``modules.regroup``) ->
  ``kt_regroup.kt_regroup_arguments`` (the same rows);
* ``EmbeddingBagCollection.forward`` with a variable-batch KJT (``inverse_indices``)
  returns a :class:`kt_regroup.VariableBatchKeyedTensor`: the pooled rows, expanded
  only when something reads its values; the regroups read the rows directly. Under fx
  tracing, TorchScript, torch.compile and export it is torchrec's forward;
* the sharded ``EmbeddingBagCollection``'s variable-batch output under
  ``DistributedModelParallel`` (``VariableBatchEmbeddingBagCollectionAwaitable._wait_impl``;
  table-wise, column-wise and row-wise shards) is a
  :class:`kt_regroup.VariableBatchKeyedTensor` too, made of the rows the output
  all-to-all delivers (a column-wise key's shards joined along the columns, at its row
  count). A layout it does not know (data-parallel shards, whose variable-batch output
  torchrec itself fails to expand) gets torchrec's expansion, and so does a wait under fx
  tracing, torch.compile or export. A graph that keeps the sharded EBC as a leaf
  (torchrec's train pipeline) is the graph it is unpatched, and gets the lazy form when
  it runs.

What is swapped and what is not:

* names are swapped, not objects: a ``KTRegroupAsDict`` constructed after patching is
  kt_regroup's; one constructed before stays torchrec's, and computes as torchrec does:
  patch before you build the model;
* only ``torchrec*`` modules are rebound. A module of yours that did
  ``from torchrec.modules.regroup import KTRegroupAsDict`` before patching keeps
  torchrec's class: patch first, or
  refer to ``torchrec.modules.regroup.KTRegroupAsDict`` at call time;
* ``unpatch_torchrec()`` restores every original, including in ``torchrec*`` modules
  imported while patched. Modules constructed while patched stay kt_regroup's;
* what was captured before (a scripted module, an fx graph, a compiled or exported
  program) keeps what it captured; captures made while patched keep kt_regroup's.
  TorchScript reuses the code it compiled for a module class: a class scripted before
  patching keeps its unpatched ``KeyedTensor.regroup`` calls in later scripts too;
* ``patch_torchrec()`` also makes the registrations kt_regroup's module needs in
  torchrec and torch: :func:`kt_regroup.register_ir_serializer` (torchrec.ir, where
  installed) and :func:`kt_regroup.register_keyed_tensor_pytree` (``KeyedTensor`` as a
  ``torch.export`` input). ``import kt_regroup`` makes none of them.

Every replacement stays traceable: the ``KeyedTensor`` methods call kt_regroup's
functions through names that are ``torch.fx.wrap``-ed here (so fx and torchrec's
tracer record one call, as for torchrec's), the ``jagged_tensor`` helpers keep torchrec's
own wrapping, and all of them are TorchScript-able, compile and export.
"""

import functools
import logging
import sys
import threading
import types
import weakref
from types import ModuleType
from typing import Any, Dict, List, Optional, Tuple

import torch
import torchrec.distributed.embeddingbag as _tr_sharded
import torchrec.modules.embedding_modules as _tr_ebc
import torchrec.modules.regroup as _tr_regroup
import torchrec.sparse.jagged_tensor as _tr_jagged
from torchrec.distributed.types import NoWait
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from kt_regroup.functional import VariableBatchKeyedTensor, regroup, regroup_as_dict
from kt_regroup.keyed_tensor_pytree import register_keyed_tensor_pytree
from kt_regroup.module import KTRegroupAsDict, _in_graph
from kt_regroup.ops import kt_regroup_arguments
from kt_regroup.torchrec_ir import register_ir_serializer

logger = logging.getLogger(__name__)

__all__ = ["patch_torchrec", "unpatch_torchrec"]

# Called from the KeyedTensor methods below: wrapped here, fx records one call to each.
torch.fx.wrap("regroup")
torch.fx.wrap("regroup_as_dict")


def _keyed_tensor_regroup(
    keyed_tensors: List["KeyedTensor"], groups: List[List[str]]
) -> List[torch.Tensor]:
    """``KeyedTensor.regroup`` on ``torch.ops.kt_regroup`` (installed by ``patch_torchrec``)."""
    return regroup(keyed_tensors, groups)


def _keyed_tensor_regroup_as_dict(
    keyed_tensors: List["KeyedTensor"], groups: List[List[str]], keys: List[str]
) -> Dict[str, torch.Tensor]:
    """``KeyedTensor.regroup_as_dict`` on ``torch.ops.kt_regroup`` (``patch_torchrec``)."""
    return regroup_as_dict(keyed_tensors, groups, keys)


# torchrec's jagged_tensor helpers, on kt_regroup, each with torchrec's own signature
# (names and annotations, as torchrec's API-compatibility check compares them).


def _regroup_keyed_tensors(
    keyed_tensors: List["KeyedTensor"], groups: List[List[str]]
) -> List[torch.Tensor]:
    return regroup(keyed_tensors, groups)


def permute_multi_embedding(
    keyed_tensors: List["KeyedTensor"], groups: List[List["str"]]
) -> List[torch.Tensor]:
    return regroup(keyed_tensors, groups)


def regroup_kts(
    keyed_tensors: List["KeyedTensor"], groups: List[List["str"]]
) -> List[torch.Tensor]:
    return regroup(keyed_tensors, groups)


def _fbgemm_permute_pooled_embs(
    keyed_tensors: List["KeyedTensor"], groups: List[List["str"]]
) -> List[torch.Tensor]:
    return regroup(keyed_tensors, groups)


def _kt_regroup_arguments(
    value: torch.Tensor,
    keys: List[List[str]],
    key_lengths: List[List[int]],
    groups: List[List[str]],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int]]:
    return kt_regroup_arguments(value, keys, key_lengths, groups)


# EmbeddingBagCollection.forward with a variable-batch KJT: a VariableBatchKeyedTensor
# (pooled rows, expanded only when read). Everywhere else (fx tracing, TorchScript,
# torch.compile / export, fake or wrapped tensors, no inverse indices) torchrec's forward.


def _rows_wanted(features: Any) -> bool:
    if torch.jit.is_scripting() or _in_graph():
        return False
    return (
        isinstance(features, KeyedJaggedTensor)
        and features.inverse_indices_or_none() is not None
        and type(features.values()) is torch.Tensor
    )


def _forward_rows(ebc: Any, features: KeyedJaggedTensor) -> VariableBatchKeyedTensor:
    """torchrec's ``EmbeddingBagCollection.forward`` without the expansion and the cat
    (a KJT without inverse indices: one row per sample, ``indices`` all None)."""
    names = [name for names in ebc._feature_names for name in names]
    inverse: List[Optional[torch.Tensor]] = [None] * len(names)
    if features.inverse_indices_or_none() is not None:
        inverse = list(_tr_ebc.reorder_inverse_indices(features.inverse_indices_or_none(), names))
    feature_dict = features.to_dict()
    pooled = []
    for i, bag in enumerate(ebc.embedding_bags.values()):
        for name in ebc._feature_names[i]:
            f = feature_dict[name]
            weights = f.weights() if ebc._is_weighted else None
            pooled.append(bag(input=f.values(), offsets=f.offsets(), per_sample_weights=weights).float())
    return VariableBatchKeyedTensor(ebc._embedding_names, ebc._lengths_per_embedding, pooled, inverse)


def _ebc_forward() -> Any:
    """The patched forward. It runs with torchrec's module globals and wraps torchrec's
    forward (``__wrapped__``), so TorchScript compiles torchrec's own source."""
    kt_regroup_original, kt_regroup_wanted, kt_regroup_rows = (
        _tr_ebc.EmbeddingBagCollection.forward, _rows_wanted, _forward_rows
    )

    def forward(self, features):
        if kt_regroup_wanted(features):
            return kt_regroup_rows(self, features)
        return kt_regroup_original(self, features)

    fn = types.FunctionType(forward.__code__, vars(_tr_ebc), "forward", None, forward.__closure__)
    return functools.update_wrapper(fn, kt_regroup_original)


# The sharded EmbeddingBagCollection's variable-batch output (DistributedModelParallel).
# The output all-to-all delivers one flat tensor per sharding type: per shard ("piece",
# torchrec's uncombined embeddings) its [rows, columns] block, row-major, in the order of
# _batch_size_per_feature_pre_a2a / _uncombined_embedding_dims. torchrec expands it with
# batch_index_select_dim0, then its permute_op puts the pieces in output order: every
# key's pieces together, by column offset (one piece per table-wise key, several per
# column-wise key, all of one feature, so of one inverse index).

_PIECE_ORDER: "weakref.WeakKeyDictionary[Any, List[int]]" = weakref.WeakKeyDictionary()


def _piece_order(permute_op: Any) -> Optional[List[int]]:
    """permute_op's order of the pieces, read once per permute_op (a device tensor)."""
    order = _PIECE_ORDER.get(permute_op)
    if order is None:
        permute = getattr(permute_op, "_permute", None)
        if not isinstance(permute, torch.Tensor):
            return None
        order = _PIECE_ORDER[permute_op] = permute.tolist()
    return order


def _sharded_rows(
    aw: Any, embeddings: List[torch.Tensor]
) -> Optional[VariableBatchKeyedTensor]:
    """The awaitable's output as pooled rows, or None for a layout this does not know
    (then torchrec's expansion reads it, or fails on it, as unpatched)."""
    rows, dims = aw._batch_size_per_feature_pre_a2a, aw._uncombined_embedding_dims
    order = _piece_order(aw._permute_op)
    if order is None or len(rows) != len(dims) or sorted(order) != list(range(len(dims))):
        return None
    if any(type(e) is not torch.Tensor or e.dim() != 1 for e in embeddings):
        return None  # data-parallel shards arrive as [batch, columns]
    sizes = [r * d for r, d in zip(rows, dims)]
    pieces: List[torch.Tensor] = []
    n = 0
    for e in embeddings:  # each flat tensor holds the next pieces: split, not cat
        first, total = n, 0
        while n < len(sizes) and total + sizes[n] <= e.numel():
            total, n = total + sizes[n], n + 1
        if total != e.numel():
            return None
        blocks = e.split(sizes[first:n])
        pieces += [b.view(r, d) for b, r, d in zip(blocks, rows[first:n], dims[first:n])]
    inverse = aw._inverse_indices[1]
    if aw._inverse_indices_permute_indices is not None:  # piece -> its feature's row
        inverse = inverse.index_select(0, aw._inverse_indices_permute_indices)
    if n != len(sizes) or inverse.size(0) != len(sizes):
        return None
    pooled: List[torch.Tensor] = []
    indices: List[Optional[torch.Tensor]] = []
    k = 0
    for width in aw._embedding_dims:
        parts, got = [], 0
        while k < len(order) and got < width:
            parts.append(order[k])
            got, k = got + dims[order[k]], k + 1
        if got != width or not parts or any(rows[p] != rows[parts[0]] for p in parts):
            return None
        joined = [pieces[p] for p in parts]  # a column-wise key: its shards' columns
        pooled.append(joined[0] if len(joined) == 1 else torch.cat(joined, 1))
        indices.append(inverse[parts[0]])
    if k != len(order):
        return None
    names, widths = list(aw._embedding_names), list(aw._embedding_dims)
    return VariableBatchKeyedTensor(names, widths, pooled, indices)


def _sharded_wait() -> Any:
    """The patched ``VariableBatchEmbeddingBagCollectionAwaitable._wait_impl``."""
    original = _tr_sharded.VariableBatchEmbeddingBagCollectionAwaitable._wait_impl

    @functools.wraps(original)
    def _wait_impl(self: Any) -> KeyedTensor:
        if _in_graph():
            return original(self)
        embeddings = []
        for i, w in enumerate(self._awaitables):  # as torchrec waits them
            with _tr_sharded.maybe_annotate_embedding_event(
                _tr_sharded.EmbeddingEvent.OUTPUT_DIST_WAIT,
                self._module_fqn,
                self._sharding_types[i] if self._sharding_types else None,
            ):
                embeddings.append(w.wait())
        kt = _sharded_rows(self, embeddings)
        if kt is None:  # torchrec's expansion of what arrived
            self._awaitables = [NoWait(e) for e in embeddings]
            return original(self)
        for awaitable in self._resize_awaitables or []:
            awaitable.wait()
        return kt

    return _wait_impl


# Module-level objects of torchrec -> kt_regroup's, rebound wherever a torchrec* module
# holds them. jagged_tensor wraps its helpers with torch.fx.wrap by name, so the
# replacements bound under those names are recorded as single calls by fx as well.
# name -> (the torchrec module defining it, kt_regroup's replacement)
_MODULE_LEVEL: Dict[str, Tuple[ModuleType, Any]] = {
    "KTRegroupAsDict": (_tr_regroup, KTRegroupAsDict),
    "_regroup_keyed_tensors": (_tr_jagged, _regroup_keyed_tensors),
    "permute_multi_embedding": (_tr_jagged, permute_multi_embedding),
    "regroup_kts": (_tr_jagged, regroup_kts),
    "_fbgemm_permute_pooled_embs": (_tr_jagged, _fbgemm_permute_pooled_embs),
    "_kt_regroup_arguments": (_tr_jagged, _kt_regroup_arguments),
}
# Class attributes: (class, name, replacement).
_CLASS_LEVEL: List[Tuple[type, str, Any]] = [
    (KeyedTensor, "regroup", staticmethod(_keyed_tensor_regroup)),
    (KeyedTensor, "regroup_as_dict", staticmethod(_keyed_tensor_regroup_as_dict)),
    (_tr_ebc.EmbeddingBagCollection, "forward", _ebc_forward()),
    (_tr_sharded.VariableBatchEmbeddingBagCollectionAwaitable, "_wait_impl", _sharded_wait()),
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
