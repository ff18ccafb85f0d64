"""Which bytes a transfer connector's descriptor for kernel block k must cover, and the rules its descriptor lists obey.

A transfer connector (NIXL) hands its transport one descriptor (address, length) per region and kernel block: a manager
block of `ratio` kernel blocks is moved as `ratio` descriptors. Derived here from the oracle's expected views only
(oracles/touch.py), never from vLLM:

- `kernel_content(k)`  the element bytes of kernel block k in every layer with a cache of its own (the unpadded content,
                       inline scales included: they are elements of the views);
- `block_padding(b)`   the bytes manager block b owns that hold no element (page padding, alignment tails, the rest of a
                       block-outermost row): block b's own, which its descriptors may carry (as the offloading connector's
                       regions may: a transfer that moves them writes only the receiving block's own padding);
- `check`              each descriptor against those sets: no byte of another block, every content byte covered, no two
                       descriptors sharing a byte, except two of one block id in layers that are one cache (a KV-sharing
                       layer and its target) or in two groups (contract.block_id_held_by_one_group), where the regions'
                       layers are known.
Never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fuzz.case import Case
from oracles import contract, touch
from oracles.expectation import Expectation, ViewExpectation
from oracles.strided import Strided


@dataclass(frozen=True)
class Descriptor:
    """One transfer descriptor as the oracle reads it: [start, end) of `buffer`, for kernel block `kernel_block` of a
    region."""

    region: int
    kernel_block: int
    buffer: int
    start: int
    end: int

    @property
    def bytes(self) -> touch.Bytes:
        return {self.buffer: touch.Spans.of([self.start], [self.end])} if self.end > self.start else {}


@dataclass(frozen=True)
class Problem:
    """What one descriptor (or block) got wrong: `kind` is "foreign", "missed", "overlap" or "outside"."""

    kind: str
    region: int
    kernel_block: int
    message: str
    byte_set: touch.Bytes


def kernel_layout(view: ViewExpectation, block: int, sub: int) -> Strided | None:
    """The elements of kernel block `sub` of manager block `block` in a view split into kernel blocks (None past its rows)."""
    rows = touch.kernel_rows(view, block)
    if sub >= len(rows):
        return None
    axis = view.block_axis
    shape = view.shape[:axis] + (1,) + view.shape[axis + 1 :]
    return Strided(shape, view.byte_strides, view.byte_offset + rows[sub] * view.byte_strides[axis], view.element_size)


def splits_evenly(expected: Expectation, ratio: int) -> bool:
    """Every cache view is split into `ratio` kernel blocks per manager block (else only whole manager blocks are judged)."""
    return all(view.kernel_ratio == ratio for name in touch.cache_layers(expected) for view in expected.layers[name].views)


def block_is_one_run(layout: str) -> bool:
    """Whether a layer's block is one run of bytes in a 0.29+ layout: the heads lie inside the block, and the layers
    outside the heads (LBHNC, BLNHC: yes; LHBNC, BHLNC: one run per head). A connector that moves one span per block and
    region (Mooncake) moves the others by one region per head or refuses them: a refusal, not a crash. The older names
    (NHD, HND) keep blocks whole."""
    if "B" not in layout:
        return True
    return layout.index("B") < layout.index("H") and layout.index("L") < layout.index("H")


def kernel_content(expected: Expectation, kernel_block: int, ratio: int) -> touch.Bytes:
    """The element bytes of kernel block `kernel_block` (manager block kernel_block // ratio) in every cache layer."""
    block, sub = divmod(kernel_block, ratio)
    parts = []
    for name in touch.cache_layers(expected):
        for view in expected.layers[name].views:
            layout = kernel_layout(view, block, sub)
            if layout is not None:
                parts.append({view.buffer: touch.layout_spans(layout)})
    return touch.union(*parts)


def block_content(expected: Expectation, block: int) -> touch.Bytes:
    return touch.owned(expected, touch.cache_layers(expected), block)


def block_padding(case: Case, expected: Expectation, block: int) -> touch.Bytes:
    return touch.minus(touch.tile(case, expected, block), block_content(expected, block))


def check(case: Case, expected: Expectation, descriptors: list[Descriptor], ratio: int,
          region_layers: Sequence[str] | None = None) -> Problem | None:
    """The first rule the descriptors break, or None. `ratio` is the kernel blocks per manager block the connector uses;
    `region_layers`, where the connector names them, the layer of each region (by region index)."""
    may_share = _same_block_aliases(case, region_layers) if region_layers is not None else _never
    return (_outside(descriptors) or _per_block(case, expected, descriptors, ratio) or _overlap(descriptors, may_share))


def _never(first: Descriptor, second: Descriptor) -> bool:
    return False


def _same_block_aliases(case: Case, region_layers: Sequence[str]) -> Callable[[Descriptor, Descriptor], bool]:
    """Whether two descriptors may share bytes: both of one block id, in layers that are one cache (a KV-sharing layer
    reads and writes its target's) or in two groups (a block id is one group's at a time)."""
    group_of = {name: index for index, group in enumerate(case.groups) for name in group.layers}
    target_of = dict(case.kv_sharing)

    def cache(region: int) -> str:
        name = region_layers[region]
        return target_of.get(name, name)

    def may_share(first: Descriptor, second: Descriptor) -> bool:
        if first.kernel_block != second.kernel_block:
            return False
        a, b = cache(first.region), cache(second.region)
        return a == b or (contract.block_id_held_by_one_group() and group_of.get(a) != group_of.get(b))

    return may_share


def _outside(descriptors: list[Descriptor]) -> Problem | None:
    for d in descriptors:
        if d.buffer < 0:
            return Problem("outside", d.region, d.kernel_block, f"starts at address {d.start}, outside every KV-cache buffer", {})
    return None


def _per_block(case: Case, expected: Expectation, descriptors: list[Descriptor], ratio: int) -> Problem | None:
    by_kernel: dict[int, list[Descriptor]] = {}
    for d in descriptors:
        by_kernel.setdefault(d.kernel_block, []).append(d)
    kernel_level = splits_evenly(expected, ratio)
    for kernel_block in sorted(by_kernel):
        block = kernel_block // ratio
        if block >= case.num_blocks:
            d = by_kernel[kernel_block][0]
            return Problem("foreign", d.region, kernel_block, f"is for kernel block {kernel_block}, past the cache's "
                                                              f"{case.num_blocks * ratio} kernel blocks", d.bytes)
        content = kernel_content(expected, kernel_block, ratio) if kernel_level else block_content(expected, block)
        padding = block_padding(case, expected, block)
        for d in by_kernel[kernel_block]:
            stray = touch.minus(d.bytes, content)
            if not stray:
                continue
            if not touch.minus(stray, padding):
                continue  # block b's own padding, moved with its content
            return Problem("foreign", d.region, kernel_block, f"covers {_describe(touch.minus(stray, padding))} that are not "
                                                              f"kernel block {kernel_block}'s (manager block {block})", stray)
    return _missed(case, expected, by_kernel, ratio, kernel_level)


def _missed(case: Case, expected: Expectation, by_kernel: dict[int, list[Descriptor]], ratio: int, kernel_level: bool) -> Problem | None:
    for block in range(case.num_blocks):
        kernel_blocks = range(block * ratio, (block + 1) * ratio)
        covered = touch.union(*(d.bytes for k in kernel_blocks for d in by_kernel.get(k, [])))
        if kernel_level:
            for k in kernel_blocks:
                here = touch.union(*(d.bytes for d in by_kernel.get(k, [])))
                missed = touch.minus(kernel_content(expected, k, ratio), here)
                if missed:
                    return Problem("missed", -1, k, f"no descriptor of kernel block {k} (manager block {block}) covers "
                                                    f"{_describe(missed)} of it", missed)
        missed = touch.minus(block_content(expected, block), covered)
        if missed:
            return Problem("missed", -1, block * ratio, f"no descriptor of manager block {block} covers {_describe(missed)} of it", missed)
    return None


def _overlap(descriptors: list[Descriptor], may_share: Callable[[Descriptor, Descriptor], bool]) -> Problem | None:
    by_buffer: dict[int, list[Descriptor]] = {}
    for d in descriptors:
        if d.end > d.start:
            by_buffer.setdefault(d.buffer, []).append(d)
    for items in by_buffer.values():
        open_spans: list[Descriptor] = []  # the descriptors that reach past the current start
        for second in sorted(items, key=lambda d: (d.start, d.end)):
            open_spans = [d for d in open_spans if d.end > second.start]
            first = next((d for d in open_spans if not may_share(d, second)), None)
            if first is not None:
                shared = {second.buffer: touch.Spans.of([second.start], [min(first.end, second.end)])}
                message = f"shares {_describe(shared)} with the descriptor of region {first.region}, kernel block {first.kernel_block}"
                return Problem("overlap", second.region, second.kernel_block, message, shared)
            open_spans.append(second)
    return None


def _describe(byte_set: touch.Bytes) -> str:
    if not byte_set:
        return "no bytes"
    buffer = min(byte_set)
    return f"{touch.count(byte_set)} bytes, the first at byte {byte_set[buffer].first} of buffer {buffer}"


def received_tiles(case: Case, expected: Expectation, blocks: list[int]) -> list[list[int]]:
    """The bytes the receiving blocks own, content and padding ([buffer, start, end] each): all a transfer into them may
    change."""
    tiles = touch.union(*(touch.tile(case, expected, block) for block in blocks)) if blocks else {}
    return [[buffer, int(start), int(end)] for buffer, spans in tiles.items() for start, end in zip(spans.starts, spans.ends, strict=True)]


def stray(changed: list[list[int]], allowed: list[list[int]]) -> str | None:
    """Which changed bytes ([buffer, start, end] each) lie outside the allowed ones, described; None when none do."""
    def as_bytes(rows: list[list[int]]) -> touch.Bytes:
        return touch.union(*({buffer: touch.Spans.of([start], [end])} for buffer, start, end in rows)) if rows else {}

    outside = touch.minus(as_bytes(changed), as_bytes(allowed))
    return _describe(outside) if outside else None
