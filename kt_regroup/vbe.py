"""Variable-batch (VBE) embeddings, regrouped from their pooled rows.

A variable-batch KJT (one with ``inverse_indices``) gives each feature fewer pooled rows
than samples. torchrec expands every key to ``[B, D]`` and concatenates; with
``patch_torchrec()`` the ``EmbeddingBagCollection`` (and the sharded one's wait) returns
a :class:`VariableBatchKeyedTensor` instead, and the regroups read its rows directly
through ``permute_multi_embedding_vbe``: :func:`regroup_rows`.

The patched forwards run torchrec's own code wherever it allows: the unsharded forward is
torchrec's, with its last step (expansion and ``cat``) swapped for the rows. Under fx
tracing, TorchScript, ``torch.compile`` and ``torch.export`` both are torchrec's.
"""

import functools
import re
import sys
import threading
import types
import weakref
from typing import Any, List, Optional, Tuple

import torch
import torch.fx._symbolic_trace as _fx_trace
import torch.utils._pytree as pytree
import torchrec.distributed.embeddingbag as _tr_sharded
import torchrec.modules.embedding_modules as _tr_ebc
from torchrec.distributed.types import NoWait
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from kt_regroup.keyed_tensor_pytree import _unflatten

__all__ = ["VariableBatchKeyedTensor", "regroup_rows"]


def in_graph() -> bool:
    """True under fx tracing (torchrec's tracer, ``torch.fx.symbolic_trace``) and
    ``torch.compile`` / ``torch.export``."""
    return _fx_trace._is_fx_tracing_flag or torch.compiler.is_compiling()


@torch.jit.unused
def waited(kt: KeyedTensor) -> KeyedTensor:
    """What a torchrec LazyAwaitable (a sharded EBC's output under DMP) stands for."""
    awaitables = sys.modules.get("torchrec.distributed.types")
    if awaitables is not None and isinstance(kt, awaitables.LazyAwaitable):
        return awaitables.LazyAwaitable._wait_async(kt)
    return kt


class VariableBatchKeyedTensor(KeyedTensor):
    """A ``KeyedTensor`` whose values are expanded only when something reads them.

    What ``patch_torchrec()``'s ``EmbeddingBagCollection`` returns for a variable-batch
    KJT: per key, the pooled rows ``[rows_k, D_k]`` and the row of each sample
    (``indices[k]``, ``[B]``; None: one row per sample). ``values()``, ``to_dict()`` and
    every other ``KeyedTensor`` method see torchrec's ``[B, sum(D)]`` values, expanded once
    by :func:`kt_regroup.ops.permute_multi_embedding_vbe` under the grad and inference
    modes the KeyedTensor was made in (torchrec computes them then), whatever mode the
    first read runs in. Until then kt_regroup's regroups read the rows directly; from
    then on every consumer reads the values, so in-place changes to them are seen.
    Pickling and pytree flattening give a plain ``KeyedTensor`` of the values.
    """

    def __init__(
        self,
        keys: List[str],
        length_per_key: List[int],
        pooled: List[torch.Tensor],
        indices: List[Optional[torch.Tensor]],
    ) -> None:
        self.pooled, self.indices, self._expanded = pooled, indices, None
        self._modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        super().__init__(keys, length_per_key, None)  # type: ignore[arg-type]

    @property
    def _values(self) -> torch.Tensor:  # type: ignore[override]
        values = self._expanded
        if values is None:
            with _EXPAND_LOCK:  # one expansion: every reader gets the same tensor
                values = self._expanded
                if values is None:
                    grad, inference = self._modes
                    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                        values = self._expanded = regroup_rows([self], [self.keys()])[0]
        return values

    @_values.setter
    def _values(self, values: Optional[torch.Tensor]) -> None:
        self._expanded = values

    def __reduce__(self):  # a plain KeyedTensor: loads without kt_regroup
        return (
            KeyedTensor,
            (self._keys, self._length_per_key, self._values, self._key_dim,
             self._offset_per_key, self._index_per_key),
        )


_EXPAND_LOCK = threading.RLock()


