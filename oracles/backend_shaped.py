"""Expected views under the backend-shaped contracts (vLLM 0.19 - 0.28, `_reshape_kv_cache`).

See oracles/contract.py for the contract. In short, per layer:
- buffers: with one KV-cache group every layer has a buffer of its own; with several, the i-th
  layer of every group shares buffer i (pages of one size). A buffer holds num_blocks pages.
- an attention view has the shape the backend declares for (kernel blocks, stored slots per
  kernel block, heads, head size) and is laid out densely in the backend's stride order; that
  shape must cover exactly the spec's unpadded page;
- a manager block splits into block_size / kernel_block_size kernel blocks (kernel block
  b * ratio + j is the j-th piece of block b) where the contract splits, and never when the
  cache is compressed;
- a padded page sets the block pitch to the page size, which needs the block axis outermost;
- on a buffer shared with Mamba, the block axis is hoisted outermost so block b stays in page b;
- on a buffer shared by backends that put different axes outside the block axis, every layer takes one arrangement
  (contract.mixed_pool_arrangement: K/V apart on the V2 runner, page by page on the V1 runner);
- Mamba layers get one view per state tensor packed inside the page, or one int8 view of whole
  pages, as the contract says;
- a case the planner packs (0.24+, oracles/packing.py) puts every layer on one backing buffer: block b
  of a layer is its page at the layer's offset in block b's slab.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from fuzz.case import DTYPE_SIZES, Case, GroupCase, evaluate_shape, parse_shape_entry
from oracles import contract as rules
from oracles import declarations, packing, pages
from oracles.contract import Contract
from oracles.expectation import Expectation, LayerExpectation, PageRule, ViewExpectation, broken, dense_strides, rejected, with_sharers


@dataclass(frozen=True)
class Broken:
    """A layer whose backend's declaration breaks the contract."""

    function: str
    message: str


@dataclass(frozen=True)
class Placement:
    """Where a layer's blocks sit: its raw buffer, the first byte of block 0, and (packed) the pitch of its blocks."""

    buffer: int
    offset: int = 0
    slab: packing.Slab | None = None
    with_mamba: bool = False  # the buffer holds Mamba state too
    mixed: str | None = None  # the arrangement of a buffer whose backends arrange blocks differently


def expect(case: Case, contract: Contract, runner: str = "v2") -> Expectation:
    if not case.groups:
        # An attention-free model: the views are checked on every other case; here only that its plan holds nothing.
        return Expectation(contract=contract.name, exact_buffers=True, planned_blocks=rules.planned_blocks(case.num_blocks, attention_free=True))
    page_sizes = {pages.page(g.spec).page_bytes for g in case.groups}
    slab = packing.slab(case, contract)
    buckets = _page_buckets(case, contract)
    if slab is None and buckets is None and len(case.groups) > 1 and len(page_sizes) > 1:
        return rejected(contract.name, "KV-cache groups that share buffers need one page size")
    pools = [members for _, members in buckets] if buckets is not None else _pools(case, slab)
    mamba_pools = {pool for pool, members in enumerate(pools) if any(case.groups[case.group_of(m)].spec.kind == "mamba" for m in members)}
    buffer_of = {name: pool for pool, members in enumerate(pools) for name in members}
    mixed_pools = _mixed_pools(case, pools) if slab is None else set()
    arrangement = rules.mixed_pool_arrangement(runner)
    layers: dict[str, LayerExpectation] = {}
    kernel_sizes: dict[int, int] = {}
    for index, group in enumerate(case.groups):
        kernel_sizes[index] = group.kernel_block_size or group.spec.block_size
        for name in group.layers:
            pool = buffer_of[name]
            # A slab that is this layer's page alone (each group one layer, all at byte 0) lays out as an unpacked pool.
            packed = slab if slab is not None and not slab.dense(pages.page(group.spec).page_bytes) else None
            where = Placement(pool, slab.offsets[name] if slab else 0, packed, pool in mamba_pools,
                              arrangement if pool in mixed_pools else None)
            built = _layer(name, index, group, case.num_blocks, where, contract)
            if isinstance(built, Broken):
                return broken(contract.name, built.function, built.message, name)
            if isinstance(built, str):
                return rejected(contract.name, built, name)
            layers[name] = built
    layers = with_sharers(layers, case.kv_sharing)
    return Expectation(
        contract=contract.name,
        buffers=_buffer_sizes(case, contract, slab, buckets),
        layers=layers,
        kv_sharing=dict(case.kv_sharing),
        kernel_block_sizes=kernel_sizes,
    )


