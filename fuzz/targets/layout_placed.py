"""Adapter for vLLM 0.29 and later: allocate_kv_cache / create_kv_cache_views, KVCacheLayout.

The V2 model runner's path (gpu/attn_utils.py init_kv_cache and init_attn_backend): backends
publish their spec fields (customize_spec), the planner builds the KVCacheConfig for the layout,
prepare_kernel_block_sizes picks each group's kernel block size, every attention group picks
its own as create_metadata_builders does, allocate_kv_cache makes the views, sharing layers
alias their target, and (0.32+) map_kv_caches_to_kernel_blocks gives the views bound to layers.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from fuzz.case import Case, GroupCase, SyntheticBackend, replace
from fuzz.errors import BrokenDeclaration, Inexpressible
from fuzz.targets.base import BackendInfo
from fuzz.targets.common import Adapter, Made
from fuzz.targets.consumers import walk_runners as runners_building
from fuzz.targets.entry_points import Probe
from fuzz.targets.synthetic import published_state
from oracles import declarations, dtypes, pages
from oracles.contract import LAYOUT_PLACED, LAYOUT_PLACED_KERNEL_MAP


def probe(entry_points: Probe) -> bool:
    """Whether the loaded vLLM places views by layout: an allocate_kv_cache that takes one."""
    return entry_points.find("allocation") is not None


class LayoutPlacedTarget(Adapter):
    def __init__(self, entry_points: Probe) -> None:
        super().__init__(entry_points)
        self.allocate = entry_points.get("allocation")
        self.layouts = entry_points.get("KVCacheLayout")
        self.kernel_map = _obj(entry_points.find("kernel-block mapping"))
        group_cls = self.attention_group.obj if self.attention_group is not None else None
        maps_kernel_blocks = group_cls is not None and hasattr(group_cls, "map_kv_cache_to_kernel_blocks")
        if maps_kernel_blocks and (self.kernel_map is None or "kernel-block choice" in self.off):
            why = entry_points.missing("kernel-block mapping") if self.kernel_map is None else "needs the kernel-block choice"
            self.off["kernel-block mapping"] = why + "; compressed caches split into kernel blocks are skipped"
            self.kernel_map = None
        customize = entry_points.find("spec customization")
        self.customize = None if customize is None else customize.obj
        if self.customize is None and not hasattr(self.base_backend, "customize_spec"):
            self.off["spec customization"] = entry_points.missing("spec customization") + "; only synthetic backends are drawn"
        common = self.common_block_size
        self.select_takes_specs = common is not None and common.takes("kv_cache_specs")
        rope = entry_points.find("rotary dims")
        self.rotary_dims = None if rope is None else importlib.import_module(rope.module)
        self.generation = "G6" if maps_kernel_blocks else "G5"
        self._runners: tuple[str, ...] | None = None
        self.info = self.target_info(LAYOUT_PLACED_KERNEL_MAP if maps_kernel_blocks else LAYOUT_PLACED,
                                     tuple(layout.name for layout in self.layouts), platforms=allocation_platforms(self.allocate),
                                     packings=("none", "uniform_type") if self.uniform_specs is not None else ("none",),
                                     attention_free=True)

    def describe_backend(self, name: str, cls: type) -> BackendInfo:
        layouts = cls.supported_kv_cache_layouts() if hasattr(cls, "supported_kv_cache_layouts") else None
        return self.base_backend_info(name, cls, layouts=None if layouts is None else tuple(layout.name for layout in layouts),
                                      asymmetric_kv=self._takes_asymmetric_heads(cls))

    def _takes_asymmetric_heads(self, cls: type) -> bool:
        """Whether the backend's customize_spec accepts K and V heads of different sizes (some assert they are equal)."""
        trial = self.spec_classes["full"](block_size=16, num_kv_heads=2, head_size=64, head_size_v=32, dtype=torch.bfloat16)
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

    def skip_reason(self, case: Case) -> str | None:
        reason = super().skip_reason(case)
        if reason is not None:
            return reason
        split = any(g.spec.compress_ratio > 1 and (g.kernel_block_size or g.spec.block_size) < g.spec.block_size for g in case.groups)
        if "kernel-block mapping" in self.off and split:
            return f"check kernel-block mapping is off: {self.off['kernel-block mapping']}"
        if "spec customization" in self.off and any(g.backend is not None for g in case.groups):
            return f"check spec customization is off: {self.off['spec customization']}"
        return None

    def declare(self, case: Case) -> Case:
        declared = super().declare(case)
        # vLLM's layout resolution keeps only block-compact layouts when the groups' pages differ
        # in shape once the backends have published their head slots and state sizes.
        shapes = {(p.heads, p.states, p.page_bytes) for p in (pages.page(g.spec) for g in declared.groups)}
        if len(shapes) > 1 and set(declared.layout[:2]) != {"L", "B"}:
            raise Inexpressible(f"vLLM resolves no {declared.layout} layout for groups whose pages differ in shape")
        return declared

    def declare_group(self, group: GroupCase, layout: str) -> GroupCase:
        if not group.spec.is_attention:
            return group
        if group.synthetic_backend is not None:
            return replace(group, spec=published_state(group.spec))
        backend = self.backend_class(group)
        if backend is None:
            return group
        self._register_rotary_dims(group)
        built = self.build_spec(group.spec)
        custom = self.customize(backend, built) if self.customize else backend.customize_spec(built)
        self._check_published(group, built, custom)
        if group.differs_per_layer and (custom.num_head_slots, custom.state_content_bytes) != (None, None):
            raise Inexpressible(f"layers that differ in size on {group.backend_name}, which publishes its page per spec")
        alignment = getattr(custom, "block_stride_alignment", None)
        if alignment is None and group.spec.is_mla and self.layer_specs is not None:
            alignment = self.layer_specs.mla_block_stride_alignment(backend, group.spec)
        spec = replace(
            group.spec,
            num_head_slots=custom.num_head_slots,
            state_content_bytes=custom.state_content_bytes,
            block_stride_alignment=None if alignment is None or hasattr(alignment, "base") else alignment,
            block_stride_multiple_of=alignment.base if hasattr(alignment, "base") else None,
        )
        return replace(group, spec=_keep_padding_margin(group.spec, spec))

    def _check_published(self, group: GroupCase, built: Any, custom: Any) -> None:
        """The head slots and state bytes a backend publishes must hold exactly the heads' K and V (oracles/declarations.py)."""
        if (custom.num_head_slots, custom.state_content_bytes) == (built.num_head_slots, built.state_content_bytes):
            return
        spec = group.spec
        definition = dtypes.definition(spec.cache_dtype)
        quantized = spec.registered_cache_dtype or spec.kv_quant_mode != "none" or definition is None or not definition.plain
        fault = declarations.published_fault(group.backend_name, quantized, built.num_kv_heads,
                                             (built.head_size + built.head_size_v) * built.dtype.itemsize,
                                             custom.num_heads, custom.state_content_size_bytes)
        if fault is not None:
            raise BrokenDeclaration("customize_spec", fault, group.layers[0])

    def _register_rotary_dims(self, group: GroupCase) -> None:
        """The model's rotary dims, where a backend sizes its cache by them (Octave). vLLM keeps them
        per process by head size; every case is a model of its own, so the previous one's go."""
        spec = group.spec
        if self.rotary_dims is None or spec.rope_dim is None:
            return
        getattr(self.rotary_dims, "_rope_dim_by_head_size", {}).pop(spec.head_size, None)
        self.rotary_dims.register_rope_dim(spec.head_size, spec.rope_dim)

    def configure_layout(self, layout: str) -> None:
        self.config.cache_config.kv_cache_layout = layout

    @contextlib.contextmanager
    def platform_answers(self, case: Case) -> Iterator[None]:
        """The allocation run as on ROCm: its module's `current_platform` says ROCm, and the ROCm kernel warm-ups it calls
        (GEMM workspaces, which a CPU cannot build and which never touch the KV cache) do nothing."""
        if case.platform == "cuda":
            yield
            return
        namespace = inspect.unwrap(self.allocate).__globals__
        saved = {name: namespace[name] for name in ("current_platform", *_rocm_helpers(self.allocate)) if name in namespace}
        namespace["current_platform"] = _RocmAnswers(saved["current_platform"])
        namespace.update(dict.fromkeys(_rocm_helpers(self.allocate), _no_op))
        try:
            yield
        finally:
            namespace.update(saved)

    def attention_groups(self, case: Case, index: int, group: GroupCase, spec: Any, config: Any) -> list[Any]:
        if self.backend_class(group) is None or not getattr(spec, "has_layer_views", True) or not isinstance(spec, self.attention_spec):
            return []
        return super().attention_groups(case, index, group, spec, config)

    def make_views(self, case: Case, config: Any, attn_groups: list[list[Any]], kernel_block_sizes: list[int],
                   device: torch.device) -> Made:
        kv_caches = self.allocate(config, device, self.layouts[case.layout], kernel_block_sizes)
        for sharer, target in case.kv_sharing:
            kv_caches[sharer] = kv_caches[target]
        kept = None
        if self.kernel_map is not None:
            kept = dict(kv_caches)  # the runner keeps these; layers bind the kernel-block views
            kv_caches = self.kernel_map(kv_caches, [g for per_group in attn_groups for g in per_group])
        if not kv_caches:
            return Made(kv_caches, [], kept)  # an attention-free model: no KV cache at all
        # One backing allocation: every view's storage is it.
        first = next(iter(kv_caches.values()))
        backing = torch.empty(0, dtype=torch.int8, device=first.device).set_(first.untyped_storage())
        return Made(kv_caches, [backing], kept)

    def walk_runners(self) -> tuple[str, ...]:
        """From 0.29 the V1 runner (and 0.34's CPU runner) allocate through the same functions as the V2 runner."""
        if self._runners is None:
            functions = (self.allocate.__name__,) + (() if self.kernel_map is None else (self.kernel_map.__name__,))
            self._runners = runners_building(True, functions)
        return self._runners

    def kernel_sizes_used(self, attn_groups: list[list[Any]], group_sizes: list[int]) -> dict[int, int]:
        """Each attention group's kernel block size, chosen as create_metadata_builders does (and bound to the
        group, which map_kv_caches_to_kernel_blocks reads)."""
        used: dict[int, int] = {}
        for index, per_group in enumerate(attn_groups):
            for group in per_group:
                if index >= len(group_sizes):  # encoder-only groups get no kernel block size
                    used[index] = group.kv_cache_spec.block_size
                    continue
                size = group_sizes[index]
                if self.kernel_map is not None:
                    if self.common_block_size is not None:
                        args = ([group.backend], [group.kv_cache_spec]) if self.select_takes_specs else ([group.backend],)
                        size = self.common_block_size.obj(size, *args)
                    if size != group.kv_cache_spec.block_size:
                        group.kernel_block_size = size
                used[index] = size
        return used


