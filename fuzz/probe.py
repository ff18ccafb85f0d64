"""The physical probe: write through every view on the device, read the raw bytes back.

For each layer and each of its tensors, the tensor's raw buffer is filled with a canary byte,
every element is written through vLLM's view with a value derived from its row-major index
(as an integer of the element's width, so any dtype carries it bit for bit), and the buffer is
read back. The check then rebuilds the same bytes from the oracle's expected view alone:
pattern bytes where the oracle puts each element, canary everywhere else (padding, other
layers' pages, the tail). All of it is vectorized torch/numpy work, on CPU or CUDA alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fuzz.targets.base import Outcome, decode_bytes
from fuzz.targets.common import storage_key
from oracles.expectation import Expectation, ViewExpectation

CANARY = 0xA5
_INT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = 0x9E3779B1


def pattern(numel: int, element_size: int, salt: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The value element e of a tensor gets, as an integer tensor `element_size` bytes wide.

    Never equal to a run of canary bytes, and different for neighbouring elements."""
    index = torch.arange(numel, dtype=torch.int64, device=device)
    bits = 8 * element_size
    mixed = ((index + salt * 7919) * _MIX) >> 7
    if bits < 63:
        mixed = mixed & ((1 << bits) - 1)
    canary = int.from_bytes(bytes([CANARY]) * element_size, "little")
    mixed = torch.where(mixed == canary, mixed ^ 1, mixed)
    if element_size == 1:
        return mixed.to(torch.uint8)
    # Two's complement wrap into the signed integer type of that width.
    wrapped = torch.where(mixed >= (1 << (bits - 1)), mixed - (1 << bits), mixed) if bits < 64 else mixed
    return wrapped.to(_INT_DTYPES[element_size])


def physical_probe(views: dict[str, Any], raw: list[torch.Tensor]) -> dict[str, Any]:
    """Per layer and tensor: which buffer it lives on and that buffer's bytes after writing it."""
    pointers = {storage_key(buffer): i for i, buffer in enumerate(raw)}
    seen: dict[int, str] = {}
    readback: dict[str, Any] = {}
    for name, value in views.items():
        tensors = value if isinstance(value, (list, tuple)) else [value]
        if tensors and id(tensors[0]) in seen:
            continue  # a KV-sharing alias of a layer probed already
        if tensors:
            seen[id(tensors[0])] = name
        records = []
        for salt, tensor in enumerate(tensors):
            index = pointers.get(storage_key(tensor), -1)
            if index < 0:
                records.append({"buffer": -1, "bytes": None})
                continue
            buffer = raw[index]
            buffer.view(torch.uint8).fill_(CANARY)
            width = tensor.element_size()
            values = pattern(tensor.numel(), width, salt, tensor.device).reshape(tensor.shape)
            tensor.view(_INT_DTYPES[width]).copy_(values)
            records.append({"buffer": index, "bytes": buffer.view(torch.uint8).cpu().numpy().copy()})
        readback[name] = records
    return readback


def expected_bytes(view: ViewExpectation, buffer_size: int, salt: int) -> np.ndarray:
    """The buffer as it must read after writing the oracle's view with the probe pattern."""
    out = np.full(buffer_size, CANARY, dtype=np.uint8)
    # Every element, gaps of packed kernel-page views included: the probe writes the whole view.
    starts = view.element_offsets(owned_only=False)
    values = pattern(int(starts.size), view.element_size, salt).numpy().view(np.uint8).reshape(-1, view.element_size)
    for byte in range(view.element_size):
        out[starts + byte] = values[:, byte]
    return out


def check(expected: Expectation, outcome: Outcome) -> str | None:
    """None when every probed byte is where, and what, the oracle says; else what differs."""
    if outcome.probe is None:
        return None
    for name, records in outcome.probe.items():
        layer = expected.layers.get(name)
        if layer is None:
            continue
        for salt, (record, view) in enumerate(zip(records, layer.views, strict=False)):
            actual = decode_bytes(record["bytes"])
            if actual is None:
                return f"{name}: tensor {salt} is not on a raw buffer"
            wanted = expected_bytes(view, actual.size, salt)
            differ = np.flatnonzero(actual != wanted)
            if differ.size:
                first = int(differ[0])
                return (f"{name}: {differ.size} bytes differ from the contract, first at byte {first} "
                        f"(read {actual[first]:#04x}, expected {wanted[first]:#04x})")
    return None
