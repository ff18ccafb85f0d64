"""fuzz/targets/byte_runs.py's fill pattern: the bytes a consumer's buffers hold before it runs, so that a byte it moves
shows where it came from. A byte that lands in another buffer, or at another offset however far, must differ from the
byte expected there."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fuzz.targets import byte_runs
from fuzz.targets.readback import changed, fill_pattern, snapshot

SIZE = 1 << 22  # past the 2 MiB period the first pattern had


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a == b))


def test_every_buffer_has_its_own_pattern():
    first = byte_runs.pattern_bytes(0, SIZE)
    for other in (1, 2, 5, 15, 16, 1000):
        assert agreement(first, byte_runs.pattern_bytes(other, SIZE)) < 0.01


@pytest.mark.parametrize("shift", [1, 2, 64, 4096, 8192, 1 << 16, 1 << 20, 1 << 21])
def test_a_byte_moved_within_a_buffer_differs_from_the_one_expected(shift: int):
    pattern = byte_runs.pattern_bytes(3, SIZE)
    assert agreement(pattern[:-shift], pattern[shift:]) < 0.01


def test_a_slice_is_the_same_bytes_wherever_it_is_worked_out():
    whole = byte_runs.pattern_bytes(2, 3 << 20)
    assert np.array_equal(byte_runs.pattern_slice(2, 12345, 2 << 20), whole[12345:2 << 20])
    far = 5 << 30  # past what is kept: worked out on the spot, the same function
    assert np.array_equal(byte_runs.pattern_slice(2, far, far + 100), byte_runs._worked_out(2, far, far + 100))
    assert byte_runs.pattern_slice(40, 10, 90).size == 80  # a buffer index past the kept ones
    assert byte_runs.pattern_slice(1, 50, 10).size == 0


def test_the_kept_pattern_cannot_be_written_through():
    with pytest.raises(ValueError):
        byte_runs.pattern_bytes(0, 100)[0] = 1


def test_a_block_copied_from_another_buffer_at_the_same_offset_is_seen():
    raw = [torch.empty(64 << 10, dtype=torch.int8) for _ in range(2)]
    fill_pattern(raw)
    before = snapshot(raw)
    raw[0][8192:12288] = raw[1][8192:12288]  # the right block of the wrong buffer
    moved = changed(raw, before)
    assert {(buffer, start >= 8192, end <= 12288) for buffer, start, end in moved} == {(0, True, True)}
    assert sum(end - start for _, start, end in moved) > 4096 * 0.99
