"""Adapter for vLLM 0.29 and later: allocate_kv_cache / create_kv_cache_views, KVCacheLayout.

The V2 model runner's path (gpu/attn_utils.py init_kv_cache and init_attn_backend): backends
publish their spec fields (customize_spec), the planner builds the KVCacheConfig for the layout,
prepare_kernel_block_sizes picks each group's kernel block size, every attention group picks
its own as create_metadata_builders does, allocate_kv_cache makes the views, sharing layers
alias their target, and (0.32+) map_kv_caches_to_kernel_blocks gives the views bound to layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fuzz.case import Case, GroupCase, SyntheticBackend
from fuzz.errors import BrokenDeclaration, Inexpressible
from fuzz.targets.base import BackendInfo
from fuzz.targets.calls import entry_parameters
from fuzz.targets.common import Adapter
from oracles import declarations, pages
from oracles.contract import LAYOUT_PLACED, LAYOUT_PLACED_KERNEL_MAP

# Cache dtypes whose state content is plain K and V of the model or cache dtype (no scales, no packing).
PLAIN_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


def probe() -> bool:
    import vllm.v1.kv_cache_interface as kv

    return hasattr(kv, "create_kv_cache_views")


class LayoutPlacedTarget(Adapter):
    def __init__(self) -> None:
        super().__init__()
        from vllm.v1.kv_cache_layout import KVCacheLayout

        self.layouts = KVCacheLayout
        self.kernel_map = getattr(self.worker, "map_kv_caches_to_kernel_blocks", None)
        self.customize = getattr(self.worker, "customize_attention_spec", None)
        self.select_takes_specs = "kv_cache_specs" in entry_parameters(self.worker.select_common_block_size, "select_common_block_size")
        self.generation = "G6" if self.kernel_map else "G5"
        self.info = self.target_info(LAYOUT_PLACED_KERNEL_MAP if self.kernel_map else LAYOUT_PLACED,
                                     tuple(layout.name for layout in KVCacheLayout))

    def describe_backend(self, name: str, cls: type) -> BackendInfo:
        layouts = cls.supported_kv_cache_layouts() if hasattr(cls, "supported_kv_cache_layouts") else None
        return self.base_backend_info(name, cls, layouts=None if layouts is None else tuple(layout.name for layout in layouts),
                                      asymmetric_kv=self._takes_asymmetric_heads(cls))

    def _takes_asymmetric_heads(self, cls: type) -> bool:
        """Whether the backend's customize_spec accepts K and V heads of different sizes (some assert they are equal)."""
        trial = self.kv.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, head_size_v=32, dtype=torch.bfloat16)
        try:
            self.customize(cls, trial) if self.customize else cls.customize_spec(trial)
        except Exception:  # noqa: BLE001 - any refusal means: not for asymmetric heads
            return False
        return True

    def synthetic_namespace(self, backend: SyntheticBackend) -> dict[str, Any]:
        layouts = self.layouts

        def supported_layouts(cls: type) -> Any:
            return None if backend.layouts is None else tuple(layouts[name] for name in backend.layouts)

        return {"supported_kv_cache_layouts": classmethod(supported_layouts), "customize_spec": classmethod(lambda cls, spec: spec)}

    def declare(self, case: Case) -> Case:
        declared = super().declare(case)
        # vLLM's layout resolution keeps only block-compact layouts when the groups' pages differ
        # in shape once the backends have published their head slots and state sizes.
        shapes = {(p.heads, p.states, p.page_bytes) for p in (pages.page(g.spec) for g in declared.groups)}
        if len(shapes) > 1 and set(declared.layout[:2]) != {"L", "B"}:
            raise Inexpressible(f"vLLM resolves no {declared.layout} layout for groups whose pages differ in shape")
        return declared

    def declare_group(self, group: GroupCase, layout: str) -> GroupCase:
        backend = self.backend_class(group)
        if backend is None or group.synthetic_backend is not None or not group.spec.is_attention:
            return group
        built = self.build_spec(group.spec)
        custom = self.customize(backend, built) if self.customize else backend.customize_spec(built)
        self._check_published(group, built, custom)
        alignment = getattr(custom, "block_stride_alignment", None)
        spec = dataclasses.replace(
            group.spec,
            num_head_slots=custom.num_head_slots,
            state_content_bytes=custom.state_content_bytes,
            block_stride_alignment=None if alignment is None or hasattr(alignment, "base") else alignment,
            block_stride_multiple_of=alignment.base if hasattr(alignment, "base") else None,
        )
        return dataclasses.replace(group, spec=_keep_padding_margin(group.spec, spec))

    def _check_published(self, group: GroupCase, built: Any, custom: Any) -> None:
        """The head slots and state bytes a backend publishes must hold exactly the heads' K and V (oracles/declarations.py)."""
        if (custom.num_head_slots, custom.state_content_bytes) == (built.num_head_slots, built.state_content_bytes):
            return
        spec = group.spec
        quantized = spec.kv_quant_mode != "none" or spec.cache_dtype not in PLAIN_CACHE_DTYPES
        fault = declarations.published_fault(group.backend_name, quantized, built.num_kv_heads,
                                             (built.head_size + built.head_size_v) * built.dtype.itemsize,
                                             custom.num_heads, custom.state_content_size_bytes)
        if fault is not None:
            raise BrokenDeclaration("customize_spec", fault, group.layers[0])

    def configure_layout(self, layout: str) -> None:
        self.config.cache_config.kv_cache_layout = layout

    def attention_groups(self, index: int, group: GroupCase, spec: Any, config: Any) -> list[Any]:
        if self.backend_class(group) is None or not getattr(spec, "has_layer_views", True) or not isinstance(spec, self.kv.AttentionSpec):
            return []
        return super().attention_groups(index, group, spec, config)

    def make_views(self, case: Case, config: Any, attn_groups: list[list[Any]], kernel_block_sizes: list[int],
                   device: torch.device) -> tuple[dict[str, Any], list[torch.Tensor]]:
        kv_caches = self.worker.allocate_kv_cache(config, device, self.layouts[case.layout], kernel_block_sizes)
        for sharer, target in case.kv_sharing:
            kv_caches[sharer] = kv_caches[target]
        if self.kernel_map is not None:
            kv_caches = self.kernel_map(kv_caches, [g for per_group in attn_groups for g in per_group])
        # One backing allocation: every view's storage is it.
        first = next(iter(kv_caches.values()))
        backing = torch.empty(0, dtype=torch.int8, device=first.device).set_(first.untyped_storage())
        return kv_caches, [backing]

    def kernel_sizes_used(self, attn_groups: list[list[Any]], group_sizes: list[int]) -> dict[int, int]:
        """Each attention group's kernel block size, chosen as create_metadata_builders does."""
        used: dict[int, int] = {}
        for index, per_group in enumerate(attn_groups):
            for group in per_group:
                if index >= len(group_sizes):  # encoder-only groups get no kernel block size
                    used[index] = group.kv_cache_spec.block_size
                    continue
                size = group_sizes[index]
                if self.kernel_map is not None:
                    args = ([group.backend], [group.kv_cache_spec]) if self.select_takes_specs else ([group.backend],)
                    size = self.worker.select_common_block_size(size, *args)
                    if size != group.kv_cache_spec.block_size:
                        group.kernel_block_size = size
                used[index] = size
        return used


def _keep_padding_margin(drawn: Any, declared: Any) -> Any:
    """Padding drawn as a margin over the generator's page keeps that margin over the backend's.

    vLLM pads pages up to the largest page of the model, computed after backends customize their
    specs (quantization scales, head slots); a padded size under the declared page is no
    configuration vLLM builds.
    """
    if drawn.page_size_padded is None:
        return declared
    margin = drawn.page_size_padded - pages.unpadded_bytes(drawn, drawn.block_size)
    if margin < 0:
        return declared
    return dataclasses.replace(declared, page_size_padded=pages.unpadded_bytes(declared, declared.block_size) + margin)
