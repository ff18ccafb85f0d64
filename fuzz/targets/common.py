"""What every adapter shares: the backend catalog, spec building, the planner walk, view records.

An adapter subclasses Adapter and supplies only what its vLLM API generation does differently:
how it probes its contract, how backends declare their layout, and the calls that turn raw
buffers into views (`declare_group`, `make_views`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

import oracles
from fuzz.case import MLA_KINDS, Case, GroupCase, SpecCase, SyntheticBackend
from fuzz.errors import BrokenDeclaration, CaseMismatch, Inexpressible, TargetError
from fuzz.targets.base import BackendInfo, BufferRecord, Execution, Outcome, TargetInfo, ViewRecord
from fuzz.targets.calls import call_mismatch
from fuzz.targets.probe import physical_probe, storage_key

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

# Real backends by vLLM name -> "module:Class" candidates, tried in order (modules moved between
# releases; relative paths are under vllm.v1.attention.backends). Modules that fail to import in
# this environment (no CUDA, no flashinfer) are left out of the target's catalog.
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
# Backends of models that compress their cache (several tokens per stored state).
COMPRESSING_BACKENDS = ("DEEPSEEK_V4_FLASHMLA", "DEEPSEEK_V4_INDEXER", "DEEPSEEK_V4_COMPRESSOR")

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
# Case spec fields -> the vLLM spec field that carries them (compression was renamed in 0.29).
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
}
FIELD_DEFAULTS = {name: getattr(SpecCase(kind="full", block_size=16), name) for name in FIELD_NAMES}
# Plenty for any case kvfuzz draws; the block count itself comes from the override.
AVAILABLE_MEMORY = 1 << 40


def import_backend(name: str) -> type | None:
    for path in BACKEND_CLASSES.get(name, ()):
        module, cls = path.split(":")
        if not module.startswith("vllm."):
            module = "vllm.v1.attention.backends." + module
        try:
            return getattr(importlib.import_module(module), cls)
        except Exception:  # noqa: BLE001 - any import failure means "not in this environment"
            continue
    return None


def kernel_size_label(size: Any) -> int | str:
    base = getattr(size, "base", None)
    return f"x{base}" if base is not None else int(size)


def capture(call: Callable[[], Outcome]) -> Outcome:
    """Run `call`; an exception raised in vLLM's code becomes an Outcome naming the innermost vLLM function.

    SystemExit and KeyboardInterrupt raised by the target are data too: workers ignore SIGINT,
    so neither can come from the user. An exception no vLLM frame took part in is kvfuzz's own
    and propagates (an internal error), as does a case whose derived fields vLLM derives differently.
    """
    try:
        return call()
    except CaseMismatch:
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as error:
        mismatch = call_mismatch(error)
        if mismatch is not None:  # kvfuzz called vLLM wrongly: not an outcome of vLLM's
            raise TargetError(mismatch) from None
        outcome = vllm_failure(error)
        if outcome is None:
            raise
        return outcome


def vllm_failure(error: BaseException) -> Outcome | None:
    """The Outcome of an exception raised in (or through) vLLM's code, naming the innermost vLLM frame;
    None when vLLM took no part in it."""
    frames = traceback.extract_tb(error.__traceback__)
    located = [(f, path) for f in frames if (path := _vllm_path(f.filename)) is not None]
    if not located:
        return None
    frame, path = located[-1]
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return Outcome(error_type=type(error).__name__, error_message=message[:500], error_function=frame.name,
                   error_layer=_layer_in_flight(error), error_file=path, error_line=frame.lineno)


def _vllm_path(filename: str) -> str | None:
    """`filename` relative to the loaded vllm package (posix), None outside it.

    The package's folders are where it was imported from, the folder its `__file__` names and its
    `__path__` (a checkout that wraps a release names the release's folder in the last two); code
    objects carry the path they were imported by."""
    package = sys.modules.get("vllm")
    spec = getattr(package, "__spec__", None)
    candidates = [getattr(spec, "origin", None), getattr(package, "__file__", None)]
    folders = {os.path.dirname(path) for path in candidates if path}
    folders.update(getattr(package, "__path__", ()) or ())
    for folder in folders:
        prefix = folder.rstrip(os.sep) + os.sep
        if filename.startswith(prefix):
            return filename[len(prefix):].replace(os.sep, "/")
    if folders:
        return None
    parts = filename.replace("\\", "/").rsplit("/vllm/", 1)
    return parts[1] if len(parts) == 2 else None


def _layer_in_flight(error: BaseException) -> str | None:
    """The innermost `layer_name` a vLLM frame was handling when it raised."""
    layer = None
    tb = error.__traceback__
    while tb is not None:
        if "/vllm/" in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            candidate = tb.tb_frame.f_locals.get("layer_name")
            if isinstance(candidate, str):
                layer = candidate
        tb = tb.tb_next
    return layer


class Adapter:
    """The parts of a target adapter that do not depend on the vLLM API generation."""

    generation = "?"

    def __init__(self) -> None:
        import vllm
        import vllm.v1.kv_cache_interface as kv
        import vllm.v1.worker.utils as worker_utils
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.v1.attention.backend import AttentionBackend, MultipleOf
        from vllm.v1.core import kv_cache_utils

        self.vllm_version = vllm.__version__
        self.kv = kv
        self.worker = worker_utils
        self.planner = kv_cache_utils.get_kv_cache_config_from_groups
        self.multiple_of = MultipleOf
        self.base_backend = AttentionBackend
        self.config = VllmConfig()
        # Backends consult the current vLLM config (stride order, kernel sizes); keep one set.
        set_current_vllm_config(self.config).__enter__()
        self.backend_classes: dict[str, type] = {}
        for name in BACKEND_CLASSES:
            cls = import_backend(name)
            if cls is not None and self.usable_backend(name, cls):
                self.backend_classes[name] = cls
        self.spec_kinds = tuple(kind for kind, cls in SPEC_CLASSES.items() if hasattr(kv, cls) and self.supports_kind(kind))
        self._synthetic: dict[SyntheticBackend, type] = {}
        self._spec_fields: dict[type, frozenset[str]] = {}
        self.max_buffer_bytes = 1 << 30  # cases needing more are skipped on real devices

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
                   device: torch.device) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Raw buffers -> per-layer views: (views by layer, raw buffers in config order)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared

    def target_info(self, contract: Any, layouts: tuple[str, ...], kv_sharing: bool = True) -> TargetInfo:
        return TargetInfo(
            vllm_version=self.vllm_version,
            generation=self.generation,
            contract=contract,
            spec_kinds=self.spec_kinds,
            backends=tuple(self._described_backends()),
            layouts=layouts,
            spec_fields={kind: self._expressible_fields(kind) for kind in self.spec_kinds},
            kv_sharing=kv_sharing,
        )

    def _described_backends(self) -> list[BackendInfo]:
        described = []
        for name, cls in list(self.backend_classes.items()):
            try:
                described.append(self.describe_backend(name, cls))
            except Exception:  # noqa: BLE001 - a backend that cannot describe itself here is left out
                del self.backend_classes[name]
        return described

    def _expressible_fields(self, kind: str) -> tuple[str, ...]:
        cls = getattr(self.kv, SPEC_CLASSES[kind])
        names = {f.name for f in dataclasses.fields(cls)}
        return tuple(field for field, vllm_names in FIELD_NAMES.items() if any(n in names for n in vllm_names))

    def base_backend_info(self, name: str, cls: type, **extra: Any) -> BackendInfo:
        return BackendInfo(
            name=name,
            is_mla=name in COMPRESSING_BACKENDS or bool(getattr(cls, "is_mla", lambda: False)()),
            compresses=name in COMPRESSING_BACKENDS,
            kernel_block_sizes=tuple(kernel_size_label(s) for s in cls.get_supported_kernel_block_sizes()),
            model_dtypes=tuple(DTYPE_NAMES[d] for d in getattr(cls, "supported_dtypes", ()) if d in DTYPE_NAMES),
            cache_dtypes=tuple(getattr(cls, "supported_kv_cache_dtypes", ("auto",))),
            **extra,
        )

    def unsupported(self, case: Case) -> str | None:
        info = self.info  # type: ignore[attr-defined]
        if case.layout not in info.layouts:
            return f"layout {case.layout} is not one of this vLLM's ({', '.join(info.layouts)})"
        if case.kv_sharing and not info.kv_sharing:
            return "this vLLM's reshape takes no KV-sharing layers"
        for group in case.groups:
            spec = group.spec
            if spec.kind not in info.spec_kinds:
                return f"spec kind {spec.kind} is not in vLLM {info.vllm_version}"
            if group.backend is not None and group.backend not in self.backend_classes:
                return f"backend {group.backend} is not importable here"
            for field, default in FIELD_DEFAULTS.items():
                if getattr(spec, field) != default and not info.can(spec.kind, field) and not self.implied(spec, field):
                    return f"{spec.kind} specs of vLLM {info.vllm_version} have no {field}"
            if spec.block_stride_multiple_of is not None and not hasattr(self.kv.KVCacheSpec, "get_block_stride_alignment"):
                return f"vLLM {info.vllm_version} takes no block_stride_alignment in whole kernel blocks"
        return None

    def implied(self, spec: SpecCase, field: str) -> bool:
        """Whether a case field this vLLM's spec lacks is implied by the fields it has."""
        return False

    def backend_class(self, group: GroupCase) -> type | None:
        if group.synthetic_backend is not None:
            key = group.synthetic_backend
            if key not in self._synthetic:
                sizes = [self.multiple_of(int(s[1:])) if isinstance(s, str) else s for s in key.kernel_block_sizes]
                namespace = {
                    "get_name": staticmethod(lambda: "SYNTHETIC_" + key.name.upper()),
                    "get_supported_kernel_block_sizes": classmethod(lambda cls, spec=None: list(sizes)),
                    **self.synthetic_namespace(key),
                }
                self._synthetic[key] = type("Synthetic" + key.name.title().replace("_", ""), (self.base_backend,), namespace)
            return self._synthetic[key]
        return self.backend_classes.get(group.backend) if group.backend else None

    def build_spec(self, spec: SpecCase) -> Any:
        cls = getattr(self.kv, SPEC_CLASSES[spec.kind])
        fields = self._spec_fields.get(cls)
        if fields is None:
            fields = self._spec_fields[cls] = frozenset(f.name for f in dataclasses.fields(cls))
        if spec.kind == "mamba":
            values: dict[str, Any] = {
                "block_size": spec.block_size,
                "shapes": tuple(spec.mamba_shapes),
                "dtypes": tuple(TORCH_DTYPES[d] for d in spec.mamba_dtypes),
                "page_size_padded": spec.page_size_padded,
            }
            return cls(**{k: v for k, v in values.items() if k in fields})
        values = {
            "block_size": spec.block_size,
            "num_kv_heads": spec.num_kv_heads,
            "head_size": spec.head_size,
            "dtype": TORCH_DTYPES[spec.dtype],
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
        }
        if "kv_quant_mode" in fields:
            values["kv_quant_mode"] = self.kv.KVQuantMode[spec.kv_quant_mode.upper()]
        if spec.head_size_v is not None:
            values["head_size_v"] = spec.head_size_v
        if spec.kind in MLA_KINDS:
            values["cache_dtype_str"] = spec.cache_dtype
        if spec.block_stride_multiple_of is not None:
            values["block_stride_alignment"] = self.multiple_of(spec.block_stride_multiple_of)
        elif spec.block_stride_alignment is not None:
            values["block_stride_alignment"] = spec.block_stride_alignment
        return cls(**{k: v for k, v in values.items() if k in fields and (v is not None or k == "page_size_padded")})

    def declare(self, case: Case) -> Case:
        """Declaring is idempotent, so cases that already carry their backends' fields may be re-run."""
        return dataclasses.replace(case, groups=tuple(self.declare_group(g, case.layout) for g in case.groups))

    def execute(self, case: Case, device: str, probe: bool = False) -> Execution:
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
        try:
            return Execution(declared, outcome=capture(lambda: self._run(declared, torch.device(device), probe)))
        except CaseMismatch as error:
            return Execution(declared, case_error=str(error))

    def _run(self, case: Case, device: torch.device, probe: bool = False) -> Outcome:
        views, raw, used = self.prepare(case, device)()
        outcome = self.record(views, raw, dict(case.kv_sharing), used)
        if probe and device.type != "meta":
            outcome = dataclasses.replace(outcome, probe=physical_probe(views, raw))
        return outcome

    def prepare(self, case: Case, device: torch.device) -> Callable[[], tuple[dict[str, Any], list[torch.Tensor], dict[int, int]]]:
        """The V2 model runner's walk up to the call under test (plan, add KV-sharing layers, pick
        kernel sizes); the returned call allocates the raw buffers and makes the views."""
        specs = [self.build_spec(g.spec) for g in case.groups]
        groups = [self.kv.KVCacheGroupSpec(list(g.layers), spec) for g, spec in zip(case.groups, specs, strict=True)]
        self.config.cache_config.num_gpu_blocks_override = case.num_blocks
        self.configure_layout(case.layout)
        config = self.planner(self.config, groups, AVAILABLE_MEMORY)
        sharing = dict(case.kv_sharing)
        self.worker.add_kv_sharing_layers_to_kv_cache_groups(sharing, config.kv_cache_groups)
        attn_groups = [self.attention_groups(index, group, spec, config)
                       for index, (group, spec) in enumerate(zip(case.groups, specs, strict=True))]
        try:
            kernel_block_sizes = self.worker.prepare_kernel_block_sizes(config, attn_groups)
            used = self.kernel_sizes_used(attn_groups, kernel_block_sizes)
        except ValueError as error:  # vLLM's rule finds no kernel block size for a backend: the case states one
            stated = [g.kernel_block_size or g.spec.block_size for g in case.groups]
            raise CaseMismatch(f"kernel_block_size: the case says {stated}, vLLM derives none ({error})".splitlines()[0]) from None
        check_derived_kernel_sizes(case, used)

        def views() -> tuple[dict[str, Any], list[torch.Tensor], dict[int, int]]:
            made, raw = self.make_views(case, config, attn_groups, kernel_block_sizes, device)
            return made, raw, used

        return views

    def kernel_sizes_used(self, attn_groups: list[list[Any]], kernel_block_sizes: list[int]) -> dict[int, int]:
        """Each group's kernel block size as vLLM derives it for the views it binds."""
        return dict(enumerate(kernel_block_sizes))

    def configure_layout(self, layout: str) -> None:
        pass

    def attention_groups(self, index: int, group: GroupCase, spec: Any, config: Any) -> list[Any]:
        backend = self.backend_class(group) or self.base_backend
        members = config.kv_cache_groups[index].layer_names
        return [self.worker.AttentionGroup(backend=backend, layer_names=list(members), kv_cache_spec=spec, kv_cache_group_id=index)]

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


def check_derived_kernel_sizes(case: Case, used: dict[int, int]) -> None:
    """A case states each group's kernel block size; vLLM derives it from the backend and the block size. A case that
    disagrees is a wrong case (CaseMismatch names the field and both values), not a finding about vLLM."""
    for index, group in enumerate(case.groups):
        derived = used.get(index)
        stated = group.kernel_block_size or group.spec.block_size
        if derived is not None and derived != stated:
            raise CaseMismatch(f"groups[{index}].kernel_block_size: the case says {stated}, vLLM derives {derived} "
                               f"for {group.backend_name} and block size {group.spec.block_size}")


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
