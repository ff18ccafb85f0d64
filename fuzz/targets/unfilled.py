"""Raw KV-cache buffers left unfilled where no check reads their bytes.

vLLM allocates each raw buffer with `torch.zeros`. Filling it is about a third of a metadata-only case's time, and no
fact the view path compares (shapes, strides, offsets, the buffer each view lies on, sizes) depends on the fill. Where a
run reads no byte it has not written first (no physical probe, no region consumer; the zeroers, the block copy and the
kernel probe fill every buffer with their own bytes before they start), the byte buffers come from `torch.empty`
instead: real memory on the chosen device, holding the same views. Tensors of other dtypes are still zeroed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

BYTE_DTYPES = (torch.int8, torch.uint8)


@contextlib.contextmanager
def unfilled_buffers() -> Iterator[None]:
    zeros = torch.zeros

    def empty_bytes(*size: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> torch.Tensor:
        if dtype in BYTE_DTYPES and "out" not in kwargs:
            return torch.empty(*size, dtype=dtype, **kwargs)
        return zeros(*size, dtype=dtype, **kwargs)

    torch.zeros = empty_bytes  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.zeros = zeros
