"""Backends as code under test: what a backend declares about a layer's cache, held to the contract.

A backend-shaped backend (vLLM <= 0.28) declares a cache shape and a stride order; a layout-placed
one (0.29+) publishes head slots and state bytes (customize_spec). A declaration that breaks the
contract is a finding of its own (`declaration`), whatever vLLM then builds from it: the shape
holds exactly the page's elements, there is one block axis, nothing but a K/V axis of size 2 lies
outside it in memory, the stride order is a permutation of the shape's axes, and published head
slots and state bytes hold exactly the heads' K and V where the cache is not quantized.
"""

from __future__ import annotations

from fuzz.case import parse_shape_entry
from oracles import contract as rules


def shaped_fault(backend: str, pattern: tuple[int | str, ...], order: tuple[int, ...], shape: tuple[int, ...] | None,
                 per_block_bytes: int | None, page_bytes: int, stores_kv_apart: bool) -> tuple[str, str] | None:
    """(vLLM function, what is wrong) when a declared cache shape / stride order breaks the contract, else None.

    `shape` and `per_block_bytes` are the declaration evaluated at the case's arguments (None when the
    block axis cannot be found, which is itself the fault)."""
    if sorted(order) != list(range(len(pattern))):
        return "get_kv_cache_stride_order", f"{backend} declares stride order {list(order)} for a {len(pattern)}-axis cache shape"
    blocks = [(i, parse_shape_entry(e)) for i, e in enumerate(pattern)]
    block_axes = [i for i, (_, symbol) in blocks if symbol == "B"]
    if len(block_axes) != 1 or blocks[block_axes[0]][1][0] != 1:
        return "get_kv_cache_shape", f"{backend} declares cache shape {list(pattern)} without exactly one block axis"
    assert shape is not None and per_block_bytes is not None
    if not rules.declared_shape_covers_page(per_block_bytes, 1, page_bytes):
        return "get_kv_cache_shape", (f"{backend} declares cache shape {list(shape)}: {per_block_bytes} bytes per block "
                                      f"for a page of {page_bytes} bytes")
    block_axis = block_axes[0]
    outside = order[: order.index(block_axis)]
    if any(not (stores_kv_apart and pattern[axis] == 2) for axis in outside):
        return "get_kv_cache_stride_order", (f"{backend} lays axes {[pattern[a] for a in outside]} of cache shape {list(pattern)} "
                                             "outside its block axis: a block is no page")
    return None


def published_fault(backend: str, quantized: bool, kv_heads: int, kv_bytes_per_head: int, head_slots: int,
                    state_bytes: int) -> str | None:
    """What is wrong when a backend's published head slots x state bytes do not hold exactly the heads' K and V (checked
    only for caches whose content is plain K and V: quantized caches add scales of their own)."""
    if head_slots < 1 or state_bytes < 1:
        return f"{backend} publishes {head_slots} head slots of {state_bytes} bytes"
    if not quantized and head_slots * state_bytes != kv_heads * kv_bytes_per_head:
        return (f"{backend} publishes {head_slots} head slots of {state_bytes} bytes per state for {kv_heads} KV heads of "
                f"{kv_bytes_per_head} bytes (K and V)")
    return None
