"""Quantized cache dtypes: pages from each format's definition, quant modes by release, the spec check."""

import pytest

from fuzz.case import SpecCase
from fuzz.targets.base import Outcome
from fuzz.verdict.specs import check_specs
from oracles import dtypes, pages
from tests.conftest import one_group


def content(name: str, head: int = 128, value_head: int | None = None, element: int = 1, mla: bool = False, **extra) -> int | None:
    geometry = dtypes.Geometry(head_size=head, head_size_v=head if value_head is None else value_head, element=element, mla=mla, **extra)
    return dtypes.definition(name).content_bytes(geometry)  # type: ignore[union-attr]


@pytest.mark.parametrize(("name", "head", "expected"), [
    # Worked by hand from each format's description (oracles/dtypes.py cites where it is from).
    ("auto", 64, (64 + 64) * 2),                     # two bf16 halves
    ("fp8_e5m2", 64, 128),                           # one byte per element, the scale is per tensor
    ("int8_per_token_head", 64, 128 + 2 * 4),        # + an fp32 scale for K and one for V
    ("int4_per_token_head", 64, 32 + 32 + 8),        # two values per byte
    ("nvfp4", 128, 2 * (64 + 8)),                    # fp4 data + one fp8 scale per 16 elements, per side
    ("turboquant_k8v4", 128, 128 + 64 + 4),          # fp8 keys; 4-bit values + fp16 scale and zero
    ("turboquant_4bit_nc", 128, (64 + 2) + (64 + 4)),
    ("turboquant_k3v4_nc", 128, (48 + 2) + (64 + 4)),
    ("turboquant_3bit_nc", 96, 36 + 2 + 36 + 4),     # 78, even already
    ("turboquant_3bit_nc", 100, 38 + 2 + 38 + 4),    # ceil(37.5) + 2 + ceil(37.5) + 4 = 82
    ("ultraquant_4bit", 256, 272),                   # vLLM's own note: D=256 -> 272 B/slot
    ("ultraquant_4bit", 128, 136),                   # and D=128 -> 136 B/slot
])
def test_attention_formats(name, head, expected):
    value = content(name, head, element=2 if name == "auto" else 1)
    assert value == expected


def test_turboquant_slots_round_up_to_even():
    # 3-bit keys of a 36-dim head: ceil(13.5) + 2 = 16; values ceil(13.5) + 4 = 18 -> 34, even; a
    # 44-dim head: 17 + 2 + 17 + 4 = 40; a 41-dim head: 16 + 2 + 16 + 4 = 38 (ceil(15.375) = 16).
    assert content("turboquant_3bit_nc", 36) == 34
    assert content("turboquant_k8v4", 41) == 41 + 21 + 4 + 0  # 66, even


def test_octave_slots():
    # Block K: RoPE dims at 4 bits, the rest at 3, V at v_bits; fp16 scales per 64-dim K block and
    # one for V; padded to 8 (compact: all K at 3 bits, one K scale, padded to 4).
    assert content("octave_k3v4", 128, rope_dim=64) == 128  # 32 + 24 + 64 codes, 3 scales -> 126 -> 128
    assert content("octave_k3v3", 128, rope_dim=128) == 120  # 64 + 0 + 48 codes, 3 scales -> 118 -> 120
    assert content("octave_k3v3_compact", 128, rope_dim=64) == 100  # 48 + 48 codes, 2 scales -> 100
    assert content("octave_k3v4", 96, rope_dim=64) is None  # head sizes are whole 64-dim blocks
    assert content("octave_k3v4", 128) is None  # no rotary dims, no page


def test_mla_formats():
    assert content("fp8_ds_mla", 512, 0, mla=True, record=656) == 656
    assert content("fp8_ds_mla", 512, 0, mla=True, record=528) == 528  # DeepSeek V4.1's MXFP8 record
    assert content("fp8_ds_mla", 512, 0, mla=True, record=600) is None  # no DeepSeek record has 600 bytes
    assert content("nvfp4_ds_mla", 512, 0, mla=True, record=352) == 352
    assert content("int8_per_token_head", 512, 0, mla=True) == 512 + 8  # a latent plus its scale pair
    assert content("nvfp4", 512, 0, mla=True) is None  # not an MLA format


def test_a_page_comes_from_the_definition_unless_the_backend_publishes_it():
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, dtype="int8", cache_dtype="int8_per_token_head",
                    kv_quant_mode="int8_per_token_head")
    assert pages.page(spec).page_bytes == 2 * 16 * (128 + 8)
    published = SpecCase(**{**spec.__dict__, "num_head_slots": 4, "state_content_bytes": 68})
    assert pages.page(published).page_bytes == 4 * 16 * 68  # the backend's split of the same bytes
    assert pages.defined_unpadded_bytes(published) == pages.page(spec).page_bytes
    unknown = SpecCase(**{**spec.__dict__, "cache_dtype": "fp2_future"})
    assert pages.defined_content_bytes(unknown) is None


