"""Expected views under the layout-placed contract (vLLM 0.29 and later).

The contract, as vLLM documents it in kv_cache_utils and KVCacheLayout:
- every layer is a logical [B, H, N, C] cache (blocks, head slots, states, content bytes);
- the layout names the physical order of [L, B, H, N, C], outermost first; axes inside the
  page tail (after the last of L and B) are packed densely, and a padded page widens the pitch
  of the innermost of L and B;
- groups overlay one backing buffer from byte 0. Block-outermost layouts give every group the
  same block pitch (the largest group's bytes per block); layer-outer layouts give each layer
  its own region of num_blocks pages;
- a manager block of `block_size` tokens splits into kernel blocks of `kernel_block_size`
  tokens: kernel block j of block b holds states j*Nk .. (j+1)*Nk - 1 of block b. Dense pages
  number kernel blocks b*ratio + j; packed block-outermost caches (when the contract has the
  kernel map) number them b*kernel_stride + j, where kernel_stride is the block pitch in kernel
  pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fuzz.case import Case, GroupCase
from oracles import pages
from oracles.contract import Contract
from oracles.expectation import Expectation, LayerExpectation, PageRule, ViewExpectation, rejected, with_sharers

AXES = "LBHNC"


@dataclass(frozen=True)
class Placement:
    """Byte strides in logical [L, B, H, N, C] order for one group's layers."""

    strides: tuple[int, int, int, int, int]
    page: pages.Page
    heads_in_page: bool
    heads_before_states: bool


def expect(case: Case, contract: Contract) -> Expectation:
    reason, layer = _reject_reason(case)
    if reason is not None:
        return rejected(contract.name, reason, layer)
    order = case.layout
    block_outermost = order[0] == "B"
    bytes_per_block = _bytes_per_block(case, block_outermost)
    layers: dict[str, LayerExpectation] = {}
    kernel_sizes: dict[int, int] = {}
    for index, group in enumerate(case.groups):
        placement = _place(group, case.num_blocks, order, bytes_per_block if block_outermost else None)
        if placement is None:
            return rejected(contract.name, "a padded page needs every axis outside the page to be L, B or of size 1", group.layers[0])
        kernel = group.kernel_block_size or group.spec.block_size
        kernel_sizes[index] = kernel
        for position, name in enumerate(group.layers):
            built = _layer_view(name, index, position, group, case.num_blocks, placement, kernel, contract)
            if isinstance(built, str):
                return rejected(contract.name, built, name)
            layers[name] = built
    layers = with_sharers(layers, case.kv_sharing)
    return Expectation(
        contract=contract.name,
        buffers=(bytes_per_block * case.num_blocks,),
        layers=layers,
        kv_sharing=dict(case.kv_sharing),
        kernel_block_sizes=kernel_sizes,
    )


def _reject_reason(case: Case) -> tuple[str | None, str | None]:
    for group in case.groups:
        spec = group.spec
        page = pages.page(spec)
        kernel = group.kernel_block_size or spec.block_size
        if spec.block_size % kernel:
            return "the kernel block size does not divide the block size", group.layers[0]
        if kernel % spec.compress_ratio:
            return "a kernel block must hold a whole number of compressed states", group.layers[0]
        if page.content_bytes % page.element_size:
            return "the state content is not a whole number of elements", group.layers[0]
        if page.page_bytes < page.unpadded_bytes:
            return "the padded page is smaller than the page", group.layers[0]
        if page.block_stride_alignment == 0:
            return "the block stride alignment names a kernel block that holds no state", group.layers[0]
        if page.page_bytes % page.element_size:
            return "the padded page is not a whole number of elements", group.layers[0]
    page_sizes = {pages.page(g.spec).page_bytes for g in case.groups}
    order = case.layout
    block_compact = set(order[:2]) == {"L", "B"}
    layer_compact = order[0] == "L"
    if len(page_sizes) > 1 and (not block_compact or (len(case.groups) > 1 and layer_compact)):
        return "the layout cannot express mixed page sizes", None
    shapes = {(p.heads, p.states, p.page_bytes) for p in (pages.page(g.spec) for g in case.groups)}
    if len(shapes) > 1 and not block_compact:
        # Pages of different (heads, states) shapes alias one block only when the block is dense.
        return "groups with different page shapes need a block-compact layout", None
    if order[0] != "B" and not block_compact:
        for group in case.groups:
            page = pages.page(group.spec)
            if pages.round_up(page.page_bytes, page.block_stride_alignment) != page.page_bytes:
                return "a layout that is not block-compact cannot pad its pages", group.layers[0]
    return None, None


def buffer_bytes(case: Case) -> int:
    """Bytes of the one backing buffer the contract lays this case out in."""
    return _bytes_per_block(case, case.layout[0] == "B") * case.num_blocks


