"""The Slot a worker writes and the coordinator reads (fuzz/campaign/protocol.py): what the coordinator's hang watch
sees must be one write, never half of one."""

from __future__ import annotations

import struct
import time

import pytest

from fuzz.campaign import protocol


def test_a_read_that_catches_a_write_half_done_is_read_again(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    slot = protocol.Slot(tmp_path / "slot")
    slot.finish()  # a fresh slot: idle, started at the clock's epoch
    slot.start(4, 17)
    _, _, started, _ = struct.unpack_from(protocol.Slot.FORMAT, slot._map, 0)
    real = struct.unpack_from
    torn = iter([(4, 17, 0, protocol.RUNNING)])  # the new phase beside the old start: what a read racing the write can see

    def racing(fmt, buffer, offset=0):
        return next(torn, None) or real(fmt, buffer, offset)

    monkeypatch.setattr(protocol.struct, "unpack_from", racing)
    batch, index, seen, phase = slot.read()
    monkeypatch.undo()
    assert (batch, index, seen, phase) == (4, 17, started, protocol.RUNNING)
    assert (time.monotonic_ns() - seen) / 1e9 < 60  # the pool's watch would not call this case a hang


def test_a_slot_reads_what_was_written_last(tmp_path) -> None:
    slot = protocol.Slot(tmp_path / "slot")
    slot.start(1, 2, protocol.SHRINKING)
    assert slot.read()[:2] == (1, 2) and slot.read()[3] == protocol.SHRINKING
    slot.finish()
    assert slot.read()[3] == protocol.IDLE
    assert protocol.Slot(tmp_path / "slot").read() == slot.read()  # as another process sees the same file
