"""What every adapter shares: the backend and dtype catalogs, spec building, the planner walk,
view records, and the checks a target runs or has off.

An adapter subclasses Adapter and supplies only what its vLLM API generation does differently:
how backends declare their layout, and the calls that turn raw buffers into views
(`declare_group`, `make_views`). Every vLLM function and class comes from the entry-point probe
(fuzz/targets/entry_points.py), never from a fixed module path.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib
import typing
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

import oracles
from fuzz.case import MLA_KINDS, Case, GroupCase, SpecCase, SyntheticBackend, layout_as, replace
from fuzz.checks.protocol import Check, Off, Record, Run, Unusable
from fuzz.checks.registry import CHECKS
from fuzz.checks.timing import timed
from fuzz.errors import BrokenDeclaration, CaseMismatch, Inexpressible
from fuzz.space import accepts, choose_kernel_block_size, layer_reason, layout_reason, packing_reason, record_reason
from fuzz.targets import capability, kernel_probe
from fuzz.targets.base import BackendInfo, BufferRecord, Execution, Outcome, TargetInfo, ViewRecord, probe_kind
from fuzz.targets.entry_points import Probe
from fuzz.targets.probe import physical_probe, storage_key
from fuzz.targets.runner_v1 import V1Runner
from fuzz.targets.spec_builder import LayerSpecs, stored_mla_dtype
from fuzz.targets.unfilled import unfilled_buffers
from fuzz.targets.walk import Walk
from fuzz.tracebacks import capture, vllm_failure
from oracles import pages

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

# Backends by kvfuzz's name -> "module:Class" candidates, tried in order (modules moved between
# releases; relative paths are under vllm.v1.attention.backends). These names come first so cases
# written with them replay on every release; every other backend comes from the release's own
# registry (AttentionBackendEnum), so a new backend is drawn without a change here. Backends that
# fail to import in this environment (no CUDA, no flashinfer) are left out of the catalog.
BACKEND_CLASSES: dict[str, tuple[str, ...]] = {
    "CPU_ATTN": ("cpu_attn:CPUAttentionBackend",),
    "TRITON_ATTN": ("triton_attn:TritonAttentionBackend",),
    "FLEX_ATTENTION": ("flex_attention:FlexAttentionBackend",),
    "FLASH_ATTN": ("flash_attn:FlashAttentionBackend",),
    "ROCM_ATTN": ("rocm_attn:RocmAttentionBackend",),
    "ROCM_AITER_FA": ("rocm_aiter_fa:AiterFlashAttentionBackend",),
    "ROCM_AITER_UNIFIED_ATTN": ("rocm_aiter_unified_attn:RocmAiterUnifiedAttentionBackend",),
    "B12X": ("b12x:B12xPagedAttentionBackend",),
    "HPC_ATTN": ("hpc_attn:HpcAttentionBackend",),
    "TRITON_MLA": ("mla.triton_mla:TritonMLABackend",),
    "FLASHMLA": ("mla.flashmla:FlashMLABackend",),
    "FLASHMLA_SPARSE": ("mla.flashmla_sparse:FlashMLASparseBackend",),
    "CPU_MLA": ("mla.cpu_mla:CPUMLABackend",),
    "DEEPSEEK_V4_FLASHMLA": (
        "vllm.models.deepseek_v4.sparse_mla:DeepseekV4FlashMLABackend",
        "vllm.models.deepseek_v4.nvidia.flashmla:DeepseekV4FlashMLASparseBackend",
        "mla.flashmla_sparse:DeepseekV4FlashMLASparseBackend",
    ),
    "DEEPSEEK_V4_INDEXER": ("mla.indexer:DeepseekV4IndexerBackend",),
    "DEEPSEEK_V4_COMPRESSOR": (
        "vllm.models.deepseek_v4.compressor:CompressorBackend",
        "vllm.model_executor.layers.deepseek_compressor:CompressorBackend",
    ),
}
# DeepSeek V4 (and V4.1) compress their cache (several tokens per stored state); their backends
# serve such caches. The release does not declare it, so it is read from where the backend lives.
COMPRESSING_BACKENDS = ("DEEPSEEK_V4_FLASHMLA", "DEEPSEEK_V4_INDEXER", "DEEPSEEK_V4_COMPRESSOR")
COMPRESSING_MODULES = ("vllm.models.deepseek_v4", "vllm.models.deepseek_v41")

SPEC_CLASSES = {
    "full": "FullAttentionSpec",
    "sliding_window": "SlidingWindowSpec",
    "chunked_local": "ChunkedLocalAttentionSpec",
    "sink": "SinkFullAttentionSpec",
    "cross": "CrossAttentionSpec",
    "encoder_only": "EncoderOnlyAttentionSpec",
    "mla": "MLAAttentionSpec",
    "sliding_window_mla": "SlidingWindowMLASpec",
    "mamba": "MambaSpec",
}
# Spec classes that are no layer's cache layout on their own: containers, bases, and HiSparse's
# derived host/hot specs (built by HiSparse's planner from MLA specs, not by a layer).
NOT_A_LAYER_KIND = ("KVCacheSpec", "AttentionSpec", "UniformTypeKVCacheSpecs", "HiSparseHotSpec", "HiSparseResidentSpec")
# Case spec fields -> the vLLM spec fields that carry them (compression was renamed in 0.29).
FIELD_NAMES = {
    "compress_ratio": ("compress_ratio", "tokens_per_state"),
    "alignment": ("alignment",),
    "model_version": ("model_version",),
    "head_size_v": ("head_size_v",),
    "kv_quant_mode": ("kv_quant_mode",),
    "num_head_slots": ("num_head_slots",),
    "state_content_bytes": ("state_content_bytes",),
    "block_stride_alignment": ("block_stride_alignment",),
    "page_size_padded": ("page_size_padded",),
    "sink_len": ("sink_len",),
    "state_alignment": ("state_alignment",),
    "topk_buffer_width": ("topk_buffer_width",),
    "is_draft": ("is_draft",),
}
FIELD_DEFAULTS = {name: getattr(SpecCase(kind="full", block_size=16), name) for name in FIELD_NAMES}
# The fields of a spec vLLM built from a layer that the spec check compares with the case (fuzz/verdict/specs.py).
SPEC_FACT_FIELDS = ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window", "num_head_slots",
                    "state_content_bytes", "page_size_padded")
SYNTHETIC_CLASSES = 256  # synthetic backend classes kept for reuse: drawn backends rarely repeat, and each class costs memory
# Plenty for any case kvfuzz draws; the block count itself comes from the override.
AVAILABLE_MEMORY = 1 << 40


def import_backend(name: str) -> type | None:
    for path in BACKEND_CLASSES.get(name, ()):
        module, cls = path.split(":")
        if not module.startswith("vllm."):
            module = "vllm.v1.attention.backends." + module
        loaded = _load(module, cls)
        if loaded is not None:
            return loaded
    return None


def _load(module: str, name: str) -> type | None:
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - any import failure means "not in this environment"
        return None


def registry_backends() -> dict[str, type]:
    """The attention backends the release's own registry lists, by its names, that import here."""
    found: dict[str, type] = {}
    enum = _load("vllm.v1.attention.backends.registry", "AttentionBackendEnum")
    for member in list(enum or ()):
        path = member.value if isinstance(member.value, str) else None
        if not path or "." not in path:
            continue
        module, cls = path.rsplit(".", 1)
        loaded = _load(module, cls)
        if loaded is not None:
            found[member.name] = loaded
    return found


