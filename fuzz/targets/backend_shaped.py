"""Adapter for vLLM 0.19 - 0.28: `_reshape_kv_cache` in vllm/v1/worker/gpu/attn_utils.py.

Four signatures of the same function, told apart by its parameters rather than the version:
- G1 (0.19-0.21) `(kv_cache_config, kv_cache_raw_tensors, attn_backends, cache_dtype)`;
- G2 (0.22) adds `kernel_block_sizes, shared_kv_cache_layers`;
- G3 (0.23) `(attn_groups, kv_cache_raw_tensors, cache_dtype, kernel_block_sizes, shared_kv_cache_layers)`;
- G4 (0.24-0.28) G3 plus `kv_cache_config`.
The contract (oracles/contract.py) is probed from what the release offers: compressed storage
blocks, kernel-block splitting, how Mamba layers are viewed.

Each backend declares its cache shape and stride order; declare_group records both in the case
(the shape as a pattern in B, T, H, D found by asking the backend at two sentinel sizes) so the
oracle can evaluate the declaration at the arguments the contract says are right.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch

import oracles
from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend, evaluate_shape, parse_shape_entry, replace
from fuzz.errors import Inexpressible, TargetError
from fuzz.targets.base import BackendInfo
from fuzz.targets.common import Adapter, Made, unique_buffers
from fuzz.targets.entry_points import Probe
from fuzz.targets.synthetic import published_state
from oracles import pages
from oracles.contract import SHAPED_019, SHAPED_020, SHAPED_021, SHAPED_022, SHAPED_023, SHAPED_024, SHAPED_027, Contract

# Sentinels for reading a declared shape: a block count no axis has by chance, and two slot
# counts (multiples of 16, which some backends require).
PROBE_BLOCKS = 1_000_003
PROBE_SLOTS = (16 * 61, 16 * 67)


def probe(entry_points: Probe) -> bool:
    """Whether the loaded vLLM views raw buffers through backend-declared shapes (_reshape_kv_cache)."""
    return entry_points.find("legacy reshape") is not None


class BackendShapedTarget(Adapter):
    def __init__(self, entry_points: Probe) -> None:
        reshape = entry_points.find("legacy reshape")
        allocate = entry_points.find("legacy allocation")
        if reshape is None or allocate is None:
            entry_points.get("legacy reshape" if reshape is None else "legacy allocation")
        assert reshape is not None and allocate is not None
        self.reshape, self.allocate = reshape, allocate
        self.attn_utils = importlib.import_module(reshape.module)
        hint = entry_points.find("legacy layout hint")
        self.set_layout = None if hint is None else hint.obj
        params = list(reshape.parameters)
        if not params or params[0] not in ("attn_groups", "kv_cache_config"):
            raise TargetError(f"vLLM's {reshape.where} takes ({', '.join(params)}), which fits none of the generations kvfuzz knows (G1-G4)")
        self.takes_groups = params[0] == "attn_groups"
        self.takes_kernel_sizes = reshape.takes("kernel_block_sizes")
        self.takes_config = self.takes_groups and reshape.takes("kv_cache_config")
        self.allocate_takes_sharing = allocate.takes("shared_layers")
        self.generation = ("G4" if self.takes_config else "G3") if self.takes_groups else ("G2" if self.takes_kernel_sizes else "G1")
        self.contract = self._probe_contract(entry_points)
        super().__init__(entry_points)
        if self.attention_group is None:
            raise TargetError(f"vLLM {self.vllm_version}: {entry_points.missing('AttentionGroup')}; {reshape.where} needs it")
        if not reshape.takes("shared_kv_cache_layers"):
            self.off["kv-sharing"] = f"{reshape.where} takes no shared_kv_cache_layers; cases with KV-sharing layers are not drawn"
        # A backend's declaration depends only on these arguments: ask it once per combination.
        self._declared: dict[tuple[Any, ...], tuple[tuple[int | str, ...], tuple[int, ...]]] = {}
        # Every release plans a group of same-type layers with different hidden sizes (UniformTypeKVCacheSpecs); 0.23 also
        # several such groups (DeepSeek V4: buffers by page size, contract page_buckets), 0.24 - 0.28 pack them in slabs,
        # as they do cross-layer blocks.
        packings = ("none",)
        if self.contract.packing != "none" and self.transfer_config is not None:
            packings += ("cross_layers",)
        if self.uniform_specs is not None:
            packings += ("uniform_type",)
        self.info = self.target_info(self.contract, ("NHD", "HND"), packings=packings, attention_free=True)

    def _probe_contract(self, entry_points: Probe) -> Contract:
        mamba_lists = hasattr(self.attn_utils, "_update_hybrid_attention_layout")
        if self.takes_kernel_sizes:
            if not mamba_lists:
                return SHAPED_027
            # The planner can pack layers into per-block slabs (a KVCacheTensor with an offset and a block stride, 0.24+).
            tensor = entry_points.find("KVCacheTensor")
            packs = tensor is not None and "block_stride" in {f.name for f in dataclasses.fields(tensor.obj)}
            if packs:
                return SHAPED_024
            # 0.23's planner buckets every group's layers by page size; 0.20 - 0.22 only group 0's page sizes.
            planner = entry_points.find("planner")
            buckets = planner is not None and hasattr(importlib.import_module(planner.module), "_bucket_layers_by_page_size")
            return SHAPED_023 if buckets else SHAPED_022
        if not hasattr(entry_points.get("KVCacheSpec"), "storage_block_size"):
            return SHAPED_019
        return SHAPED_021 if mamba_lists else SHAPED_020

    def supports_kind(self, kind: str) -> bool:
        # Encoder-only groups get no view from 0.23 on (they fall out of the kernel-size list). Mamba layers are drawn where
        # either runner builds their views (0.19 - 0.20: the V1 runner only).
        if kind == "mamba":
            v1 = oracles.runner_contract(self.contract, "v1")
            return self.contract.mamba_views != "none" or (self.v1 is not None and v1.mamba_views != "none")
        return kind != "encoder_only"

    def usable_backend(self, name: str, cls: type) -> bool:
        return hasattr(cls, "get_kv_cache_shape")

    def describe_backend(self, name: str, cls: type) -> BackendInfo:
        required = getattr(cls, "get_required_kv_cache_layout", lambda: None)()
        info = self.base_backend_info(name, cls, layouts=None if required is None else (required,))
        # Before 0.29 a backend learns the V head size only from the model (set_head_size_v, DiffKV): only such a
        # backend's declared shape can hold K and V heads of different sizes.
        sets_value_heads = hasattr(cls, "set_head_size_v")
        return BackendInfo(**{**info.__dict__, "kv_first": self._kv_first(cls, info.is_mla), "sets_value_heads": sets_value_heads})

    def _kv_first(self, cls: type, is_mla: bool) -> bool:
        try:
            pattern, order = self._declaration(cls, heads=1 if is_mla else 2, head_size=64, cache_dtype="auto")
        except Exception:  # noqa: BLE001 - a backend we cannot read is treated as blocks-first
            return False
        block_axis = next((i for i, e in enumerate(pattern) if parse_shape_entry(e)[1] == "B"), None)
        return block_axis is not None and bool(order) and order[0] != block_axis

    def implied(self, spec: SpecCase, field: str) -> bool:
        # Before 0.28 the fp8_ds_mla cache dtype itself fixes the bytes per stored token.
        return field == "state_content_bytes" and spec.cache_dtype == "fp8_ds_mla"

    def unsupported(self, case: Case) -> str | None:
        reason = super().unsupported(case)
        if reason is not None:
            return reason
        dtypes = {g.spec.cache_dtype for g in case.groups if g.spec.is_attention}
        if len(dtypes) > 1:
            return "field cache_dtype: this vLLM takes one cache dtype for every layer"
        for group in case.groups:
            if group.synthetic_backend is not None and group.synthetic_backend.shape is None and group.spec.is_attention:
                return "field synthetic_backend.shape: this vLLM's backends declare their cache shape, and this synthetic one declares none"
            definition = pages.dtype_definition(group.spec)
            if group.synthetic_backend is not None and group.spec.is_attention and definition is not None and not definition.plain \
                    and (group.spec.is_mla or pages.half_elements(group.spec) is None):
                # A synthetic backend declares one head's K and V apart, in whole storage elements each, and a plain latent.
                return f"cache dtype {group.spec.cache_dtype}: a synthetic backend's declared shape cannot hold it here"
        return None

    def synthetic_namespace(self, backend: SyntheticBackend) -> dict[str, Any]:
        pattern = backend.shape or ("B", 2, "T", "H", "D")
        order = tuple(backend.stride_order) if backend.stride_order is not None else tuple(range(len(pattern)))

        mla = "H" not in {parse_shape_entry(entry)[1] for entry in pattern}

        def shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
            # Its head dim holds one head's K (or V; MLA: the latent) in storage elements, as the cache dtype stores it.
            storage = self.info.cache_dtypes.get(cache_dtype_str)
            head = head_size
            if storage is not None:
                stored = SpecCase(kind="mla" if mla else "full", block_size=block_size, head_size=head_size, dtype=storage,
                                  cache_dtype=cache_dtype_str)
                head = pages.half_elements(stored) or head_size
            return evaluate_shape(pattern, blocks=num_blocks, slots=block_size, heads=num_kv_heads, head_size=head)

        return {
            "get_kv_cache_shape": staticmethod(shape),
            "get_kv_cache_stride_order": staticmethod(lambda include_num_layers_dimension=False: order),
        }

    # ------------------------------------------------------------------ declarations

    def layer_cache_dtype(self, spec: SpecCase) -> str:
        return spec.cache_dtype

    def declare_group(self, group: GroupCase, layout: str) -> GroupCase:
        if not group.spec.is_attention:
            return group
        if group.synthetic_backend is not None:
            return self._published_by_synthetic(group)
        group = self._customized(group)
        value_head = self._set_value_head_size(group)
        key = (group.backend, group.spec.num_kv_heads, group.spec.head_size, self.layer_cache_dtype(group.spec), layout, value_head)
        declared = self._declared.get(key)
        if declared is None:
            self.configure_layout(layout)
            declared = self._declared[key] = self._declaration(self.backend_class(group), *key[1:4])
        return replace(group, declared_shape=declared[0], declared_stride_order=declared[1])

    def _set_value_head_size(self, group: GroupCase) -> int | None:
        """Backends for models whose V heads differ from K heads (DiffKV) read the V head size from a
        class attribute the model sets (set_head_size_v) rather than from their arguments; set it as
        the model does, for this case, before the backend is asked or used."""
        backend = self.backend_class(group)
        setter = getattr(backend, "set_head_size_v", None)
        if setter is None:
            return None
        value_head = group.spec.head_size_v if group.spec.head_size_v is not None else group.spec.head_size
        setter(value_head)
        return value_head

    def _published_by_synthetic(self, group: GroupCase) -> GroupCase:
        """A synthetic backend publishes state bytes where the release's specs carry them (0.28), as its real ones do."""
        if "state_content_bytes" not in self.spec_fields(self.spec_classes[group.spec.kind]):
            return group
        return replace(group, spec=published_state(group.spec))

    def _customized(self, group: GroupCase) -> GroupCase:
        """The fields the backend publishes for its spec (customize_spec, 0.28): state content and slots."""
        backend = self.backend_class(group)
        fields = self.spec_fields(self.spec_classes[group.spec.kind])
        if backend is None or not hasattr(backend, "customize_spec") or "state_content_bytes" not in fields:
            return group
        custom = backend.customize_spec(self.build_spec(group.spec))
        return replace(group, spec=replace(group.spec, state_content_bytes=custom.state_content_bytes, num_head_slots=custom.num_head_slots))

    def _declaration(self, backend: Any, heads: int, head_size: int, cache_dtype: str) -> tuple[tuple[int | str, ...], tuple[int, ...]]:
        first, second = (tuple(backend.get_kv_cache_shape(PROBE_BLOCKS, slots, heads, head_size, cache_dtype_str=cache_dtype))
                         for slots in PROBE_SLOTS)
        pattern: list[int | str] = []
        for a, b in zip(first, second, strict=True):
            if a == b and a >= PROBE_BLOCKS and a % PROBE_BLOCKS == 0:
                pattern.append("B" if a == PROBE_BLOCKS else f"{a // PROBE_BLOCKS}*B")
            elif a == b:
                pattern.append(int(a))
            elif a % PROBE_SLOTS[0] == 0 and b % PROBE_SLOTS[1] == 0 and a // PROBE_SLOTS[0] == b // PROBE_SLOTS[1]:
                factor = a // PROBE_SLOTS[0]
                pattern.append("T" if factor == 1 else f"{factor}*T")
            else:
                raise Inexpressible(f"cannot read the cache shape {first} as a pattern in blocks and slots")
        try:
            order = tuple(int(i) for i in backend.get_kv_cache_stride_order())
        except (AttributeError, NotImplementedError):
            order = tuple(range(len(pattern)))
        # Recorded as declared: whether there is one block axis and the order fits is the oracle's to judge.
        return tuple(pattern), order

    def configure_layout(self, layout: str) -> None:
        if self.set_layout is not None:
            self.set_layout(layout)

    # ------------------------------------------------------------------ the call under test

    def make_views(self, case: Case, config: Any, attn_groups: list[list[Any]], kernel_block_sizes: list[int],
                   device: torch.device) -> Made:
        sharing = dict(case.kv_sharing)
        allocate = self.allocate.obj
        raw = allocate(config, sharing, device) if self.allocate_takes_sharing else allocate(config, device)
        cache_dtype = next((g.spec.cache_dtype for g in case.groups if g.spec.is_attention), "auto")
        reshape = self.reshape.obj
        if self.takes_groups:
            kwargs: dict[str, Any] = {"kv_cache_config": config} if self.takes_config else {}
            views = reshape(attn_groups=[g for groups in attn_groups for g in groups], kv_cache_raw_tensors=raw, cache_dtype=cache_dtype,
                            kernel_block_sizes=kernel_block_sizes, shared_kv_cache_layers=sharing, **kwargs)
        else:
            backends = {name: g.backend for groups in attn_groups for g in groups for name in g.layer_names
                        if isinstance(g.kv_cache_spec, self.attention_spec)}
            args = (kernel_block_sizes, sharing) if self.takes_kernel_sizes else ()
            views = reshape(config, raw, backends, cache_dtype, *args)
        buffers = unique_buffers(raw[n] for t in config.kv_cache_tensors for n in t.shared_by if n in raw)
        return Made(views, buffers)
