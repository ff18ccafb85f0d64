"""Packed per-block slabs (vLLM 0.24 - 0.28): where the planner puts each layer when a case asks for packing.

Asked for by the cross-layer-blocks connector setting or by DeepSeek V4's UniformTypeKVCacheSpecs groups,
the planner gives every layer an offset inside one per-block slab of `block_stride` bytes, all layers on
one backing allocation; block b of a layer is its page at `offset + b * block_stride`. Which layers pack
and where they sit are vLLM's design choices, stated in oracles/contract.py (`packs`, `bucketed_slab`,
`per_group_slab`); from 0.29 the layout's letters place layers and this module has nothing to say.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuzz.case import Case
from oracles import contract as rules
from oracles import pages
from oracles.contract import Contract


@dataclass(frozen=True)
class Slab:
    block_stride: int  # bytes from block b's slab to block b + 1's
    offsets: dict[str, int]  # layer -> first byte of its page inside a slab

    def dense(self, page_bytes: int) -> bool:
        """Whether a layer's page is its whole slab (the next block's page follows right after)."""
        return self.block_stride == page_bytes


def slab(case: Case, contract: Contract) -> Slab | None:
    """The slab the contract packs the case into; None when the planner does not pack it."""
    if not rules.packs(contract, case.packing, len(case.groups)):
        return None
    groups = [[(name, pages.page(g.spec).page_bytes) for name in g.layers] for g in case.groups]
    stride, offsets = rules.bucketed_slab(groups) if contract.packing == "bucketed" else rules.per_group_slab(groups)
    return Slab(stride, offsets)