# As torchrec's KeyedTensor: one leaf, the values (pytree finds nodes by exact type).
pytree.register_pytree_node(
    VariableBatchKeyedTensor,
    lambda kt: ([kt._values], (kt._keys, kt._length_per_key)),
    _unflatten,
    serialized_type_name="kt_regroup.VariableBatchKeyedTensor",
    flatten_with_keys_fn=lambda kt: (
        [(pytree.GetAttrKey("_values"), kt._values)], (kt._keys, kt._length_per_key)
    ),
)


# --- the regroup of pooled rows ---------------------------------------------------------------


@torch.jit.unused
def some_data(kt: KeyedTensor) -> torch.Tensor:
    """A tensor of ``kt``'s data, on its device (pooled rows are not expanded for it)."""
    kt = waited(kt)
    return kt.pooled[0] if reads_rows(kt) and len(kt.pooled) > 0 else kt.values()


@torch.jit.unused
def reads_rows(kt: KeyedTensor) -> bool:
    """Whether ``kt`` is regrouped from its pooled rows: a variable-batch KeyedTensor whose
    values nobody has read (once they exist, they are what every consumer reads)."""
    return isinstance(kt, VariableBatchKeyedTensor) and kt._expanded is None


@torch.jit.unused
def has_pooled_rows(keyed_tensors: List[KeyedTensor]) -> bool:
    if not isinstance(keyed_tensors, (list, tuple)):
        return False
    # a plain KeyedTensor first: neither kind, and the usual one
    return any(type(kt) is not KeyedTensor and reads_rows(waited(kt)) for kt in keyed_tensors)


@torch.jit.unused
def rows_layout(
    keyed_tensors: List[KeyedTensor],
) -> Tuple[List[bool], List[List[str]], List[List[int]]]:
    """Per input, whether it is regrouped from its pooled rows, and the op's inputs' keys
    and widths: one tensor per key of such an input, the values of any other."""
    rows: List[bool] = []
    keys: List[List[str]] = []
    lengths: List[List[int]] = []
    for kt in map(waited, keyed_tensors):
        if kt.key_dim() != 1:
            raise ValueError("kt_regroup: variable-batch inputs regroup along key_dim 1 only")
        rows.append(reads_rows(kt))
        if rows[-1]:
            keys += [[k] for k in kt.keys()]
            lengths += [[int(n)] for n in kt.length_per_key()]
        else:
            keys.append(list(kt.keys()))
            lengths.append([int(n) for n in kt.length_per_key()])
    return rows, keys, lengths


@torch.jit.unused
def permute_rows(
    keyed_tensors: List[KeyedTensor],
    rows: List[bool],
    permutes: torch.Tensor,
    in_shapes: torch.Tensor,
    out_shapes: torch.Tensor,
    out_lengths: List[int],
) -> List[torch.Tensor]:
    """One ``permute_multi_embedding_vbe`` call on the pooled rows of the inputs that
    ``rows`` names (one op input per key) and the values of the others, with a plan of
    :func:`rows_layout`. Mixed dtypes promote as :func:`kt_regroup.regroup` does; a bad
    index is an ``IndexError`` naming its key."""
    pooled: List[torch.Tensor] = []
    indices: List[Optional[torch.Tensor]] = []
    for kt, from_rows in zip(map(waited, keyed_tensors), rows):
        if from_rows:
            pooled += kt.pooled
            indices += kt.indices
        else:
            pooled.append(kt.values())
            indices.append(None)
    op = torch.ops.kt_regroup.permute_multi_embedding_vbe
    try:
        return op(pooled, indices, permutes, in_shapes, out_shapes, out_lengths)
    except TypeError:
        promoted = functools.reduce(torch.promote_types, [p.dtype for p in pooled])
        if all(p.dtype == promoted for p in pooled):
            raise
        pooled = [p.to(promoted) for p in pooled]
        return op(pooled, indices, permutes, in_shapes, out_shapes, out_lengths)
    except IndexError as exc:
        found = re.search(r"indices\[(\d+)\]\[(\d+)\]", str(exc))
        if found is None:
            raise
        key = rows_layout(keyed_tensors)[1][int(found[1])][0]
        raise IndexError(f"kt_regroup: key {key!r}, sample {found[2]}: {exc}") from exc