def buffer_bytes(case: Case, contract: Contract) -> int:
    """Bytes of all the raw buffers the contract gives this case."""
    slab = packing.slab(case, contract)
    return sum(_buffer_sizes(case, contract, slab, _page_buckets(case, contract)))


def _buffer_sizes(case: Case, contract: Contract, slab: packing.Slab | None, buckets: list[tuple[int, list[str]]] | None) -> tuple[int, ...]:
    if slab is not None:
        return (case.num_blocks * slab.block_stride,)
    if buckets is not None:
        return tuple(case.num_blocks * page_bytes for page_bytes, _ in buckets)
    if not case.groups:
        return ()
    pitch = max(pages.page(g.spec).page_bytes for g in case.groups)
    return tuple(case.num_blocks * pitch for _ in _pools(case, None))


def _page_buckets(case: Case, contract: Contract) -> list[tuple[int, list[str]]] | None:
    """The (page size, layers) buffers of several UniformTypeKVCacheSpecs groups where the planner buckets them by page size."""
    if not (contract.page_buckets and case.packing == "uniform_type" and len(case.groups) > 1):
        return None
    return rules.page_bucket_pools([[(name, pages.page(g.spec).page_bytes) for name in g.layers] for g in case.groups])


def _mixed_pools(case: Case, pools: list[list[str]]) -> set[int]:
    """The pools whose attention layers' backends put different axes outside the block axis in memory: there a block id
    would name different bytes in different layers, unless vLLM gives them one arrangement."""
    outside = [_outside_blocks(group) for group in case.groups]
    return {pool for pool, members in enumerate(pools)
            if len({outside[case.group_of(name)] for name in members} - {None}) > 1}


def _outside_blocks(group: GroupCase) -> tuple[int | str, ...] | None:
    """The declared shape entries a group's backend lays out outside its block axis, outermost first (None: no attention
    shape with one block axis, as for Mamba)."""
    pattern = group.declared_shape or (group.synthetic_backend.shape if group.synthetic_backend else None)
    if not group.spec.is_attention or pattern is None:
        return None
    symbols = [parse_shape_entry(e)[1] for e in pattern]
    if symbols.count("B") != 1:
        return None
    order = group.declared_stride_order or (group.synthetic_backend.stride_order if group.synthetic_backend else None)
    order = tuple(order) if order is not None else tuple(range(len(pattern)))
    if sorted(order) != list(range(len(pattern))):
        return None
    return tuple(pattern[axis] for axis in order[: order.index(symbols.index("B"))])


def _pools(case: Case, slab: packing.Slab | None) -> list[list[str]]:
    if slab is not None:
        return [case.layer_names]
    return rules.shaped_pools([g.layers for g in case.groups])


def _layer(name: str, index: int, group: GroupCase, num_blocks: int, where: Placement, contract: Contract) -> LayerExpectation | Broken | str:
    page = pages.page(group.spec)
    if page.padded and not contract.padded_pages:
        return "this contract has no padded pages"
    if group.spec.kind == "mamba":
        if contract.mamba_views == "none":
            return "this contract has no Mamba layers"
        return _mamba_layer(name, index, group, num_blocks, where, page, contract)
    return _attention_layer(name, index, group, num_blocks, where, page, contract)


