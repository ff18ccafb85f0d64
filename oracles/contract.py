"""The vLLM layout contracts the oracle knows: every design choice of vLLM's, stated once, with its source.

The oracle derives a case's expected layout from what the case means (pages of heads x states x
content bytes, nested in the order a layout names) and from the rules below. Each rule is a
design choice vLLM made and documented (a docstring, a code comment stating the intent, a test,
a design note or pull request); `RULES` lists them with that source, quoted. A rule is never a
restatement of how vLLM computes something: where vLLM's code and its stated intent differ, the
rule follows the intent and the difference is a finding.

A target adapter names the contract its vLLM follows. A contract changes where vLLM's intended
behaviour changed, not where its code was merely refactored; a release whose code breaks its own
contract is a finding, not a new contract.

Backend-shaped contracts (vLLM <= 0.28, `_reshape_kv_cache`): each layer has raw buffers of its
own (layers of different KV-cache groups share the i-th buffer: the hybrid allocator's pools),
a buffer holds `num_blocks` pages, and the layer's view is the shape its backend declares for
(kernel blocks, stored slots per kernel block, heads, head size), laid out densely in the
backend's stride order.

- shaped-0.19  0.19: the shape counts tokens per block; no padding, no Mamba, no kernel split.
- shaped-0.20  0.20: the shape counts stored slots (block_size / compress_ratio); padded pages.
- shaped-0.21  0.21: Mamba layers get one view per state tensor, packed inside each page.
- shaped-0.22  0.22: views address kernel blocks (block_size / kernel_block_size per block); a
               compressed cache keeps its stored block as its kernel block.
- shaped-0.23  0.23: 0.22's, and several UniformTypeKVCacheSpecs groups (DeepSeek V4) get one
               buffer per (page size, slot) whatever their page sizes (0.20 - 0.22 assume every
               group's pages are among group 0's sizes, which the model's own grouping pads to).
- shaped-0.24  0.24-0.26: 0.22's, and the planner may pack layers into one per-block slab (the
               cross-layer-blocks connector setting, DeepSeek V4's UniformTypeKVCacheSpecs groups):
               one slot per (page size, layer index), buckets side by side (oracles/packing.py).
- shaped-0.27  0.27-0.28: a Mamba layer gets one int8 view of whole pages; packed slabs lay each
               group out densely from byte 0 (groups overlap: a block id belongs to one group).

The V1 model runner (GPUModelRunner, which CPUModelRunner subclasses) has reshape code of its own up
to 0.28. It addressed kernel blocks before the V2 runner did, so for 0.19 - 0.21 it follows contracts
of its own: shaped-0.19-v1 (0.19's, split into kernel blocks) and shaped-0.20-v1 (0.20's, split);
from 0.21 its contract is the V2 runner's of the same release (0.21's V1 is shaped-0.22 less packing,
which 0.21 does not have). A case run by both runners is judged against each one's contract, and
the two runners' layouts against each other (fuzz/verdict/runners.py).

Layout-placed contracts (vLLM >= 0.29): every layer is a [B, H, N, C] view placed by a
KVCacheLayout on one backing buffer; compression is tokens_per_state.

- placed-0.29  0.29-0.31: a manager block splits into kernel blocks only in place, as equal
               pieces of one dense page; 0.31 adds an integer block_stride_alignment.
- placed-0.32  0.32+: block_stride_alignment may name whole kernel blocks (MultipleOf); a packed
               block-outermost cache is never split in place, and a compressed single-head one is
               viewed in kernel pages numbered b * kernel_stride + j. 0.33 and 0.34 keep it: the
               planner moved (v1/core/kv_cache_planning.py), the views did not change.

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

import math
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., object])


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
    # Layout-placed 0.32+: packed compressed caches get strided kernel-page views, and
    # block_stride_alignment may be given in whole kernel blocks.
    packed_kernel_map: bool = False
    # Backend-shaped 0.24+: how the planner packs layers into per-block slabs when asked ("none",
    # "bucketed" 0.24-0.26, "per-group" 0.27-0.28).
    packing: str = "none"
    # Backend-shaped 0.23: several groups of UniformTypeKVCacheSpecs (DeepSeek V4) get one buffer per (page size,
    # slot), whatever their page sizes (`page_bucket_pools`); 0.20 - 0.22 bucket only group 0's page sizes.
    page_buckets: bool = False


SHAPED_019 = Contract(name="shaped-0.19", shape_block="tokens")
SHAPED_020 = Contract(name="shaped-0.20", padded_pages=True)
SHAPED_021 = Contract(name="shaped-0.21", padded_pages=True, mamba_views="per-state")
SHAPED_022 = Contract(name="shaped-0.22", padded_pages=True, mamba_views="per-state", kernel_split=True)
SHAPED_023 = Contract(name="shaped-0.23", padded_pages=True, mamba_views="per-state", kernel_split=True, page_buckets=True)
SHAPED_024 = Contract(name="shaped-0.24", padded_pages=True, mamba_views="per-state", kernel_split=True, packing="bucketed")
SHAPED_027 = Contract(name="shaped-0.27", padded_pages=True, mamba_views="page-bytes", kernel_split=True, packing="per-group")
# The V1 runner of 0.19 - 0.20 builds Mamba views (GPUModelRunner._reshape_kv_cache_tensors, `elif isinstance(kv_cache_spec,
# MambaSpec)`: one tensor per state, `target_stride = (num_element_per_page, ...)` over `page_size_bytes`, which counts
# MambaSpec.page_size_padded) a release before its V2 runner does (0.21): its contracts have 0.21's per-state Mamba views,
# and 0.19's the padded Mamba pages its MambaSpec has (its attention specs have no padding field to draw).
SHAPED_019_V1 = Contract(name="shaped-0.19-v1", padded_pages=True, mamba_views="per-state", kernel_split=True)
SHAPED_020_V1 = Contract(name="shaped-0.20-v1", padded_pages=True, mamba_views="per-state", kernel_split=True)
LAYOUT_PLACED = Contract(name="placed-0.29", layout_placed=True)
LAYOUT_PLACED_KERNEL_MAP = Contract(name="placed-0.32", layout_placed=True, packed_kernel_map=True)

CONTRACTS = {c.name: c for c in (SHAPED_019, SHAPED_020, SHAPED_021, SHAPED_022, SHAPED_023, SHAPED_024, SHAPED_027,
                                 SHAPED_019_V1, SHAPED_020_V1,
                                 LAYOUT_PLACED, LAYOUT_PLACED_KERNEL_MAP)}


# ------------------------------------------------------------------ the rules and their sources


@dataclass(frozen=True)
class Rule:
    name: str
    statement: str  # the rule in one sentence (the function's docstring)
    source: str  # where vLLM states it: file / function / test / PR, with a short quote


RULES: dict[str, Rule] = {}


def rule(source: str) -> Callable[[F], F]:
    """Register a design choice of vLLM's with the place vLLM states it."""

    def register(function: F) -> F:
        doc = (function.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        RULES[function.__name__] = Rule(function.__name__, doc, source)
        return function

    return register


# --- what a page holds (both contract families)


@rule("vllm/v1/kv_cache_interface.py AttentionSpec (0.28+): num_head_slots is 'H of the logical [B, H, N, C] page when packing "
      "diverges from one slot per KV head ... Published by the backend'; state_content_bytes is 'C in bytes when packed; None "
      "means dense K/V content'; state_content_size_bytes: 'Bytes per (head slot, stored state) cell of the page'; vLLM test "
      "tests/v1/worker/test_attn_utils.py::test_reshape_padded_kv_cache_strides_by_padded_page: 'Content dim packs K and V: 2 * head_size'")
def state_content_bytes(published: int | None, head_size: int, head_size_v: int, element_size: int) -> int:
    """A state holds the backend's published content, else K then V of one head slot, side by side."""
    return published if published is not None else (head_size + head_size_v) * element_size


@rule("vllm/v1/kv_cache_interface.py MLAAttentionSpec (0.28+): 'MLA stores a single latent vector per state; there is no "
      "separate V.' (head_size_v = 0; before 0.28 the MLA page formula counts head_size only)")
def mla_value_head(is_mla: bool, head_size: int) -> int:
    """The value head size a spec without an explicit one stores: none for MLA (one latent), head_size otherwise."""
    return 0 if is_mla else head_size


@rule("vllm/v1/kv_cache_interface.py AttentionSpec.tokens_per_state (0.29+): 'Tokens covered by one stored state. Ints > 1 "
      "compress multiple tokens into one state (DSv4 sparse MLA)'; compress_ratio / storage_block_size before 0.29")
def states_per_block(block_size: int, tokens_per_state: int) -> int:
    """A block of block_size tokens stores block_size / tokens_per_state states per head slot."""
    return block_size // tokens_per_state


@rule("vllm/v1/kv_cache_interface.py MambaSpec (0.29+): tokens_per_state = -1 and one head: a Mamba block holds one state, "
      "the concatenated state tensors, viewed as bytes (0.27+: 'each gets one int8 view')")
def mamba_page(state_bytes: list[int]) -> int:
    """A Mamba block holds one state: its state tensors back to back, as raw bytes."""
    return sum(state_bytes)


@rule("vllm/v1/kv_cache_interface.py _apply_alignment_padding (0.20+, MLAAttentionSpec / SlidingWindowMLASpec): the page is "
      "rounded up to `alignment` and recorded as page_size_padded; AttentionSpec.page_size_bytes: a set page_size_padded is the "
      "page size (asserted >= the unpadded page)")
def padded_page(unpadded: int, alignment: int | None, page_size_padded: int | None) -> tuple[int, bool]:
    """(page bytes, padded): an MLA alignment rounds the page up; an explicit padded size replaces it. A page counts as padded
    whenever a padded size is set, even one equal to the page (vLLM then takes the padded-page path)."""
    if alignment is not None and -(-unpadded // alignment) * alignment != unpadded:
        return -(-unpadded // alignment) * alignment, True
    if page_size_padded is not None:
        return page_size_padded, True
    return unpadded, False


# --- layout-placed contracts: where pages go


@rule("vllm/v1/kv_cache_layout.py KVCacheLayout: 'Each member's value is a stride permutation that maps logical axes to "
      "physical (memory) order' over the logical [L, B, H, N, <content>] (RFC #42082, PR #51718); is_block_compact: 'each "
      "page's [H, N, C] bytes form one contiguous run; i.e. the L and B dimensions are outermost'")
def page_grid_end(order: str) -> int:
    """The page grid is the layout's axes up to the last of L and B; the axes after it (the page tail) hold one page."""
    return max(order.index("L"), order.index("B"))


@rule("vllm test tests/v1/worker/test_attn_utils.py (module docstring): 'a page_size_padded spec strides the block dimension "
      "by the padded page while keeping per-block content compact, so padding bytes at the end of each page are never "
      "addressed'; kv_cache_interface.compute_layout_strides: 'Page padding requires dimensions outside the page tail to be L, "
      "B, or singleton'")
def padding_fits(order: str, extents: dict[str, int]) -> bool:
    """A padded page widens the pitch of the innermost page-grid axis to the padded size; that needs every axis of the grid
    other than L and B to have size 1 (else padding would fall between the pieces of one page)."""
    return all(extents[axis] == 1 for axis in order[: page_grid_end(order) + 1] if axis not in "LB")


@rule("vllm/v1/core/kv_cache_utils.py get_kv_cache_config_from_groups: 'Groups alias from byte 0. ... block-outer (the same "
      "packing repeats for every block) ... layer-outer (only supported for uniform page sizes or single-group models)'; "
      "_get_kv_cache_bytes_per_block: 'Return the largest cache group's bytes per block'; PR #44577 (DSv4): 'pack all layer "
      "data contiguously per block'")
def block_outermost_pitch(group_bytes_per_block: list[int], alignments: list[int]) -> int:
    """Block-outermost layouts: every group overlays the same blocks from byte 0, one page per layer side by side, and every
    group's block pitch is the largest group's bytes per block, rounded up to every layer's block stride alignment."""
    widest = max(group_bytes_per_block)
    multiple = math.lcm(*alignments) if alignments else 1
    return -(-widest // multiple) * multiple


@rule("vllm/v1/worker/utils.py allocate_kv_cache (0.29+): '``torch.zeros(size, int8)``' of the KVCacheTensors' one shared size; "
      "on ROCm 'Pad to the page granularity MoRIIO needs to register the shared backing as a single RDMA memory region. Other "
      "platforms keep the exact-size allocation (see #53974)', page granularity 4096")
def backing_allocation_bytes(laid_out: int, platform: str) -> int:
    """The one backing buffer holds exactly the bytes the layout spans; on ROCm it is rounded up to whole 4096-byte pages."""
    if platform != "rocm":
        return laid_out
    return -(-laid_out // ROCM_ALLOCATION_GRANULARITY) * ROCM_ALLOCATION_GRANULARITY


ROCM_ALLOCATION_GRANULARITY = 4096


@rule("vllm/v1/core/kv_cache_utils.py get_kv_cache_config_from_groups: 'Attention free models do not have KV cache. Return "
      "num_blocks=1 as BlockPool always needs a null_block.'; vllm/config/cache.py CacheConfig.num_gpu_blocks_override: 'This "
      "overrides the profiled `num_gpu_blocks` if specified'")
def planned_blocks(override: int, attention_free: bool) -> int:
    """Under the block-count override a plan has the override's blocks; a model with no KV cache has one, the block pool's
    null block, and no tensors."""
    return 1 if attention_free else override


@rule("vllm/v1/core/kv_cache_utils.py get_kv_cache_config_from_groups (0.29+): a UniformTypeKVCacheSpecs group ('all layers have "
      "the same type of KV cache but with different hidden sizes') is bucketed by spec (`layers_by_spec[spec].append(layer_name)`, "
      "first seen first), one KVCacheTensor a bucket at `offset=byte_offset`, and 'Block-outer layers share each block; "
      "layer-outer ones own regions'")
def same_spec_runs(layer_specs: Sequence[Hashable]) -> list[list[int]]:
    """A group's layers that differ in size are placed in runs of one spec each, in the order each spec first appears; a run
    starts where the previous run's layers end (inside every block for block-outermost layouts, after its regions otherwise)."""
    runs: dict[Hashable, list[int]] = {}
    for position, spec in enumerate(layer_specs):
        runs.setdefault(spec, []).append(position)
    return list(runs.values())


@rule("vllm/v1/core/kv_cache_utils.py _get_layer_block_stride (0.32): 'A layer-outer block stride: the page padded to its "
      "alignment'; KVCacheSpec.block_stride_alignment (0.31): 'Required byte alignment between physical blocks, including "
      "packed layers'")
def layer_outer_pitch(page_bytes: int, alignment: int) -> int:
    """Layer-outer layouts: each layer owns a region of num_blocks pages; a page is padded up to its block stride alignment."""
    return -(-page_bytes // alignment) * alignment


@rule("vllm/v1/core/kv_cache_utils.py get_kv_cache_config_from_groups (0.32): `assert layout.is_block_compact, f\"{layout.name} "
      "cannot pad pages\"` when a layer-outer page is padded to its block stride alignment")
def alignment_padding_fits(order: str) -> bool:
    """Padding a layer-outer page to its block stride alignment needs a block-compact layout (L and B outermost)."""
    return set(order[:2]) == {"L", "B"}


@rule("vllm/v1/kv_cache_interface.py KVCacheSpec.block_stride_alignment (0.32): '``MultipleOf(n)``: whole kernel blocks, when "
      "blocks are split into kernel blocks of up to ``n`` tokens'; get_block_stride_alignment: 'Bytes the stride between physical "
      "blocks must be a multiple of'; 0.31 takes bytes only, 0.29-0.30 have no such field")
def multiple_of_alignment(block_size: int, kernel_tokens: int, page_of: Callable[[int], int]) -> int:
    """An alignment of MultipleOf(n) is the page of one kernel block of gcd(n, block_size) tokens; none (1) when that kernel
    block is the whole block. 0 when such a kernel block holds no whole state (no stride can be a multiple of it)."""
    tokens = math.gcd(kernel_tokens, block_size)
    return 1 if tokens == block_size else page_of(tokens)


@rule("vllm/v1/core/kv_cache_utils.py validate_kv_cache_layout: 'Mixed page sizes pack pages side by side within a block, which "
      "needs each page to be one contiguous chunk inside its block (a block-compact layout) and, with multiple KV cache groups, "
      "the layer dim inside the block dim'; vllm test tests/v1/attention/test_kv_cache_layout.py::"
      "test_resolve_mixed_hnc_shapes_need_block_compact")
def mixed_pages_fit(order: str, mixed_sizes: bool, mixed_shapes: bool, groups: int) -> bool:
    """Groups whose pages differ in size need a block-compact layout with B outside L when there are several groups; pages
    that differ in (heads, states) shape need a block-compact layout."""
    block_compact = set(order[:2]) == {"L", "B"}
    if mixed_sizes and (not block_compact or (groups > 1 and order[0] == "L")):
        return False
    return not (mixed_shapes and not block_compact)


# --- kernel blocks


@rule("vllm/v1/kv_cache_interface.py compute_layer_kv_cache_shape_bytes: 'Kernel block size {bs} must divide KV cache block "
      "size'; AttentionSpec.tokens_per_state: 'Tokens covered by one stored state' (a state is never cut: get_num_kernel_states "
      "counts whole states per kernel block)")
def kernel_fits(block_size: int, kernel_block_size: int, tokens_per_state: int) -> str | None:
    """A manager block holds a whole number of kernel blocks, and a kernel block a whole number of stored states."""
    if block_size % kernel_block_size:
        return "the kernel block size does not divide the block size"
    if kernel_block_size % tokens_per_state:
        return "a kernel block must hold a whole number of compressed states"
    return None


@rule("vllm/v1/kv_cache_interface.py create_kv_cache_views (0.29+): 'Kernel blocks subdivide a manager block into `ratio` equal "
      "pieces, so they sit a constant stride apart only if a block is one dense page: no padding at its end, and no other layer's "
      "page before the next block'; vllm test tests/v1/worker/test_attn_utils.py::"
      "test_copy_kv_cache_blocks_with_virtual_block_splitting: 'Splitting needs a manager block to be one dense page, which a "
      "block-outermost layout only gives when the block holds one layer'")
def splits_in_place(dense_page: bool) -> bool:
    """A manager block splits in place only when it is one dense page: its bytes one unpadded run, the next block right after."""
    return dense_page


@rule("vllm/v1/kv_cache_interface.py create_kv_cache_views: kernel blocks are 'equal pieces' of the page, viewed through "
      "compute_layout_strides(..., kernel_block_size) over the kernel shape [B * ratio, H, N / ratio, C]; vllm test "
      "test_copy_kv_cache_blocks_with_virtual_block_splitting: manager block 2's kernel blocks start at `2 * physical_per_logical`")
def in_place_kernel_stride(ratio: int) -> int:
    """Kernel block j of manager block b is view block b * ratio + j: the j-th equal piece of b's page, laid out inside as a
    block of its own (the layout's order of H, N, C with N / ratio states). Returns the view blocks per manager block."""
    return ratio


@rule("vllm/v1/worker/utils.py prepare_kernel_block_sizes (0.32): 'Block-outermost packing puts other layers' pages between the "
      "blocks, so they are never split group-wide'; AttentionGroup.map_kv_cache_to_kernel_blocks: 'Views a packed cache in "
      "manager blocks as kernel blocks ... only compressed caches (written from their block table) can be mapped ... Kernel block "
      "j of block b is b * kernel_block_stride + j'")
def packed_kernel_pages(contract: Contract, packed: bool, tokens_per_state: int, heads: int) -> bool:
    """0.32+: a packed block (block-outermost, other pages between its blocks) of a compressed single-head cache is viewed as
    kernel pages b * kernel_stride + j, kernel_stride being the block pitch in kernel pages; other packed splits are refused."""
    return contract.packed_kernel_map and packed and tokens_per_state > 1 and heads == 1


# --- backend-shaped contracts


@rule("vllm/v1/core/kv_cache_utils.py get_kv_cache_config_from_groups (<= 0.28): 'We will have group_size memory pools, each "
      "is shared by one layer from each group. As layers of different groups have different block table, they will use different "
      "parts of the shared Tensor.'; KVCacheTensor.shared_by: 'layer names that share the same KV cache tensor'")
def shaped_pools(group_layers: list[tuple[str, ...]]) -> list[list[str]]:
    """With one group every layer has a buffer of its own; with several, the i-th layer of every group shares buffer i."""
    if len(group_layers) == 1:
        return [[name] for name in group_layers[0]]
    depth = max(len(layers) for layers in group_layers)
    return [[layers[i] for layers in group_layers if i < len(layers)] for i in range(depth)]


@rule("vllm/v1/core/kv_cache_utils.py (0.23) get_kv_cache_config_from_groups: 'DeepseekV4: UniformTypeKVCacheSpecs but "
      "multiple groups' goes to _get_kv_cache_config_deepseek_v4: 'Emit one KVCacheTensor per (slot_idx, page_size). Layers from "
      "different groups at the same slot share a tensor (they have independent block tables so block-id namespaces never "
      "collide)'; _bucket_layers_by_page_size: 'result[ps][slot_idx] = [layer_names]'")
def page_bucket_pools(group_layers: Sequence[Sequence[tuple[str, int]]]) -> list[tuple[int, list[str]]]:
    """Several groups of UniformTypeKVCacheSpecs: a layer's slot counts the layers of its own group with its page size
    before it; the layers of every group at one (page size, slot) share one buffer of pages of that size. Buffers come
    by page size in the order the sizes first appear, then by slot."""
    return _page_slots(group_layers)


def _page_slots(group_layers: Sequence[Sequence[tuple[str, int]]]) -> list[tuple[int, list[str]]]:
    """(page size, the layers at one slot of that size): a layer's slot counts the layers of its own group with its page size
    before it; page sizes in order of first appearance, then slots."""
    buckets: dict[int, list[list[str]]] = {}
    for layers in group_layers:
        taken: dict[int, int] = {}
        for name, page_bytes in layers:
            slot = taken.get(page_bytes, 0)
            taken[page_bytes] = slot + 1
            slots = buckets.setdefault(page_bytes, [])
            if slot == len(slots):
                slots.append([])
            slots[slot].append(name)
    return [(page_bytes, members) for page_bytes, slots in buckets.items() for members in slots]


@rule("vllm/v1/attention/backend.py AttentionBackend.get_kv_cache_shape / get_kv_cache_stride_order (<= 0.28): 'the "
      "permutation that gets us from get_kv_cache_shape to the actual memory layout'; attn_utils._reshape_kv_cache views the "
      "layer's page bytes as that shape (`.view(kv_cache_shape)` over num_blocks pages)")
def declared_shape_covers_page(shape_elements_per_block: int, element_size: int, page_bytes: int) -> bool:
    """A backend's declared shape holds exactly one page's elements per block, laid out densely in its stride order."""
    return shape_elements_per_block * element_size == page_bytes


@rule("vllm/v1/worker/gpu/attn_utils.py _reshape_kv_cache (0.22): kernel_num_blocks = num_blocks * (block_size // "
      "kernel_block_size); 0.23+ comment: 'use storage_block_size as the kernel block size for groups that apply a compression "
      "on block size (eg. DeepSeek V4)' (PR #43988, fixing #38831)")
def shaped_kernel_ratio(contract: Contract, block_size: int, kernel_block_size: int, compress_ratio: int) -> int:
    """Kernel blocks per manager block: block_size / kernel_block_size where the contract splits, and 1 for a compressed cache
    (its stored block is its kernel block)."""
    return block_size // kernel_block_size if contract.kernel_split and compress_ratio == 1 else 1


@rule("vllm/v1/worker/gpu/attn_utils.py (0.20-0.23) padded-page branch: 'This assumes kv_cache_shape[0] == num_blocks (i.e. "
      "the first physical dimension is the block index)'; 0.24+: 'Padded KV pages require a num-blocks-first KV cache layout'")
def shaped_padding_fits(block_axis_outermost: bool) -> bool:
    """A padded page widens the block pitch to the padded size, which needs the block axis outermost in memory."""
    return block_axis_outermost


@rule("vllm/v1/worker/gpu/attn_utils.py _kv_first_layers_sharing_pool_with_mamba (0.28): 'Mamba addresses its state by page, "
      "so these layers have to lay their blocks out page by page as well; otherwise block ids from the two groups resolve to "
      "overlapping bytes' (0.21-0.26: _update_hybrid_attention_layout)")
def mamba_pool_hoists_blocks(shares_pool_with_mamba: bool) -> bool:
    """On a buffer shared with Mamba state, block b of every layer stays inside page b: the block axis is outermost."""
    return shares_pool_with_mamba


@rule("vllm/v1/worker/gpu/attn_utils.py _align_mixed_attention_kv_cache_views (0.25+, PR #47685): 'Keep the physical storage in "
      "the K/V-first layout expected by ROCM_ATTN, and restride the blocks-first logical views so block IDs address the same bytes'; "
      "gpu_model_runner.py _has_mixed_attention_kv_layout (0.25+, PR #47035): 'Mixed block dims mean a block ID maps to different bytes "
      "per layer, so the shared buffer must be normalized to a single (blocks-first) layout'; PR #41657: 'Two layers may share a raw "
      "KVCacheTensor iff their per-layer reshape over that tensor produces the same layout'")
def mixed_pool_arrangement(runner: str) -> str:
    """A pool shared by layers whose backends arrange blocks differently (encoder-decoder cross-attention, a drafter on another
    backend) gets one arrangement, so that a block id names the same bytes in every layer of it: the V2 runner keeps K and V
    apart and steps the blocks inside each ("kv-outer"), the V1 runner lays blocks page by page ("page")."""
    return "page" if runner == "v1" else "kv-outer"


# --- the V1 model runner


@rule("vllm/v1/worker/gpu_model_runner.py GPUModelRunner._reshape_kv_cache_tensors (0.19.1+): 'kernel_block_sizes: The kernel block "
      "sizes for each KV cache group', viewed as `num_blocks_per_kv_block = kv_cache_spec.block_size // kernel_block_size` kernel "
      "blocks of `kernel_block_size` tokens; GPUModelRunner.initialize_kv_cache: 'if kv_cache_manager uses block_size 256 for a given "
      "group, but the attention backends for that group only supports block_size 64, we will return kernel_block_size 64 and split "
      "the 256-token-block to 4 blocks with 64 tokens each'")
def v1_contract(v2: Contract) -> Contract:
    """The V1 runner splits a manager block into kernel blocks in every release it has reshape code in; where the V2 runner of a
    release does not split yet (0.19 - 0.21), the V1 runner's contract is the V2 runner's plus that split."""
    if v2.layout_placed or v2.kernel_split:
        return v2
    return {SHAPED_019.name: SHAPED_019_V1, SHAPED_020.name: SHAPED_020_V1, SHAPED_021.name: SHAPED_022}[v2.name]


# --- packed per-block slabs (backend-shaped contracts, 0.24 - 0.28)


@rule("vllm/config/cache.py CacheConfig.num_gpu_blocks_override: 'Number of GPU blocks to use. This overrides the profiled "
      "`num_gpu_blocks` if specified. Does nothing if `None`.'; get_kv_cache_config_from_groups (<= 0.28) takes 'available_memory: "
      "Memory available for KV cache in bytes' and get_num_blocks: 'Get the number of kv cache blocks' from it")
def fitted_blocks(available_memory: int, bytes_per_block: int) -> int:
    """Without the override, the planner gives the most blocks the memory holds: as many whole blocks of the bytes its own plan
    spends per block (the override's plan measures them) as fit in the available memory, none below zero."""
    return max(available_memory // bytes_per_block, 0)


@rule("vllm/v1/core/kv_cache_utils.py _use_packed_kv_cache_config (0.24-0.28): packs when every group's spec is a "
      "UniformTypeKVCacheSpecs (DeepSeek V4) or `enable_cross_layers and len(kv_cache_groups) > 1` (kv_connector_extra_config "
      "'enable_cross_layers_blocks', 'an experimental API', issue #42082); one UniformTypeKVCacheSpecs group is the special case "
      "'all layers have the same type of KV cache but with different hidden sizes', one tensor per layer")
def packs(contract: Contract, requested: str, groups: int) -> bool:
    """The planner packs layers into one per-block slab when the release packs at all, the case asks for it, and there are
    several KV-cache groups."""
    return contract.packing != "none" and requested != "none" and groups > 1


@rule("vllm/v1/core/kv_cache_utils.py _get_kv_cache_config_packed (0.24-0.26): 'Emit one KVCacheTensor per (slot_idx, page_size). "
      "Layers from different groups at the same slot share a tensor ... Each emitted tensor aliases one physical backing allocation, "
      "with per-block data laid out contiguously'; _bucket_layers_by_page_size: 'result[ps][slot_idx] = [layer_names]', buckets in "
      "the order their page sizes first appear, each slot one page after the previous")
def bucketed_slab(groups: list[list[tuple[str, int]]]) -> tuple[int, dict[str, int]]:
    """(block stride, offset of each layer in the slab): the i-th layer of each page size in a group takes slot i of that page
    size; slots of one page size follow each other, page sizes in order of first appearance; a block's slab holds them all."""
    offsets: dict[str, int] = {}
    offset = 0
    for page, names in _page_slots(groups):
        offsets.update(dict.fromkeys(names, offset))
        offset += page
    return offset, offsets


@rule("vllm/v1/core/kv_cache_utils.py _get_packed_kv_cache_layout (0.27-0.28): 'Lay out each cache group densely in one shared block "
      "slab. A block ID is owned by one cache group at a time, so layouts from different groups may overlap. Layers within a group "
      "remain disjoint.'")
def per_group_slab(groups: list[list[tuple[str, int]]]) -> tuple[int, dict[str, int]]:
    """(block stride, offset of each layer in the slab): each group's layers side by side from byte 0 in their order; the slab
    is as wide as the widest group."""
    offsets: dict[str, int] = {}
    stride = 0
    for layers in groups:
        offset = 0
        for name, page in layers:
            offsets[name] = offset
            offset += page
        stride = max(stride, offset)
    return stride, offsets


@rule("vllm/v1/core/kv_cache_utils.py _get_kv_cache_config_packed docstring: 'Each emitted tensor aliases one physical backing "
      "allocation, with per-block data laid out contiguously'; create_kv_cache_views (0.29+): kernel blocks 'sit a constant stride "
      "apart only if a block is one dense page'")
def packed_page(splits: bool) -> str | None:
    """A layer packed into a slab with other layers' pages holds block b as one contiguous page at its offset in slab b: the
    block axis is outermost (hoisted, the other axes in their declared order inside the page), and kernel blocks cannot be cut
    out of it (a layer's next kernel block would be a slab further on, no constant stride away). A slab that is one layer's
    page alone lays out as if unpacked. Returns why the case is inexpressible, or None."""
    if splits and not splits_in_place(False):
        return "a block packed into a slab with other layers' pages cannot be split into kernel blocks"
    return None
# --- code that addresses blocks by bytes beyond the views (oracles/touch.py)


@rule("vllm/v1/worker/utils.py KVBlockZeroer.__init__ (0.32): 'A segment's page spans everything inside its block, so under "
      "BHLNC it also covers the block's other layers -- safe, since block IDs are global pool indices and a newly allocated "
      "block owns its whole tile'; get_kv_cache_config_from_groups: 'Groups alias from byte 0. ... block-outer (the same packing "
      "repeats for every block)'; _get_layer_block_stride (0.32): 'A layer-outer block stride: the page padded to its alignment'")
def block_owns_its_row(layout_placed: bool, layout: str) -> bool:
    """A block id is one index into one pool, and it owns its whole tile: where a layout puts blocks outermost, its whole
    row of the buffer (every layer's and group's page of block b, and the row's alignment tail); elsewhere, in each layer,
    its page with the alignment tail up to the next block's page."""
    return layout_placed and layout.startswith("B")


@rule("vllm/v1/core/kv_cache_coordinator.py KVCacheCoordinator.__init__: 'self.block_pool = BlockPool(num_gpu_blocks="
      "kv_cache_config.num_blocks, ...)', one pool for every KV cache group, each group's manager taking its blocks from it; "
      "kv_cache_utils.py get_kv_cache_config_from_groups: 'Groups alias from byte 0'")
def block_id_held_by_one_group() -> bool:
    """A block id is handed to one group at a time: the groups' layers that share a tensor address the same bytes under one
    block id, and never both hold it. A connector's spans of one block id in two groups may share bytes; of two ids, never."""
    return True


# Spec kinds of the layers that allocate a KV cache and attend to the whole context, by their meaning.
ALLOCATING_ATTENTION_KINDS = ("full", "sliding_window", "chunked_local", "sink", "cross", "mla", "sliding_window_mla")
FULL_ATTENTION_KINDS = ("full", "sink", "mla")


@rule("vllm/v1/worker/utils.py KVBlockZeroer (0.19.1+): 'Only AttentionSpec layers are processed; Mamba layers are skipped.'; "
      "PR #51749 'Generalize KV block zeroing to AttentionSpec': 'Encoder-only attention allocates no KV cache; other registered "
      "allocating attention specs implement this same contract' (the zeroer 'only processed full-attention groups. Recycled FP8 "
      "sliding-window pages could therefore retain stale data'); vllm/v1/worker/cpu_model_runner.py _zero_block_ids (0.25+): "
      "'Zero full-attention blocks to prevent stale data corruption on partial writes'; vllm/v1/worker/cpu/utils.py "
      "CPUKVBlockZeroer(KVBlockZeroer) (0.34): 'Zero newly allocated logical KV blocks through their tensor views'")
def zeroed_kinds(full_attention_only: bool) -> tuple[str, ...]:
    """The layers a zeroer clears block b in: KVBlockZeroer and 0.34's CPUKVBlockZeroer every attention layer that
    allocates a cache; the CPU runner's _zero_block_ids (`full_attention_only`) the full-attention layers it says it zeroes."""
    return FULL_ATTENTION_KINDS if full_attention_only else ALLOCATING_ATTENTION_KINDS


@rule("vllm/v1/worker/utils.py _zero_kv_blocks_kernel: 'seg_addrs_ptr holds absolute byte addresses ... ptr = "
      "tl.cast(seg_addr, tl.pointer_type(tl.int32))'; KVBlockZeroer.__init__: `assert block_stride_bytes % 4 == 0`, "
      "`assert kernel_page_bytes % 4 == 0`, `assert (dp + off_bytes) % 4 == 0`")
def zeroer_granule(clears_words: bool) -> int:
    """KVBlockZeroer (`clears_words`) clears 4-byte words: it serves layouts whose pages, block pitches and page starts are
    whole words, and refuses others (0.34's CPUKVBlockZeroer and the CPU runner zero through tensor views, any byte)."""
    return 4 if clears_words else 1


def declares(sizes: Sequence[int | str], size: int) -> bool:
    """Whether a backend declaring kernel block `sizes` (ints, or "xN" for any multiple of N) takes `size`."""
    return any(size == s if isinstance(s, int) else size % int(s[1:]) == 0 for s in sizes)


@rule("vllm/v1/worker/utils.py select_common_block_size (0.19.1 - 0.34.0): 'Select a block size that is supported by all "
      "backends and is a factor of kv_manager_block_size. If kv_manager_block_size is supported by all backends, return it "
      "directly. Otherwise, return the max supported size.'")
def kernel_block_size(block_size: int, sizes: Sequence[int | str]) -> int | None:
    """The kernel block size for blocks of `block_size` tokens on a backend declaring `sizes`: the block itself where the
    backend takes it, else the largest size it declares that divides the block; None where none does."""
    if declares(sizes, block_size):
        return block_size
    explicit = sorted({s for s in sizes if isinstance(s, int) and block_size % s == 0}, reverse=True)
    return next((s for s in explicit if declares(sizes, s)), None)


@rule("vllm/v1/worker/block_table.py BlockTable.compute_slot_mapping: 'E.g., [0, 1, 0, 1, 2, 3, 4, 0, 1, 2] -> [0, 0, K, K, "
      "K + 1, K + 1, K + 2, 2 * K, 2 * K, 2 * K + 1]' (slot = block number * block size + offset); map_to_kernel_blocks: "
      "'kernel_block_ids = kv_manager_block_id * blocks_per_kv_block + kernel_block_arange'")
def token_slot(block: int, position: int, block_size: int) -> int:
    """The slot a cache write gets for token `position` of manager block `block`: kernel block b * ratio + position //
    kernel size, times the kernel size, plus position % kernel size, which is b * block_size + position."""
    return block * block_size + position


@rule("vllm/v1/kv_cache_interface.py AttentionSpec / vllm test tests/v1/worker/test_attn_utils.py: 'Content dim packs K and V: "
      "2 * head_size'; vllm/_custom_ops.py concat_and_cache_mla and vllm/v1/attention/backends/mla/cpu_mla.py do_kv_cache_update: "
      "`flat[slots, :kv_lora_rank] = kv_c_normed`, `flat[slots, kv_lora_rank:] = k_pe`; MLAAttentionSpec (0.28+): 'MLA stores a "
      "single latent vector per state'")
def content_order(mla: bool) -> tuple[str, ...]:
    """What a state's content holds, in order: a head's K then its V; for MLA one vector, the latent then its rope part."""
    return ("latent", "rope") if mla else ("K", "V")


@rule("vllm/v1/attention/backends/cpu_attn.py CPUAttentionBackend.supported_kv_cache_layouts: 'The CPU backend only reads "
      "head-major block interiors'; do_kv_cache_update: '[num_blocks, num_kv_heads, block_size, 2 * head_size]. Make a view "
      "[num_blocks, num_kv_heads, block_size * 2, head_size]' (K rows, then V rows; the kernels keep their own order inside)")
def private_block_interior(backend: str) -> bool:
    """CPU_ATTN keeps (block, head) interiors in its own order: its writes must stay in the token's block and head, cover
    every element once, and nothing more is promised about where inside."""
    return backend == "CPU_ATTN"


# --- several workers of one model: the engine-level planner (oracles/planner.py)


@rule("vllm/v1/core/kv_cache_utils.py get_kv_cache_configs (0.19.1 - 0.32; vllm/v1/core/kv_cache_planning.py from 0.33) "
      "docstring: '5. Change the num_blocks of each worker to the smallest among all workers and shrink tensor sizes "
      "proportionally to avoid allocating unused memory.'; generate_scheduler_kv_cache_config: `assert all([cfg.num_blocks == "
      "kv_cache_configs[0].num_blocks for cfg in kv_cache_configs])`")
def least_blocks(blocks_each_worker_holds: Sequence[int]) -> int:
    """Workers of one model get one block count (the scheduler hands every worker the same block ids): the least any
    worker's memory holds; each worker's tensors hold that many blocks of the bytes its own plan spends per block."""
    return min(blocks_each_worker_holds)


@rule("vllm/v1/core/kv_cache_utils.py get_kv_cache_configs docstring: '2. Generate the KV cache groups based on the layer "
      "ratio of the whole model. ... "
      "4. Generate the KV cache configs for each worker based on the KV cache grouping strategy.'; "
      "_project_kv_cache_groups_to_worker (0.19.1+): 'In pipeline parallelism, each worker only owns a subset of layers. This "
      "function filters the global groups to include only layers present on the given worker' (a group is kept for every "
      "global group, its layer list empty where the worker owns none of its layers); generate_scheduler_kv_cache_config: 'All "
      "workers have the same kv_cache_config except layer names'; PR #23974 (fixing #23883, stages planning different groups): "
      "'generating the kv cache groups based on the full:sw ratio of the full model'")
def projected_layers(group_layers: Sequence[str], worker_layers: Collection[str]) -> tuple[str, ...]:
    """Every worker has every group of the whole model, in the whole model's order, with the group's block size and spec:
    its layers are those of the group the worker owns, in the group's order, none where it owns none of them."""
    return tuple(name for name in group_layers if name in worker_layers)


@rule("vllm/v1/core/kv_cache_utils.py get_kv_cache_configs: 'kv_cache_specs: List of dict[layer_name, KVCacheSpec] for "
      "each worker' and `assert "
      "sum(len(group.layer_names) for group in projected_groups) == len(kv_cache_spec_one_worker), \"Some layers are not "
      "assigned to any group.\"`; KVCacheTensor.shared_by / layers: the layers whose cache the tensor backs; issue #54711 (a "
      "group projected empty 'still emits KVCacheTensors for other ranks' layers', allocation then fails)")
def owned_tensor_layers(worker_layers: Collection[str]) -> frozenset[str]:
    """A worker's KV-cache tensors back exactly the layers it owns, each once: none of another worker's."""
    return frozenset(worker_layers)


LOCAL_ATTENTION_KINDS = ("sliding_window", "chunked_local")


@rule("vllm/v1/core/kv_cache_utils.py unify_hybrid_kv_cache_specs (0.19.1+; kv_cache_planning.py from 0.33), which "
      "get_kv_cache_groups calls `if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager`: 'This function tries to "
      "convert the KV cache specs to one type if the model is a hybrid model with multiple type of KV cache. It will convert "
      "all SlidingWindowSpec to FullAttentionSpec if both types are present.'; the refusal 'Hybrid KV cache manager is disabled "
      "but failed to convert the KV cache specs to one unified type.' (0.19.1 - 0.27), from 0.28 _promote_local_kv_cache_specs: "
      "'Use full-attention allocation for local-attention cache specs', 'Failed to promote local KV cache specs to one unified "
      "type.'; a promoted layer keeps its window (FullAttentionSpec(sliding_window=...), 0.28+ replace_as), and "
      "FullAttentionSpec.merge_window_sizes: 'All attention layers in the same KV cache group must have the same window size.'")
def unified_kind(kinds: Collection[str], windows: Collection[int], chunks: Collection[int]) -> str | None:
    """With the hybrid KV-cache manager off, a model's layers are planned as one type, in one group: where it has
    full-attention layers, its sliding-window and chunked-local layers as full attention, keeping their windows (one
    sliding window and one chunk size at most in a group); a model whose layers are then not of one type (Mamba beside
    attention, local layers of two kinds or several windows) is refused. Returns the kind every layer is planned as, None
    where vLLM must refuse."""
    present = set(kinds)
    one_window = len(set(windows)) <= 1 and len(set(chunks)) <= 1
    if "full" in present and present <= {"full", *LOCAL_ATTENTION_KINDS}:
        return "full" if one_window else None
    if len(present) == 1 and one_window:
        return next(iter(present))
    return None


@rule("vllm/v1/core/kv_cache_planning.py shrink_kv_cache_configs (0.34): 'Lower num_blocks of every config in place after "
      "measured sizing. The tensors' size follows (their strides and offsets keep describing the reservation).'")
def shrunk_blocks(requested: int) -> int:
    """Shrunk to a block count, every worker's config holds that many blocks, each tensor that many of its bytes per block."""
    return requested


# --- HiSparse (vllm/v1/hisparse, 0.30+): sparse-MLA KV on host, resident and hot copies on the device


@rule("vllm/v1/attention/backends/mla/indexer.py DeepseekV32IndexerBackend.get_supported_kernel_block_sizes (0.30+): "
      "'return [1, MultipleOf(16)] if current_platform.is_rocm() else [64]'; vllm/v1/hisparse/binding.py "
      "resolve_hisparse_specs (resolve_hisparse_block_size in 0.30): 'HiSparse requires a GPU block size supported by every "
      "sparse attention and indexer backend', every MLA spec `copy_with_new_block_size(block_size)`")
def hisparse_block_tokens() -> int:
    """HiSparse pages every sparse-MLA and indexer cache in 64-token blocks on NVIDIA (the DeepSeek V3.2 indexer's size)."""
    return 64


@rule("vllm/model_executor/models/deepseek_v2.py Indexer: `DeepseekV32IndexerCache(head_dim=self.head_dim + "
      "self.head_dim // self.quant_block_size * 4, dtype=torch.uint8)`, one head (get_kv_cache_spec: `num_kv_heads=1, "
      "cache_role=SparseCacheRole.INDEXER`); index_head_dim 128, quant_block_size 128 in DeepSeek V3.2")
def hisparse_indexer_row_bytes(index_head_dim: int = 128, quant_block: int = 128) -> int:
    """A DeepSeek V3.2 indexer cache stores, per token, its fp8 key and one 4-byte scale per quantization block."""
    return index_head_dim + index_head_dim // quant_block * 4


@rule("vllm/v1/hisparse/layout.py _lay_out_hisparse_groups (0.30+): a hot group of layers of one page size gets "
      "HiSparseResidentSpec(block_size=gpu_block_size, page_size=page_size) and HiSparseHotSpec(..., page_size=page_size), "
      "page_size the layers' spec.page_size_bytes; runtime.py PagedCacheView.bind views (num_blocks, block_size, row_width)")
def hisparse_device_copy_page(source_page: int) -> int:
    """A sparse-MLA layer's resident and hot blocks each hold one whole page of the layer's own (host) cache."""
    return source_page


@rule("vllm/v1/hisparse/layout.py create_hisparse_layout (0.30+): host_block_stride = get_hisparse_host_block_stride("
      "source_group.kv_cache_spec.page_size_bytes, ...) ('return page_size_bytes' without a shared pool), host_num_blocks = "
      "host_budget // host_block_stride; get_hisparse_kv_cache_config: host_size = host_bytes_per_block * host_num_blocks; "
      "get_hisparse_host_pool_bytes: int(host_pool_gib * 2**30)")
def hisparse_host_blocks(budget_bytes: int, source_pages: list[int]) -> int:
    """A private host pool's block holds one page of every sparse-MLA layer; the budget holds as many whole blocks as fit."""
    return budget_bytes // sum(source_pages)


@rule("vllm/v1/kv_cache_interface.py KVCacheTensor (0.29+): 'Tensors whose address ranges overlap alias the same bytes: "
      "cache groups overlay each other, which is sound because a block ID is owned by one group at a time'; "
      "vllm/v1/hisparse/layout.py: 'the GPU groups sharing one device pool'")
def hisparse_groups_overlay(same_group: bool, same_block: bool) -> bool:
    """Two blocks may share bytes only when they are one block id of two groups (never live at once)."""
    return not same_group and same_block


@rule("vllm/v1/hisparse/layout.py _build_hisparse_kv_cache_tensors (0.30+): 'HiSparse requires a block-outermost KV layout.' "
      "(a ValueError for resident and hot specs in any other layout); vllm/v1/core/kv_cache_utils.py (kv_cache_planning.py "
      "0.33+) validate_kv_cache_layout, which get_hisparse_kv_cache_config calls on the device groups: 'Mixed page sizes pack "
      "pages side by side within a block, which needs each page to be one contiguous chunk inside its block (a block-compact "
      "layout)' (the indexer's and the sparse-MLA layers' pages differ)")
def hisparse_layout_accepted(layout: str) -> bool:
    """HiSparse lays out its device pool only where a block is outermost and holds each layer's page in one piece."""
    return layout.startswith("BL")


@rule("vllm/v1/hisparse/runtime.py HiSparseRuntime.__init__ (0.30+): 'HiSparse requires 16-byte aligned KV rows'; "
      "index_group.py HiSparseMLAIndexGroup.register_layer: an fp8_ds_mla row is FP8_DS_MLA_ROW_BYTES (656) bytes, any other "
      "cache a head_size row of the cache dtype")
def hisparse_row_accepted(row_bytes: int) -> bool:
    """HiSparse moves whole token rows of 16-byte multiples."""
    return row_bytes % 16 == 0
