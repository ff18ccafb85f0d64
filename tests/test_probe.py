"""The physical probe: bytes written through real torch views read back as the oracle predicts."""

import numpy as np
import pytest
import torch

from fuzz.targets.probe import CANARY, pattern, physical_probe
from fuzz.verdict.probe import expected_bytes
from oracles.expectation import ViewExpectation


def test_pattern_is_never_canary_and_neighbours_differ():
    for width in (1, 2, 4, 8):
        values = pattern(5000, width, salt=3).numpy().view(np.uint8).reshape(-1, width)
        assert not (values == CANARY).all(axis=1).any()
        assert (values[1:] != values[:-1]).any(axis=1).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn])
def test_probe_readback_matches_the_expected_bytes_of_the_same_strided_view(dtype):
    raw = torch.zeros(4096, dtype=torch.int8)
    esz = torch.empty((), dtype=dtype).element_size()
    # blocks of 2 x 8 elements, padded to a 512-byte page: (4, 2, 8) with a page-sized block stride
    view = torch.as_strided(raw.view(dtype), (4, 2, 8), (512 // esz, 8, 1))
    readback = physical_probe({"l0": view}, [raw])["l0"][0]
    want = ViewExpectation(shape=(4, 2, 8), byte_strides=(512, 8 * esz, esz), byte_offset=0, buffer=0,
                           dtype=str(dtype).removeprefix("torch."), element_size=esz, block_axis=0)
    assert np.array_equal(readback["bytes"], expected_bytes(want, 4096, salt=0))
    moved = ViewExpectation(shape=(4, 2, 8), byte_strides=(512, 8 * esz, esz), byte_offset=esz, buffer=0,
                            dtype=want.dtype, element_size=esz, block_axis=0)
    assert not np.array_equal(readback["bytes"], expected_bytes(moved, 4096, salt=0)), "a misplaced view is caught"


def test_kv_sharing_aliases_are_probed_once():
    raw = torch.zeros(256, dtype=torch.int8)
    view = raw.view(torch.bfloat16).view(4, 32)
    readback = physical_probe({"a": view, "b": view}, [raw])
    assert list(readback) == ["a"]