def _bytes_per_block(case: Case, block_outermost: bool) -> int:
    # (layers, page bytes, stride alignment); an alignment of 0 (no valid stride) is a rejection
    # reason of its own, counted as 1 here so sizing never divides by it.
    sizes = [(len(g.layers), p.page_bytes, max(1, p.block_stride_alignment)) for g, p in ((g, pages.page(g.spec)) for g in case.groups)]
    if not block_outermost:
        return max(count * pages.round_up(page, align) for count, page, align in sizes)
    widest = max(count * page for count, page, _ in sizes)
    return pages.round_up(widest, math.lcm(*(align for _, _, align in sizes)))


def _place(group: GroupCase, num_blocks: int, order: str, block_pitch: int | None) -> Placement | None:
    page = pages.page(group.spec)
    if block_pitch is None:
        aligned = pages.round_up(page.page_bytes, page.block_stride_alignment)
        block_pitch = aligned if aligned != page.page_bytes else None
    extents = {"L": len(group.layers), "B": num_blocks, "H": page.heads, "N": page.states, "C": page.content_bytes}
    # The page tail starts after the last of L and B in the layout's order (vLLM's rule: structural,
    # whatever the sizes).
    grid_end = max(order.index("L"), order.index("B"))
    if page.padded and any(extents[axis] != 1 for axis in order[: grid_end + 1] if axis in "HNC"):
        return None
    strides: dict[str, int] = {}
    pitch = 1
    for position in range(len(order) - 1, -1, -1):
        axis = order[position]
        if position == grid_end and page.padded:
            pitch = max(pitch, page.page_bytes)
        strides[axis] = block_pitch if (axis == "B" and block_pitch is not None) else pitch
        pitch = strides[axis] * extents[axis]
    return Placement(
        strides=tuple(strides[a] for a in AXES),  # type: ignore[arg-type]
        page=page,
        heads_in_page=order.index("H") > grid_end,
        heads_before_states=order.index("H") < order.index("N"),
    )


def _layer_view(
    name: str,
    group_index: int,
    position: int,
    group: GroupCase,
    num_blocks: int,
    placement: Placement,
    kernel: int,
    contract: Contract,
) -> LayerExpectation | str:
    spec = group.spec
    page = placement.page
    layer_stride, block_stride, head_stride, state_stride, _ = placement.strides
    ratio = spec.block_size // kernel
    kernel_states = page.states // ratio
    dense = block_stride == page.heads * page.states * page.content_bytes
    if ratio > 1 and dense and page.padded:
        return "a padded page cannot be split into kernel blocks"
    if ratio > 1 and dense and not placement.heads_in_page and page.heads > 1:
        # A kernel block would hold a piece of every head's run: not one strided block.
        return "a page whose heads lie outside the page tail cannot be split into kernel blocks"
    if ratio == 1 or dense:
        kernel_stride, view_blocks = ratio, num_blocks * ratio
    elif contract.packed_kernel_map and spec.compress_ratio > 1 and page.heads == 1:
        kernel_page = kernel_states * state_stride
        if block_stride % kernel_page:
            return "packed blocks are not a whole number of kernel pages apart"
        kernel_stride = block_stride // kernel_page
        view_blocks = (num_blocks - 1) * kernel_stride + ratio
    else:
        return "a manager block that is not one dense page cannot be split into kernel blocks"

    # A kernel block is the j-th of `ratio` equal pieces of its block's page, laid out inside
    # in the layout's own order of H and N (with Nk states), as if it were a block of its own.
    if ratio > 1 and placement.heads_in_page and page.heads > 1:
        if placement.heads_before_states:
            head_stride, state_stride = kernel_states * page.content_bytes, page.content_bytes
        else:
            head_stride, state_stride = page.content_bytes, page.heads * page.content_bytes
    piece_bytes = page.heads * kernel_states * page.content_bytes if dense else kernel_states * state_stride
    view = ViewExpectation(
        shape=(view_blocks, page.heads, kernel_states, page.content_bytes // page.element_size),
        byte_strides=(block_stride if ratio == 1 else piece_bytes, head_stride, state_stride, page.element_size),
        byte_offset=position * layer_stride,
        buffer=0,
        dtype="int8" if spec.kind == "mamba" else spec.dtype,
        element_size=page.element_size,
        block_axis=0,
        kernel_ratio=ratio,
        kernel_stride=kernel_stride,
    )
    return LayerExpectation(name=name, group=group_index, views=(view,), pages=_page_rule(position, placement))


def _page_rule(position: int, placement: Placement) -> PageRule:
    layer_stride, block_stride, head_stride, _, _ = placement.strides
    page = placement.page
    if placement.heads_in_page:
        starts, length = (0,), page.page_bytes
    else:
        starts, length = tuple(h * head_stride for h in range(page.heads)), page.states * page.content_bytes
    return PageRule(
        origin=position * layer_stride,
        block_pitch=block_stride,
        span_starts=starts,
        span_len=length,
        pad_start=page.unpadded_bytes if page.padded and placement.heads_in_page else length,
    )
