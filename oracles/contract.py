"""The vLLM contracts the oracle knows, and what differs between them (kept in this one place).

A target adapter names the contract its vLLM generation follows; the oracle derives the expected
layout from the case and that contract only. Contracts change where vLLM's documented behaviour
changed, not where its code was merely refactored:

- layout-placed (0.29-0.31): every layer is a [B, H, N, C] view placed by a KVCacheLayout;
  compression is tokens_per_state; kernel blocks split only dense pages.
- layout-placed+kernel-map (0.32+): as above, and a compressed single-head cache packed
  block-outermost is viewed in kernel pages numbered b * kernel_stride + j.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Contract:
    name: str
    # [B, H, N, C] views placed by KVCacheLayout with explicit offset / layer / block strides.
    layout_placed: bool = True
    # map_kv_caches_to_kernel_blocks: packed compressed caches get strided kernel-page views.
    packed_kernel_map: bool = False


LAYOUT_PLACED = Contract(name="layout-placed")
LAYOUT_PLACED_KERNEL_MAP = Contract(name="layout-placed+kernel-map", packed_kernel_map=True)

CONTRACTS = {c.name: c for c in (LAYOUT_PLACED, LAYOUT_PLACED_KERNEL_MAP)}