@torch.jit.unused
def regroup_rows(
    keyed_tensors: List[KeyedTensor],
    groups: List[List[str]],
    dtype: Optional[torch.dtype] = None,
) -> List[torch.Tensor]:
    """The regroup of inputs some of which are :class:`VariableBatchKeyedTensor`, from
    their pooled rows (never expanded), with an uncached plan."""
    rows, keys, lengths = rows_layout(keyed_tensors)
    permutes, in_shapes, out_shapes, out_lengths = torch.ops.kt_regroup.kt_regroup_arguments(
        some_data(keyed_tensors[0]), keys, lengths, groups
    )
    outs = permute_rows(keyed_tensors, rows, permutes, in_shapes, out_shapes, out_lengths)
    return outs if dtype is None else [o.to(dtype) for o in outs]


# --- EmbeddingBagCollection.forward, patched -------------------------------------------------


_EBC_FORWARD = _tr_ebc.EmbeddingBagCollection.__dict__["forward"]
_EBC_FORWARD = getattr(_EBC_FORWARD, "__wrapped__", _EBC_FORWARD)  # torchrec's own


def _rows_wanted(features: Any) -> bool:
    if torch.jit.is_scripting() or in_graph():
        return False
    return (
        isinstance(features, KeyedJaggedTensor)
        and features.inverse_indices_or_none() is not None
        and type(features.values()) is torch.Tensor
    )


def _pooled(pooled_embeddings: List[torch.Tensor], inverse_indices: torch.Tensor):
    return pooled_embeddings, inverse_indices


def _rows_keyed_tensor(keys, values, length_per_key) -> VariableBatchKeyedTensor:
    pooled, inverse = values  # what _pooled returned
    indices = list(inverse) if inverse.numel() > 0 else [None] * len(pooled)
    return VariableBatchKeyedTensor(keys, length_per_key, pooled, indices)


def forward_rows(ebc: Any, features: KeyedJaggedTensor) -> VariableBatchKeyedTensor:
    """torchrec's ``EmbeddingBagCollection.forward``, run on its own code, with the
    expansion and ``cat`` (``process_pooled_embeddings``) left out: per key, the pooled
    rows and their samples' rows (a KJT without inverse indices: ``indices`` all None)."""
    scope = dict(vars(_tr_ebc), process_pooled_embeddings=_pooled, KeyedTensor=_rows_keyed_tensor)
    return types.FunctionType(_EBC_FORWARD.__code__, scope)(ebc, features)


def ebc_forward() -> Any:
    """The patched forward. It runs with torchrec's module globals and wraps torchrec's
    forward (``__wrapped__``), so TorchScript compiles torchrec's own source."""
    kt_regroup_original, kt_regroup_wanted, kt_regroup_rows = (
        _EBC_FORWARD, _rows_wanted, forward_rows
    )

    def forward(self, features):
        if kt_regroup_wanted(features):
            return kt_regroup_rows(self, features)
        return kt_regroup_original(self, features)

    fn = types.FunctionType(forward.__code__, vars(_tr_ebc), "forward", None, forward.__closure__)
    return functools.update_wrapper(fn, kt_regroup_original)


# --- the sharded EmbeddingBagCollection's wait, patched (DistributedModelParallel) ----------
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


def sharded_rows(aw: Any, embeddings: List[torch.Tensor]) -> Optional[VariableBatchKeyedTensor]:
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
    return VariableBatchKeyedTensor(list(aw._embedding_names), list(aw._embedding_dims), pooled, indices)


def sharded_wait() -> Any:
    """The patched ``VariableBatchEmbeddingBagCollectionAwaitable._wait_impl``."""
    original = _tr_sharded.VariableBatchEmbeddingBagCollectionAwaitable._wait_impl

    @functools.wraps(original)
    def _wait_impl(self: Any) -> KeyedTensor:
        if in_graph():
            return original(self)
        embeddings = []
        for i, w in enumerate(self._awaitables):  # as torchrec waits them
            with _tr_sharded.maybe_annotate_embedding_event(
                _tr_sharded.EmbeddingEvent.OUTPUT_DIST_WAIT,
                self._module_fqn,
                self._sharding_types[i] if self._sharding_types else None,
            ):
                embeddings.append(w.wait())
        kt = sharded_rows(self, embeddings)
        if kt is None:  # torchrec's expansion of what arrived
            self._awaitables = [NoWait(e) for e in embeddings]
            return original(self)
        for awaitable in self._resize_awaitables or []:
            awaitable.wait()
        return kt

    return _wait_impl
