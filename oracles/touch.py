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
Byte sets are `{buffer: sorted unique byte offsets}` over the expectation's buffers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from fuzz.case import Case, GroupCase, parse_shape_entry
from oracles import contract as rules
from oracles.expectation import Expectation, ViewExpectation

Bytes = dict[int, np.ndarray]


def union(*sets: Bytes) -> Bytes:
    out: dict[int, list[np.ndarray]] = {}
    for byte_set in sets:
        for buffer, offsets in byte_set.items():
            out.setdefault(buffer, []).append(offsets)
    return {buffer: np.unique(np.concatenate(parts)) for buffer, parts in out.items()}


def _spans(buffer: int, spans: list[tuple[int, int]]) -> Bytes:
    if not spans:
        return {}
    return {buffer: np.unique(np.concatenate([np.arange(start, end, dtype=np.int64) for start, end in spans]))}


def cache_layers(expected: Expectation) -> list[str]:
    """The layers with a cache of their own (KV-sharing layers alias their target's)."""
    return [name for name in expected.layers if name not in expected.kv_sharing]


def kernel_rows(view: ViewExpectation, block: int) -> list[int]:
    """The view's blocks (kernel blocks) that belong to manager block `block`."""
    first = block * view.kernel_stride
    return [first + j for j in range(view.kernel_ratio) if first + j < view.shape[view.block_axis]]


def _block_starts(view: ViewExpectation, block: int) -> np.ndarray:
    """Element start offsets of block `block` in the view, row-major within the block."""
    offsets = view.element_offsets(owned_only=False).reshape(view.shape)
    return np.take(offsets, kernel_rows(view, block), axis=view.block_axis).reshape(-1)


def _element_bytes(starts: np.ndarray, element_size: int) -> np.ndarray:
    return (starts[:, None] + np.arange(element_size, dtype=np.int64)[None, :]).reshape(-1)


def owned(expected: Expectation, layers: list[str], block: int) -> Bytes:
    """The bytes of block `block`'s elements in `layers`."""
    parts: list[Bytes] = []
    for name in layers:
        for view in expected.layers[name].views:
            parts.append({view.buffer: np.unique(_element_bytes(_block_starts(view, block), view.element_size))})
    return union(*parts)


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
            nexts = [s for other_buffer, other in layers if other_buffer == buffer
                     for b in (block, block + 1) for s, _ in other.spans(b) if end <= s < limit]
            spans = [(start, min([limit, *nexts]))]
        parts.append(_spans(buffer, spans))
        pitches.add((buffer, rule.block_pitch))
    if rules.block_owns_its_row(rules.CONTRACTS[expected.contract].layout_placed, case.layout):
        for buffer, pitch in pitches:
            parts.append(_spans(buffer, [(block * pitch, (block + 1) * pitch)]))
    return union(*parts)


def zeroed_layers(case: Case, expected: Expectation, consumer: str) -> list[str]:
    """The layers a zeroer must clear block b in: those of the spec kinds it zeroes (rules.zeroed_kinds)."""
    kinds = rules.zeroed_kinds(consumer)
    return [name for name in cache_layers(expected) if case.groups[expected.layers[name].group].spec.kind in kinds]


def zeroer_serves(case: Case, expected: Expectation, consumer: str) -> bool:
    """Whether every page the zeroer clears starts, ends and steps on its granule (rules.zeroer_granule); a padded page's
    content too (the zeroer measures a page by the elements it holds)."""
    granule = rules.zeroer_granule(consumer)
    for name in zeroed_layers(case, expected, consumer):
        rule, view = expected.layers[name].pages, expected.layers[name].views
        steps = [rule.origin, rule.block_pitch, rule.span_len, min(rule.pad_start, rule.span_len), *rule.span_starts,
                 *(v.byte_offset for v in view), *(v.byte_strides[v.block_axis] for v in view)]
        if any(step % granule for step in steps):
            return False
    return True


