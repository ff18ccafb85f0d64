"""What each KV-cache dtype stores: the bytes one token of one KV head occupies in a page.

The oracle computes a quantized page from the format's definition (bytes per stored element,
packing, scale bytes per token and head), never from a backend's arithmetic. Each definition
cites the description it is derived from (vLLM's docstrings and design notes). A cache dtype
missing here has no definition: cases using it are skipped with that reason, counted in the
campaign report, so the gap is visible and nothing is guessed.

Content bytes are per (token, KV head) with K and V together, for attention caches; for MLA
caches (one latent per token, `head_size_v` 0) per token. `element` is the byte size of the
model dtype for dtypes stored at model precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from oracles import contract

FP32 = 4  # bytes of one float32 scale


@dataclass(frozen=True)
class Geometry:
    """What a definition needs from a spec."""

    head_size: int
    head_size_v: int  # 0 for MLA
    element: int  # bytes of one element of the spec's storage dtype
    mla: bool
    rope_dim: int | None = None  # rotary dims of a head (Octave stores them with more bits)
    record: int | None = None  # a DS-MLA record size the model publishes (state_content_bytes)


@dataclass(frozen=True)
class Definition:
    name: str
    # KVQuantMode member names (lower case) the dtype means, newest spelling first: a release
    # calls it by the first one it declares.
    quant_modes: tuple[str, ...]
    content: Callable[[Geometry], int | None]  # None: the dtype does not apply to this geometry
    source: str
    # Bits of one stored K/V element when packed below a byte (None: the storage element).
    packed_bits: int | None = None
    scales: bool = False  # the page holds per-token scales
    # Head sizes must be multiples of this (scale groups, rotation blocks, packed bytes).
    head_multiple: int = 1
    # K and V of a head are stored alike, one after the other (False: at different bits or in other formats).
    kv_alike: bool = True

    def content_bytes(self, geometry: Geometry) -> int | None:
        return self.content(geometry)

    @property
    def plain(self) -> bool:
        """Whether a page of this dtype is elements of the storage dtype and nothing else."""
        return self.packed_bits is None and not self.scales


def _plain(g: Geometry) -> int:
    return contract.state_content_bytes(None, g.head_size, g.head_size_v, g.element)


def _per_token_head(packed_bits: int | None) -> Callable[[Geometry], int]:
    # Triton / MLA common backends: "Per-token-head modes pack inline fp32 scales after each head's
    # data, so the content is (data + one scale) per K/V side"; MLA keeps "an inline fp32 scale pair
    # after the latent data". INT4 packs two values per byte.
    def content(g: Geometry) -> int:
        k, v = g.head_size, g.head_size_v
        if packed_bits is not None:
            k, v = k * packed_bits // 8, v * packed_bits // 8
        return (k + v) * g.element + 2 * FP32

    return content


def _nvfp4(g: Geometry) -> int | None:
    # utils/torch_utils.nvfp4_kv_cache_full_dim: "fp4 data + fp8 block scales" per side,
    # head_size / 2 bytes of data and one fp8 scale per 16 elements.
    if g.mla:
        return None
    return sum(d // 2 + d // 16 for d in (g.head_size, g.head_size_v))


def _turboquant(key_bits: int, value_bits: int) -> Callable[[Geometry], int | None]:
    # model_executor/layers/quantization/turboquant/config.py (TurboQuantConfig): one slot per
    # (token, head), [key_packed | value_packed] rounded up to an even size; FP8 keys take one
    # byte per dim, MSE keys ceil(D * bits / 8) plus a 2-byte fp16 norm; values take
    # ceil(D * bits / 8) plus a 2-byte scale and a 2-byte zero point. K and V have the head size.
    def content(g: Geometry) -> int | None:
        if g.mla:
            return None
        d = g.head_size
        key = d if key_bits == 8 else math.ceil(d * key_bits / 8) + 2
        value = math.ceil(d * value_bits / 8) + 4
        slot = key + value
        return slot + slot % 2

    return content


def _turboquant_source(preset: str, key_bits: int, value_bits: int) -> str:
    keys = "fp8 keys (a byte per dim)" if key_bits == 8 else f"{key_bits}-bit keys plus a 2-byte norm"
    values = f"{value_bits}-bit values plus a 2-byte scale and zero point"
    return f"TurboQuant preset {preset}: per token and head, {keys}, then {values}, rounded up to an even size"


def _ultraquant(g: Geometry) -> int | None:
    # v1/attention/ops/ultraquant/format.py: per (token, head), K codes (FP4, 2 per byte), one
    # UE8M0 scale byte per 32-element group, then the same for V.
    if g.mla or g.head_size % 32:
        return None
    return 2 * (g.head_size // 2 + g.head_size // 32)


def _octave(v_bits: int, compact: bool) -> Callable[[Geometry], int | None]:
    # v1/attention/ops/rocm_octave.py: "[k_rope codes][k_nope codes][v codes][fp16 scales][pad
    # to 8]" per (token, KV head); RoPE dims take 4-bit codes, NoPE dims 3-bit, V `v_bits`; one
    # fp16 scale per 64-dim K block and one for V. Compact K: all dims 3-bit, one K scale, pad
    # to 4. Head size and rotary dims are multiples of 64 (compact: a power of two).
    def content(g: Geometry) -> int | None:
        d, rope = g.head_size, g.rope_dim
        if g.mla or rope is None or d % 64 or rope % 64 or rope > d or (compact and d & (d - 1)):
            return None
        wide = 0 if compact else rope
        codes = wide * 4 // 8 + (d - wide) * 3 // 8 + d * v_bits // 8
        scales = (1 if compact else d // 64) + 1
        align = 4 if compact else 8
        return -(-(codes + 2 * scales) // align) * align

    return content


# DeepSeek MLA records (v1/attention/backends/mla/flashmla_sparse.py, "FlashMLA Sparse uses an fp8
# cache with the following format"): a whole token's latent in one opaque record.
DS_MLA_RECORDS = {
    "fp8_ds_mla": {None: (656,), "deepseek_v4": (584, 528)},  # V3.2; V4 (and V4.1 MXFP8)
    "nvfp4_ds_mla": {None: (352,)},  # V3.2 geometry, NVFP4 NoPE + FP8 RoPE
}


def _ds_mla(name: str) -> Callable[[Geometry], int | None]:
    def content(g: Geometry) -> int | None:
        if not g.mla:
            return None
        records = {size for sizes in DS_MLA_RECORDS[name].values() for size in sizes}
        return g.record if g.record in records else None

    return content


_FP8 = "8-bit floats, one per element; the per-tensor scale lives outside the cache"
DEFINITIONS: dict[str, Definition] = {d.name: d for d in (
    Definition("auto", ("none",), _plain, "the model dtype's elements"),
    Definition("float16", ("none",), _plain, "float16 elements"),
    Definition("bfloat16", ("none",), _plain, "bfloat16 elements"),
    Definition("fp8", ("fp8_per_tensor",), _plain, _FP8),
    Definition("fp8_e4m3", ("fp8_per_tensor",), _plain, _FP8),
    Definition("fp8_e5m2", ("fp8_per_tensor",), _plain, _FP8),
    Definition("fp8_inc", ("fp8_per_tensor",), _plain, _FP8),
    Definition("int8_per_token_head", ("int8_per_token_head",), _per_token_head(None),
               "int8 elements plus an fp32 scale per token, head and side", scales=True),
    Definition("fp8_per_token_head", ("fp8_per_token_head",), _per_token_head(None),
               "fp8 elements plus an fp32 scale per token, head and side", scales=True),
    Definition("int4_per_token_head", ("int4_per_token_head",), _per_token_head(4),
               "int4 elements packed two per byte plus an fp32 scale per token, head and side", packed_bits=4, scales=True, head_multiple=2),
    Definition("nvfp4", ("nvfp4",), _nvfp4, "fp4 elements packed two per byte plus an fp8 scale per 16", packed_bits=4, scales=True,
               head_multiple=16),
    Definition("nvfp4_4over6", ("nvfp4",), _nvfp4, "the NVFP4 layout (max/6 or max/4 scale choice)", packed_bits=4, scales=True,
               head_multiple=16),
    Definition("turboquant_k8v4", ("turboquant_k8v4", "turboquant"), _turboquant(8, 4), _turboquant_source("k8v4", 8, 4),
               packed_bits=4, scales=True, kv_alike=False),
    Definition("turboquant_4bit_nc", ("turboquant_4bit_nc", "turboquant"), _turboquant(4, 4), _turboquant_source("4bit_nc", 4, 4),
               packed_bits=4, scales=True, kv_alike=False),
    Definition("turboquant_k3v4_nc", ("turboquant_k3v4_nc", "turboquant"), _turboquant(3, 4), _turboquant_source("k3v4_nc", 3, 4),
               packed_bits=3, scales=True, kv_alike=False),
    Definition("turboquant_3bit_nc", ("turboquant_3bit_nc", "turboquant"), _turboquant(3, 3), _turboquant_source("3bit_nc", 3, 3),
               packed_bits=3, scales=True, kv_alike=False),
    Definition("ultraquant_4bit", ("ultraquant_4bit",), _ultraquant, "UltraQuant FP4 codes with UE8M0 group scales", packed_bits=4, scales=True,
               head_multiple=32, kv_alike=False),
    Definition("octave_k3v4", ("octave_k3v4",), _octave(4, False), "Octave block K, 4-bit V", packed_bits=3, scales=True, head_multiple=64,
               kv_alike=False),
    Definition("octave_k3v3", ("octave_k3v3",), _octave(3, False), "Octave block K, 3-bit V", packed_bits=3, scales=True, head_multiple=64,
               kv_alike=False),
    Definition("octave_k3v3_compact", ("octave_k3v3_compact",), _octave(3, True), "Octave compact K, 3-bit V", packed_bits=3, scales=True,
               head_multiple=64, kv_alike=False),
    Definition("fp8_ds_mla", ("fp8_per_tensor",), _ds_mla("fp8_ds_mla"), "DeepSeek fp8 MLA records", scales=True),
    Definition("nvfp4_ds_mla", ("nvfp4_ds_mla", "nvfp4"), _ds_mla("nvfp4_ds_mla"), "DeepSeek NVFP4 MLA records", packed_bits=4, scales=True),
)}


def definition(name: str) -> Definition | None:
    return DEFINITIONS.get(name)


def registered(quant_mode: str) -> Definition:
    """A cache dtype kvfuzz registers with a release's dtype-handler registry: a storage dtype and
    a quant mode, nothing else (vllm.config.cache.KVCacheDTypeHandler), so its page is the storage
    dtype's elements; a backend owning such a dtype publishes any other layout itself."""
    return Definition("registered", (quant_mode,), _plain, "KVCacheDTypeHandler: torch_dtype() and quant_mode() only")


def quant_mode_in(definition: Definition, release_modes: tuple[str, ...]) -> str | None:
    """What the release calls the definition's quant mode; None if it has no such mode."""
    if definition.quant_modes == ("none",):
        return "none"
    return next((mode for mode in definition.quant_modes if mode in release_modes), None)
