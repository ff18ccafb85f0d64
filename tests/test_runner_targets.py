"""The V1 model runner and vLLM-built specs against a real vLLM (the installed one, or --kvfuzz-vllm).

From 0.29 both runners call allocate_kv_cache and must give the same views; before, the V1 runner has
reshape code of its own. Specs built by vLLM from layers must say what the case says.
"""

import pytest

from fuzz.case import Case, GroupCase, SpecCase
from fuzz.verdict.runner import other_runners, run_case


def layout(target) -> str:
    return "LBNHC" if target.info.contract.layout_placed else "NHD"


def triton_case(target, **options) -> Case:
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64)
    group = GroupCase(spec=spec, layers=("l0", "l1"), backend="TRITON_ATTN", kernel_block_size=16)
    return Case(groups=(group,), num_blocks=3, layout=layout(target), **options)


@pytest.fixture
def target(kvfuzz_target):
    if "v1" not in kvfuzz_target.info.runners:
        pytest.skip(f"vLLM {kvfuzz_target.info.vllm_version} has no V1 model runner")
    if kvfuzz_target.info.backend("TRITON_ATTN") is None:
        pytest.skip("no TRITON_ATTN here")
    return kvfuzz_target


def test_both_runners_build_the_same_views_for_a_plain_case(target, kvfuzz_device):
    result = run_case(target, triton_case(target, runner="both"), kvfuzz_device)
    assert result.verdict.status == "pass", result.verdict
    [(_, v1)] = other_runners(result, target.info.contract)
    assert v1.verdict.status == "pass"
    assert (result.outcome.runner, v1.outcome.runner) == ("v2", "v1")
    assert result.outcome.views == v1.outcome.views


def test_the_v1_runner_binds_sharing_layers_to_their_target(target, kvfuzz_device):
    if not target.info.kv_sharing:
        pytest.skip("no KV sharing here")
    case = triton_case(target, runner="v1")
    case = Case(groups=case.groups, num_blocks=3, layout=case.layout, kv_sharing=(("shared", "l1"),), runner="v1")
    result = run_case(target, case, kvfuzz_device)
    assert result.verdict.status == "pass", result.verdict
    assert result.outcome.views["shared"] == result.outcome.views["l1"]


def test_specs_built_by_vllm_from_attention_layers_match_the_case(target, kvfuzz_device):
    if "full" not in target.info.layer_kinds or "TRITON_ATTN" not in target.info.layer_backends:
        pytest.skip("no Attention layer builds here")
    for cache in ("auto", "fp8"):
        if cache not in target.info.backend("TRITON_ATTN").cache_dtypes:
            continue
        spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, cache_dtype=cache,
                        dtype="bfloat16" if cache == "auto" else target.info.cache_dtypes[cache],
                        kv_quant_mode="none" if cache == "auto" else "fp8_per_tensor")
        group = GroupCase(spec=spec, layers=("l0",), backend="TRITON_ATTN", kernel_block_size=16)
        result = run_case(target, Case(groups=(group,), num_blocks=2, layout=layout(target), spec_source="vllm"), kvfuzz_device)
        assert result.verdict.status == "pass", (cache, result.verdict)
        facts = result.outcome.specs[0]
        assert facts["layer"] == "Attention" and "FullAttentionSpec" in facts["classes"]
        assert (facts["fields"]["block_size"], facts["fields"]["num_kv_heads"], facts["fields"]["head_size"]) == (16, 2, 64)


def test_a_sliding_window_layer_that_picks_its_own_block_size_is_a_skip_naming_the_field(kvfuzz_target, kvfuzz_device):
    """0.32's sliding-window layers choose their block size (ROCM_AITER_FA runs 64-token blocks as 32): a case stating
    64 cannot be built from layers there, which is a skip, never a spec-mismatch or a case error."""
    specs = getattr(kvfuzz_target, "layer_specs", None)
    if specs is None or not specs.window_picks_block or "ROCM_AITER_FA" not in kvfuzz_target.info.layer_backends:
        pytest.skip("this vLLM's sliding-window layers keep the configured block size")
    spec = SpecCase(kind="sliding_window", block_size=64, num_kv_heads=1, head_size=1, sliding_window=1483)
    group = GroupCase(spec=spec, layers=("l0",), backend="ROCM_AITER_FA", kernel_block_size=32)
    # A layout ROCM_AITER_FA takes (LBHNC / LHBNC from 0.29): any other is skipped for its layout first.
    result = run_case(kvfuzz_target, Case(groups=(group,), num_blocks=1, layout="LBHNC", spec_source="vllm"), kvfuzz_device)
    assert result.verdict.status == "skipped" and "field spec_source" in result.verdict.reason
    assert "(32, not the case's 64)" in result.verdict.reason
