"""The page contract: how many bytes one manager block of one layer occupies.

A block of `block_size` tokens stores `states = block_size / compress_ratio` states for each of
`heads` head slots; a state is `content` bytes. The page is heads x states x content bytes,
optionally padded (explicit `page_size_padded`, or MLA `alignment` rounding). Derived from the
spec fields alone; see oracles/contract.py for what differs between vLLM generations.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from fuzz.case import DTYPE_SIZES, SpecCase


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Page:
    heads: int
    states: int
    content_bytes: int
    element_size: int
    unpadded_bytes: int
    page_bytes: int
    block_stride_alignment: int
    # vLLM applies the padded-page rules whenever a padded size is set, even one equal to the page.
    padded: bool


def element_size(spec: SpecCase) -> int:
    """Bytes per element of the view a layer gets: mamba layers stay raw bytes."""
    return 1 if spec.kind == "mamba" else DTYPE_SIZES[spec.dtype]


def content_bytes(spec: SpecCase) -> int:
    if spec.kind == "mamba":
        return sum(math.prod(shape) * DTYPE_SIZES[dtype] for shape, dtype in zip(spec.mamba_shapes, spec.mamba_dtypes, strict=False))
    if spec.state_content_bytes is not None:
        return spec.state_content_bytes
    value_head = spec.head_size_v
    if value_head is None:
        # MLA stores one latent vector per token; other kinds store K and V of equal size.
        value_head = 0 if spec.is_mla else spec.head_size
    return (spec.head_size + value_head) * DTYPE_SIZES[spec.dtype]


def heads(spec: SpecCase) -> int:
    if spec.kind == "mamba":
        return 1
    return spec.num_head_slots if spec.num_head_slots is not None else spec.num_kv_heads


def states(spec: SpecCase, tokens: int) -> int:
    """States that `tokens` tokens occupy; a mamba block holds one state whatever its size."""
    if spec.kind == "mamba":
        return 1
    return tokens // spec.compress_ratio


def unpadded_bytes(spec: SpecCase, tokens: int) -> int:
    return heads(spec) * states(spec, tokens) * content_bytes(spec)


def padded_bytes(spec: SpecCase, tokens: int) -> int:
    real = unpadded_bytes(spec, tokens)
    if spec.is_mla and spec.alignment is not None and round_up(real, spec.alignment) != real:
        return round_up(real, spec.alignment)
    if spec.page_size_padded is not None:
        return spec.page_size_padded
    return real


def block_stride_alignment(spec: SpecCase) -> int:
    """Bytes every block stride must be a multiple of (vLLM 0.31+ block_stride_alignment).

    0 means the alignment names a kernel block too small to hold one state: no valid stride.
    """
    if spec.block_stride_multiple_of is not None:
        kernel_tokens = math.gcd(spec.block_stride_multiple_of, spec.block_size)
        if kernel_tokens == spec.block_size:
            return 1
        return padded_bytes(spec, kernel_tokens)
    return spec.block_stride_alignment or 1


@functools.lru_cache(maxsize=8192)
def page(spec: SpecCase) -> Page:
    return Page(
        heads=heads(spec),
        states=states(spec, spec.block_size),
        content_bytes=content_bytes(spec),
        element_size=element_size(spec),
        unpadded_bytes=unpadded_bytes(spec, spec.block_size),
        page_bytes=padded_bytes(spec, spec.block_size),
        block_stride_alignment=block_stride_alignment(spec),
        padded=spec.page_size_padded is not None or padded_bytes(spec, spec.block_size) != unpadded_bytes(spec, spec.block_size),
    )
