"""Expected views under the layout-placed contracts (vLLM 0.29 and later), from what a layout means.

Every group's cache is the logical array [L, B, H, N, C]: layers, manager blocks, head slots,
states per block, content bytes per state (the page, oracles/pages.py). A layout names the
physical nesting of those axes, outermost first. Nesting them in that order over the page
geometry gives every element's byte address: the innermost axis, C, packs bytes densely, and
each axis further out steps over everything nested inside it, so its stride is the stride times
extent of the axis just inside it. Two things widen a step, each a design choice of vLLM's
stated in oracles/contract.py: a padded page (the innermost axis of the page grid steps a whole
padded page) and a block pitch fixed by the allocator (block-outermost layouts share the largest
group's bytes per block; layer-outer pages are padded to their block stride alignment). Groups
overlay one backing buffer from byte 0.

A manager block of `block_size` tokens splits into kernel blocks of `kernel_block_size` tokens
in place when it is one dense page: kernel block b * ratio + j is the j-th equal piece of block
b's page, nested inside like a block of its own (N / ratio states). From 0.32 a packed block of a
compressed single-head cache is viewed instead as kernel pages b * kernel_stride + j.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fuzz.case import Case, GroupCase
from oracles import contract as rules
from oracles import pages
from oracles.contract import Contract
from oracles.expectation import Expectation, LayerExpectation, PageRule, ViewExpectation, rejected, with_sharers

AXES = "LBHNC"


@dataclass(frozen=True)
class Placement:
    """One group's layers in the backing buffer."""

    order: str
    extents: dict[str, int]
    strides: dict[str, int]  # bytes, by logical axis
    page: pages.Page
    dense: bool  # a block is one unpadded run of page bytes and the next block starts right after it
    packed: bool  # blocks hold other pages between this layer's pages (block-outermost packing)

    @property
    def heads_in_tail(self) -> bool:
        return self.order.index("H") > rules.page_grid_end(self.order)


def nest(order: str, extents: dict[str, int], pitches: dict[str, int]) -> dict[str, int]:
    """Byte strides of axes nested in `order` (outermost first): each axis steps over everything inside it, or over the
    pitch a contract rule gives it, whichever is more."""
    strides: dict[str, int] = {}
    span = 1
    for axis in reversed(order):
        strides[axis] = max(span, pitches.get(axis, 0))
        span = strides[axis] * extents[axis]
    return strides


def expect(case: Case, contract: Contract) -> Expectation:
    reason, layer = _reject_reason(case)
    if reason is not None:
        return rejected(contract.name, reason, layer)
    planned = rules.planned_blocks(case.num_blocks, attention_free=not case.groups)
    if not case.groups:
        return Expectation(contract=contract.name, exact_buffers=True, planned_blocks=planned)
    block_pitch = _block_outermost_pitch(case)
    layers: dict[str, LayerExpectation] = {}
    kernel_sizes: dict[int, int] = {}
    for index, group in enumerate(case.groups):
        kernel = group.kernel_block_size or group.spec.block_size
        kernel_sizes[index] = kernel
        origin = 0
        for run in runs(group):
            placement = place(run, case.num_blocks, case.layout, block_pitch)
            if isinstance(placement, str):
                return rejected(contract.name, placement, run.layers[0])
            for position, name in enumerate(run.layers):
                built = _layer_view(name, index, origin + position * placement.strides["L"], run, case.num_blocks, placement, kernel,
                                    contract)
                if isinstance(built, str):
                    return rejected(contract.name, built, name)
                layers[name] = built
            origin += len(run.layers) * placement.strides["L"]
    return Expectation(
        contract=contract.name,
        buffers=(rules.backing_allocation_bytes(buffer_bytes(case), case.platform),),
        exact_buffers=True,
        planned_blocks=planned,
        layers=with_sharers(layers, case.kv_sharing),
        kv_sharing=dict(case.kv_sharing),
        kernel_block_sizes=kernel_sizes,
    )


