"""HiSparse caches, from what they mean: which bytes each sparse-MLA layer's host, resident and hot blocks and each indexer
block must occupy, and how large the host pool must be.

A HiSparse model (DeepSeek V3.2-style sparse MLA) keeps every sparse-MLA layer's KV on the host, one page per host block;
the device holds, per layer, a resident copy and a hot buffer of whole pages, and each layer's indexer cache, in one pool
whose groups overlay each other (a block id is one group's at a time). The pages come from oracles/pages.py; every
design choice of vLLM's this relies on is a rule in oracles/contract.py. Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuzz.case import Case, SpecCase, replace
from oracles import contract, pages

SOURCE, INDEXER, RESIDENT, HOT = "source", "indexer", "resident", "hot"
ROLES = (SOURCE, INDEXER, RESIDENT, HOT)
HOST, DEVICE = "host", "device"


@dataclass(frozen=True)
class Model:
    """What HiSparse must lay out for a case: each sparse-MLA layer's page, the indexer's page and both pools' blocks."""

    source_pages: dict[str, int]  # case layer -> its page, in HiSparse's blocks
    indexer_page: int
    host_blocks: int
    device_blocks: int

    def page(self, role: str, layer: str) -> int:
        if role == INDEXER:
            return self.indexer_page
        source = self.source_pages[layer]
        return source if role == SOURCE else contract.hisparse_device_copy_page(source)

    def blocks(self, role: str) -> int:
        return self.host_blocks if role == SOURCE else self.device_blocks

    @property
    def host_pool_bytes(self) -> int:
        return self.host_blocks * sum(self.source_pages.values())


@dataclass(frozen=True)
class View:
    """One cache view as vLLM made it: its blocks in a pool, in bytes from the pool's start."""

    name: str  # how the check names it (vLLM's cache name)
    layer: str  # the case's layer it serves
    role: str  # one of ROLES
    group: int  # the KV-cache group whose block table addresses it
    pool: str  # HOST or DEVICE
    first: int  # byte offset of block 0
    stride: int  # bytes from one block to the next
    extent: int  # bytes from a block's first byte to its last, both included
    content: int  # bytes a block's elements hold
    blocks: int


@dataclass(frozen=True)
class Problem:
    kind: str  # "page", "outside", "overlap", "host-pool", "sharing"
    message: str


def refused(layout: str, row_bytes: int) -> str | None:
    """Why vLLM's HiSparse refuses a layout or a cache row before any view (None: it takes them)."""
    if not contract.hisparse_layout_accepted(layout):
        return "HiSparse lays out its device pool only in a block-outermost, block-compact layout (BLHNC, BLNHC)"
    if not contract.hisparse_row_accepted(row_bytes):
        return "HiSparse moves 16-byte aligned rows only"
    return None


def indexer_spec() -> SpecCase:
    return SpecCase(kind="mla", block_size=contract.hisparse_block_tokens(), num_kv_heads=1,
                    head_size=contract.hisparse_indexer_row_bytes(), dtype="uint8")


def source_spec(spec: SpecCase) -> SpecCase:
    """A sparse-MLA layer's spec in HiSparse's blocks."""
    return replace(spec, block_size=contract.hisparse_block_tokens())


def expect(case: Case, host_budget: int) -> Model:
    source_pages = {layer: pages.page(source_spec(group.layer_spec(position))).page_bytes
                    for group in case.groups for position, layer in enumerate(group.layers)}
    return Model(source_pages=source_pages, indexer_page=pages.page(indexer_spec()).page_bytes,
                 host_blocks=contract.hisparse_host_blocks(host_budget, list(source_pages.values())),
                 device_blocks=case.num_blocks)


def judge(model: Model, views: list[View], pool_bytes: dict[str, int], readers: dict[str, list[View]]) -> Problem | None:
    """The first problem of vLLM's views: a block that is not one page of its spec, a view past its pool, two live blocks
    sharing a byte, a host pool of another size than its blocks need, a KV-sharing layer reading other buffers."""
    return (_missing(model, views) or _pages(model, views) or _outside(views, pool_bytes) or _host_pool(model, pool_bytes)
            or _overlap(views) or _sharing(views, readers))


def _missing(model: Model, views: list[View]) -> Problem | None:
    made = {(view.layer, view.role) for view in views}
    for layer in model.source_pages:
        for role in ROLES:
            if (layer, role) not in made:
                return Problem("page", f"layer {layer} has no {role} view")
    return None


def _pages(model: Model, views: list[View]) -> Problem | None:
    for view in views:
        page, blocks = model.page(view.role, view.layer), model.blocks(view.role)
        if view.extent != page or view.content != page:
            return Problem("page", f"{view.role} view {view.name}: a block spans {view.extent} bytes and holds {view.content}, "
                                   f"its page is {page}")
        if view.blocks != blocks:
            return Problem("page", f"{view.role} view {view.name} has {view.blocks} blocks, its pool {blocks}")
    return None


def _outside(views: list[View], pool_bytes: dict[str, int]) -> Problem | None:
    for view in views:
        end = view.first + (view.blocks - 1) * view.stride + view.extent
        if view.first < 0 or view.stride < 0 or end > pool_bytes[view.pool]:
            return Problem("outside", f"{view.role} view {view.name} spans bytes [{view.first}, {end}) of the "
                                      f"{pool_bytes[view.pool]}-byte {view.pool} pool")
    return None


def _host_pool(model: Model, pool_bytes: dict[str, int]) -> Problem | None:
    if pool_bytes[HOST] != model.host_pool_bytes:
        return Problem("host-pool", f"the host pool holds {pool_bytes[HOST]} bytes; {model.host_blocks} blocks of the layers' "
                                    f"pages need {model.host_pool_bytes}")
    return None


def _overlap(views: list[View]) -> Problem | None:
    for pool in sorted({view.pool for view in views}):
        spans = sorted((view.first + block * view.stride, view.first + block * view.stride + view.extent, index, block)
                       for index, view in enumerate(views) if view.pool == pool for block in range(view.blocks))
        live: list[tuple[int, int, int]] = []  # (end, view, block) of the spans that reach past the current start
        for start, end, index, block in spans:
            live = [span for span in live if span[0] > start]
            for _, other, other_block in live:
                first, second = views[other], views[index]
                if not contract.hisparse_groups_overlay(first.group == second.group, other_block == block):
                    return Problem("overlap", f"block {other_block} of {first.role} view {first.name} and block {block} of "
                                              f"{second.role} view {second.name} share {pool} bytes from {start}")
            live.append((end, index, block))
    return None


def _sharing(views: list[View], readers: dict[str, list[View]]) -> Problem | None:
    """A KV-sharing layer reads its target's buffers: each of its views is the target's view of that role."""
    by_role = {(view.layer, view.role): view for view in views}
    for reader, read in readers.items():
        for view in read:
            target = by_role.get((view.layer, view.role))
            if target is None or (view.pool, view.first, view.stride, view.extent, view.blocks) != (
                    target.pool, target.first, target.stride, target.extent, target.blocks):
                return Problem("sharing", f"KV-sharing layer {reader}'s {view.role} view is not its target {view.layer}'s")
    return None
