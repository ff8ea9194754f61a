"""torchrec's IR serializer (``torchrec.ir``) for ``kt_regroup.KTRegroupAsDict``.

``torchrec.ir.utils.encapsulate_ir_modules`` stores the constructor arguments of every
module its ``JsonSerializer`` knows in an ``ir_metadata`` buffer and swaps in a
shape-only forward for ``torch.export``; ``decapsulate_ir_modules`` rebuilds the modules
from those buffers after ``torch.export.unflatten``. :func:`register_ir_serializer` adds
kt_regroup's module to that registry, so an exported model comes back with a
``kt_regroup.KTRegroupAsDict`` rather than a generic ``InterpreterModule``.

Where the installed torchrec has no ``torchrec.ir`` (the torchrec 1.9.2 wheel ships
none) it returns False and changes nothing.
"""

import logging
from typing import Any, Dict, List, Optional, Type

import torch
from torchrec.modules.embedding_configs import data_type_to_dtype, dtype_to_data_type
from torchrec.sparse.jagged_tensor import KeyedTensor
from torchrec.types import DataType

from kt_regroup.module import KTRegroupAsDict

logger = logging.getLogger(__name__)

__all__ = ["register_ir_serializer"]


def _data_type(module: torch.nn.Module) -> Optional[DataType]:
    """The module's ``emb_dtype`` as torchrec's ``DataType`` (whichever form it keeps)."""
    emb_dtype = module._emb_dtype
    if emb_dtype is None or isinstance(emb_dtype, DataType):
        return emb_dtype
    try:
        return dtype_to_data_type(emb_dtype)
    except Exception as e:  # torchrec raises a bare Exception
        raise ValueError(
            f"KTRegroupAsDict(emb_dtype={emb_dtype}): torchrec's IR stores emb_dtype as a "
            "torchrec DataType, and this dtype has none"
        ) from e


def _meta_forward(
    module: torch.nn.Module, keyed_tensors: List[KeyedTensor]
) -> Dict[str, torch.Tensor]:
    """Shape-only forward used while exporting an encapsulated model."""
    width = {k: w for kt in keyed_tensors for k, w in zip(kt.keys(), kt.length_per_key())}
    values = [kt.values() for kt in keyed_tensors]
    data_type = _data_type(module)
    if data_type is not None:
        dtype = data_type_to_dtype(data_type)
    else:  # what the module returns: the inputs' (promoted) dtype
        dtype = values[0].dtype
        for v in values[1:]:
            dtype = torch.promote_types(dtype, v.dtype)
    outs = torch.ops.torchrec.ir_kt_regroup(
        values,
        values[0].size(0),
        [sum(width[k] for k in group) for group in module._groups],
        dtype=dtype,
    )
    return dict(zip(module._keys, outs))


_serializer: Optional[Type[Any]] = None


def register_ir_serializer() -> bool:
    """Registers ``kt_regroup.KTRegroupAsDict`` with torchrec's default ``JsonSerializer``.

    Returns False where ``torchrec.ir`` is absent. Idempotent.

    Example::

        >>> kt_regroup.register_ir_serializer()  # False where torchrec.ir is absent
        True
        >>> model, fqns = encapsulate_ir_modules(model, JsonSerializer)
        >>> ep = torch.export.export(model, (features,), preserve_module_call_signature=tuple(fqns))
        >>> restored = decapsulate_ir_modules(torch.export.unflatten(ep), JsonSerializer)
    """
    global _serializer

    try:
        from torchrec.ir.schema import KTRegroupAsDictMetadata
        from torchrec.ir.serializer import JsonSerializer
        from torchrec.ir.utils import qualname
    except ImportError:
        logger.debug("torchrec.ir is not installed: no IR serializer registered")
        return False
    if _serializer is None:

        class KTRegroupAsDictJsonSerializer(JsonSerializer):
            """torchrec.ir serializer of ``kt_regroup.KTRegroupAsDict``."""

            _module_cls = KTRegroupAsDict

            @classmethod
            def swap_meta_forward(cls, module: torch.nn.Module) -> None:
                module.forward = _meta_forward.__get__(module, KTRegroupAsDict)

            @classmethod
            def serialize_to_dict(cls, module: torch.nn.Module) -> Dict[str, Any]:
                data_type = _data_type(module)
                metadata = KTRegroupAsDictMetadata(
                    groups=module._groups,
                    keys=module._keys,
                    emb_dtype=None if data_type is None else data_type.value,
                )
                return metadata.__dict__

            @classmethod
            def deserialize_from_dict(
                cls,
                metadata_dict: Dict[str, Any],
                device: Optional[torch.device] = None,
                unflatten_ep: Optional[torch.nn.Module] = None,
            ) -> torch.nn.Module:
                metadata = KTRegroupAsDictMetadata(**metadata_dict)
                emb_dtype = metadata.emb_dtype
                return KTRegroupAsDict(
                    groups=metadata.groups,
                    keys=metadata.keys,
                    emb_dtype=None if emb_dtype is None else DataType(emb_dtype),
                )

        _serializer = KTRegroupAsDictJsonSerializer
    registry = JsonSerializer.module_to_serializer_cls
    if registry.get(qualname(KTRegroupAsDict)) is not _serializer:
        registry[qualname(KTRegroupAsDict)] = _serializer
        logger.info("kt_regroup: registered KTRegroupAsDict with torchrec.ir's JsonSerializer")
    return True
