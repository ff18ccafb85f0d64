"""What the oracle expects of a case: accept it with these views, or reject it with a reason.

Every expected view is a strided byte layout (shape, byte strides, byte offset into one raw
buffer), so the comparator can check vLLM's view metadata arithmetically and only enumerate
bytes when it has to explain a difference.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class PageRule:
    """The bytes manager block b may occupy: `len(span_starts)` spans of `span_len` bytes at
    `origin + b * block_pitch + start`. Bytes from `pad_start` to `span_len` of a span are padding."""

    origin: int
    block_pitch: int
    span_starts: tuple[int, ...]
    span_len: int
    pad_start: int

    def spans(self, block: int) -> list[tuple[int, int]]:
        base = self.origin + block * self.block_pitch
        return [(base + s, base + s + self.span_len) for s in self.span_starts]

    def padding(self, block: int) -> list[tuple[int, int]]:
        if self.pad_start >= self.span_len:
            return []
        base = self.origin + block * self.block_pitch
        return [(base + s + self.pad_start, base + s + self.span_len) for s in self.span_starts]


@dataclass(frozen=True)
class ViewExpectation:
    """One tensor a layer must get.

    `block_axis` indexes kernel blocks: view block k belongs to manager block
    k // kernel_stride when k % kernel_stride < kernel_ratio; other view blocks are gaps that a
    packed kernel-page view spans but never addresses.
    """

    shape: tuple[int, ...]
    byte_strides: tuple[int, ...]
    byte_offset: int
    buffer: int
    dtype: str
    element_size: int
    block_axis: int
    kernel_ratio: int = 1
    kernel_stride: int = 1

    def element_offsets(self, owned_only: bool = True) -> np.ndarray:
        """Byte offset of every element's first byte, row-major; -1 for gap positions unless
        `owned_only` is False (a write through the whole view lands on the gaps too)."""
        offsets = np.full((), self.byte_offset, dtype=np.int64)
        for size, stride in zip(self.shape, self.byte_strides, strict=True):
            offsets = offsets[..., None] + np.arange(size, dtype=np.int64) * stride
        if not owned_only:
            return offsets.reshape(-1)
        return np.where(self.owned_mask(), offsets, -1).reshape(-1)

    def element_blocks(self) -> np.ndarray:
        """Manager block of every element, row-major; -1 for gap positions."""
        k = np.arange(self.shape[self.block_axis], dtype=np.int64)
        block = np.where(k % self.kernel_stride < self.kernel_ratio, k // self.kernel_stride, -1)
        view = [1] * len(self.shape)
        view[self.block_axis] = -1
        return np.broadcast_to(block.reshape(view), self.shape).reshape(-1)

    def owned_mask(self) -> np.ndarray:
        k = np.arange(self.shape[self.block_axis], dtype=np.int64)
        view = [1] * len(self.shape)
        view[self.block_axis] = -1
        return np.broadcast_to((k % self.kernel_stride < self.kernel_ratio).reshape(view), self.shape)


@dataclass(frozen=True)
class LayerExpectation:
    name: str
    group: int
    views: tuple[ViewExpectation, ...]
    pages: PageRule
    # Mamba page views of vLLM 0.27-0.28 cover whole pages, padding included, on purpose.
    addresses_padding: bool = False
    # The runner picks the block arrangement of this layer's pool itself (contract.mixed_pool_arrangement): the two model
    # runners may lay it out differently, each consistently.
    runner_arranged: bool = False


@dataclass(frozen=True)
class Expectation:
    contract: str
    buffers: tuple[int, ...] = ()  # bytes each raw buffer must hold at least
    exact_buffers: bool = False  # and no more: vLLM allocates exactly them (one backing allocation, 0.29+)
    planned_blocks: int | None = None  # the blocks the planner's config must give (None: not checked)
    layers: dict[str, LayerExpectation] = field(default_factory=dict)
    kv_sharing: dict[str, str] = field(default_factory=dict)
    kernel_block_sizes: dict[int, int] = field(default_factory=dict)
    reject_reason: str | None = None
    reject_layer: str | None = None  # a layer of the group the reason (or broken declaration) is about
    # A backend's declaration breaks the contract: (the vLLM function that declared it, what is wrong).
    broken_declaration: tuple[str, str] | None = None

    @property
    def accepted(self) -> bool:
        return self.reject_reason is None

    @property
    def buffer_bytes(self) -> int:
        return sum(self.buffers)


def rejected(contract: str, reason: str, layer: str | None = None) -> Expectation:
    return Expectation(contract=contract, reject_reason=reason, reject_layer=layer)


def broken(contract: str, function: str, message: str, layer: str | None) -> Expectation:
    """A backend declared something the contract forbids: a finding whatever vLLM then does."""
    return Expectation(contract=contract, reject_reason=f"broken declaration: {message}", reject_layer=layer,
                       broken_declaration=(function, message))


def with_sharers(layers: dict[str, LayerExpectation], kv_sharing: Iterable[tuple[str, str]]) -> dict[str, LayerExpectation]:
    """A KV-sharing layer has no cache of its own: it expects exactly its target's view."""
    return {**layers, **{sharer: layers[target] for sharer, target in kv_sharing}}


def dense_strides(shape: tuple[int, ...], order: tuple[int, ...], element_size: int) -> list[int]:
    """Byte strides of `shape` laid out densely with axes in physical `order`, outermost first."""
    strides = [0] * len(shape)
    pitch = element_size
    for axis in reversed(order):
        strides[axis] = pitch
        pitch *= shape[axis]
    return strides