def kernel_size_label(size: Any) -> int | str:
    base = getattr(size, "base", None)
    return f"x{base}" if base is not None else int(size)


class Made(typing.NamedTuple):
    """What the call under test made: the views each layer binds, the raw buffers (in config order), and where the runner
    keeps other views than the layers bind (kernel-block views from 0.32), those it keeps and connectors get."""

    views: dict[str, Any]
    raw: list[torch.Tensor]
    manager_views: dict[str, Any] | None = None


@dataclasses.dataclass
class Prepared:
    """A case walked up to the call under test, as the model runners' initialize_kv_cache prepares it: the planned
    config (KV-sharing layers in their target's group), the attention groups and each group's kernel block size."""

    config: Any
    attn_groups: list[list[Any]]
    kernel_block_sizes: list[int]
    used: dict[int, int]  # kernel block size per group, as vLLM derives it for the views it binds
    views: Callable[[], Made]  # the V2 runner's call under test
    replan: Callable[[int], Any]  # the groups planned again from a memory, the block-count override unset


class Adapter:
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

    def synthetic_namespace(self, backend: SyntheticBackend) -> dict[str, Any]:
        return {}

    def declare_group(self, group: GroupCase, layout: str) -> GroupCase:
        """The group with the fields its backend publishes filled in."""
        return group

    def make_views(self, case: Case, config: Any, attn_groups: list[list[Any]], kernel_block_sizes: list[int],
                   device: torch.device) -> Made:
        """Raw buffers -> per-layer views."""
        raise NotImplementedError

    def skip_reason(self, case: Case) -> str | None:
        """Why this target cannot run a case because a check it needs is off."""
        if case.kv_sharing and "kv-sharing" in self.off:
            return f"check kv-sharing is off: {self.off['kv-sharing']}"
        return None

    # ------------------------------------------------------------------ catalogs

    def _backend_catalog(self) -> dict[str, type]:
        """kvfuzz's names first, then the release registry's; one name per backend class."""
        catalog: dict[str, type] = {}
        for name in BACKEND_CLASSES:
            cls = import_backend(name)
            if cls is not None and self.usable_backend(name, cls):
                catalog[name] = cls
        known = set(catalog.values())
        for name, cls in registry_backends().items():
            if cls not in known and name not in catalog and isinstance(cls, type) and self.usable_backend(name, cls):
                catalog[name] = cls
                known.add(cls)
        return catalog

    def cache_dtype_catalog(self) -> dict[str, str | None]:
        """The cache dtypes the release accepts, from its own list (KV_CACHE_DTYPES / CacheDType),
        each with the storage dtype its table (STR_DTYPE_TO_TORCH_DTYPE) names."""
        names_found = self.probe.find("cache dtype names")
        names: list[str] = []
        if names_found is not None:
            value = names_found.obj
            names = [str(n) for n in value] if isinstance(value, list) else [str(n) for n in typing.get_args(value)]
        catalog: dict[str, str | None] = {}
        for name in names or ["auto"]:
            stored = self.dtype_table.get(name)
            catalog[name] = None if name == "auto" or stored is None else DTYPE_NAMES.get(stored, str(stored))
        return catalog

    def quant_mode_names(self) -> tuple[str, ...]:
        """Every member name of the release's KVQuantMode, aliases included (lower case)."""
        if self.quant_enum is None:
            return ("none",)
        return tuple(name.lower() for name in self.quant_enum.__members__)

    # ------------------------------------------------------------------ shared

    def target_info(self, contract: Any, layouts: tuple[str, ...], kv_sharing: bool = True, packings: tuple[str, ...] = ("none",),
                    platforms: tuple[str, ...] = ("cuda",), attention_free: bool = False) -> TargetInfo:
        uncovered = [f"spec class {name}" for name in self._unknown_spec_classes()]
        if self.probe.spec_class("HiSparseHotSpec") is not None:
            # Its host pool is pinned memory and its binding needs attention layers and block tables.
            uncovered.append("HiSparse caches (init_hisparse_kv_cache)")
        backends = tuple(self._described_backends())
        self.layer_specs = self._layer_specs()
        if self.layer_specs is not None and self.layer_specs.kinds and "sliding_window" not in self.layer_specs.kinds:
            uncovered.append("sliding-window specs built by vLLM (the layer picks its block size; kvfuzz drives no page unification)")
        return TargetInfo(
            vllm_version=self.vllm_version,
            generation=self.generation,
            contract=contract,
            spec_kinds=self.spec_kinds,
            backends=backends,
            layouts=layouts,
            spec_fields={kind: self._expressible_fields(kind) for kind in self.spec_kinds},
            kv_sharing=kv_sharing and "kv-sharing" not in self.off,
            checks_off=tuple(f"{name}: {why}" for name, why in sorted(self.off.items())),
            cache_dtypes=self.cache_dtype_catalog(),
            quant_modes=self.quant_mode_names(),
            registers_dtypes=self.registry is not None and "registered cache dtypes" not in self.off,
            entry_points=self.probe.located(),
            uncovered=tuple(uncovered),
            runners=("v2", "v1") if self.v1 is not None else ("v2",),
            layer_kinds=self.layer_specs.kinds if self.layer_specs else (),
            layer_backends=self.layer_specs.backends if self.layer_specs else (),
            layer_fields=self.layer_specs.fields if self.layer_specs else (),
            packings=packings,
            checks=tuple(check.name for check in self.checks()),
            consumers=tuple(check.name for check in self.checks() if check.drawn),
            platforms=platforms,
            attention_free=attention_free,
        )

    def _layer_specs(self) -> LayerSpecs | None:
        """What builds specs from layers here (spec_source "vllm"); None, with the reason among the checks off, if nothing."""
        try:
            built = LayerSpecs(self.probe, self.backend_classes, self.probe.get("set_current_vllm_config"),
                               lambda **fields: self._make_config(self.probe.get("VllmConfig"), **fields))
        except Exception as error:  # noqa: BLE001 - building no layer here turns the check off, with the reason
            self.off["vllm-built specs"] = f"layers do not build here ({type(error).__name__}: {error})".splitlines()[0]
            return None
        if built.off is not None:
            self.off["vllm-built specs"] = built.off
        if not built.kinds:
            self.off.setdefault("vllm-built specs", "no backend's layer builds here")
            return None
        return built

    def _unknown_spec_classes(self) -> list[str]:
        """Layer spec classes the release defines that kvfuzz has no kind for (visible, not drawn).
        A subclass of a kind's class that adds no field of its own lays out as that kind."""
        base = self.probe.find("KVCacheSpec")
        if base is None:
            return []
        module = importlib.import_module(base.module)
        known = set(SPEC_CLASSES.values()) | set(NOT_A_LAYER_KIND)
        kinds = tuple(self.spec_classes.values())

        def covered(cls: type) -> bool:
            parents = [k for k in kinds if issubclass(cls, k)]
            own = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
            return any(own <= {f.name for f in dataclasses.fields(parent)} for parent in parents)

        return sorted(name for name, obj in vars(module).items()
                      if isinstance(obj, type) and issubclass(obj, base.obj) and obj.__module__ == base.module and name not in known
                      and not name.startswith("_") and not covered(obj))

    def _described_backends(self) -> list[BackendInfo]:
        described = []
        for name, cls in list(self.backend_classes.items()):
            try:
                capability.ask_on_supported_gpu(cls)
                described.append(self.describe_backend(name, cls))
            except Exception:  # noqa: BLE001 - a backend that cannot describe itself here is left out
                del self.backend_classes[name]
        return described

    def _expressible_fields(self, kind: str) -> tuple[str, ...]:
        names = {f.name for f in dataclasses.fields(self.spec_classes[kind])}
        return tuple(field for field, vllm_names in FIELD_NAMES.items() if any(n in names for n in vllm_names))

    def base_backend_info(self, name: str, cls: type, **extra: Any) -> BackendInfo:
        compresses = name in COMPRESSING_BACKENDS or any(cls.__module__.startswith(m + ".") for m in COMPRESSING_MODULES)
        kernel_block_sizes = tuple(kernel_size_label(s) for s in cls.get_supported_kernel_block_sizes())
        cache_dtypes = self.stored_cache_dtypes(cls, tuple(getattr(cls, "supported_kv_cache_dtypes", None) or ("auto",)))
        head_sizes = kernel_probe.declared_head_sizes(cls)
        refused = capability.refused_everywhere(cls, cache_dtypes, head_sizes[0] if head_sizes else 128,
                                                next((s for s in kernel_block_sizes if isinstance(s, int)), 16))
        if refused:
            self.refused_on_gpus[name] = refused
            cache_dtypes = tuple(d for d in cache_dtypes if d not in refused)
            if not cache_dtypes:
                raise ValueError(f"{name}: no GPU it supports accepts any of its cache dtypes")
        return BackendInfo(
            name=name,
            is_mla=compresses or bool(getattr(cls, "is_mla", lambda: False)()),
            compresses=compresses,
            kernel_block_sizes=kernel_block_sizes,
            model_dtypes=tuple(DTYPE_NAMES[d] for d in getattr(cls, "supported_dtypes", ()) if d in DTYPE_NAMES),
            cache_dtypes=cache_dtypes,
            **extra,
        )

    def stored_cache_dtypes(self, cls: type, accepted: tuple[str, ...]) -> tuple[str, ...]:
        """The cache dtypes a backend's caches are made in: those its MLA layers store as another dtype (a sparse MLA
        backend's `auto` cache is `fp8_ds_mla`) are not layouts of their own and are not drawn with it."""
        if self._stored_mla_dtype is None or not getattr(cls, "is_mla", lambda: False)():
            return accepted
        kept = []
        for dtype in accepted:
            try:
                stored = self._stored_mla_dtype(cls, dtype)
            except Exception:  # noqa: BLE001 - a rule that cannot judge this backend leaves its dtypes as declared
                stored = dtype
            if stored == dtype:
                kept.append(dtype)
        return tuple(kept) or accepted

    @functools.cached_property
    def _stored_mla_dtype(self) -> Callable[[type, str], str] | None:
        return stored_mla_dtype(getattr(self.probe.find("MLA layer"), "obj", None))

    def translate(self, case: Case) -> Case | str:
        """The case in this release's terms, or why the release cannot express it (naming the field):
        the layout under the name the release gives it, and each real backend's kernel block size
        as this release's backend declares it (vLLM's rule picks it from the backend's sizes)."""
        info: TargetInfo = self.info  # type: ignore[attr-defined]
        layout = layout_as(case.layout, info.layouts)
        if layout is None:
            return f"field layout: {case.layout} has no equivalent among this vLLM's ({', '.join(info.layouts)})"
        groups = []
        for group in case.groups:
            backend = info.backend(group.backend) if group.backend else None
            if backend is not None and group.spec.kind != "encoder_only":
                kernel = choose_kernel_block_size(group.spec.block_size, backend.kernel_block_sizes)
                if kernel is None:
                    return (f"field kernel_block_size: {backend.name} of vLLM {info.vllm_version} has none for "
                            f"{group.spec.block_size}-token blocks")
                group = replace(group, kernel_block_size=kernel)
            groups.append(group)
        return replace(case, layout=layout, groups=tuple(groups))

    def unsupported(self, case: Case) -> str | None:
        info: TargetInfo = self.info  # type: ignore[attr-defined]
        reason = self.skip_reason(case)
        if reason is not None:
            return reason
        if case.runner != "v2" and "v1" not in info.runners:
            return f"field runner: {self.off.get('v1 runner', 'no V1 model runner')}"
        if case.packing not in info.packings:
            return (f"field packing: vLLM {info.vllm_version} packs no {case.packing} slabs "
                    "(from 0.29 block-outermost layouts are the packed form)")
        if (why := packing_reason(case, info, case.packing)) is not None:
            return f"field packing: {why}"
        if case.platform not in info.platforms:
            return f"field platform: vLLM {info.vllm_version}'s allocation asks no {case.platform} question"
        if not case.groups and not info.attention_free:
            return "field groups: kvfuzz judges attention-free models from vLLM 0.29"
        if any(g.layer_heads for g in case.groups) and not info.contract.layout_placed:
            return "field layer_heads: kvfuzz judges layers that differ in heads from vLLM 0.29 (one page size a pool before)"
        if case.spec_source == "vllm":
            reason = layer_reason(case, info)
            if reason is not None:
                return reason
        if (reason := layout_reason(case, info)) is not None:
            return reason
        for group in case.groups:
            spec = group.spec
            if spec.kind not in info.spec_kinds:
                return f"field kind: {spec.kind} specs are not in vLLM {info.vllm_version}"
            if group.backend is not None and group.backend not in self.backend_classes:
                return f"field backend: {group.backend} is not importable here"
            if spec.cache_dtype in self.refused_on_gpus.get(group.backend or "", ()):
                return (f"field cache_dtype: no GPU {group.backend} supports accepts {spec.cache_dtype} "
                        "(its supports_combination)")
            for field, default in FIELD_DEFAULTS.items():
                if getattr(spec, field) != default and not info.can(spec.kind, field) and not self.implied(spec, field):
                    return f"field {field}: {spec.kind} specs of vLLM {info.vllm_version} have none"
            if spec.block_stride_multiple_of is not None and not info.can(spec.kind, "block_stride_alignment"):
                return f"field block_stride_alignment: {spec.kind} specs of vLLM {info.vllm_version} have none"
            if spec.block_stride_multiple_of is not None and not hasattr(self.attention_spec, "get_block_stride_alignment"):
                return f"field block_stride_alignment: vLLM {info.vllm_version} takes none in whole kernel blocks"
            reason = self._dtype_reason(spec, info) or record_reason(spec, info)
            if reason is not None:
                return reason
        return None

    def _dtype_reason(self, spec: SpecCase, info: TargetInfo) -> str | None:
        if spec.kind == "mamba":
            return None
        if spec.registered_cache_dtype:
            if not info.registers_dtypes:
                return f"field registered_cache_dtype: vLLM {info.vllm_version} has no cache dtype handler registry"
            if spec.cache_dtype in info.cache_dtypes:
                # Registering it would replace vLLM's own dtype for every later case of this process.
                return f"field cache_dtype: {spec.cache_dtype} is vLLM's own; a registered dtype needs a name of its own"
            if spec.kv_quant_mode not in info.quant_modes:
                return f"field kv_quant_mode: {spec.kv_quant_mode} is not a KVQuantMode of vLLM {info.vllm_version}"
            return None
        if spec.cache_dtype not in info.cache_dtypes:
            return f"field cache_dtype: vLLM {info.vllm_version} accepts no {spec.cache_dtype}"
        if spec.kv_quant_mode not in info.quant_modes:
            return f"field kv_quant_mode: {spec.kv_quant_mode} is not a KVQuantMode of vLLM {info.vllm_version}"
        if pages.defined_content_bytes(spec) is None:
            return f"cache dtype {spec.cache_dtype}: the oracle has no definition of its page for this spec"
        return None

    def implied(self, spec: SpecCase, field: str) -> bool:
        """Whether a case field this vLLM's spec lacks is implied by the fields it has."""
        return False

    def backend_class(self, group: GroupCase) -> type | None:
        if group.synthetic_backend is not None:
            key = group.synthetic_backend
            if key in self._synthetic:
                self._synthetic.move_to_end(key)
            else:
                if len(self._synthetic) >= SYNTHETIC_CLASSES:
                    self._synthetic.popitem(last=False)
                sizes = [self.multiple_of(int(s[1:])) if isinstance(s, str) else s for s in key.kernel_block_sizes]
                namespace = {
                    "get_name": staticmethod(lambda: key.registered_name),
                    "get_supported_kernel_block_sizes": classmethod(lambda cls, spec=None: list(sizes)),
                    **self.synthetic_namespace(key),
                }
                self._synthetic[key] = type("Synthetic" + key.name.title().replace("_", ""), (self.base_backend,), namespace)
            return self._synthetic[key]
        return self.backend_classes.get(group.backend) if group.backend else None

    def spec_fields(self, cls: type) -> frozenset[str]:
        fields = self._spec_fields.get(cls)
        if fields is None:
            fields = self._spec_fields[cls] = frozenset(f.name for f in dataclasses.fields(cls))
        return fields

    def build_spec(self, spec: SpecCase) -> Any:
        """vLLM's spec for the case's spec, built as a layer builds it: storage dtype and quant mode
        come from the release's own tables for the cache dtype."""
        cls = self.spec_classes[spec.kind]
        fields = self.spec_fields(cls)
        if spec.kind == "mamba":
            values: dict[str, Any] = {
                "block_size": spec.block_size,
                "shapes": tuple(spec.mamba_shapes),
                "dtypes": tuple(TORCH_DTYPES[d] for d in spec.mamba_dtypes),
                "page_size_padded": spec.page_size_padded,
                "state_alignment": spec.state_alignment if spec.state_alignment != 1 else None,
                "block_stride_alignment": self._block_stride_alignment(spec),
            }
            return cls(**{k: v for k, v in values.items() if k in fields and (v is not None or k == "page_size_padded")})
        self.register_cache_dtype(spec)
        values = {
            "block_size": spec.block_size,
            "num_kv_heads": spec.num_kv_heads,
            "head_size": spec.head_size,
            "dtype": self.storage_dtype(spec),
            "page_size_padded": spec.page_size_padded,
            "compress_ratio": spec.compress_ratio,
            "tokens_per_state": spec.compress_ratio,
            "num_head_slots": spec.num_head_slots,
            "state_content_bytes": spec.state_content_bytes,
            "sliding_window": spec.sliding_window,
            "attention_chunk_size": spec.attention_chunk_size,
            "sink_len": spec.sink_len,
            "alignment": spec.alignment,
            "model_version": spec.model_version,
            "topk_buffer_width": spec.topk_buffer_width,
            "is_draft": spec.is_draft or None,
        }
        if "kv_quant_mode" in fields:
            values["kv_quant_mode"] = self.quant_mode(spec)
        if spec.head_size_v is not None:
            values["head_size_v"] = spec.head_size_v
        if spec.kind in MLA_KINDS:
            values["cache_dtype_str"] = spec.cache_dtype
        values["block_stride_alignment"] = self._block_stride_alignment(spec)
        return cls(**{k: v for k, v in values.items() if k in fields and (v is not None or k == "page_size_padded")})

    def _block_stride_alignment(self, spec: SpecCase) -> Any:
        if spec.block_stride_multiple_of is not None:
            return self.multiple_of(spec.block_stride_multiple_of)
        return spec.block_stride_alignment

    def storage_dtype(self, spec: SpecCase) -> torch.dtype:
        """The torch dtype the release stores the cache dtype as (the model dtype for "auto")."""
        stored = self.dtype_table.get(spec.cache_dtype) if spec.cache_dtype != "auto" else None
        return stored if isinstance(stored, torch.dtype) else TORCH_DTYPES[spec.dtype]

    def quant_mode(self, spec: SpecCase) -> Any:
        """The KVQuantMode the release gives the cache dtype (its own lookup, as a layer asks it)."""
        if self.quant_lookup is not None:
            return self.quant_lookup(spec.cache_dtype)
        return self.quant_enum[spec.kv_quant_mode.upper()]  # type: ignore[index]

    def register_cache_dtype(self, spec: SpecCase) -> None:
        """Registers a case's own cache dtype with the release's handler registry, once."""
        if not spec.registered_cache_dtype or spec.cache_dtype in self._registered or self.registry is None:
            return
        storage, mode = TORCH_DTYPES[spec.dtype], self.quant_enum[spec.kv_quant_mode.upper()]  # type: ignore[index]
        handler = type("KvfuzzDTypeHandler", (), {"name": spec.cache_dtype, "torch_dtype": lambda self: storage,
                                                   "quant_mode": lambda self: mode})
        self.registry(spec.cache_dtype)(handler)
        self._registered.add(spec.cache_dtype)

    def declare(self, case: Case) -> Case:
        """Declaring is idempotent, so cases that already carry their backends' fields may be re-run."""
        return replace(case, groups=tuple(self.declare_group(g, case.layout) for g in case.groups))

    def checks(self) -> tuple[Check, ...]:
        """The deeper checks this target offers (fuzz/checks), in the order a case meets them."""
        return tuple(check for check in CHECKS if check.name in self.runs)

    def execute(self, case: Case, device: str, probe: bool | str = False, checks: Collection[str] | None = None) -> Execution:
        """The case through vLLM and the deeper checks it asks for (`checks`: only these, by name; None: all it asks for)."""
        translated = self.translate(case)
        if isinstance(translated, str):
            return Execution(case, skipped=translated)
        case = translated
        reason = self.unsupported(case)
        if reason is not None:
            return Execution(case, skipped=reason)
        try:
            declared = self.declare(case)
        except Inexpressible as error:
            return Execution(case, skipped=str(error))
        except BrokenDeclaration as error:
            return Execution(case, declaration=(error.function, str(error), error.layer))
        except Exception as error:  # noqa: BLE001 - building specs or asking the backend failed: judged like any vLLM error
            failure = vllm_failure(error)
            if failure is None:
                raise
            return Execution(case, outcome=failure)
        if device != "meta" and self.max_buffer_bytes and oracles.buffer_bytes(declared, self.info.contract) > self.max_buffer_bytes:  # type: ignore[attr-defined]
            # Alignment rules can blow a few-block case up to GiBs; describe those at production scale instead.
            return Execution(declared, skipped=f"its buffers need more than {self.max_buffer_bytes} bytes")
        wanted = [check for check in self.checks() if (checks is None or check.name in checks)
                  and (check.applies(declared) or (check.probe is not None and check.probe == probe_kind(probe)))]
        runner = "v1" if declared.runner == "v1" else "v2"
        try:
            outcome = self.runner_outcome(declared, torch.device(device), probe, runner, [c for c in wanted if c.needs_views])
        except CaseMismatch as error:
            return Execution(declared, case_error=str(error))
        except Inexpressible as error:
            return Execution(declared, skipped=str(error))
        alone = [check for check in wanted if not check.needs_views]
        if alone and device != "meta":
            walk = Walk.of_case(declared, self.config, lambda other: self.runner_outcome(declared, torch.device(device), probe, other, []))
            outcome = replace(outcome, checks={**outcome.checks, **self.run_checks(alone, walk)})
        return Execution(declared, outcome=outcome)

    def runner_outcome(self, case: Case, device: torch.device, probe: bool | str, runner: str, checks: list[Check]) -> Outcome:
        """One model runner's walk of the declared case: its views (an error in vLLM's code included), what vLLM's specs say
        of their pages, and the records of the checks that run on its views."""
        specs: list[tuple[Any, str | None]] = []  # vLLM's specs (and the layer that built each), before anything else can fail
        outcome = capture(lambda: self._run(case, device, probe, specs, runner, checks))
        if runner == "v1":
            assert self.v1 is not None
            outcome = self.v1.restore(outcome)
        if specs:
            outcome = self._with_spec_facts(outcome, specs)
        return replace(outcome, runner=runner)

    def _run(self, case: Case, device: torch.device, probe: bool | str, specs: list[tuple[Any, str | None]], runner: str,
             checks: list[Check]) -> Outcome:
        with self.platform_answers(case):
            return self._run_walk(case, device, probe, specs, runner, checks)

    @contextlib.contextmanager
    def platform_answers(self, case: Case) -> Iterator[None]:
        """vLLM's code answering platform questions as on the case's platform (only "cuda" where the target offers no other)."""
        yield

    def _run_walk(self, case: Case, device: torch.device, probe: bool | str, specs: list[tuple[Any, str | None]], runner: str,
                  checks: list[Check]) -> Outcome:
        prepared = self.prepare(case, device, specs)
        kind = probe_kind(probe)
        # The checks run on the V2 runner's walk (from 0.29 the V1 runner's views are the same: walk_runners).
        checks = checks if runner == "v2" else []
        # vLLM zero-fills its buffers; only a run that reads a byte it did not write first needs the zeros.
        reads_bytes = kind == "physical" or any(check.reads_buffers for check in checks)
        with contextlib.nullcontext() if reads_bytes else unfilled_buffers():
            if runner == "v1":
                assert self.v1 is not None
                made = Made(*self.v1.views(case, prepared.config, prepared.attn_groups, prepared.kernel_block_sizes,
                                           self.config.cache_config, self.config, device))
            else:
                made = prepared.views()
        outcome = replace(self.record(made.views, made.raw, dict(case.kv_sharing), prepared.used),
                          planned_blocks=int(prepared.config.num_blocks))
        if device.type == "meta":
            return outcome
        if kind == "physical":
            outcome = replace(outcome, probe=physical_probe(made.views, made.raw))
        if checks:
            if not _inside_buffers(outcome):
                return replace(outcome, checks={c.name: {"skipped": "a view addresses bytes outside its raw buffer"} for c in checks})
            walk = Walk(case=case, config=prepared.config, attn_groups=prepared.attn_groups, kernel_block_sizes=prepared.kernel_block_sizes,
                        manager_views=made.manager_views if made.manager_views is not None else made.views, bound_views=made.views,
                        raw=made.raw, runners=self.walk_runners(), vllm_config=self.config, replan=prepared.replan)
            outcome = replace(outcome, checks=self.run_checks(checks, walk))
        return outcome

    def run_checks(self, checks: list[Check], walk: Walk) -> dict[str, Record]:
        """Each check's record on the walk, run as the runner's own code runs (under the model's config) and timed as its own.
        An exception raised in vLLM's code is the check's record to judge; kvfuzz's own propagate."""
        records: dict[str, Record] = {}
        with self.probe.get("set_current_vllm_config")(self.config):
            for check in checks:
                with timed(check.name):
                    try:
                        records[check.name] = self.runs[check.name](walk)
                    except Unusable as why:
                        records[check.name] = {"skipped": str(why)}
                    except Exception as error:  # noqa: BLE001 - judged by the check; kvfuzz's own errors propagate
                        failure = vllm_failure(error)
                        if failure is None:
                            raise
                        records[check.name] = {"error": {"type": failure.error_type, "message": failure.error_message,
                                                         "function": failure.error_function, "file": failure.error_file,
                                                         "line": failure.error_line}}
        return records

    def walk(self, case: Case, device: str = "cpu") -> Walk:
        """The V2 runner's walk of a case, views built, for a check run by hand (tests, exports); raises Inexpressible
        where the target cannot run the case."""
        translated = self.translate(case)
        if isinstance(translated, str) or (reason := self.unsupported(translated)) is not None:
            raise Inexpressible(translated if isinstance(translated, str) else reason)
        declared = self.declare(translated)
        with self.platform_answers(declared):
            prepared = self.prepare(declared, torch.device(device))
            made = prepared.views()
        return Walk(case=declared, config=prepared.config, attn_groups=prepared.attn_groups, kernel_block_sizes=prepared.kernel_block_sizes,
                    manager_views=made.manager_views if made.manager_views is not None else made.views, bound_views=made.views,
                    raw=made.raw, runners=self.walk_runners(), vllm_config=self.config, replan=prepared.replan)

    def walk_runners(self) -> tuple[str, ...]:
        """The model runners whose own initialisation builds this adapter's views (fuzz/targets/consumers.py)."""
        return ("v2",)

    def _with_spec_facts(self, outcome: Outcome, specs: list[tuple[Any, str | None]]) -> Outcome:
        """The outcome with what vLLM's specs say about their pages. Reading them runs vLLM's own properties: one that
        raises is vLLM failing on the case (the first such failure, where the walk itself did not fail first)."""
        try:
            facts = {i: self.spec_facts(spec, layer) for i, (spec, layer) in enumerate(specs)}
        except Exception as error:  # noqa: BLE001 - judged like any vLLM error; kvfuzz's own errors are raised again
            failure = vllm_failure(error)
            if failure is None:
                raise
            return outcome if outcome.raised else failure
        return replace(outcome, specs=facts)

    def spec_facts(self, spec: Any, layer: str | None = None) -> dict[str, Any]:
        """What vLLM's spec says about the page: its quant mode and its page before padding; for a spec vLLM built from a
        layer, also that layer's class, the spec's classes and the fields a case states."""
        mode = getattr(spec, "kv_quant_mode", None) if self.quant_lookup is not None else None
        if hasattr(spec, "unpadded_page_size_bytes"):
            page = spec.unpadded_page_size_bytes
        else:
            page = spec.page_size_bytes if getattr(spec, "page_size_padded", None) is None else None
        facts: dict[str, Any] = {"kv_quant_mode": None if mode is None else mode.name.lower(), "page_bytes": page}
        if layer is not None:
            fields = {}
            for name in SPEC_FACT_FIELDS:
                value = getattr(spec, name, None)
                fields[name] = DTYPE_NAMES.get(value, str(value)) if isinstance(value, torch.dtype) else value
            facts.update(layer=layer, classes=[cls.__name__ for cls in type(spec).__mro__], fields=fields)
        return facts

    def prepare(self, case: Case, device: torch.device, built: list[tuple[Any, str | None]] | None = None) -> Prepared:
        """The model runners' walk up to the call under test (specs, plan, add KV-sharing layers, pick kernel sizes); the
        returned Prepared allocates the raw buffers and makes the V2 runner's views when called."""
        if case.spec_source == "vllm":
            assert self.layer_specs is not None
            made: list[tuple[Any, str | None]] = list(self.layer_specs.build(case))
        else:
            made = [(self.build_spec(g.spec), None) for g in case.groups]
        if built is not None:
            built.extend(made)
        specs = [spec for spec, _ in made]
        group_specs = [self.group_level_spec(case, g, spec) for g, spec in zip(case.groups, specs, strict=True)]
        groups = self.group_specs(case, group_specs)
        self.config.cache_config.num_gpu_blocks_override = case.num_blocks
        self.configure_layout(case.layout)
        with self.packing(case):
            config = self.plan(groups, case.num_blocks)
        if case.kv_sharing:
            self.sharing(dict(case.kv_sharing), config.kv_cache_groups)  # type: ignore[misc]
        attn_groups = [self.attention_groups(case, index, group, spec, config)
                       for index, (group, spec) in enumerate(zip(case.groups, specs, strict=True))]
        if "kernel-block choice" in self.off:
            kernel_block_sizes = [g.kernel_block_size or g.spec.block_size for g in case.groups if g.spec.kind != "encoder_only"]
            used = dict(enumerate(kernel_block_sizes))
        else:
            try:
                kernel_block_sizes = self.kernel_choice(config, attn_groups)  # type: ignore[misc]
                used = self.kernel_sizes_used(attn_groups, kernel_block_sizes)
            except ValueError as error:  # vLLM's rule finds no kernel block size for a backend: the case states one
                if stated_kernel_sizes_declared(case, attn_groups):
                    raise  # vLLM refuses a size the backend declares: judged as vLLM's refusal
                stated = [g.kernel_block_size or g.spec.block_size for g in case.groups]
                raise CaseMismatch(f"kernel_block_size: the case says {stated}, vLLM derives none ({error})".splitlines()[0]) from None
            check_derived_kernel_sizes(case, used, lambda index: declared_kernel_sizes(attn_groups, index))
        return Prepared(config, attn_groups, kernel_block_sizes, used,
                        lambda: self.make_views(case, config, attn_groups, kernel_block_sizes, device),
                        lambda memory: self.replan(case, self.group_specs(case, group_specs), memory))

    def group_level_spec(self, case: Case, group: GroupCase, spec: Any) -> Any:
        """The spec a KV-cache group carries: the layer spec, or (case packing "uniform_type", DeepSeek V4) the layers'
        specs in a UniformTypeKVCacheSpecs."""
        if case.packing != "uniform_type" or self.uniform_specs is None:
            return spec
        return self.uniform_specs(block_size=spec.block_size, kv_cache_specs=self.layer_spec_objects(group, spec))

    def layer_spec_objects(self, group: GroupCase, spec: Any) -> dict[str, Any]:
        """Each layer's vLLM spec: the group's for layers like the group's spec, one built for each other size (equal specs
        are equal objects, as vLLM's layers give them)."""
        built: dict[SpecCase, Any] = {group.spec: spec}
        for layer in group.layer_specs:
            if layer not in built:
                built[layer] = self.build_spec(layer)
        return {name: built[layer] for name, layer in zip(group.layers, group.layer_specs, strict=True)}

    @contextlib.contextmanager
    def packing(self, case: Case) -> Iterator[None]:
        """The connector setting that asks the planner for cross-layer blocks (case packing "cross_layers"), while planning."""
        if case.packing != "cross_layers" or self.transfer_config is None:
            yield
            return
        previous = self.config.kv_transfer_config
        self.config.kv_transfer_config = self.transfer_config(kv_connector_extra_config={"enable_cross_layers_blocks": "true"})
        try:
            yield
        finally:
            self.config.kv_transfer_config = previous

    def kernel_sizes_used(self, attn_groups: list[list[Any]], kernel_block_sizes: list[int]) -> dict[int, int]:
        """Each group's kernel block size as vLLM derives it for the views it binds."""
        return dict(enumerate(kernel_block_sizes))

    def plan(self, groups: list[Any], num_blocks: int) -> Any:
        assert self.planner is not None
        budget = num_blocks if self.planner.takes("num_blocks") else AVAILABLE_MEMORY
        return self.planner.obj(self.config, groups, budget)

    def group_specs(self, case: Case, specs: list[Any]) -> list[Any]:
        """vLLM's KVCacheGroupSpecs of the case's groups: new ones each time (the shared-layer wiring adds to a planned
        config's groups in place)."""
        return [self.group_spec(list(g.layers), spec) for g, spec in zip(case.groups, specs, strict=True)]

    def replan(self, case: Case, groups: list[Any], memory: int) -> Any:
        """The groups planned again from `memory` bytes with the block-count override unset (planners that take memory)."""
        cache_config = self.config.cache_config
        override, cache_config.num_gpu_blocks_override = cache_config.num_gpu_blocks_override, None
        try:
            with self.packing(case):
                return self.planner.obj(self.config, groups, memory)  # type: ignore[union-attr]
        finally:
            cache_config.num_gpu_blocks_override = override

    def configure_layout(self, layout: str) -> None:
        pass

    def attention_groups(self, case: Case, index: int, group: GroupCase, spec: Any, config: Any) -> list[Any]:
        """The group's AttentionGroups as the model runner forms them: one per per-layer spec (layers that differ in size
        form one each; a KV-sharing layer joins its target's)."""
        if self.attention_group is None:
            return []
        backend = self.backend_class(group) or self.base_backend
        members = config.kv_cache_groups[index].layer_names
        per_layer = getattr(config.kv_cache_groups[index].kv_cache_spec, "kv_cache_specs", None)
        if not group.layer_heads or per_layer is None:
            return [self.attention_group.obj(backend=backend, layer_names=list(members), kv_cache_spec=spec, kv_cache_group_id=index)]
        targets = dict(case.kv_sharing)
        by_spec: dict[Any, list[str]] = {}
        for name in members:
            by_spec.setdefault(per_layer[targets.get(name, name)], []).append(name)
        return [self.attention_group.obj(backend=backend, layer_names=names, kv_cache_spec=layer_spec, kv_cache_group_id=index)
                for layer_spec, names in by_spec.items()]

    def record(self, views: dict[str, Any], raw: list[torch.Tensor], sharing: dict[str, str], used: dict[int, int]) -> Outcome:
        pointers = {storage_key(buffer): i for i, buffer in enumerate(raw)}
        records: dict[str, tuple[ViewRecord, ...]] = {}
        owners: dict[int, str] = {}
        aliases: dict[str, str] = {}
        layers_on: list[list[str]] = [[] for _ in raw]
        for name, value in views.items():
            tensors = value if isinstance(value, (list, tuple)) else [value]
            records[name] = tuple(record_view(t, pointers) for t in tensors)
            first = id(tensors[0]) if tensors else 0
            if first in owners:
                aliases[name] = owners[first]
            else:
                owners[first] = name
            for buffer in {r.buffer for r in records[name] if r.buffer >= 0}:
                layers_on[buffer].append(name)
        buffers = tuple(BufferRecord(size=b.untyped_storage().nbytes(), layers=tuple(layers)) for b, layers in zip(raw, layers_on, strict=True))
        return Outcome(views=records, buffers=buffers, kernel_block_sizes=used, aliases=aliases)


