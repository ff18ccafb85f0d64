"""The wider layout-placed surface (0.29+): ROCm's backing allocation, one group of layers that differ in
heads (vLLM's UniformTypeKVCacheSpecs), attention-free models; the checks that judge them (buffer-size,
the planner's block count) and the case model's and minimizer's handling of them.

Expectations are worked out by hand from the layout's meaning (tests/test_addresses.py checks the
oracle's placement of differing layers against brute-force addresses); the target tests run the
installed vLLM (or `--kvfuzz-vllm`), and skip on releases before 0.29."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fuzz.case import Case, CaseError, GroupCase, SpecCase, from_dict, to_dict, validate
from fuzz.corpus import minimize
from fuzz.targets.base import Outcome
from fuzz.verdict.compare import compare
from fuzz.verdict.runner import run_case
from oracles import contract as rules
from oracles import expect
from oracles.contract import LAYOUT_PLACED_KERNEL_MAP
from tests.conftest import synthetic_info

SPEC = SpecCase(kind="full", block_size=32, num_kv_heads=1, head_size=64, dtype="bfloat16")


def differing(layout: str = "LBNHC", heads: tuple[int, ...] = (1, 2, 1), blocks: int = 2, sharing: dict[str, str] | None = None) -> Case:
    # TRITON_ATTN takes every layout (CPU_ATTN only LBHNC), and its views are built on the CPU too.
    group = GroupCase(spec=SPEC, layers=tuple(f"l{i}" for i in range(len(heads))), backend="TRITON_ATTN", kernel_block_size=32,
                      layer_heads=heads)
    return Case(groups=(group,), num_blocks=blocks, layout=layout, packing="uniform_type",
                kv_sharing=tuple(sorted((sharing or {}).items())))


def placed(target) -> None:
    if not target.info.contract.layout_placed:
        pytest.skip("the layout-placed surface starts at vLLM 0.29")


def test_rocm_backing_allocation_is_whole_pages():
    assert [rules.backing_allocation_bytes(n, "rocm") for n in (1, 4095, 4096, 4097, 12288)] == [4096, 4096, 4096, 8192, 12288]
    assert rules.backing_allocation_bytes(4097, "cuda") == 4097


def test_same_spec_runs_keep_first_appearance():
    assert rules.same_spec_runs(["a", "b", "a", "c", "b"]) == [[0, 2], [1, 4], [3]]


def test_differing_layers_by_hand():
    # Pages: 32 tokens x 1 state each x (64 + 64) x 2 bytes = 8192 bytes a head; l0 and l2 have 1 head, l1 has 2.
    # Block-outermost (BLNHC): l0 and l2 (the first run) then l1 inside every 32768-byte block.
    block_outer = expect(differing("BLNHC"), LAYOUT_PLACED_KERNEL_MAP)
    assert {n: v.views[0].byte_offset for n, v in block_outer.layers.items()} == {"l0": 0, "l2": 8192, "l1": 16384}
    assert {v.views[0].byte_strides[0] for v in block_outer.layers.values()} == {32768}
    assert block_outer.buffers == (2 * 32768,)
    # Layer-outer (LBNHC): regions of 2 blocks, l0's and l2's 16384 bytes each, then l1's 32768.
    layer_outer = expect(differing("LBNHC"), LAYOUT_PLACED_KERNEL_MAP)
    assert {n: v.views[0].byte_offset for n, v in layer_outer.layers.items()} == {"l0": 0, "l2": 16384, "l1": 32768}
    assert layer_outer.layers["l1"].views[0].shape == (2, 2, 32, 128)  # [B, H, N, C]: K and V side by side in C
    # A layout whose pages are not one chunk inside their block cannot hold pages of different sizes.
    assert not expect(differing("LHBNC"), LAYOUT_PLACED_KERNEL_MAP).accepted


def test_attention_free_expectation():
    expectation = expect(Case(groups=(), num_blocks=7), LAYOUT_PLACED_KERNEL_MAP)
    assert expectation.accepted and expectation.layers == {} and expectation.buffers == () and expectation.planned_blocks == 1


def test_case_json_round_trip_and_errors():
    case = dataclasses.replace(differing(), platform="rocm")
    assert from_dict(json.loads(json.dumps(to_dict(case)))) == case
    plain = to_dict(dataclasses.replace(case, platform="cuda", packing="none",
                                        groups=(dataclasses.replace(case.groups[0], layer_heads=()),)))
    assert "platform" not in plain and "layer_heads" not in plain["groups"][0]  # older cases keep their JSON and hashes
    assert from_dict({"groups": [], "num_blocks": 3}).groups == ()
    for bad, field in ((dataclasses.replace(case.groups[0], layer_heads=(1, 2)), "groups[0].layer_heads"),
                       (dataclasses.replace(case.groups[0], layer_heads=(1, 0, 2)), "groups[0].layer_heads")):
        with pytest.raises(CaseError, match=field.replace("[", r"\[").replace("]", r"\]")):
            validate(dataclasses.replace(case, groups=(bad,)))
    with pytest.raises(CaseError, match="packing uniform_type"):
        validate(dataclasses.replace(case, packing="none"))
    with pytest.raises(CaseError, match="platform"):
        from_dict({**to_dict(case), "platform": "tpu"})


def test_minimizer_drops_a_layer_with_its_heads():
    case = differing()
    info = synthetic_info()
    for candidate in minimize._drop_layers(case, info):
        validate(candidate)
        group = candidate.groups[0]
        kept = [int(name[1:]) for name in group.layers]
        assert group.layer_heads == tuple(case.groups[0].layer_heads[i] for i in kept)
    simpler = list(minimize._simpler_options(case, info))
    assert any(not c.groups[0].layer_heads and c.packing == "uniform_type" for c in simpler)
    assert all(c.packing == "uniform_type" for c in simpler if c.groups[0].layer_heads)


def test_differing_layers_on_vllm(kvfuzz_target, kvfuzz_device):
    placed(kvfuzz_target)
    for layout in ("LBNHC", "BLNHC"):
        result = run_case(kvfuzz_target, differing(layout), kvfuzz_device)
        assert result.verdict.status == "pass", (layout, result.verdict)
        offsets = {name: views[0].offset_bytes for name, views in result.outcome.views.items()}
        assert offsets == {n: v.views[0].byte_offset for n, v in result.expectation.layers.items()}
    # vLLM's layout resolution refuses pages of different shapes in a layout that is not block-compact before any view
    # exists, so no deployment hands the allocation such a case: kvfuzz skips it naming the rule, and the contract
    # rejects it (test_differing_layers_by_hand).
    skipped = run_case(kvfuzz_target, differing("LHBNC"), kvfuzz_device).verdict
    assert skipped.status == "skipped" and skipped.reason is not None and "block-compact" in skipped.reason, skipped


def test_rocm_allocation_on_vllm(kvfuzz_target, kvfuzz_device):
    placed(kvfuzz_target)
    if "rocm" not in kvfuzz_target.info.platforms:
        pytest.skip("this vLLM's allocation asks no platform question")
    # One 1-head layer of 3 blocks: 3 * 8192 bytes, 24576, is 6 pages of 4096; 5 blocks of a 2-byte-head layer are not.
    odd = Case(groups=(GroupCase(spec=dataclasses.replace(SPEC, head_size=3), layers=("l0",), backend="CPU_ATTN", kernel_block_size=32),),
               num_blocks=5, layout="LBHNC", platform="rocm")  # the layout CPU_ATTN takes
    result = run_case(kvfuzz_target, odd, kvfuzz_device)
    assert result.verdict.status == "pass", result.verdict
    laid_out = 5 * 32 * 6 * 2
    assert [b.size for b in result.outcome.buffers] == [4096 * -(-laid_out // 4096)]
    # The same buffer judged as CUDA's exact allocation is one of the wrong size.
    cuda = dataclasses.replace(odd, platform="cuda")
    verdict = compare(cuda, expect(cuda, kvfuzz_target.info.contract), result.outcome)
    assert verdict.finding is not None and verdict.finding.kind == "buffer-size"
    exact = run_case(kvfuzz_target, cuda, kvfuzz_device)
    assert exact.verdict.status == "pass" and [b.size for b in exact.outcome.buffers] == [laid_out]


def test_attention_free_model_on_vllm(kvfuzz_target, kvfuzz_device):
    placed(kvfuzz_target)
    case = Case(groups=(), num_blocks=5, layout="BLHNC")
    result = run_case(kvfuzz_target, case, kvfuzz_device)
    assert result.verdict.status == "pass", result.verdict
    assert result.outcome.planned_blocks == 1 and result.outcome.views == {}
    wrong = compare(case, result.expectation, dataclasses.replace(result.outcome, planned_blocks=5))
    assert wrong.finding is not None and wrong.finding.kind == "planner-fit"


def test_planned_blocks_follow_the_override():
    case = differing()
    expectation = expect(case, LAYOUT_PLACED_KERNEL_MAP)
    assert expectation.planned_blocks == case.num_blocks
    verdict = compare(case, expectation, Outcome(planned_blocks=case.num_blocks + 1))
    assert verdict.finding is not None and verdict.finding.kind == "planner-fit"