def _obj(found: Any) -> Any:
    return None if found is None else found.obj


def allocation_platforms(allocate: Any) -> tuple[str, ...]:
    """"cuda", and "rocm" where the allocation asks the platform whether it is ROCm (from 0.29 it pads the backing buffer there)."""
    names = _allocation_names(allocate)
    return ("cuda", "rocm") if "is_rocm" in names and "current_platform" in names else ("cuda",)


def _allocation_names(allocate: Any) -> set[str]:
    """The names the allocation's code reads, and those of its module's functions it calls (0.34 asks in
    _allocate_kv_cache_buffer)."""
    function = inspect.unwrap(allocate)
    names = set(function.__code__.co_names)
    helpers = [function.__globals__.get(name) for name in names]
    for helper in helpers:
        if inspect.isfunction(helper) and helper.__module__ == function.__module__:
            names |= set(helper.__code__.co_names)
    return names


def _rocm_helpers(allocate: Any) -> list[str]:
    namespace = inspect.unwrap(allocate).__globals__
    return [name for name in sorted(_allocation_names(allocate)) if "rocm" in name and name != "is_rocm" and callable(namespace.get(name))]


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


class _RocmAnswers:
    """vLLM's current_platform, except that it is ROCm."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def is_rocm(self) -> bool:
        return True

    def is_cuda(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)


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
    return replace(declared, page_size_padded=pages.unpadded_bytes(declared, declared.block_size) + margin)
