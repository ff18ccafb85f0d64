"""The adapter for the vLLM this process imports: chosen by the entry points it has, never by its version string."""

from __future__ import annotations

from fuzz.errors import TargetError
from fuzz.targets.base import Target


def load_local() -> Target:
    """The adapter for the vLLM importable in this process, chosen by the entry points it has."""
    try:
        import vllm

        from fuzz.targets import backend_shaped, layout_placed
        from fuzz.targets.entry_points import Probe
        from fuzz.targets.native import settle_kernel_library
    except Exception as error:  # noqa: BLE001 - any import failure is a setup error
        raise TargetError(f"cannot import vLLM: {type(error).__name__}: {error}".splitlines()[0]) from None
    version = str(getattr(vllm, "__version__", "?"))
    probe = Probe(version)
    if layout_placed.probe(probe):
        settle_kernel_library()
        return layout_placed.LayoutPlacedTarget(probe)
    if backend_shaped.probe(probe):
        settle_kernel_library()
        return backend_shaped.BackendShapedTarget(probe)
    failure = probe.import_failure(("allocate_kv_cache", "_reshape_kv_cache"))
    if failure is not None:
        raise TargetError(f"vLLM {version}: the module of its KV-cache views does not import here ({failure})")
    raise TargetError(
        f"vLLM {version} has neither allocate_kv_cache (layout-placed views) nor _reshape_kv_cache (backend-shaped views) "
        f"anywhere in {', '.join(probe.search)}; kvfuzz supports 0.19.1 and later"
    )


