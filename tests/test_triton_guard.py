"""Interpreted kernels store only inside the buffers `guarded` names (fuzz/targets/triton_interp.py): a zeroer aimed past
the end of the cache has its stray stores dropped and counted, not written over the process's heap."""

from __future__ import annotations

import pytest
import torch

from fuzz.targets import triton_interp

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

if not triton_interp.interpreting():
    pytest.skip("Triton compiles kernels here: the guard applies to the interpreter only", allow_module_level=True)


@triton.jit
def fill_kernel(out, count, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out + offsets, tl.full((BLOCK,), 7, tl.uint8), mask=offsets < count)


def test_stores_past_the_buffers_are_dropped_and_counted():
    buffer = torch.zeros(16, dtype=torch.uint8)
    with triton_interp.guarded([buffer]) as outside:
        fill_kernel[(1,)](buffer, 40, BLOCK=64)  # 24 bytes past the end
    assert buffer.tolist() == [7] * 16
    assert (outside.count, outside.first) == (24, (0, 0))


def test_stores_inside_every_named_buffer_are_left_alone():
    buffers = [torch.zeros(32, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)]
    with triton_interp.guarded(buffers) as outside:
        fill_kernel[(1,)](buffers[0], 32, BLOCK=32)
        fill_kernel[(1,)](buffers[1][2:], 6, BLOCK=8)  # a view inside the second buffer's storage
    assert outside.count == 0 and outside.first is None
    assert buffers[0].tolist() == [7] * 32 and buffers[1].tolist() == [0, 0] + [7] * 6


def test_the_interpreter_stores_as_before_once_the_guard_is_closed():
    buffer = torch.zeros(8, dtype=torch.uint8)
    with triton_interp.guarded([buffer]):
        pass
    fill_kernel[(1,)](buffer, 8, BLOCK=8)
    assert buffer.tolist() == [7] * 8
