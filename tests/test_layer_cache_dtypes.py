"""Per-layer cache dtypes (issue 46): layers of one group that skip the cache dtype's quantization
(vLLM's `--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers ...`) keep the model dtype, so one
UniformTypeKVCacheSpecs group holds layers of two page sizes and two precisions.

Pages are worked out by hand from what a page holds (32 tokens x 1 head x K and V of 16 elements: 1024 bytes at one
byte an element, 2048 at two); the target tests run the installed vLLM and skip before 0.29."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fuzz.case import Case, CaseError, GroupCase, SpecCase, SyntheticBackend, Touches, from_dict, to_dict, validate
from fuzz.checks.when import zeroes
from fuzz.corpus import minimize
from fuzz.targets.base import TargetInfo
from fuzz.verdict.runner import run_case
from oracles import expect, pages
from oracles.contract import LAYOUT_PLACED_KERNEL_MAP
from tests.conftest import synthetic_info

FP8 = SpecCase(kind="full", block_size=32, num_kv_heads=1, head_size=16, dtype="uint8", cache_dtype="fp8", kv_quant_mode="fp8_per_tensor")


def skipping(layout: str = "LBHNC", dtypes: tuple[str, ...] = ("fp8", "bfloat16"), backend: str = "CPU_ATTN",
             touches: Touches | None = None) -> Case:
    group = GroupCase(spec=FP8, layers=tuple(f"l{i}" for i in range(len(dtypes))), backend=backend, kernel_block_size=32,
                      layer_cache_dtypes=dtypes)
    return Case(groups=(group,), num_blocks=2, layout=layout, packing="uniform_type", touches=touches)


def test_a_skipped_layer_keeps_the_model_dtype_unquantized():
    group = skipping(dtypes=("fp8", "bfloat16", "fp8")).groups[0]
    assert group.layer_spec(0) == FP8 and group.layer_spec(2) == FP8
    assert group.layer_spec(1) == dataclasses.replace(FP8, cache_dtype="auto", dtype="bfloat16", kv_quant_mode="none")
    assert [pages.page(spec).page_bytes for spec in group.layer_specs] == [1024, 2048, 1024]
    assert group.of_layer(1) == dataclasses.replace(group, spec=group.layer_spec(1), layer_cache_dtypes=())
    assert group.differs_per_layer and not dataclasses.replace(group, layer_cache_dtypes=()).differs_per_layer


def test_the_oracle_places_layers_of_two_precisions_by_hand():
    # Block-outermost: l0's 1024-byte page, then l1's 2048, inside every 3072-byte block.
    block_outer = expect(skipping("BLHNC"), LAYOUT_PLACED_KERNEL_MAP)
    assert {n: v.views[0].byte_offset for n, v in block_outer.layers.items()} == {"l0": 0, "l1": 1024}
    assert {n: v.views[0].byte_strides[0] for n, v in block_outer.layers.items()} == {"l0": 3072, "l1": 3072}
    assert {n: v.views[0].element_size for n, v in block_outer.layers.items()} == {"l0": 1, "l1": 2}
    assert block_outer.buffers == (2 * 3072,)
    # Layer-outer: l0's two blocks (2048 bytes), then l1's (4096).
    layer_outer = expect(skipping("LBHNC"), LAYOUT_PLACED_KERNEL_MAP)
    assert {n: v.views[0].byte_offset for n, v in layer_outer.layers.items()} == {"l0": 0, "l1": 2048}
    assert layer_outer.buffers == (2048 + 4096,)


def test_two_precisions_make_vllm_zero_blocks():
    # KVCacheConfig.needs_kv_cache_zeroing: attention caches stored at more than one precision (fuzz/checks/when.py).
    assert zeroes(skipping())
    assert not zeroes(skipping(dtypes=("fp8", "fp8")))


def test_case_json_round_trip_and_errors():
    case = skipping()
    data = to_dict(case)
    assert data["groups"][0]["layer_cache_dtypes"] == ["fp8", "bfloat16"]
    assert from_dict(json.loads(json.dumps(data))) == case
    plain = to_dict(dataclasses.replace(case, groups=(dataclasses.replace(case.groups[0], layer_cache_dtypes=()),)))
    assert "layer_cache_dtypes" not in plain["groups"][0]  # older cases keep their JSON and hashes
    group = case.groups[0]
    for bad, message in ((dataclasses.replace(group, layer_cache_dtypes=("fp8",)), "one cache dtype per layer"),
                         (dataclasses.replace(group, layer_cache_dtypes=("fp8", "int8")), "or a model dtype"),
                         (dataclasses.replace(group, spec=dataclasses.replace(FP8, cache_dtype="auto", dtype="bfloat16",
                                                                              kv_quant_mode="none")), "quantized cache dtype"),
                         (dataclasses.replace(group, spec=dataclasses.replace(FP8, kind="mla")), "not MLA")):
        with pytest.raises(CaseError, match=message):
            validate(dataclasses.replace(case, groups=(bad,)))
    with pytest.raises(CaseError, match="packing uniform_type"):
        validate(dataclasses.replace(case, packing="none"))
    with pytest.raises(CaseError, match="list of strings"):
        from_dict({**data, "groups": [{**data["groups"][0], "layer_cache_dtypes": "fp8"}]})


def test_minimizer_drops_a_layer_with_its_cache_dtype_and_the_dimension():
    case = skipping(dtypes=("fp8", "bfloat16", "fp8"))
    info = synthetic_info()
    for candidate in minimize._drop_layers(case, info):
        validate(candidate)
        group = candidate.groups[0]
        assert group.layer_cache_dtypes == tuple(case.groups[0].layer_cache_dtypes[int(name[1:])] for name in group.layers)
    simpler = list(minimize._simpler_options(case, info))
    assert any(not c.groups[0].layer_cache_dtypes and c.packing == "uniform_type" for c in simpler)
    assert all(c.packing == "uniform_type" for c in simpler if c.groups[0].layer_cache_dtypes)


def test_layers_of_two_precisions_on_vllm(kvfuzz_target, kvfuzz_device):
    if not kvfuzz_target.info.contract.layout_placed:
        pytest.skip("layers that differ in size are drawn from vLLM 0.29")
    for layout in ("LBNHC", "BLNHC"):
        case = skipping(layout, backend="TRITON_ATTN")  # TRITON_ATTN takes every layout and fp8
        result = run_case(kvfuzz_target, case, kvfuzz_device)
        assert result.verdict.status == "pass", (layout, result.verdict)
        assert {name: str(views[0].dtype) for name, views in result.outcome.views.items()} == {"l0": "uint8", "l1": "bfloat16"}
        offsets = {name: views[0].offset_bytes for name, views in result.outcome.views.items()}
        assert offsets == {n: v.views[0].byte_offset for n, v in result.expectation.layers.items()}


def test_the_cpu_zeroer_on_layers_of_two_precisions(kvfuzz_target, kvfuzz_device):
    """FINDINGS #24: up to 0.33 the CPU runner's `_zero_block_ids` passes over a UniformTypeKVCacheSpecs group, and a model
    with skipped layers is one vLLM zeroes; 0.34's CPUKVBlockZeroer clears it."""
    if "cpu-zero" not in kvfuzz_target.info.checks and "cpu-zeroer" not in kvfuzz_target.info.checks:
        pytest.skip("this vLLM has no CPU block zeroer kvfuzz drives")
    consumer = "cpu-zero" if "cpu-zero" in kvfuzz_target.info.checks else "cpu-zeroer"
    case = skipping(touches=Touches(consumers=(consumer,), blocks=(0,)))
    if not kvfuzz_target.info.contract.layout_placed:
        pytest.skip("layers that differ in size are drawn from vLLM 0.29")
    verdict = run_case(kvfuzz_target, case, kvfuzz_device).verdict
    if consumer == "cpu-zero":
        assert verdict.status == "finding" and verdict.finding.kind == "zero-miss", verdict
        assert "cleared no byte at all" in verdict.finding.message
    else:
        assert verdict.status == "pass", verdict