def test_quant_modes_by_release_name():
    turbo = dtypes.definition("turboquant_k8v4")
    assert dtypes.quant_mode_in(turbo, ("none", "turboquant_k8v4", "turboquant")) == "turboquant_k8v4"
    assert dtypes.quant_mode_in(turbo, ("none", "turboquant")) == "turboquant"  # 0.27 had one TurboQuant mode
    assert dtypes.quant_mode_in(turbo, ("none", "nvfp4")) is None
    assert dtypes.quant_mode_in(dtypes.definition("bfloat16"), ("none",)) == "none"


def spec_case(**spec):
    fields = {"kind": "full", "block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": "uint8", **spec}
    return one_group(SpecCase(**fields))


def test_the_spec_check_catches_a_mode_other_than_the_one_asked_for():
    case = spec_case(cache_dtype="kvfuzz_uint8_custom", kv_quant_mode="custom", registered_cache_dtype=True)
    page = 2 * 16 * 128
    assert check_specs(case, Outcome(specs={0: {"kv_quant_mode": "custom", "page_bytes": page}})) is None
    finding = check_specs(case, Outcome(specs={0: {"kv_quant_mode": "octave_k3v4", "page_bytes": page}}))
    assert finding is not None and finding.kind == "spec-mismatch"
    assert finding.message == "a registered cache dtype: kv_quant_mode octave_k3v4 instead of custom"
    assert finding.function == "get_kv_quant_mode"
    # The lookup's bug is one whatever the spec kind it shows under: the kind is the variant, not the signature.
    assert finding.signature == "spec-mismatch | get_kv_quant_mode | a registered cache dtype: kv_quant_mode octave_k#v# instead of custom"


def test_the_spec_check_catches_a_page_that_is_not_the_dtypes():
    case = spec_case(dtype="uint8", cache_dtype="int4_per_token_head", kv_quant_mode="int4_per_token_head")
    right = 2 * 16 * (32 + 32 + 8)
    assert check_specs(case, Outcome(specs={0: {"kv_quant_mode": "int4_per_token_head", "page_bytes": right}})) is None
    wrong = check_specs(case, Outcome(specs={0: {"kv_quant_mode": "int4_per_token_head", "page_bytes": 2 * 16 * (128 + 8)}}))
    assert wrong is not None and f"instead of {right}" in wrong.message
    assert wrong.message.startswith("kv_quant_mode int4_per_token_head: a page of"), "the mode names the bug, not the dtype"
    # A fact the target could not read (None) is not checked.
    assert check_specs(case, Outcome(specs={0: {"kv_quant_mode": None, "page_bytes": None}})) is None


def built_by_layer(layer="MLAAttention", classes=("MLAAttentionSpec", "AttentionSpec"), **fields):
    """The facts of a spec vLLM built from a layer for an fp8 MLA case with 576-element latents, 16-token blocks."""
    base = {"block_size": 16, "num_kv_heads": 1, "head_size": 576, "head_size_v": 0, "dtype": "uint8", "sliding_window": None,
            "num_head_slots": None, "state_content_bytes": None, "page_size_padded": None}
    return {"layer": layer, "classes": list(classes), "fields": {**base, **fields}}


def test_a_spec_a_layer_built_is_held_to_the_case_and_names_the_layer():
    case = spec_case(kind="mla", num_kv_heads=1, head_size=576, cache_dtype="fp8", kv_quant_mode="fp8_per_tensor")
    page = 16 * 576  # one byte per latent element
    right = {"kv_quant_mode": "fp8_per_tensor", "page_bytes": page, **built_by_layer()}
    assert check_specs(case, Outcome(specs={0: right})) is None
    # vLLM 0.25's MLA layer leaves the quant mode unset for an fp8 cache (design notes §2.3).
    unset = check_specs(case, Outcome(specs={0: {**right, "kv_quant_mode": "none"}}))
    assert (unset.kind, unset.spec_kind, unset.function) == ("spec-mismatch", "mla", "MLAAttention.get_kv_cache_spec")
    # Every fp8 dtype meets the same unset mode: the message does not name the dtype, so they are one finding.
    assert unset.message == "kv_quant_mode none instead of fp8_per_tensor"
    e5m2 = spec_case(kind="mla", num_kv_heads=1, head_size=576, cache_dtype="fp8_e5m2", kv_quant_mode="fp8_per_tensor")
    assert check_specs(e5m2, Outcome(specs={0: {**right, "kv_quant_mode": "none"}})).signature == unset.signature
    other_block = check_specs(case, Outcome(specs={0: {**right, **built_by_layer(block_size=64)}}))
    assert other_block.message == "cache dtype fp8: block_size 64 instead of 16"
    other_class = check_specs(case, Outcome(specs={0: {**right, **built_by_layer(classes=("FullAttentionSpec",))}}))
    assert other_class.message == "cache dtype fp8: a FullAttentionSpec instead of a MLAAttentionSpec"
    padded = check_specs(case, Outcome(specs={0: {**right, **built_by_layer(page_size_padded=page + 64)}}))
    assert padded.message == f"cache dtype fp8: page_size_padded {page + 64} instead of None"
