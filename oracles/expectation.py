"""What the oracle expects of a case: accept with these views, or reject with a reason."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class LayerExpectation:
    """The view one layer must get.

    `offsets` holds, in the view's logical (row-major) element order, the byte offset into the
    backing buffer where each element starts; -1 marks view positions that belong to no manager
    block (the gaps a packed kernel-block view spans but never addresses). `blocks` holds the
    manager block of each element (-1 for gaps). `pages` maps each block to the half-open byte
    spans that block may occupy, padding included, and `padding` to its padding spans.
    """

    name: str
    group: int
    shape: tuple[int, ...]
    dtype: str
    element_size: int
    offsets: np.ndarray
    blocks: np.ndarray
    pages: dict[int, list[tuple[int, int]]]
    padding: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Expectation:
    contract: str
    buffer_bytes: int = 0
    layers: dict[str, LayerExpectation] = field(default_factory=dict)
    kv_sharing: dict[str, str] = field(default_factory=dict)
    kernel_block_sizes: dict[int, int] = field(default_factory=dict)
    reject_reason: str | None = None

    @property
    def accepted(self) -> bool:
        return self.reject_reason is None


def rejected(contract: str, reason: str) -> Expectation:
    return Expectation(contract=contract, reject_reason=reason)
