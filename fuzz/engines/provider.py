"""The atheris engine at the level of libFuzzer's bytes: how they draw a case, and where they wait.

`ProviderSource` is the case space's Source protocol (`fuzz.space`) over an
atheris.FuzzedDataProvider, so `case_from_bytes` is a pure function of the bytes and the target's
declarations: the coordinator redraws a case from the bytes a dead process left behind.

`InputSlot` is where it finds them: before each case the child copies libFuzzer's input into a
small memory-mapped file (a few microseconds, versus tens for the case as JSON) and counts each
verdict there after it. The file outlives a process killed by anything.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from fuzz.case import Case
from fuzz.space import Rejected, draw_case
from fuzz.targets.base import TargetInfo

T = TypeVar("T")

STATUSES = ("pass", "finding", "rejected", "skipped", "unbuildable")  # the verdicts a slot counts, in its layout order


# ---------------------------------------------------------------------------------- the source


class ProviderSource:
    """The space's Source protocol over an atheris.FuzzedDataProvider.

    Every choice is ConsumeIntInRange (libFuzzer takes integers from the end of its input). An
    exhausted provider answers the lower bound: the first option, False for chance(), so short
    inputs draw the simplest cases, as Hypothesis' shrinker would.
    """

    def __init__(self, provider: Any) -> None:
        self.provider = provider

    @classmethod
    def from_bytes(cls, data: bytes) -> ProviderSource:
        import atheris

        return cls(atheris.FuzzedDataProvider(data))

    def integer(self, low: int, high: int) -> int:
        return int(self.provider.ConsumeIntInRange(low, high))

    def choice(self, options: Sequence[T]) -> T:
        return options[self.provider.ConsumeIntInRange(0, len(options) - 1)]

    def chance(self, percent: int) -> bool:
        return bool(self.provider.ConsumeIntInRange(0, 99) >= 100 - percent)

    def reject(self) -> NoReturn:
        raise Rejected


def case_from_bytes(data: bytes, info: TargetInfo, synthetic: bool = True) -> Case | None:
    """The case these fuzzer bytes draw, or None when they make no valid case."""
    try:
        return draw_case(ProviderSource.from_bytes(data), info, synthetic=synthetic)
    except Rejected:
        return None


# ---------------------------------------------------------------------------------- the slot


@dataclass(frozen=True)
class SlotState:
    """A slot as read, by this process or another."""

    busy: bool  # a case was running when the slot was read
    data: bytes  # the input of the last case begun
    counts: dict[str, int]


class InputSlot:
    """The case in flight and the verdict counts, in a memory-mapped file that outlives the process.

    Layout: busy flag, input length, one counter per status, then the input bytes.
    """

    HEAD = struct.Struct("<qq" + "q" * len(STATUSES))
    CAPACITY = 4096  # above libFuzzer's -max_len: a corpus file from elsewhere may be longer
    SIZE = HEAD.size + CAPACITY

    def __init__(self, path: Path) -> None:
        if not path.exists() or path.stat().st_size < self.SIZE:
            path.write_bytes(b"\0" * self.SIZE)
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, self.SIZE)
        self._counts = dict(self.read().counts)

    def begin(self, data: bytes) -> None:
        data = data[:self.CAPACITY]
        self._map[self.HEAD.size:self.HEAD.size + len(data)] = data
        struct.pack_into("<qq", self._map, 0, 1, len(data))

    def end(self, status: str) -> None:
        self._counts[status] += 1
        struct.pack_into("<q", self._map, 16 + 8 * STATUSES.index(status), self._counts[status])
        struct.pack_into("<q", self._map, 0, 0)

    def read(self) -> SlotState:
        busy, length, *counts = self.HEAD.unpack_from(self._map, 0)
        data = bytes(self._map[self.HEAD.size:self.HEAD.size + min(max(length, 0), self.CAPACITY)])
        return SlotState(bool(busy), data, dict(zip(STATUSES, counts, strict=True)))

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
