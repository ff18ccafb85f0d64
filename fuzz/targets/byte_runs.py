"""Byte sets and fill patterns as plain numpy: what the target side records and the verdict side rebuilds, without torch
(a coordinator judging a consumer's record never imports it).

A byte set crosses the process boundary as intervals `[buffer, start, end)` (sorted, merged).
"""

from __future__ import annotations

import numpy as np

CANARY = 0x5A  # never 0: a zeroed byte always differs from it
PATTERN_CHUNK = 1 << 20  # bytes of pattern worked out at a time

Intervals = list[list[int]]


def pattern_bytes(buffer: int, size: int) -> np.ndarray:
    return pattern_slice(buffer, 0, size)


def pattern_slice(buffer: int, start: int, end: int) -> np.ndarray:
    """Bytes start..end-1 of `pattern_bytes(buffer, ...)`, worked out a chunk at a time (the arithmetic is 64-bit per byte)."""
    out = np.empty(max(0, end - start), dtype=np.uint8)
    for lo in range(start, end, PATTERN_CHUNK):
        hi = min(end, lo + PATTERN_CHUNK)
        offsets = np.arange(lo, hi, dtype=np.uint64) + np.uint64(buffer) * np.uint64(0x10000000)
        out[lo - start : hi - start] = ((offsets * np.uint64(2654435761)) >> np.uint64(13)).astype(np.uint8)
    return out


def runs(offsets: np.ndarray) -> list[tuple[int, int]]:
    """Sorted offsets as [start, end) runs."""
    if offsets.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(offsets) != 1)
    starts = np.concatenate(([offsets[0]], offsets[breaks + 1]))
    ends = np.concatenate((offsets[breaks] + 1, [offsets[-1] + 1]))
    return [(int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def mask_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) runs of True in a flat boolean array, found from its edges (no array of the set offsets)."""
    mask = mask.reshape(-1)
    if mask.size == 0:
        return []
    edges = np.flatnonzero(mask[1:] != mask[:-1]) + 1
    cuts = np.concatenate(([0], edges, [mask.size])).tolist()
    return [(cuts[i], cuts[i + 1]) for i in range(0 if mask[0] else 1, len(cuts) - 1, 2)]
