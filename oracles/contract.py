"""The vLLM layout contracts the oracle knows, and what differs between them (kept in this one place).

A target adapter names the contract its vLLM follows; the oracle derives the expected layout
from the case and that contract alone. A contract changes where vLLM's intended behaviour
changed, not where its code was merely refactored; a release whose code breaks its own
contract is a finding, not a new contract.

Backend-shaped contracts (vLLM <= 0.28, `_reshape_kv_cache`): each layer has raw buffers of its
own (layers of different KV-cache groups share the i-th buffer: the hybrid allocator's pools),
a buffer holds `num_blocks` pages, and the layer's view is the shape its backend declares for
(kernel blocks, stored slots per kernel block, heads, head size), laid out densely in the
backend's stride order. A padded page widens the block pitch (the block axis must then be
outermost). A buffer shared with Mamba state keeps block b inside page b (block axis hoisted
outermost), since Mamba addresses its state by page.

- shaped-0.19  0.19: the shape counts tokens per block; no padding, no Mamba, no kernel split.
- shaped-0.20  0.20: the shape counts stored slots (block_size / compress_ratio); padded pages.
- shaped-0.21  0.21: Mamba layers get one view per state tensor, packed inside each page.
- shaped-0.22  0.22-0.26: views address kernel blocks (block_size / kernel_block_size per
               block); a compressed cache keeps its stored block as its kernel block.
- shaped-0.27  0.27-0.28: a Mamba layer gets one int8 view of whole pages.

Layout-placed contracts (vLLM >= 0.29): every layer is a [B, H, N, C] view placed by a
KVCacheLayout with explicit offset / layer / block strides on one backing buffer; compression is
tokens_per_state and compressed caches split into kernel blocks too; only dense pages split.

- placed-0.29  0.29-0.31.
- placed-0.32  0.32+: a compressed single-head cache packed block-outermost is viewed in kernel
               pages numbered b * kernel_stride + j (map_kv_caches_to_kernel_blocks). 0.33 and 0.34
               keep it: the planner moved (v1/core/kv_cache_planning.py), the views did not change.

Quantized pages, every contract: a cache dtype's page is what its definition says one token of one
KV head occupies (oracles/dtypes.py: element bytes, packing, scale bytes per token and head, each
with the vLLM description it comes from). Who computes it in vLLM changed, not what it is: 0.20-0.27
specs add the per-token-head scales themselves (2 * block * heads * 4 bytes before padding,
kv_cache_interface.AttentionSpec.page_size_bytes) and size NVFP4 / INT4 elements from kv_quant_mode;
from 0.28 the producer publishes the content (a backend's customize_spec, e.g. Triton "Per-token-head
modes pack inline fp32 scales after each head's data"; the MLA layer's DeepSeek record sizes).
Before 0.29 the backend's declared shape must cover that page; from 0.29 the published content is
placed as is. 0.33 adds cache dtypes registered by platforms (vllm/config/cache.py,
KVCacheDTypeHandler): a storage dtype and a quant mode, so a registered dtype's page is its storage
elements, and the spec must carry the quant mode its handler returns.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Contract:
    name: str
    layout_placed: bool = False
    # Backend-shaped: the block argument of get_kv_cache_shape counts "tokens" or stored "slots".
    shape_block: str = "slots"
    kernel_split: bool = False
    padded_pages: bool = False
    # "none" (no Mamba support), "per-state" (a list of state views), "page-bytes" (one int8 view).
    mamba_views: str = "none"
    # Layout-placed 0.32+: packed compressed caches get strided kernel-page views.
    packed_kernel_map: bool = False


SHAPED_019 = Contract(name="shaped-0.19", shape_block="tokens")
SHAPED_020 = Contract(name="shaped-0.20", padded_pages=True)
SHAPED_021 = Contract(name="shaped-0.21", padded_pages=True, mamba_views="per-state")
SHAPED_022 = Contract(name="shaped-0.22", padded_pages=True, mamba_views="per-state", kernel_split=True)
SHAPED_027 = Contract(name="shaped-0.27", padded_pages=True, mamba_views="page-bytes", kernel_split=True)
LAYOUT_PLACED = Contract(name="placed-0.29", layout_placed=True)
LAYOUT_PLACED_KERNEL_MAP = Contract(name="placed-0.32", layout_placed=True, packed_kernel_map=True)

CONTRACTS = {c.name: c for c in (SHAPED_019, SHAPED_020, SHAPED_021, SHAPED_022, SHAPED_027, LAYOUT_PLACED, LAYOUT_PLACED_KERNEL_MAP)}