def runs(group: GroupCase) -> list[GroupCase]:
    """The group's layers in runs of one spec each (rules.same_spec_runs), each a group of its own: the whole group when its
    layers are alike."""
    if not group.differs_per_layer:
        return [group]
    return [dataclasses.replace(group.of_layer(positions[0]), layers=tuple(group.layers[i] for i in positions))
            for positions in rules.same_spec_runs(group.layer_specs)]


def _reject_reason(case: Case) -> tuple[str | None, str | None]:
    for group in (run for g in case.groups for run in runs(g)):
        spec = group.spec
        page = pages.page(spec)
        misfit = rules.kernel_fits(spec.block_size, group.kernel_block_size or spec.block_size, spec.compress_ratio)
        if misfit is not None:
            return misfit, group.layers[0]
        if page.content_bytes % page.element_size:
            return "the state content is not a whole number of elements", group.layers[0]
        if page.page_bytes < page.unpadded_bytes:
            return "the padded page is smaller than the page", group.layers[0]
        if page.block_stride_alignment == 0:
            return "the block stride alignment names a kernel block that holds no state", group.layers[0]
        if page.page_bytes % page.element_size:
            return "the padded page is not a whole number of elements", group.layers[0]
    group_pages = [pages.page(spec) for g in case.groups for spec in g.layer_specs]
    mixed_sizes = len({p.page_bytes for p in group_pages}) > 1
    mixed_shapes = len({(p.heads, p.states, p.page_bytes) for p in group_pages}) > 1
    if not rules.mixed_pages_fit(case.layout, mixed_sizes, mixed_shapes, len(case.groups)):
        return "the layout cannot express these groups' mixed pages", None
    return None, None


def buffer_bytes(case: Case) -> int:
    """Bytes of the one backing buffer the contract lays this case out in."""
    if not case.groups:
        return 0
    pitch = _block_outermost_pitch(case)
    if pitch is not None:
        return pitch * case.num_blocks
    return max(sum(_layer_outer_pitch(pages.page(spec)) for spec in g.layer_specs) for g in case.groups) * case.num_blocks


def _block_outermost_pitch(case: Case) -> int | None:
    if case.layout[0] != "B":
        return None
    group_pages = [[pages.page(spec) for spec in g.layer_specs] for g in case.groups]
    return rules.block_outermost_pitch([sum(p.page_bytes for p in layer_pages) for layer_pages in group_pages],
                                       [_sizing_alignment(p) for layer_pages in group_pages for p in layer_pages])


def _layer_outer_pitch(page: pages.Page) -> int:
    return rules.layer_outer_pitch(page.page_bytes, _sizing_alignment(page))


def _sizing_alignment(page: pages.Page) -> int:
    """The block stride alignment a page is sized with. An alignment of 0 (a kernel block that holds no state: no valid
    stride) is a rejection reason of its own, but the buffer is still sized as vLLM's planner would size it, so a case
    whose allocation is too large to run is skipped whether or not the contract expresses it: vLLM takes that kernel
    block's page from `copy_with_new_block_size`, a `dataclasses.replace` that keeps the block's `page_size_padded` when
    the kernel page pads to nothing (kv_cache_interface.py, 0.32 - 0.34), so a padded page counts whole; an unpadded
    one counts 1 (vLLM's lcm is then 0 and its `round_up` divides by zero before anything is allocated, #5)."""
    if page.block_stride_alignment:
        return page.block_stride_alignment
    return page.page_bytes if page.padded else 1


