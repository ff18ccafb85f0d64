"""What a vLLM release offers kvfuzz, as plain data: its backends by kvfuzz's names, its spec classes, dtypes and the case
fields each spec kind carries (module constants), and the Catalog part of an adapter, which reads them off the release
and describes the target (TargetInfo) that the generator draws from."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import typing
from collections.abc import Callable
from typing import Any

import torch

from fuzz.case import SpecCase
from fuzz.targets import capability, kernel_probe
from fuzz.targets.base import BackendInfo, TargetInfo
from fuzz.targets.entry_points import Probe
from fuzz.targets.spec_builder import LayerSpecs, stored_mla_dtype

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


class Catalog:
    """The target's catalogs: backends, cache dtypes, quant modes, spec kinds and fields, and the TargetInfo built from them."""

    probe: Probe
    off: dict[str, str]
    backend_classes: dict[str, type]
    spec_classes: dict[str, type]
    spec_kinds: tuple[str, ...]
    refused_on_gpus: dict[str, frozenset[str]]
    layer_specs: LayerSpecs | None

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

    def target_info(self, contract: Any, layouts: tuple[str, ...], kv_sharing: bool = True, packings: tuple[str, ...] = ("none",),
                    platforms: tuple[str, ...] = ("cuda",), attention_free: bool = False) -> TargetInfo:
        uncovered = [f"spec class {name}" for name in self._unknown_spec_classes()]
        if self.probe.spec_class("HiSparseHotSpec") is not None:
            # The check drives the layout and binding on cases that name it; no campaign draws such a model on its own.
            uncovered.append("HiSparse caches in campaigns (the hisparse-caches check runs on cases that name it), "
                             "their shared host pool (TP > 1) and data movement")
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
