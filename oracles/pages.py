"""The page: how many bytes one manager block of one layer occupies, from the spec's meaning.

A block of `block_size` tokens stores `states` states for each of `heads` head slots; a state is
`content` bytes. The page is heads x states x content bytes, optionally padded. The content of a
state is what the backend published for it (`state_content_bytes`, with `num_head_slots`), else what
the cache dtype's definition says a token of a head occupies (oracles/dtypes.py). Which of vLLM's
design choices shape a page (K and V side by side in a state, one latent per MLA token, the MLA
alignment padding, block stride alignment in whole kernel blocks) is stated in oracles/contract.py.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from fuzz.case import DTYPE_SIZES, SpecCase
from oracles import contract, dtypes


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
    padded: bool


def element_size(spec: SpecCase) -> int:
    """Bytes per element of the view a layer gets: mamba layers stay raw bytes."""
    return 1 if spec.kind == "mamba" else DTYPE_SIZES[spec.dtype]


def content_bytes(spec: SpecCase) -> int:
    if spec.kind == "mamba":
        tensors = zip(spec.mamba_shapes, spec.mamba_dtypes, strict=False)
        return contract.mamba_page([round_up(math.prod(shape) * DTYPE_SIZES[dtype], spec.state_alignment) for shape, dtype in tensors])
    if spec.state_content_bytes is not None:
        return spec.state_content_bytes
    defined = defined_content_bytes(spec)
    # A dtype without a definition is never judged (targets skip its cases); the plain size here
    # only sizes buffers while drawing.
    return defined if defined is not None else _plain_bytes(spec)


def half_elements(spec: SpecCase) -> int | None:
    """Storage elements of one head's K (or V) in a state, what a backend-shaped cache's head dim holds when K and V are
    stored apart (an MLA latent: the whole state); None where K and V are not two equal halves of whole elements."""
    content, element = content_bytes(spec), element_size(spec)
    if spec.is_mla:
        return content // element if content % element == 0 else None
    definition = dtype_definition(spec)
    if spec.head_size_v not in (None, spec.head_size) or (definition is not None and not definition.kv_alike) or content % (2 * element):
        return None
    return content // (2 * element)


def dtype_definition(spec: SpecCase) -> dtypes.Definition | None:
    if spec.registered_cache_dtype:
        return dtypes.registered(spec.kv_quant_mode)
    return dtypes.definition(spec.cache_dtype)


def defined_content_bytes(spec: SpecCase) -> int | None:
    """Bytes of one state (a token of one KV head) by the cache dtype's definition; None when the
    oracle has no definition of that dtype for this spec."""
    definition = dtype_definition(spec)
    return None if definition is None else definition.content_bytes(_geometry(spec))


def defined_unpadded_bytes(spec: SpecCase) -> int | None:
    """The page before padding by the dtype's definition alone: KV heads x states x content,
    whatever slots a backend splits it into."""
    content = defined_content_bytes(spec)
    return None if content is None else spec.num_kv_heads * states(spec, spec.block_size) * content


def _geometry(spec: SpecCase) -> dtypes.Geometry:
    value_head = spec.head_size_v if spec.head_size_v is not None else contract.mla_value_head(spec.is_mla, spec.head_size)
    return dtypes.Geometry(head_size=spec.head_size, head_size_v=value_head, element=DTYPE_SIZES[spec.dtype], mla=spec.is_mla,
                           rope_dim=spec.rope_dim, record=spec.state_content_bytes)


def _plain_bytes(spec: SpecCase) -> int:
    geometry = _geometry(spec)
    return contract.state_content_bytes(None, geometry.head_size, geometry.head_size_v, geometry.element)


def heads(spec: SpecCase) -> int:
    if spec.kind == "mamba":
        return 1
    return spec.num_head_slots if spec.num_head_slots is not None else spec.num_kv_heads


def states(spec: SpecCase, tokens: int) -> int:
    """States that `tokens` tokens occupy; a mamba block holds one state whatever its size."""
    if spec.kind == "mamba":
        return 1
    return contract.states_per_block(tokens, spec.compress_ratio)


def unpadded_bytes(spec: SpecCase, tokens: int) -> int:
    return heads(spec) * states(spec, tokens) * content_bytes(spec)


def padded_bytes(spec: SpecCase, tokens: int) -> int:
    return _padding(spec, tokens)[0]


def _padding(spec: SpecCase, tokens: int) -> tuple[int, bool]:
    alignment = spec.alignment if spec.is_mla else None
    return contract.padded_page(unpadded_bytes(spec, tokens), alignment, spec.page_size_padded)


def block_stride_alignment(spec: SpecCase) -> int:
    """Bytes every block stride must be a multiple of; 0 when the alignment names a kernel block that holds no state."""
    if spec.block_stride_multiple_of is not None:
        return contract.multiple_of_alignment(spec.block_size, spec.block_stride_multiple_of, lambda tokens: padded_bytes(spec, tokens))
    return spec.block_stride_alignment or 1


@functools.lru_cache(maxsize=8192)
def page(spec: SpecCase) -> Page:
    size, padded = _padding(spec, spec.block_size)
    return Page(
        heads=heads(spec),
        states=states(spec, spec.block_size),
        content_bytes=content_bytes(spec),
        element_size=element_size(spec),
        unpadded_bytes=unpadded_bytes(spec, spec.block_size),
        page_bytes=size,
        block_stride_alignment=block_stride_alignment(spec),
        padded=padded,
    )
