"""The kernel probe's reading of where a token's ids landed (fuzz/targets/kernel_probe.py `_landed`), against a reading
done element by element: buffers with ids written, some twice, bytes changed that carry no id, and odd-sized tails."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fuzz.targets.kernel_probe import ID_BASE, _landed


def element_by_element(raw: list[torch.Tensor], before: list[np.ndarray], width: int, base: int, count: int):
    """Each changed element in buffer order: an id not seen yet lands there; every other changed byte is stray."""
    landed = [-1] * count
    stray = []
    for index, (buffer, old) in enumerate(zip(raw, before, strict=True)):
        now = buffer.view(torch.uint8).numpy()
        explained = set()
        for element in range(now.size // width):
            span = slice(element * width, element * width + width)
            if (now[span] == old[span]).all():
                continue
            value = int.from_bytes(now[span].tobytes(), "little") - base
            if 0 <= value < count and landed[value] == -1:
                landed[value] = (index << 40) | element * width
                explained.update(range(span.start, span.stop))
        bytes_left = [int(b) for b in np.flatnonzero(now != old) if int(b) not in explained]
        for byte in bytes_left:  # [start, end) runs
            if stray and stray[-1][0] == index and stray[-1][2] == byte:
                stray[-1][2] = byte + 1
            else:
                stray.append([index, byte, byte + 1])
    return landed, stray


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", range(6))
def test_landed_agrees_with_reading_each_element(dtype, seed):
    rng = random.Random(seed)
    width = torch.finfo(dtype).bits // 8
    count = rng.randint(1, 40)
    raw, before = [], []
    for _ in range(rng.randint(1, 3)):
        old = np.frombuffer(rng.randbytes(rng.randint(1, 64) * width + rng.randint(0, width - 1)), dtype=np.uint8).copy()
        now = old.copy()
        elements = now.size // width
        for _ in range(rng.randint(0, 12)):  # ids, some of them written twice (another element, another buffer)
            if elements:
                element = rng.randrange(elements)
                now[element * width: element * width + width] = np.frombuffer(
                    (ID_BASE[dtype] + rng.randrange(count)).to_bytes(width, "little"), dtype=np.uint8)
        for _ in range(rng.randint(0, 6)):  # bytes that carry no id (and, in the tail, belong to no element)
            now[rng.randrange(now.size)] ^= rng.randint(1, 255)
        raw.append(torch.from_numpy(now))
        before.append(old)
    landed, stray = _landed(raw, before, dtype, count)
    expected_landed, expected_stray = element_by_element(raw, before, width, ID_BASE[dtype], count)
    assert landed.tolist() == expected_landed
    assert stray == expected_stray