def test_a_skipped_layer_drops_the_quantized_formats_published_state():
    """A quantized spec's published per-state bytes (its scales) are the format's; the skipped layer is a plain cache whose
    page the oracle and vLLM derive from its own dtype. Carrying them over built a float32 layer of an int8 page (two false
    alarms of issue 46's first campaigns: crash-on-invalid and page-escape on block-outermost pools)."""
    published = dataclasses.replace(FP8, cache_dtype="int8_per_token_head", dtype="int8", kv_quant_mode="int8_per_token_head",
                                    state_content_bytes=40)
    group = dataclasses.replace(skipping().groups[0], spec=published, layer_cache_dtypes=("int8_per_token_head", "float32"))
    assert group.layer_spec(0).state_content_bytes == 40
    assert group.layer_spec(1).state_content_bytes is None
    assert pages.page(group.layer_spec(1)).page_bytes == 32 * 1 * 2 * 16 * 4


def test_pages_of_mixed_shapes_are_drawn_in_block_compact_layouts_only():
    """vLLM resolves the layout before any view and keeps block-compact layouts only for pages of mixed (heads, states,
    bytes) shapes; kvfuzz hands the allocation the case's layout, so a case in another layout is no deployment's. Two
    layers of one page size but other shapes (an fp8 layer of 2 heads, a skipped bf16 layer of 1) passed the allocation's
    own page-size check in BHLNC (issue 46's first campaigns: accepted-invalid, a false alarm)."""
    from fuzz.space import MIXED_SHAPES_RULE, unrealistic

    info = TargetInfo(**{**synthetic_info().__dict__, "packings": ("none", "uniform_type")})
    equal_pages = dataclasses.replace(skipping().groups[0], backend=None, synthetic_backend=SyntheticBackend("any"),
                                      layer_heads=(1, 2), layer_cache_dtypes=("bfloat16", "fp8"))
    assert len({pages.page(spec).page_bytes for spec in equal_pages.layer_specs}) == 1
    case = dataclasses.replace(skipping(), groups=(equal_pages,), layout="BHLNC")
    assert unrealistic(case, info) == MIXED_SHAPES_RULE
    assert unrealistic(dataclasses.replace(case, layout="BLHNC"), info) is None
