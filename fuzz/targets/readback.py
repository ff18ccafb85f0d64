"""Bytes of the raw KV-cache buffers as plain records: fills, and which bytes a call changed.

A byte set crosses the process boundary as intervals `[buffer, start, end)` (sorted, merged), so
a consumer that clears a page reports one line, not thousands of offsets.
"""

from __future__ import annotations

import numpy as np
import torch

from fuzz.targets.byte_runs import CANARY, Intervals, mask_runs, pattern_bytes
from oracles.strided import Strided, intervals


def fill(raw: list[torch.Tensor], value: int = CANARY) -> None:
    for buffer in raw:
        buffer.view(torch.uint8).fill_(value)


def fill_pattern(raw: list[torch.Tensor]) -> None:
    """Every byte a value derived from its buffer and offset (`pattern_bytes`), so a moved byte shows where it came from."""
    for index, buffer in enumerate(raw):
        flat = buffer.view(torch.uint8)
        flat.copy_(torch.from_numpy(pattern_bytes(index, flat.numel()).copy()).to(flat.device))


def host_bytes(buffer: torch.Tensor) -> np.ndarray:
    """A copy of the buffer's bytes on the host. Never `.numpy()` on the buffer itself: a storage numpy has shared stays
    unresizable for good, and vLLM code run later on the same buffer (the offloading connector resizes its storage)
    would then fail because kvfuzz looked at it."""
    return buffer.view(torch.uint8).to("cpu", copy=True).numpy()


def snapshot(raw: list[torch.Tensor]) -> list[np.ndarray]:
    return [host_bytes(buffer) for buffer in raw]


def changed(raw: list[torch.Tensor], before: list[np.ndarray]) -> Intervals:
    """The bytes that differ from `before`, as intervals per buffer."""
    out: Intervals = []
    for index, (buffer, old) in enumerate(zip(raw, before, strict=True)):
        now = host_bytes(buffer)
        out += [[index, start, end] for start, end in mask_runs(now != old)]
    return out


def changed_to(raw: list[torch.Tensor], before: list[np.ndarray], value: int) -> tuple[Intervals, Intervals]:
    """The changed bytes that now hold `value`, and those that hold anything else."""
    to_value: Intervals = []
    other: Intervals = []
    for index, (buffer, old) in enumerate(zip(raw, before, strict=True)):
        now = host_bytes(buffer)
        moved = now != old
        to_value += [[index, start, end] for start, end in mask_runs(moved & (now == value))]
        other += [[index, start, end] for start, end in mask_runs(moved & (now != value))]
    return to_value, other


def values(raw: list[torch.Tensor], intervals: Intervals) -> list[str]:
    """The bytes now at each interval, hex."""
    now = {b: host_bytes(raw[b]) for b in {b for b, _, _ in intervals}}  # one copy each: a changed set may be many runs
    return [now[b][s:e].tobytes().hex() for b, s, e in intervals]


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
    """The bytes `tensor[row]` (or all of `tensor`) addresses, as intervals on the raw buffers (worked out from its strides,
    never listing its bytes)."""
    part = tensor if row is None else tensor[row]
    element = part.element_size()
    layout = Strided(tuple(part.shape), tuple(stride * element for stride in part.stride()), 0, element)
    base = part.data_ptr()
    starts, ends = intervals(layout)
    return [addresses.locate(base + int(start), int(end - start)) for start, end in zip(starts, ends, strict=True)]
