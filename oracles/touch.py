"""Which bytes block b owns, for code that addresses KV blocks by bytes beyond the views.

Everything here is derived from the oracle's own expected views (ViewExpectation: every
element's byte address and manager block) and page rules (PageRule: the bytes block b may
occupy), with the few design choices of vLLM's that consumers depend on stated in
oracles/contract.py. Never imports vLLM.

- `owned(b)`   the element bytes of block b in the given layers (no padding, no gaps);
- `tile(b)`    every byte block b owns: its pages in every layer (padding and alignment tail
               included), and in a block-outermost layout the whole block row (a block id is one
               pool index);
- `copy_map`   for a block copy src -> dst: each owned byte of dst and the byte of src it must hold;
- `token_map`  where each element of token (b, p) of a layer lives, in a cache write's element
               order (K then V per head; an MLA latent then its rope part), and the bytes of its
               (block, head), for backends whose in-block order is their own.
Byte sets are `{buffer: Spans}`: per buffer sorted, disjoint intervals, worked out from the views' strides
(oracles/strided.py) and the page rules, so no set costs memory per byte.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fuzz.case import Case, GroupCase, parse_shape_entry
from oracles import contract as rules
from oracles.expectation import Expectation, ViewExpectation
from oracles.strided import Strided, byte_addresses, intervals, sub_layout


@dataclass(frozen=True, eq=False)
class Spans:
    """A set of byte offsets of one buffer as intervals [starts[i], ends[i]): ascending, non-empty, neither overlapping nor
    abutting (so two equal sets have equal arrays). `np.asarray(spans)` lists the offsets, for tests and small sets."""

    starts: np.ndarray
    ends: np.ndarray

    @staticmethod
    def of(starts: np.ndarray | list[int], ends: np.ndarray | list[int]) -> Spans:
        """The union of the intervals [starts[i], ends[i]), in any order, overlapping or empty."""
        starts, ends = np.asarray(starts, dtype=np.int64).reshape(-1), np.asarray(ends, dtype=np.int64).reshape(-1)
        keep = ends > starts
        starts, ends = starts[keep], ends[keep]
        if starts.size == 0:
            return EMPTY
        order = np.argsort(starts, kind="stable")
        starts, reach = starts[order], np.maximum.accumulate(ends[order])
        first = np.flatnonzero(np.concatenate(([True], starts[1:] > reach[:-1])))
        last = np.concatenate((first[1:] - 1, [starts.size - 1]))
        return Spans(starts[first], reach[last])

    @property
    def count(self) -> int:
        return int((self.ends - self.starts).sum())

    @property
    def first(self) -> int:
        return int(self.starts[0])

    def __bool__(self) -> bool:
        return bool(self.starts.size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Spans):
            return NotImplemented
        return np.array_equal(self.starts, other.starts) and np.array_equal(self.ends, other.ends)

    __hash__ = None  # type: ignore[assignment]

    def __or__(self, other: Spans) -> Spans:
        return Spans.of(np.concatenate((self.starts, other.starts)), np.concatenate((self.ends, other.ends)))

    def __sub__(self, other: Spans) -> Spans:
        return self._combine(other, lambda mine, theirs: mine & ~theirs)

    def __and__(self, other: Spans) -> Spans:
        return self._combine(other, lambda mine, theirs: mine & theirs)

    def _combine(self, other: Spans, keep: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Spans:
        # Between two consecutive boundaries of either set, membership in each is constant: decide each piece by its start.
        cuts = np.unique(np.concatenate((self.starts, self.ends, other.starts, other.ends)))
        lo, hi = cuts[:-1], cuts[1:]
        chosen = keep(self.holds(lo), other.holds(lo))
        return Spans.of(lo[chosen], hi[chosen])

    def holds(self, offsets: np.ndarray) -> np.ndarray:
        """Which of the offsets are in the set."""
        offsets = np.asarray(offsets, dtype=np.int64)
        index = np.searchsorted(self.starts, offsets, side="right") - 1
        return (index >= 0) & (self.ends[np.maximum(index, 0)] > offsets) if self.starts.size else np.zeros(offsets.shape, dtype=bool)

    def within(self, other: Spans) -> bool:
        return not self - other

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        if not self:
            return np.empty(0, dtype=dtype or np.int64)
        lengths = self.ends - self.starts
        offsets = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(self.starts - np.cumsum(lengths) + lengths, lengths)
        return offsets if dtype is None else offsets.astype(dtype)

    def __repr__(self) -> str:
        return f"Spans({list(zip(self.starts.tolist(), self.ends.tolist(), strict=True))})"


EMPTY = Spans(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))

Bytes = dict[int, Spans]  # buffer -> its bytes in the set; a buffer with none is left out


def union(*sets: Bytes) -> Bytes:
    parts: dict[int, list[Spans]] = {}
    for byte_set in sets:
        for buffer, spans in byte_set.items():
            parts.setdefault(buffer, []).append(spans)
    out = {buffer: Spans.of(np.concatenate([s.starts for s in items]), np.concatenate([s.ends for s in items]))
           for buffer, items in parts.items()}
    return {buffer: spans for buffer, spans in out.items() if spans}


def minus(left: Bytes, right: Bytes) -> Bytes:
    out = {buffer: spans - right[buffer] if buffer in right else spans for buffer, spans in left.items()}
    return {buffer: spans for buffer, spans in out.items() if spans}


def meets(left: Bytes, right: Bytes) -> bool:
    """The two sets share a byte."""
    return any(buffer in right and bool(spans & right[buffer]) for buffer, spans in left.items())


def count(byte_set: Bytes) -> int:
    return sum(spans.count for spans in byte_set.values())


def _spans(buffer: int, spans: list[tuple[int, int]]) -> Bytes:
    found = Spans.of([start for start, _ in spans], [end for _, end in spans])
    return {buffer: found} if found else {}


def layout_spans(layout: Strided) -> Spans:
    return Spans(*intervals(layout))


def cache_layers(expected: Expectation) -> list[str]:
    """The layers with a cache of their own (KV-sharing layers alias their target's)."""
    return [name for name in expected.layers if name not in expected.kv_sharing]


def kernel_rows(view: ViewExpectation, block: int) -> list[int]:
    """The view's blocks (kernel blocks) that belong to manager block `block`."""
    first = block * view.kernel_stride
    return [first + j for j in range(view.kernel_ratio) if first + j < view.shape[view.block_axis]]


def block_layout(view: ViewExpectation, block: int, rows: int | None = None) -> Strided:
    """The elements of block `block` in the view (its kernel rows, consecutive on the block axis; at most `rows` of them)."""
    found = kernel_rows(view, block)[:rows]
    axis = view.block_axis
    shape = view.shape[:axis] + (len(found),) + view.shape[axis + 1 :]
    offset = view.byte_offset + (found[0] if found else 0) * view.byte_strides[axis]
    return Strided(shape, view.byte_strides, offset, view.element_size)


def owned(expected: Expectation, layers: list[str], block: int) -> Bytes:
    """The bytes of block `block`'s elements in `layers`."""
    return union(*({view.buffer: layout_spans(block_layout(view, block))} for name in layers for view in expected.layers[name].views))


def tile(case: Case, expected: Expectation, block: int) -> Bytes:
    """Every byte block `block` owns: its page spans in every layer, and under a layout that puts blocks outermost the
    whole block row (rules.block_owns_its_row)."""
    parts: list[Bytes] = []
    pitches = set()
    layers = [(expected.layers[name].views[0].buffer if expected.layers[name].views else 0, expected.layers[name].pages)
              for name in cache_layers(expected)]
    for buffer, rule in layers:
        spans = rule.spans(block)
        if len(spans) == 1:  # a page and its alignment tail, up to the next page any layer places for this or the next block
            start, end = spans[0]
            limit = start + max(rule.span_len, rule.block_pitch)
            # A block past the cache's last one places no page: the last block's tail is its own.
            neighbours = [b for b in (block, block + 1) if b < case.num_blocks]
            nexts = [s for other_buffer, other in layers if other_buffer == buffer
                     for b in neighbours for s, _ in other.spans(b) if end <= s < limit]
            spans = [(start, min([limit, *nexts]))]
        parts.append(_spans(buffer, spans))
        pitches.add((buffer, rule.block_pitch))
    if rules.block_owns_its_row(rules.CONTRACTS[expected.contract].layout_placed, case.layout):
        for buffer, pitch in pitches:
            parts.append(_spans(buffer, [(block * pitch, (block + 1) * pitch)]))
    return union(*parts)


def zeroed_layers(case: Case, expected: Expectation, full_attention_only: bool) -> list[str]:
    """The layers a zeroer must clear block b in: those of the spec kinds it zeroes (rules.zeroed_kinds)."""
    kinds = rules.zeroed_kinds(full_attention_only)
    return [name for name in cache_layers(expected) if case.groups[expected.layers[name].group].spec.kind in kinds]


def zeroer_serves(case: Case, expected: Expectation, full_attention_only: bool, clears_words: bool) -> bool:
    """Whether every page the zeroer clears starts, ends and steps on its granule (rules.zeroer_granule); a padded page's
    content too (the zeroer measures a page by the elements it holds)."""
    granule = rules.zeroer_granule(clears_words)
    for name in zeroed_layers(case, expected, full_attention_only):
        rule, view = expected.layers[name].pages, expected.layers[name].views
        steps = [rule.origin, rule.block_pitch, rule.span_len, min(rule.pad_start, rule.span_len), *rule.span_starts,
                 *(v.byte_offset for v in view), *(v.byte_strides[v.block_axis] for v in view)]
        if any(step % granule for step in steps):
            return False
    return True


@dataclass(frozen=True)
class CopyPart:
    """One view's share of a block copy src -> dst: every byte of `target` (dst's elements, row-major) must hold the byte
    `shift` below it (src's: the views address both blocks alike, `shift` apart)."""

    layer: str
    target: Strided
    shift: int


def copy_parts(expected: Expectation, layers: list[str], src: int, dst: int) -> dict[int, list[CopyPart]]:
    """For a copy src -> dst: per buffer, each view's owned elements of dst and how far below them src's lie."""
    parts: dict[int, list[CopyPart]] = {}
    for name in layers:
        for view in expected.layers[name].views:
            source, target = kernel_rows(view, src), kernel_rows(view, dst)
            rows = min(len(source), len(target))
            shift = (target[0] - source[0]) * view.byte_strides[view.block_axis] if rows else 0
            parts.setdefault(view.buffer, []).append(CopyPart(name, block_layout(view, dst, rows), shift))
    return parts


def copy_map(expected: Expectation, layers: list[str], src: int, dst: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """`copy_parts` listed byte by byte: per buffer, the owned bytes of dst and the bytes of src they must hold (aligned)."""
    out = {}
    for buffer, parts in copy_parts(expected, layers, src, dst).items():
        targets = [byte_addresses(part.target) for part in parts]
        sources = [bytes_ - part.shift for bytes_, part in zip(targets, parts, strict=True)]
        out[buffer] = (np.concatenate(targets), np.concatenate(sources))
    return out


@dataclass(frozen=True)
class TokenMap:
    """Where one token's elements live, in the cache write's element order."""

    buffer: int
    element_size: int
    offsets: np.ndarray | None  # byte offset of each element; None where the in-block order is the backend's own
    heads: np.ndarray  # the head slot of each element
    head_bytes: dict[int, Spans]  # head slot -> bytes of (block, head) in the layer
    block_bytes: Spans  # bytes of the token's block in the layer


def token_map(case: Case, expected: Expectation, layer: str, block: int, position: int, mla: bool) -> TokenMap | None:
    """Where each element of token (block, position) of `layer` lives; None when the oracle cannot say (a declared shape
    it cannot read as blocks, slots, heads and dims)."""
    want = expected.layers[layer]
    group = case.groups[want.group]
    owner = dict(case.kv_sharing).get(layer, layer)
    group = group.of_layer(group.layers.index(owner))  # layers that differ in size: this layer's own spec
    view = want.views[0]
    spec = group.spec
    axes = _axes(group, len(view.shape))
    if axes is None or view.kernel_stride != view.kernel_ratio:
        return None  # packed kernel pages are compressed caches, which the kernel probe does not write
    kernel = spec.block_size // view.kernel_ratio
    # Kernel blocks split a block in place (rules.in_place_kernel_stride): the slot's kernel block is the view's row.
    row, state = divmod(rules.token_slot(block, position, spec.block_size), kernel)
    head_size, value_size = spec.head_size, (spec.head_size_v if spec.head_size_v is not None else spec.head_size)
    kv, head_of, dim = _parts(mla, spec.num_kv_heads, head_size, value_size)
    values = {"B": row, "T": state, "H": head_of, "KV": kv, "D": dim, "C": kv * head_size + dim, "1": 0}
    offsets = _element_offsets(view, [np.broadcast_to(np.asarray(values[axis], dtype=np.int64), kv.shape) for axis in axes])
    head_axis = axes.index("H") if "H" in axes else None
    rows = block_layout(view, block)
    head_bytes = {head: layout_spans(rows if head_axis is None else sub_layout(rows, head_axis, head)) for head in np.unique(head_of).tolist()}
    private = rules.private_block_interior(group.backend_name)
    return TokenMap(buffer=view.buffer, element_size=view.element_size, offsets=None if private else offsets, heads=head_of,
                    head_bytes=head_bytes, block_bytes=layout_spans(rows))


def _parts(mla: bool, heads: int, head_size: int, value_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(half, head, dim) of each element the write takes, in the order it takes them: for MLA one vector of head_size
    elements; otherwise K then V, each heads x dims, the half being where the content holds it (rules.content_order)."""
    if mla:
        dims = np.arange(head_size, dtype=np.int64)
        return np.zeros_like(dims), np.zeros_like(dims), dims
    order = rules.content_order(mla)
    halves = [(order.index("K"), head_size), (order.index("V"), value_size)]
    kv = np.concatenate([np.full(heads * size, half, dtype=np.int64) for half, size in halves])
    head = np.concatenate([np.repeat(np.arange(heads, dtype=np.int64), size) for _, size in halves])
    dim = np.concatenate([np.tile(np.arange(size, dtype=np.int64), heads) for _, size in halves])
    return kv, head, dim


def _element_offsets(view: ViewExpectation, index: list[np.ndarray]) -> np.ndarray:
    """The first byte of each of the view's elements at `index` (one array per axis), worked out from the strides (the
    view never listed)."""
    offsets = np.full(index[0].shape, view.byte_offset, dtype=np.int64)
    for axis, (where, size, stride) in enumerate(zip(index, view.shape, view.byte_strides, strict=True)):
        outside = (where < 0) | (where >= size)
        if outside.any():
            raise IndexError(f"index {int(where[outside][0])} is out of bounds for axis {axis} with size {size}")
        offsets += where * stride
    return offsets


def _axes(group: GroupCase, ndim: int) -> list[str] | None:
    """What each axis of the layer's view indexes: B (kernel block), T (slot), H (head), C (K then V dims), KV (2 halves), D
    (dims of one half), or 1 (a unit axis). Layout-placed views are [B, H, N, C]; backend-shaped ones follow the declared shape."""
    pattern = group.declared_shape or (group.synthetic_backend.shape if group.synthetic_backend else None)
    if pattern is None:
        return ["B", "H", "T", "C"] if ndim == 4 else None
    axes = []
    for entry in pattern:
        factor, symbol = parse_shape_entry(entry)
        if symbol is None:
            axes.append({1: "1", 2: "KV"}.get(factor, "?"))
        elif symbol == "D":
            axes.append({1: "D", 2: "C"}.get(factor, "?"))
        else:
            axes.append(symbol if factor == 1 else "?")
    if "?" in axes or len(axes) != ndim or any(axes.count(axis) > 1 for axis in axes if axis != "1"):
        return None  # a shape whose sizes coincide (heads and head size both 2) reads back ambiguously
    if not group.spec.is_mla and "H" not in axes and group.spec.num_kv_heads > 1:
        return None
    if "D" in axes and "KV" not in axes:
        axes[axes.index("D")] = "C"  # one vector per slot (MLA)
    return axes


