"""The adapter every vLLM API generation shares: what it finds in the release (the entry-point probe) and the deeper
checks it offers; the rest of its work lives in one module per job, joined here:

- fuzz/targets/catalog.py       what the release offers: backends, dtypes, spec kinds, the TargetInfo drawn from;
- fuzz/targets/expressible.py   a case in the release's terms, or why it cannot run;
- fuzz/targets/spec_making.py   vLLM's spec objects and backend classes for a case;
- fuzz/targets/walker.py        the model runners' walk: plan, views, records, the deeper checks.

An adapter subclasses Adapter and supplies only what its vLLM API generation does differently (fuzz/targets/
backend_shaped.py, layout_placed.py): how backends declare their layout, and the calls that turn raw buffers into views
(`declare_group`, `make_views`). Every vLLM function and class comes from the entry-point probe
(fuzz/targets/entry_points.py), never from a fixed module path.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from fuzz.case import Case, SyntheticBackend
from fuzz.checks.protocol import Off, Run
from fuzz.checks.registry import CHECKS
from fuzz.targets.base import BackendInfo
from fuzz.targets.catalog import SPEC_CLASSES, Catalog
from fuzz.targets.entry_points import Probe
from fuzz.targets.expressible import Expressible
from fuzz.targets.runner_v1 import V1Runner
from fuzz.targets.spec_builder import LayerSpecs
from fuzz.targets.spec_making import SpecMaking
from fuzz.targets.walker import Made, Walker, unique_buffers

__all__ = ["Adapter", "Made", "unique_buffers"]


class Adapter(Catalog, Expressible, SpecMaking, Walker):
    """The parts of a target adapter that do not depend on the vLLM API generation."""

    generation = "?"

    def __init__(self, probe: Probe) -> None:
        import vllm

        self.vllm_version = str(getattr(vllm, "__version__", "?"))
        self.probe = probe
        self.planner = probe.find("planner")
        probe.get("planner")  # nothing runs without vLLM's planner
        self.group_spec = probe.get("KVCacheGroupSpec")
        self.attention_spec = probe.get("AttentionSpec")
        self.multiple_of = probe.get("MultipleOf")
        self.base_backend = probe.get("AttentionBackend")
        self.attention_group = probe.find("AttentionGroup")
        self.quant_enum = _obj(probe.find("KVQuantMode"))
        self.quant_lookup = _obj(probe.find("quant-mode lookup"))
        # Checks this target cannot run: name -> why (one line).
        self.off: dict[str, str] = {}
        self.config = self._make_config(probe.get("VllmConfig"))
        # Backends consult the current vLLM config (stride order, kernel sizes); keep one set. The context is held for
        # the target's life: a context manager nobody holds is collected at once, and its exit unsets the config.
        self._config_context = probe.get("set_current_vllm_config")(self.config)
        self._config_context.__enter__()
        found_v1 = probe.find("V1 runner")
        self.v1 = None if found_v1 is None else V1Runner(found_v1)
        self.uniform_specs = _obj(probe.find("UniformTypeKVCacheSpecs"))
        self.transfer_config = _obj(probe.find("KVTransferConfig"))
        self.layer_specs: LayerSpecs | None = None
        self.sharing = _obj(probe.find("shared-layer wiring"))
        if self.sharing is None:
            self.off["kv-sharing"] = probe.missing("shared-layer wiring") + "; cases with KV-sharing layers are not drawn"
        self.kernel_choice = _obj(probe.find("kernel-block choice"))
        self.common_block_size = probe.find("common block size")
        if self.kernel_choice is None or self.attention_group is None:
            role = "kernel-block choice" if self.kernel_choice is None else "AttentionGroup"
            self.off["kernel-block choice"] = probe.missing(role) + "; views use the kernel block size the case names"
        self.dtype_table = _obj(probe.find("cache dtype table")) or {}
        self.registry = _obj(probe.find("dtype handler registry"))
        if self.registry is None and self.quant_enum is not None and "CUSTOM" in self.quant_enum.__members__:
            self.off["registered cache dtypes"] = probe.missing("dtype handler registry") + "; kvfuzz registers no cache dtypes"
        if self.quant_enum is not None and self.quant_lookup is None:
            self.off["quant modes"] = probe.missing("quant-mode lookup") + "; specs take the case's own quant mode, unchecked"
        self.backend_classes = self._backend_catalog()
        self.refused_on_gpus: dict[str, frozenset[str]] = {}  # backend -> cache dtypes no GPU it supports accepts
        self.spec_classes = {kind: cls for kind, name in SPEC_CLASSES.items() if (cls := probe.spec_class(name)) is not None}
        self.spec_kinds = tuple(kind for kind in SPEC_CLASSES if kind in self.spec_classes and self.supports_kind(kind))
        self._synthetic: collections.OrderedDict[SyntheticBackend, type] = collections.OrderedDict()  # the most recent SYNTHETIC_CLASSES
        self._spec_fields: dict[type, frozenset[str]] = {}
        self._registered: set[str] = set()
        self.max_buffer_bytes = 1 << 30  # cases needing more are skipped on real devices
        self.runs: dict[str, Run] = {}  # the deeper checks this vLLM offers, by name: how each runs (fuzz/checks)
        for check in CHECKS:
            offered = check.offer(probe)
            if isinstance(offered, Off):
                self.off[check.name] = offered.reason
            elif offered is not None:
                self.runs[check.name] = offered

    def _make_config(self, config_cls: type, **fields: Any) -> Any:
        """A VllmConfig (default, or with `fields`). Where the platform refuses to configure this machine (0.34's x86 CPU
        platform wants triton-cpu for its kernels), the config is built without the platform's hook:
        the layout code under test runs no kernel. The report says so."""
        try:
            return config_cls(**fields)
        except RuntimeError as error:
            from unittest import mock

            from vllm.platforms import current_platform

            hook = classmethod(lambda cls, vllm_config: None)
            with mock.patch.object(type(current_platform), "check_and_update_config", hook):
                config = config_cls(**fields)
            self.off["platform configuration"] = (f"{type(current_platform).__name__} refused a default VllmConfig ({error}); "
                                                  "kvfuzz builds it without the platform's check_and_update_config")
            return config

    # ------------------------------------------------------------------ what subclasses supply

    def usable_backend(self, name: str, cls: type) -> bool:
        return True

    def supports_kind(self, kind: str) -> bool:
        return True

    def describe_backend(self, name: str, cls: type) -> BackendInfo:
        raise NotImplementedError

    def make_views(self, case: Case, config: Any, attn_groups: list[list[Any]], kernel_block_sizes: list[int],
                   device: torch.device) -> Made:
        """Raw buffers -> per-layer views."""
        raise NotImplementedError


def _obj(found: Any) -> Any:
    return None if found is None else found.obj
