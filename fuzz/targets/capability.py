"""Backends whose declared cache shape depends on the GPU they run on.

A few backends ask vLLM's `current_platform` for the device capability inside `get_kv_cache_shape` (DeepSeek V4's
FlashInfer sparse MLA backend, 0.24 - 0.28: on SM12x it keeps FlashMLA's 584-byte `fp8_ds_mla` records, on SM10x a
plain per-tensor fp8 cache). kvfuzz runs them on a CPU, where the capability is None and the branch it falls into is the
shape of no platform that would run that cache. Such a backend is asked here as on the first GPU it supports whose
`supports_combination` accepts the call (vLLM's backend selection asks the same two questions); a cache dtype that no
GPU it supports accepts is not drawn with it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

# Compute capabilities of the GPUs vLLM's CUDA backends name (Ampere, Ada, Hopper, Blackwell data-centre and consumer).
CAPABILITIES = ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0))
WRAPPED = "__kvfuzz_asks_on_gpu__"


def reads_capability(cls: type) -> bool:
    """Whether the backend's own `get_kv_cache_shape` asks the platform for the device capability."""
    shape = getattr(cls, "get_kv_cache_shape", None)
    shape = getattr(shape, WRAPPED, shape)
    try:
        return "get_device_capability" in inspect.getsource(inspect.unwrap(shape))
    except (OSError, TypeError):
        return False


def ask_on_supported_gpu(cls: type) -> bool:
    """Make `cls.get_kv_cache_shape` answer as on the GPU that would run each call (see the module docstring); False where
    the backend does not read the capability or its module names no `DeviceCapability` to build one from."""
    shape = cls.__dict__.get("get_kv_cache_shape")
    if not isinstance(shape, staticmethod) or not reads_capability(cls):
        return False
    if hasattr(shape.__func__, WRAPPED):
        return True  # a second target description in this process
    original = shape.__func__
    namespace = original.__globals__
    capability_type = namespace.get("DeviceCapability")
    if capability_type is None or "current_platform" not in namespace:
        return False
    signature = inspect.signature(original)

    @functools.wraps(original)
    def declared(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        gpu = accepting_gpu(cls, capability_type, str(call.arguments.get("cache_dtype_str", "auto")),
                            int(call.arguments["head_size"]), int(call.arguments["block_size"]))
        if gpu is None:
            return original(*args, **kwargs)
        platform = namespace["current_platform"]
        namespace["current_platform"] = _GpuAnswers(platform, gpu)
        try:
            return original(*args, **kwargs)
        finally:
            namespace["current_platform"] = platform

    setattr(declared, WRAPPED, original)
    cls.get_kv_cache_shape = staticmethod(declared)  # type: ignore[attr-defined]
    return True


def refused_everywhere(cls: type, cache_dtypes: tuple[str, ...], head_size: int, block_size: int) -> frozenset[str]:
    """The cache dtypes of a capability-reading backend that no GPU it supports accepts (empty for other backends)."""
    shape = cls.__dict__.get("get_kv_cache_shape")
    original = getattr(getattr(shape, "__func__", None), WRAPPED, None)
    if original is None:
        return frozenset()
    capability_type = original.__globals__["DeviceCapability"]
    return frozenset(d for d in cache_dtypes if accepting_gpu(cls, capability_type, d, head_size, block_size) is None)


@functools.lru_cache(maxsize=4096)
def accepting_gpu(cls: type, capability_type: type, cache_dtype: str, head_size: int, block_size: int) -> Any:
    """The first capability the backend supports whose `supports_combination` accepts this cache, or None."""
    combination = getattr(cls, "supports_combination", None)
    names = set(inspect.signature(combination).parameters) if combination is not None else set()
    dtypes = list(getattr(cls, "supported_dtypes", ()) or [torch.bfloat16])
    for major, minor in CAPABILITIES:
        capability = capability_type(major, minor)
        try:
            if not cls.supports_compute_capability(capability):  # type: ignore[attr-defined]
                continue
            asked = {"head_size": head_size, "dtype": dtypes[0], "kv_cache_dtype": cache_dtype, "block_size": block_size,
                     "use_mla": bool(getattr(cls, "is_mla", lambda: False)()), "has_sink": False,
                     "use_sparse": bool(getattr(cls, "is_sparse", lambda: False)()), "use_mm_prefix": False,
                     "device_capability": capability}
            if combination is None or combination(**{k: v for k, v in asked.items() if k in names}) is None:
                return capability
        except Exception:  # noqa: BLE001 - a check that cannot run here (a missing kernel library) is a refusal
            continue
    return None


class _GpuAnswers:
    """vLLM's current_platform, except for the device capability it reports."""

    def __init__(self, platform: Any, capability: Any) -> None:
        self._platform = platform
        self._capability = capability

    def get_device_capability(self, device_id: int = 0) -> Any:
        return self._capability

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)