def copy_map(expected: Expectation, layers: list[str], src: int, dst: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """For a copy src -> dst: per buffer, the owned bytes of dst and the bytes of src they must hold (aligned)."""
    pairs: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for name in layers:
        for view in expected.layers[name].views:
            source, target = _block_starts(view, src), _block_starts(view, dst)
            pairs.setdefault(view.buffer, []).append((_element_bytes(target, view.element_size), _element_bytes(source, view.element_size)))
    return {buffer: (np.concatenate([t for t, _ in items]), np.concatenate([s for _, s in items])) for buffer, items in pairs.items()}


@dataclass(frozen=True)
class TokenMap:
    """Where one token's elements live, in the cache write's element order."""

    buffer: int
    element_size: int
    offsets: np.ndarray | None  # byte offset of each element; None where the in-block order is the backend's own
    heads: np.ndarray  # the head slot of each element
    head_bytes: dict[int, np.ndarray]  # head slot -> bytes of (block, head) in the layer
    block_bytes: np.ndarray  # bytes of the token's block in the layer


def token_map(case: Case, expected: Expectation, layer: str, block: int, position: int, mla: bool) -> TokenMap | None:
    """Where each element of token (block, position) of `layer` lives; None when the oracle cannot say (a declared shape
    it cannot read as blocks, slots, heads and dims)."""
    want = expected.layers[layer]
    group = case.groups[want.group]
    owner = dict(case.kv_sharing).get(layer, layer)
    if group.layer_heads:  # layers that differ in heads: this layer's own spec
        group = dataclasses.replace(group, spec=group.layer_spec(group.layers.index(owner)), layer_heads=())
    view = want.views[0]
    spec = group.spec
    axes = _axes(group, len(view.shape))
    if axes is None or view.kernel_stride != view.kernel_ratio:
        return None  # packed kernel pages are compressed caches, which the kernel probe does not write
    kernel = spec.block_size // view.kernel_ratio
    # Kernel blocks split a block in place (rules.in_place_kernel_stride): the slot's kernel block is the view's row.
    row, state = divmod(rules.token_slot(block, position, spec.block_size), kernel)
    head_size, value_size = spec.head_size, (spec.head_size_v if spec.head_size_v is not None else spec.head_size)
    order = rules.content_order(mla)
    if mla:  # one vector of head_size elements, its parts in the order the content holds them
        parts = [(0, 0, c) for c in range(head_size)]
    else:  # the write's K then V, each heads x dims; the content holds them in `order`
        heads = spec.num_kv_heads
        halves = {"K": [(order.index("K"), h, d) for h in range(heads) for d in range(head_size)],
                  "V": [(order.index("V"), h, d) for h in range(heads) for d in range(value_size)]}
        parts = halves["K"] + halves["V"]
    starts = view.element_offsets(owned_only=False).reshape(view.shape)
    offsets = np.array([starts[_index(axes, row, state, kv, h, d, head_size)] for kv, h, d in parts], dtype=np.int64)
    head_of = np.array([h for _, h, _ in parts], dtype=np.int64)
    head_axis = axes.index("H") if "H" in axes else None
    block_starts = np.take(starts, kernel_rows(view, block), axis=view.block_axis)
    head_bytes = {}
    for head in np.unique(head_of).tolist():
        rows = block_starts if head_axis is None else np.take(block_starts, [head], axis=head_axis)
        head_bytes[head] = np.unique(_element_bytes(rows.reshape(-1), view.element_size))
    private = rules.private_block_interior(group.backend_name)
    return TokenMap(buffer=view.buffer, element_size=view.element_size, offsets=None if private else offsets, heads=head_of,
                    head_bytes=head_bytes, block_bytes=np.unique(_element_bytes(block_starts.reshape(-1), view.element_size)))


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


def _index(axes: list[str], row: int, state: int, kv: int, head: int, dim: int, head_size: int) -> tuple[int, ...]:
    values = {"B": row, "T": state, "H": head, "KV": kv, "D": dim, "C": kv * head_size + dim, "1": 0}
    return tuple(values[axis] for axis in axes)