def place(group: GroupCase, num_blocks: int, order: str, block_outermost_pitch: int | None) -> Placement | str:
    """The group's layers nested in the layout's order, or why the contract cannot place them."""
    page = pages.page(group.spec)
    extents = {"L": len(group.layers), "B": num_blocks, "H": page.heads, "N": page.states, "C": page.content_bytes}
    pitches: dict[str, int] = {}
    if page.padded:
        if not rules.padding_fits(order, extents):
            return "a padded page needs every axis outside the page tail to be L, B or of size 1"
        pitches[order[rules.page_grid_end(order)]] = page.page_bytes
    if block_outermost_pitch is not None:
        pitches["B"] = block_outermost_pitch
    else:
        pitch = _layer_outer_pitch(page)
        if pitch != page.page_bytes:
            if not rules.alignment_padding_fits(order):
                return "a layout that is not block-compact cannot pad its pages to their block stride alignment"
            pitches["B"] = max(pitch, pitches.get("B", 0))
    strides = nest(order, extents, pitches)
    dense = not page.padded and strides["B"] == page.unpadded_bytes and _contiguous(strides, extents, "HNC")
    packed = order.index("B") < order.index("L") and strides["B"] > page.page_bytes
    return Placement(order=order, extents=extents, strides=strides, page=page, dense=dense, packed=packed)


def _contiguous(strides: dict[str, int], extents: dict[str, int], axes: str) -> bool:
    """Whether `axes` address one gapless run of bytes from their origin."""
    span = 1
    for axis in sorted((a for a in axes if extents[a] > 1), key=lambda a: strides[a]):
        if strides[axis] != span:
            return False
        span *= extents[axis]
    return True


def _layer_view(name: str, group_index: int, origin: int, group: GroupCase, num_blocks: int, placement: Placement,
                kernel: int, contract: Contract) -> LayerExpectation | str:
    """The view of the layer whose bytes start `origin` bytes into the group's blocks (or regions)."""
    spec = group.spec
    page = placement.page
    strides = placement.strides
    ratio = spec.block_size // kernel
    kernel_states = page.states // ratio
    if ratio == 1:
        view_blocks, kernel_stride, view_strides = num_blocks, 1, strides
    elif rules.splits_in_place(placement.dense):
        # Each kernel block nested like a block of its own, its blocks one piece of a page apart.
        kernel_stride = rules.in_place_kernel_stride(ratio)
        view_blocks = num_blocks * kernel_stride
        view_strides = nest(placement.order, {**placement.extents, "B": view_blocks, "N": kernel_states},
                            {"B": strides["B"] // ratio})
    elif rules.packed_kernel_pages(contract, placement.packed, spec.compress_ratio, page.heads):
        kernel_page = kernel_states * strides["N"]
        if strides["B"] % kernel_page:
            return "packed blocks are not a whole number of kernel pages apart"
        kernel_stride = strides["B"] // kernel_page
        view_blocks = (num_blocks - 1) * kernel_stride + ratio
        view_strides = {**strides, "B": kernel_page}
    else:
        return "a manager block that is not one dense page cannot be split into kernel blocks"
    if any(step % page.element_size for step in (view_strides["B"], view_strides["H"], view_strides["N"], origin)):
        return "a block pitch or layer offset is not a whole number of elements"
    view = ViewExpectation(
        shape=(view_blocks, page.heads, kernel_states, page.content_bytes // page.element_size),
        byte_strides=(view_strides["B"], view_strides["H"], view_strides["N"], page.element_size),
        byte_offset=origin,
        buffer=0,
        dtype="int8" if spec.kind == "mamba" else spec.dtype,
        element_size=page.element_size,
        block_axis=0,
        kernel_ratio=ratio,
        kernel_stride=kernel_stride,
    )
    return LayerExpectation(name=name, group=group_index, views=(view,), pages=_page_rule(origin, placement))


def _page_rule(origin: int, placement: Placement) -> PageRule:
    """The bytes manager block b of this layer owns: its page, or with heads outside the page tail, one run per head."""
    page, strides = placement.page, placement.strides
    if placement.heads_in_tail:
        starts, length = (0,), page.page_bytes
    else:
        starts, length = tuple(h * strides["H"] for h in range(page.heads)), page.states * page.content_bytes
    return PageRule(
        origin=origin,
        block_pitch=strides["B"],
        span_starts=starts,
        span_len=length,
        pad_start=page.unpadded_bytes if page.padded and placement.heads_in_tail else length,
    )
