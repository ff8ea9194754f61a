"""kt_regroup: fused KeyedTensor regroup for TorchRec.

``import kt_regroup`` loads the compiled op library (``kt_regroup/_C*.so``, built when
the package is installed; :func:`library_path` gives its path), which registers
``torch.ops.kt_regroup.*``, and registers the ops' fake kernels. It changes nothing of
torch's or torchrec's. The torchrec-facing API (:class:`KTRegroupAsDict`,
:func:`regroup`, :func:`regroup_as_dict`, :func:`patch_torchrec`) imports torchrec on
first use; :func:`patch_torchrec` makes the registrations in torchrec and torch
(:func:`register_ir_serializer`, :func:`register_keyed_tensor_pytree`).
"""

from kt_regroup import ops
from kt_regroup.ops import (
    cpu_memory,
    empty_cpu_cache,
    kt_regroup_arguments,
    library_path,
    permute_multi_embedding,
    permute_multi_embedding_into,
    permute_multi_embedding_to,
    permute_multi_embedding_vbe,
    regroup_keyed_tensor,
)
from kt_regroup.plan import RegroupPlan, get_plan

__version__ = "0.1.0"

_LAZY = {
    "KTRegroupAsDict": "kt_regroup.module",
    "VariableBatchKeyedTensor": "kt_regroup.vbe",
    "regroup": "kt_regroup.functional",
    "regroup_as_dict": "kt_regroup.functional",
    "patch_torchrec": "kt_regroup.patch",
    "unpatch_torchrec": "kt_regroup.patch",
    "register_keyed_tensor_pytree": "kt_regroup.keyed_tensor_pytree",
    "register_ir_serializer": "kt_regroup.torchrec_ir",
}


def __getattr__(name: str):
    # torchrec is imported only when its API is used: `import kt_regroup` stays light.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kt_regroup' has no attribute {name!r}")


__all__ = [
    "KTRegroupAsDict",
    "RegroupPlan",
    "VariableBatchKeyedTensor",
    "__version__",
    "cpu_memory",
    "empty_cpu_cache",
    "get_plan",
    "kt_regroup_arguments",
    "library_path",
    "ops",
    "patch_torchrec",
    "permute_multi_embedding",
    "permute_multi_embedding_into",
    "permute_multi_embedding_to",
    "permute_multi_embedding_vbe",
    "regroup",
    "regroup_as_dict",
    "regroup_keyed_tensor",
    "register_ir_serializer",
    "register_keyed_tensor_pytree",
    "unpatch_torchrec",
]
