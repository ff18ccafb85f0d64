"""Pieces every adapter shares: dtypes, backend classes, view records, error capture."""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
from typing import Any

import torch

from fuzz.case import SyntheticBackend
from fuzz.targets.base import BackendInfo, Outcome, ViewRecord

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}

# Real backends by vLLM name -> "module:Class" (relative paths are under
# vllm.v1.attention.backends). Modules that fail to import in this environment (no CUDA, no
# flashinfer) are left out of the catalog.
BACKEND_CLASSES = {
    "CPU_ATTN": "cpu_attn:CPUAttentionBackend",
    "TRITON_ATTN": "triton_attn:TritonAttentionBackend",
    "FLEX_ATTENTION": "flex_attention:FlexAttentionBackend",
    "FLASH_ATTN": "flash_attn:FlashAttentionBackend",
    "ROCM_ATTN": "rocm_attn:RocmAttentionBackend",
    "ROCM_AITER_FA": "rocm_aiter_fa:AiterFlashAttentionBackend",
    "B12X": "b12x:B12xPagedAttentionBackend",
    "HPC_ATTN": "hpc_attn:HpcAttentionBackend",
    "TRITON_MLA": "mla.triton_mla:TritonMLABackend",
    "FLASHMLA": "mla.flashmla:FlashMLABackend",
    "FLASHMLA_SPARSE": "mla.flashmla_sparse:FlashMLASparseBackend",
    "CPU_MLA": "mla.cpu_mla:CPUMLABackend",
    "DEEPSEEK_V4_FLASHMLA": "vllm.models.deepseek_v4.sparse_mla:DeepseekV4FlashMLABackend",
    "DEEPSEEK_V4_INDEXER": "mla.indexer:DeepseekV4IndexerBackend",
}
# Backends of models that compress their cache (several tokens per stored state).
COMPRESSING_BACKENDS = ("DEEPSEEK_V4_FLASHMLA", "DEEPSEEK_V4_INDEXER")


def import_backend(name: str) -> type | None:
    path = BACKEND_CLASSES.get(name)
    if path is None:
        return None
    module, cls = path.split(":")
    if not module.startswith("vllm."):
        module = "vllm.v1.attention.backends." + module
    try:
        return getattr(importlib.import_module(module), cls)
    except Exception:  # noqa: BLE001 - any import failure means "not in this environment"
        return None


def kernel_size_label(size: Any) -> int | str:
    base = getattr(size, "base", None)
    return f"x{base}" if base is not None else int(size)


def describe_backend(name: str, cls: type) -> BackendInfo:
    is_mla = name in COMPRESSING_BACKENDS or bool(getattr(cls, "is_mla", lambda: False)())
    layouts = cls.supported_kv_cache_layouts() if hasattr(cls, "supported_kv_cache_layouts") else None
    return BackendInfo(
        name=name,
        is_mla=is_mla,
        compresses=name in COMPRESSING_BACKENDS,
        kernel_block_sizes=tuple(kernel_size_label(s) for s in cls.get_supported_kernel_block_sizes()),
        layouts=None if layouts is None else tuple(layout.name for layout in layouts),
        model_dtypes=tuple(DTYPE_NAMES[d] for d in getattr(cls, "supported_dtypes", ()) if d in DTYPE_NAMES),
        cache_dtypes=tuple(getattr(cls, "supported_kv_cache_dtypes", ("auto",))),
    )


def synthetic_backend_class(base: type, backend: SyntheticBackend, multiple_of: type) -> type:
    """A backend class that declares exactly what the case's synthetic backend declares."""
    sizes = [multiple_of(int(s[1:])) if isinstance(s, str) else s for s in backend.kernel_block_sizes]
    layouts = backend.layouts

    def supported_layouts(cls: type) -> Any:
        if layouts is None:
            return None
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return tuple(KVCacheLayout[name] for name in layouts)

    namespace = {
        "get_name": staticmethod(lambda: "SYNTHETIC_" + backend.name.upper()),
        "get_supported_kernel_block_sizes": classmethod(lambda cls, spec=None: list(sizes)),
        "supported_kv_cache_layouts": classmethod(supported_layouts),
        "customize_spec": classmethod(lambda cls, spec: spec),
    }
    return type("Synthetic" + backend.name.title().replace("_", ""), (base,), namespace)


def record_view(tensor: torch.Tensor, buffer: torch.Tensor) -> ViewRecord:
    storage = tensor.untyped_storage()
    same = storage.data_ptr() == buffer.untyped_storage().data_ptr()
    return ViewRecord(
        shape=tuple(tensor.shape),
        stride=tuple(tensor.stride()),
        offset_bytes=tensor.storage_offset() * tensor.element_size(),
        dtype=DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype)),
        element_size=tensor.element_size(),
        same_buffer=same,
        identity=id(tensor),
    )


def capture(call: Callable[[], Outcome]) -> Outcome:
    """Run `call`; an exception becomes an Outcome naming the innermost vLLM function."""
    try:
        return call()
    except Exception as error:  # noqa: BLE001 - every exception is data for the comparator
        frames = traceback.extract_tb(error.__traceback__)
        vllm_frames = [f for f in frames if "/vllm/" in f.filename.replace("\\", "/")]
        function = (vllm_frames or frames)[-1].name if frames else "?"
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return Outcome(error_type=type(error).__name__, error_message=message[:500], error_function=function)