def _attention_layer(name: str, index: int, group: GroupCase, num_blocks: int, where: Placement, page: pages.Page,
                     contract: Contract) -> LayerExpectation | Broken | str:
    spec = group.spec
    pattern = group.declared_shape or (group.synthetic_backend.shape if group.synthetic_backend else None)
    pitch = where.slab.block_stride if where.slab else page.page_bytes
    if pattern is None:
        # Asking the backend failed, so the error is all there is to judge: only the rules that need no shape apply.
        rule = PageRule(origin=where.offset, block_pitch=pitch, span_starts=(0,), span_len=page.page_bytes, pad_start=page.unpadded_bytes)
        return LayerExpectation(name=name, group=index, views=(), pages=rule)
    order = group.declared_stride_order or (group.synthetic_backend.stride_order if group.synthetic_backend else None)
    order = tuple(order) if order is not None else tuple(range(len(pattern)))

    kernel = group.kernel_block_size or spec.block_size
    if spec.block_size % kernel:
        return "the kernel block size does not divide the block size"
    ratio = rules.shaped_kernel_ratio(contract, spec.block_size, kernel, spec.compress_ratio)
    if contract.shape_block == "tokens":
        slots = spec.block_size
    else:
        slots = kernel if ratio > 1 else spec.block_size // spec.compress_ratio
    if ratio > 1 and page.padded:
        return "a padded page cannot be split into kernel blocks"
    esz = DTYPE_SIZES[spec.dtype]
    symbols = [parse_shape_entry(e)[1] for e in pattern]
    shape = per_block = None
    if symbols.count("B") == 1:
        # A synthetic backend's "D" is what one head's K (or V) takes in storage elements (the head size for plain elements).
        head = pages.half_elements(spec) if group.synthetic_backend is not None else spec.head_size
        if head is None:
            return "a synthetic backend's head dim cannot hold K and V of different sizes apart"
        shape = evaluate_shape(pattern, blocks=num_blocks * ratio, slots=slots, heads=spec.num_kv_heads, head_size=head)
        block_axis = symbols.index("B")
        per_block = math.prod(shape) // max(shape[block_axis], 1) * ratio * esz
    fault = declarations.shaped_fault(group.backend_name, pattern, order, shape, per_block, page.unpadded_bytes, not spec.is_mla)
    if fault is not None:
        return Broken(*fault)
    assert shape is not None

    physical = order
    if where.slab is not None or rules.mamba_pool_hoists_blocks(where.with_mamba) or where.mixed == "page":
        physical = (block_axis,) + tuple(a for a in order if a != block_axis)
    elif where.mixed == "kv-outer":
        # The K/V pair is an axis of two beside the block axis; a fused head whose shape has none cannot be kept apart.
        pair = next((axis for axis in (block_axis - 1, block_axis + 1) if 0 <= axis < len(shape) and pattern[axis] == 2), None)
        if pair is None:
            return "a buffer whose backends arrange blocks differently keeps K and V apart, and this backend's shape has no K/V axis"
        physical = (pair, block_axis) + tuple(a for a in order if a not in (pair, block_axis))
    strides = dense_strides(shape, physical, esz)
    if where.slab is not None:
        unfit = rules.packed_page(ratio > 1)
        if unfit is not None:
            return unfit
        strides[block_axis] = where.slab.block_stride
    elif page.padded:
        if not rules.shaped_padding_fits(physical[0] == block_axis):
            return "padded pages need the block axis outermost"
        strides[block_axis] = page.page_bytes
    view = ViewExpectation(shape=shape, byte_strides=tuple(strides), byte_offset=where.offset, buffer=where.buffer, dtype=spec.dtype,
                           element_size=esz, block_axis=block_axis, kernel_ratio=ratio, kernel_stride=ratio)
    outer = physical[: physical.index(block_axis)]
    starts = sorted(sum(i * strides[a] for a, i in zip(outer, combo, strict=True))
                    for combo in itertools.product(*(range(shape[a]) for a in outer)))
    pitch = ratio * strides[block_axis]
    padded = page.padded or where.slab is not None
    length = page.page_bytes if padded else pitch
    rule = PageRule(origin=where.offset, block_pitch=pitch, span_starts=tuple(starts), span_len=length,
                    pad_start=page.unpadded_bytes if padded else length)
    return LayerExpectation(name=name, group=index, views=(view,), pages=rule, runner_arranged=where.mixed is not None)


def _mamba_layer(name: str, index: int, group: GroupCase, num_blocks: int, where: Placement, page: pages.Page,
                 contract: Contract) -> LayerExpectation | str:
    spec = group.spec
    pitch = where.slab.block_stride if where.slab else page.page_bytes
    rule = PageRule(origin=where.offset, block_pitch=pitch, span_starts=(0,), span_len=page.page_bytes, pad_start=page.unpadded_bytes)
    if contract.mamba_views == "page-bytes":
        view = ViewExpectation(shape=(num_blocks, 1, 1, page.page_bytes), byte_strides=(pitch, page.page_bytes, page.page_bytes, 1),
                               byte_offset=where.offset, buffer=where.buffer, dtype="int8", element_size=1, block_axis=0)
        return LayerExpectation(name=name, group=index, views=(view,), pages=rule, addresses_padding=True)
    views = []
    offset = 0
    for state_shape, dtype in zip(spec.mamba_shapes, spec.mamba_dtypes, strict=True):
        esz = DTYPE_SIZES[dtype]
        if (where.offset + offset) % esz or pitch % esz:
            return "a Mamba state tensor does not start on a whole number of its elements in every page"
        shape = (num_blocks, *state_shape)
        strides = dense_strides(shape, tuple(range(len(shape))), esz)
        strides[0] = pitch
        views.append(ViewExpectation(shape=shape, byte_strides=tuple(strides), byte_offset=where.offset + offset, buffer=where.buffer,
                                     dtype=dtype, element_size=esz, block_axis=0))
        offset += math.prod(state_shape) * esz
    return LayerExpectation(name=name, group=index, views=tuple(views), pages=rule)