def check_derived_kernel_sizes(case: Case, used: dict[int, int], declared: Callable[[int], tuple[int | str, ...] | None]) -> None:
    """A case states each group's kernel block size; vLLM derives it from the backend and the block size. A case that
    disagrees with a size vLLM may pick (one the group's backend declares for its spec, dividing the block) is a wrong
    case (CaseMismatch names the field and both values), not a finding about vLLM. A derived size that breaks the
    backend's declaration or does not divide the block is vLLM's choice gone wrong: the views it builds are judged."""
    for index, group in enumerate(case.groups):
        derived = used.get(index)
        stated = group.kernel_block_size or group.spec.block_size
        if derived is None or derived == stated:
            continue
        sizes = declared(index)
        if sizes is not None and (group.spec.block_size % derived or not accepts(sizes, derived)):
            continue
        raise CaseMismatch(f"groups[{index}].kernel_block_size: the case says {stated}, vLLM derives {derived} "
                           f"for {group.backend_name} and block size {group.spec.block_size}")


def stated_kernel_sizes_declared(case: Case, attn_groups: list[list[Any]]) -> bool:
    """Whether every group whose backend can say declares the case's kernel block size for its spec and the size divides
    the block (at least one group can say)."""
    said = False
    for index, group in enumerate(case.groups):
        sizes = declared_kernel_sizes(attn_groups, index)
        if sizes is None:
            continue
        stated = group.kernel_block_size or group.spec.block_size
        if group.spec.block_size % stated or not accepts(sizes, stated):
            return False
        said = True
    return said


