"""Bytes of the raw KV-cache buffers as plain records: fills, and which bytes a call changed.

A byte set crosses the process boundary as intervals `[buffer, start, end)` (sorted, merged), so
a consumer that clears a page reports one line, not thousands of offsets.
"""

from __future__ import annotations

import numpy as np
import torch

CANARY = 0x5A  # never 0: a zeroed byte always differs from it

Intervals = list[list[int]]


def fill(raw: list[torch.Tensor], value: int = CANARY) -> None:
    for buffer in raw:
        buffer.view(torch.uint8).fill_(value)


def fill_pattern(raw: list[torch.Tensor]) -> None:
    """Every byte a value derived from its buffer and offset (`pattern_bytes`), so a moved byte shows where it came from."""
    for index, buffer in enumerate(raw):
        flat = buffer.view(torch.uint8)
        flat.copy_(torch.from_numpy(pattern_bytes(index, flat.numel())).to(flat.device))


def pattern_bytes(buffer: int, size: int) -> np.ndarray:
    offsets = np.arange(size, dtype=np.uint64) + np.uint64(buffer) * np.uint64(0x10000000)
    return ((offsets * np.uint64(2654435761)) >> np.uint64(13)).astype(np.uint8)


def snapshot(raw: list[torch.Tensor]) -> list[np.ndarray]:
    return [buffer.view(torch.uint8).cpu().numpy().copy() for buffer in raw]


def changed(raw: list[torch.Tensor], before: list[np.ndarray]) -> Intervals:
    """The bytes that differ from `before`, as intervals per buffer."""
    out: Intervals = []
    for index, (buffer, old) in enumerate(zip(raw, before, strict=True)):
        now = buffer.view(torch.uint8).cpu().numpy()
        out += [[index, start, end] for start, end in runs(np.flatnonzero(now != old))]
    return out


def changed_to(raw: list[torch.Tensor], before: list[np.ndarray], value: int) -> tuple[Intervals, Intervals]:
    """The changed bytes that now hold `value`, and those that hold anything else."""
    to_value: Intervals = []
    other: Intervals = []
    for index, (buffer, old) in enumerate(zip(raw, before, strict=True)):
        now = buffer.view(torch.uint8).cpu().numpy()
        moved = now != old
        to_value += [[index, start, end] for start, end in runs(np.flatnonzero(moved & (now == value)))]
        other += [[index, start, end] for start, end in runs(np.flatnonzero(moved & (now != value)))]
    return to_value, other


def values(raw: list[torch.Tensor], intervals: Intervals) -> list[str]:
    """The bytes now at each interval, hex."""
    return [raw[b].view(torch.uint8)[s:e].cpu().numpy().tobytes().hex() for b, s, e in intervals]


def runs(offsets: np.ndarray) -> list[tuple[int, int]]:
    """Sorted offsets as [start, end) runs."""
    if offsets.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(offsets) != 1)
    starts = np.concatenate(([offsets[0]], offsets[breaks + 1]))
    ends = np.concatenate((offsets[breaks] + 1, [offsets[-1] + 1]))
    return [(int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


class Addresses:
    """Absolute host or device addresses -> (buffer index, offset), for regions vLLM computes as pointers."""

    def __init__(self, raw: list[torch.Tensor]) -> None:
        self.spans = [(b.untyped_storage().data_ptr(), b.untyped_storage().nbytes()) for b in raw]

    def locate(self, address: int, length: int) -> list[int]:
        for index, (base, size) in enumerate(self.spans):
            if base <= address < base + size:
                return [index, address - base, address - base + length]
        return [-1, address, address + length]


def region_of(tensor: torch.Tensor, row: int | None, addresses: Addresses) -> Intervals:
    """The bytes `tensor[row]` (or all of `tensor`) addresses, as intervals on the raw buffers."""
    part = tensor if row is None else tensor[row]
    element = part.element_size()
    offsets = np.zeros((), dtype=np.int64)
    for size, stride in zip(part.shape, part.stride(), strict=True):
        offsets = offsets[..., None] + np.arange(size, dtype=np.int64) * stride * element
    base = part.data_ptr()
    starts = np.unique(offsets.reshape(-1))
    covered = np.unique((starts[:, None] + np.arange(element, dtype=np.int64)[None, :]).reshape(-1))
    out: Intervals = []
    for start, end in runs(covered):
        out.append(addresses.locate(base + start, end - start))
    return out
