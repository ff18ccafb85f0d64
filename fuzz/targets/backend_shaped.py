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

import inspect
from dataclasses import replace
from typing import Any

import torch

from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend, evaluate_shape, parse_shape_entry
from fuzz.errors import Inexpressible, TargetError
from fuzz.targets.base import BackendInfo
from fuzz.targets.calls import entry_parameters
from fuzz.targets.common import Adapter, unique_buffers
from oracles.contract import SHAPED_019, SHAPED_020, SHAPED_021, SHAPED_022, SHAPED_027, Contract

# Cache dtypes whose page the backend-shaped contract derives without per-release quantization
# rules (scale bytes, packed nibbles); the others are left to the layout-placed generations.
PLAIN_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")
# Sentinels for reading a declared shape: a block count no axis has by chance, and two slot
# counts (multiples of 16, which some backends require).
PROBE_BLOCKS = 1_000_003
PROBE_SLOTS = (16 * 61, 16 * 67)


def probe() -> bool:
    import vllm.v1.worker.gpu.attn_utils as attn_utils

    return hasattr(attn_utils, "_reshape_kv_cache")


class BackendShapedTarget(Adapter):
    def __init__(self) -> None:
        import vllm.v1.worker.gpu.attn_utils as attn_utils
        from vllm.v1.attention.backends.utils import set_kv_cache_layout

        self.attn_utils = attn_utils
        self.set_layout = set_kv_cache_layout
        params = entry_parameters(attn_utils._reshape_kv_cache, "_reshape_kv_cache")
        if params[0] not in ("attn_groups", "kv_cache_config"):
            raise TargetError(f"vLLM's _reshape_kv_cache{inspect.signature(attn_utils._reshape_kv_cache)} fits none of the "
                              "generations kvfuzz knows (G1-G4)")
        self.takes_groups = params[0] == "attn_groups"
        self.takes_kernel_sizes = "kernel_block_sizes" in params
        self.takes_config = self.takes_groups and "kv_cache_config" in params
        self.allocate_takes_sharing = "shared_layers" in entry_parameters(attn_utils._allocate_kv_cache, "_allocate_kv_cache")
        self.generation = ("G4" if self.takes_config else "G3") if self.takes_groups else ("G2" if self.takes_kernel_sizes else "G1")
        self.contract = self._probe_contract()
        super().__init__()
        # A backend's declaration depends only on these arguments: ask it once per combination.
        self._declared: dict[tuple[Any, ...], tuple[tuple[int | str, ...], tuple[int, ...]]] = {}
        self.info = self.target_info(self.contract, ("NHD", "HND"), kv_sharing=self.takes_kernel_sizes)

    def _probe_contract(self) -> Contract:
        from vllm.v1.kv_cache_interface import KVCacheSpec

        mamba_lists = hasattr(self.attn_utils, "_update_hybrid_attention_layout")
        if self.takes_kernel_sizes:
            return SHAPED_022 if mamba_lists else SHAPED_027
        if not hasattr(KVCacheSpec, "storage_block_size"):
            return SHAPED_019
        return SHAPED_021 if mamba_lists else SHAPED_020

    def supports_kind(self, kind: str) -> bool:
        # Encoder-only groups get no view from 0.23 on (they fall out of the kernel-size list).
        return kind != "encoder_only" and (kind != "mamba" or self.contract.mamba_views != "none")

    def usable_backend(self, name: str, cls: type) -> bool:
        return hasattr(cls, "get_kv_cache_shape")

    def describe_backend(self, name: str, cls: type) -> BackendInfo:
        required = getattr(cls, "get_required_kv_cache_layout", lambda: None)()
        info = self.base_backend_info(name, cls, layouts=None if required is None else (required,))
        plain = tuple(c for c in info.cache_dtypes if c in PLAIN_CACHE_DTYPES)
        return BackendInfo(**{**info.__dict__, "cache_dtypes": plain or ("auto",), "kv_first": self._kv_first(cls, info.is_mla)})

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
            return "this vLLM takes one cache dtype for every layer"
        if dtypes and not dtypes <= set(PLAIN_CACHE_DTYPES):
            return f"cache dtype {dtypes.pop()} needs per-release quantization rules"
        return None

    def synthetic_namespace(self, backend: SyntheticBackend) -> dict[str, Any]:
        pattern = backend.shape or ("B", 2, "T", "H", "D")
        order = tuple(backend.stride_order) if backend.stride_order is not None else tuple(range(len(pattern)))

        def shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
            return evaluate_shape(pattern, blocks=num_blocks, slots=block_size, heads=num_kv_heads, head_size=head_size)

        return {
            "get_kv_cache_shape": staticmethod(shape),
            "get_kv_cache_stride_order": staticmethod(lambda include_num_layers_dimension=False: order),
        }

    # ------------------------------------------------------------------ declarations

    def layer_cache_dtype(self, spec: SpecCase) -> str:
        return spec.cache_dtype

    def declare_group(self, group: GroupCase, layout: str) -> GroupCase:
        if not group.spec.is_attention or group.synthetic_backend is not None:
            return group
        key = (group.backend, group.spec.num_kv_heads, group.spec.head_size, self.layer_cache_dtype(group.spec), layout)
        declared = self._declared.get(key)
        if declared is None:
            self.configure_layout(layout)
            declared = self._declared[key] = self._declaration(self.backend_class(group), *key[1:4])
        return replace(group, declared_shape=declared[0], declared_stride_order=declared[1])

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
        self.set_layout(layout)

    # ------------------------------------------------------------------ the call under test

    def make_views(self, case: Case, config: Any, attn_groups: list[list[Any]], kernel_block_sizes: list[int],
                   device: torch.device) -> tuple[dict[str, Any], list[torch.Tensor]]:
        sharing = dict(case.kv_sharing)
        allocate = self.attn_utils._allocate_kv_cache
        raw = allocate(config, sharing, device) if self.allocate_takes_sharing else allocate(config, device)
        cache_dtype = next((g.spec.cache_dtype for g in case.groups if g.spec.is_attention), "auto")
        reshape = self.attn_utils._reshape_kv_cache
        if self.takes_groups:
            kwargs: dict[str, Any] = {"kv_cache_config": config} if self.takes_config else {}
            views = reshape(attn_groups=[g for groups in attn_groups for g in groups], kv_cache_raw_tensors=raw, cache_dtype=cache_dtype,
                            kernel_block_sizes=kernel_block_sizes, shared_kv_cache_layers=sharing, **kwargs)
        else:
            backends = {name: g.backend for groups in attn_groups for g in groups for name in g.layer_names
                        if isinstance(g.kv_cache_spec, self.kv.AttentionSpec)}
            args = (kernel_block_sizes, sharing) if self.takes_kernel_sizes else ()
            views = reshape(config, raw, backends, cache_dtype, *args)
        buffers = unique_buffers(raw[n] for t in config.kv_cache_tensors for n in t.shared_by if n in raw)
        return views, buffers
