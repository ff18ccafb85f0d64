"""Target adapters: one per vLLM API generation, chosen by probing what the loaded vLLM offers."""

from __future__ import annotations

from fuzz.errors import TargetError
from fuzz.targets.base import BackendInfo, Execution, Outcome, Target, TargetInfo, ViewRecord


def load_local() -> Target:
    """The adapter for the vLLM importable in this process."""
    try:
        import vllm  # noqa: F401

        from fuzz.targets import backend_shaped, layout_placed
    except Exception as error:  # noqa: BLE001 - any import failure is a setup error
        raise TargetError(f"cannot import vLLM: {type(error).__name__}: {error}".splitlines()[0]) from None
    if layout_placed.probe():
        return layout_placed.LayoutPlacedTarget()
    if backend_shaped.probe():
        return backend_shaped.BackendShapedTarget()
    raise TargetError(
        f"vLLM {getattr(vllm, '__version__', '?')} has neither create_kv_cache_views nor gpu/attn_utils._reshape_kv_cache; "
        "kvfuzz supports 0.19.1 and later"
    )


__all__ = ["BackendInfo", "Execution", "Outcome", "Target", "TargetInfo", "ViewRecord", "load_local"]