def declared_kernel_sizes(attn_groups: list[list[Any]], index: int) -> tuple[int | str, ...] | None:
    """The kernel block sizes group `index`'s backend declares for its spec (ints, or "xN"); None when it cannot say."""
    if index >= len(attn_groups) or not attn_groups[index]:
        return None
    backend, spec = attn_groups[index][0].backend, attn_groups[index][0].kv_cache_spec
    ask = getattr(backend, "get_supported_kernel_block_sizes", None)
    if ask is None:
        return None
    try:
        sizes = ask(spec)
    except TypeError:  # releases whose backends take no spec
        sizes = ask()
    return tuple(kernel_size_label(size) for size in sizes)


def _obj(found: Any) -> Any:
    return None if found is None else found.obj


def _inside_buffers(outcome: Outcome) -> bool:
    """Whether every recorded view addresses only bytes of its raw buffer (a consumer run on any other would write wild)."""
    for records in outcome.views.values():
        for view in records:
            if view.buffer < 0:
                return False
            low = high = view.offset_bytes
            for size, stride in zip(view.shape, view.byte_strides, strict=True):
                if size == 0:
                    break
                reach = (size - 1) * stride
                low, high = (low + reach, high) if reach < 0 else (low, high + reach)
            if low < 0 or high + view.element_size > outcome.buffers[view.buffer].size:
                return False
    return True


def record_view(tensor: torch.Tensor, buffers: dict[int, int]) -> ViewRecord:
    return ViewRecord(
        shape=tuple(tensor.shape),
        stride=tuple(tensor.stride()),
        offset_bytes=tensor.storage_offset() * tensor.element_size(),
        dtype=DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype)),
        element_size=tensor.element_size(),
        buffer=buffers.get(storage_key(tensor), -1),
    )


def unique_buffers(tensors: Any) -> list[torch.Tensor]:
    """Distinct raw tensors, in first-seen order."""
    seen: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        seen.setdefault(storage_key(tensor), tensor)
    return list(seen.values())
