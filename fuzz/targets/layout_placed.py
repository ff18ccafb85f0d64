"""Adapter for vLLM 0.29 and later: allocate_kv_cache / create_kv_cache_views, KVCacheLayout.

It walks the path vLLM's V2 model runner walks (gpu/attn_utils.py init_kv_cache and
init_attn_backend): the planner builds the KVCacheConfig, KV-sharing layers join their
target's group, prepare_kernel_block_sizes picks each group's kernel block size, every
attention group picks its own as create_metadata_builders does, allocate_kv_cache makes the
views, sharing layers alias their target, and (0.32+) map_kv_caches_to_kernel_blocks gives
the views bound to layers.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from fuzz.case import Case, GroupCase, SpecCase
from fuzz.targets.base import Outcome, TargetInfo
from fuzz.targets.common import (
    BACKEND_CLASSES,
    TORCH_DTYPES,
    capture,
    describe_backend,
    import_backend,
    record_view,
    synthetic_backend_class,
)
from oracles.contract import LAYOUT_PLACED, LAYOUT_PLACED_KERNEL_MAP

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
# Plenty for any case kvfuzz draws; the block count itself comes from the override.
AVAILABLE_MEMORY = 1 << 40


def probe() -> bool:
    import vllm.v1.kv_cache_interface as kv

    return hasattr(kv, "create_kv_cache_views")


class LayoutPlacedTarget:
    def __init__(self) -> None:
        import vllm
        import vllm.v1.kv_cache_interface as kv
        import vllm.v1.worker.utils as worker_utils
        from vllm.config import VllmConfig
        from vllm.v1.attention.backend import AttentionBackend, MultipleOf
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.kv_cache_layout import KVCacheLayout

        self.kv = kv
        self.worker = worker_utils
        self.planner = kv_cache_utils.get_kv_cache_config_from_groups
        self.layouts = KVCacheLayout
        self.multiple_of = MultipleOf
        self.base_backend = AttentionBackend
        self.config = VllmConfig()
        self.kernel_map = getattr(worker_utils, "map_kv_caches_to_kernel_blocks", None)
        self.customize = getattr(worker_utils, "customize_attention_spec", None)
        self.select_takes_specs = "kv_cache_specs" in inspect.signature(worker_utils.select_common_block_size).parameters
        self.backend_classes: dict[str, type] = {}
        infos = []
        for name in BACKEND_CLASSES:
            cls = import_backend(name)
            if cls is None:
                continue
            self.backend_classes[name] = cls
            infos.append(describe_backend(name, cls))
        kinds = tuple(kind for kind, cls in SPEC_CLASSES.items() if hasattr(kv, cls))
        self.info = TargetInfo(
            vllm_version=vllm.__version__,
            generation="G6" if self.kernel_map else "G5",
            contract=LAYOUT_PLACED_KERNEL_MAP if self.kernel_map else LAYOUT_PLACED,
            spec_kinds=kinds,
            backends=tuple(infos),
            layouts=tuple(layout.name for layout in KVCacheLayout),
        )
        self._synthetic: dict[Any, type] = {}

    # ------------------------------------------------------------------ case -> vLLM objects

    def unsupported(self, case: Case) -> str | None:
        for group in case.groups:
            if group.spec.kind not in self.info.spec_kinds:
                return f"spec kind {group.spec.kind} is not in vLLM {self.info.vllm_version}"
            if group.backend is not None and group.backend not in self.backend_classes:
                return f"backend {group.backend} is not importable here"
        return None

    def backend_class(self, group: GroupCase) -> type | None:
        if group.synthetic_backend is not None:
            key = group.synthetic_backend
            if key not in self._synthetic:
                self._synthetic[key] = synthetic_backend_class(self.base_backend, key, self.multiple_of)
            return self._synthetic[key]
        return self.backend_classes.get(group.backend) if group.backend else None

    def build_spec(self, spec: SpecCase) -> Any:
        cls = getattr(self.kv, SPEC_CLASSES[spec.kind])
        if spec.kind == "mamba":
            return cls(
                block_size=spec.block_size,
                shapes=tuple(spec.mamba_shapes),
                dtypes=tuple(TORCH_DTYPES[d] for d in spec.mamba_dtypes),
                page_size_padded=spec.page_size_padded,
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {
            "block_size": spec.block_size,
            "num_kv_heads": spec.num_kv_heads,
            "head_size": spec.head_size,
            "dtype": TORCH_DTYPES[spec.dtype],
            "page_size_padded": spec.page_size_padded,
            "kv_quant_mode": self.kv.KVQuantMode[spec.kv_quant_mode.upper()],
            "tokens_per_state": spec.compress_ratio,
            "num_head_slots": spec.num_head_slots,
            "state_content_bytes": spec.state_content_bytes,
            "sliding_window": spec.sliding_window,
            "attention_chunk_size": spec.attention_chunk_size,
            "sink_len": spec.sink_len,
            "alignment": spec.alignment,
            "model_version": spec.model_version,
        }
        if spec.head_size_v is not None:
            values["head_size_v"] = spec.head_size_v
        if spec.is_mla:
            values["cache_dtype_str"] = spec.cache_dtype
        if spec.block_stride_multiple_of is not None:
            values["block_stride_alignment"] = self.multiple_of(spec.block_stride_multiple_of)
        elif spec.block_stride_alignment is not None:
            values["block_stride_alignment"] = spec.block_stride_alignment
        return cls(**{k: v for k, v in values.items() if k in fields and (v is not None or k == "page_size_padded")})

    def declare(self, case: Case) -> Case:
        groups = []
        for group in case.groups:
            backend = self.backend_class(group)
            if backend is None or group.synthetic_backend is not None or not group.spec.is_attention:
                groups.append(group)
                continue
            built = self.build_spec(group.spec)
            custom = self.customize(backend, built) if self.customize else backend.customize_spec(built)
            alignment = getattr(custom, "block_stride_alignment", None)
            spec = dataclasses.replace(
                group.spec,
                num_head_slots=custom.num_head_slots,
                state_content_bytes=custom.state_content_bytes,
                block_stride_alignment=None if alignment is None or hasattr(alignment, "base") else alignment,
                block_stride_multiple_of=alignment.base if hasattr(alignment, "base") else None,
            )
            groups.append(dataclasses.replace(group, spec=spec))
        return dataclasses.replace(case, groups=tuple(groups))

    # ------------------------------------------------------------------ the call under test

    def run(self, case: Case, device: str) -> Outcome:
        return capture(lambda: self._run(case, torch.device(device)))

    def _run(self, case: Case, device: torch.device) -> Outcome:
        worker = self.worker
        specs = [self.build_spec(g.spec) for g in case.groups]
        groups = [self.kv.KVCacheGroupSpec(list(g.layers), spec) for g, spec in zip(case.groups, specs, strict=False)]
        self.config.cache_config.kv_cache_layout = case.layout
        self.config.cache_config.num_gpu_blocks_override = case.num_blocks
        config = self.planner(self.config, groups, AVAILABLE_MEMORY)
        sharing = dict(case.kv_sharing)
        worker.add_kv_sharing_layers_to_kv_cache_groups(sharing, config.kv_cache_groups)

        attn_groups: list[list[Any]] = []
        for index, (group, spec) in enumerate(zip(case.groups, specs, strict=False)):
            backend = self.backend_class(group)
            members = config.kv_cache_groups[index].layer_names
            attn_groups.append(
                [worker.AttentionGroup(backend=backend, layer_names=list(members), kv_cache_spec=spec, kv_cache_group_id=index)]
                if backend is not None and spec.has_layer_views and isinstance(spec, self.kv.AttentionSpec)
                else []
            )
        kernel_block_sizes = worker.prepare_kernel_block_sizes(config, attn_groups)
        used_kernels = self._bind_kernel_block_sizes(attn_groups, kernel_block_sizes)

        kv_caches = worker.allocate_kv_cache(config, device, self.layouts[case.layout], kernel_block_sizes)
        for sharer, target in sharing.items():
            kv_caches[sharer] = kv_caches[target]
        if self.kernel_map is not None:
            kv_caches = self.kernel_map(kv_caches, [g for per_group in attn_groups for g in per_group])
        buffer = next(iter(kv_caches.values()))
        buffer_bytes = buffer.untyped_storage().nbytes()
        return Outcome(
            views={name: record_view(view, buffer) for name, view in kv_caches.items()},
            buffer_bytes=buffer_bytes,
            kernel_block_sizes=used_kernels,
        )

    def _bind_kernel_block_sizes(self, attn_groups: list[list[Any]], group_sizes: list[int]) -> dict[int, int]:
        """Each attention group's kernel block size, chosen as create_metadata_builders does."""
        used: dict[int, int] = {}
        for index, per_group in enumerate(attn_groups):
            for group in per_group:
                size = group_sizes[index] if index < len(group_sizes) else group.kv_cache_spec.block_size
                if self.kernel_map is not None:
                    args = ([group.backend], [group.kv_cache_spec]) if self.select_takes_specs else ([group.backend],)
                    size = self.worker.select_common_block_size(size, *args)
                    if size != group.kv_cache_spec.block_size:
                        group.kernel_block_size = size
                used[index] = size
        return used
