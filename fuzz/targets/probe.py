"""The physical probe, target side: write through every view on the device, read the raw bytes back.

For each layer and each of its tensors, the tensor's raw buffer is filled with a canary byte,
every element is written through vLLM's view with a value derived from its row-major index
(as an integer of the element's width, so any dtype carries it bit for bit), and the buffer is
read back. `fuzz.verdict.probe` rebuilds the same bytes from the oracle's expected view alone.
All of it is vectorized torch work, on CPU or CUDA alike.
"""

from __future__ import annotations

from typing import Any

import torch

from fuzz.targets.readback import host_bytes

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
            records.append({"buffer": index, "bytes": host_bytes(buffer)})
        readback[name] = records
    return readback


def storage_key(tensor: torch.Tensor) -> int:
    """Which raw allocation a tensor views. Meta tensors (production-size metadata runs) have no
    addresses, so the storage object itself tells them apart."""
    storage = tensor.untyped_storage()
    return storage._cdata if tensor.is_meta else storage.data_ptr()  # type: ignore[attr-defined]
