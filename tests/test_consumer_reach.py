"""The block zeroers run where vLLM runs them: only on a planned KVCacheConfig whose needs_kv_cache_zeroing holds
(a Mamba group; from 0.28 also attention caches of several precisions), and the generator draws them on such cases."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fuzz.case import Case, GroupCase, SpecCase, Touches, from_dict
from fuzz.checks.when import CPU_RULE, ZEROING_RULE, on_cpu, zeroes
from fuzz.space import Rejected, draw_indexed, unrealistic
from fuzz.targets.base import TargetInfo
from fuzz.verdict.runner import run_case

ZEROERS = ("zeroer", "cpu-zero", "cpu-zeroer")
CPU_CONSUMERS = ("cpu-zero", "cpu-zeroer")

SEED = Path(__file__).resolve().parent.parent / "corpus" / "seeds" / "hybrid-attention-mamba-padded.json"


def attention() -> GroupCase:
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64)
    return GroupCase(spec=spec, layers=("g0.l0",), backend="TRITON_ATTN", kernel_block_size=16)


def mamba() -> GroupCase:
    """A Mamba group whose page is padded to the attention group's (the corpus seed's)."""
    return from_dict(json.loads(SEED.read_text())).groups[1]


def zeroing_case(target, *groups: GroupCase) -> Case:
    zeroers = tuple(name for name in target.info.consumers if name in ZEROERS)
    return Case(groups=groups, num_blocks=2, layout="LBNHC", touches=Touches(consumers=zeroers, blocks=(1,)))


@pytest.fixture
def target(kvfuzz_target):
    info = kvfuzz_target.info
    if not info.contract.layout_placed or info.backend("TRITON_ATTN") is None or not set(info.consumers) & set(ZEROERS):
        pytest.skip("needs a layout-placed release with TRITON_ATTN and a block zeroer")
    return kvfuzz_target


def zeroer_records(target, case: Case) -> dict[str, dict]:
    result = run_case(target, case, "cpu")
    assert result.verdict.status == "pass", result.verdict
    return {name: record for name, record in result.outcome.checks.items() if name in ZEROERS}


def test_a_zeroer_is_skipped_with_the_reason_where_vllm_zeroes_nothing(target):
    records = zeroer_records(target, zeroing_case(target, attention()))
    assert records
    for name, record in records.items():
        assert record.keys() == {"skipped"}, (name, record)
        assert record["skipped"].startswith(ZEROING_RULE) and "needs_kv_cache_zeroing is False" in record["skipped"]


def test_a_zeroer_runs_on_a_model_with_mamba_layers(target):
    records = zeroer_records(target, zeroing_case(target, attention(), mamba()))
    ran = {name: record for name, record in records.items() if "skipped" not in record}
    assert ran, records
    for record in ran.values():
        assert [entry["block"] for entry in record["blocks"]] == [1]
        assert record["blocks"][0]["zeroed"], "the attention layer's block 1 is cleared"


def test_the_rule_counts_mamba_groups_and_several_precisions():
    plain = Case(groups=(attention(),), num_blocks=2, layout="LBNHC")
    assert not zeroes(plain)
    assert zeroes(Case(groups=(attention(), mamba()), num_blocks=2, layout="LBNHC"))
    fp8 = GroupCase(spec=SpecCase(kind="sliding_window", block_size=16, num_kv_heads=2, head_size=64, sliding_window=8, dtype="uint8",
                                  cache_dtype="fp8", kv_quant_mode="fp8_per_tensor"), layers=("g1.l0",), backend="TRITON_ATTN",
                    kernel_block_size=16)
    assert zeroes(Case(groups=(attention(), fp8), num_blocks=2, layout="LBNHC"))


def test_the_minimizer_counts_a_zeroer_vllm_never_runs_as_unrealistic(kvfuzz_target):
    info = kvfuzz_target.info
    if info.backend("TRITON_ATTN") is None or "LBNHC" not in info.layouts:
        pytest.skip("needs TRITON_ATTN on LBNHC")
    plain = Case(groups=(attention(),), num_blocks=2, layout="LBNHC")
    assert unrealistic(plain, info) is None
    assert unrealistic(dataclasses.replace(plain, touches=Touches(consumers=("zeroer",), blocks=(1,))), info) == ZEROING_RULE
    hybrid = Case(groups=(attention(), mamba()), num_blocks=2, layout="LBNHC", touches=Touches(consumers=("zeroer",), blocks=(1,)))
    assert unrealistic(hybrid, info) is None


def drawn_zeroers(info: TargetInfo, sample: int) -> tuple[int, int]:
    """Cases of a fixed-seed sample that run a zeroer: all of them, and those vLLM zeroes."""
    drawn = zeroing = 0
    for index in range(sample):
        try:
            case = draw_indexed(info, 1, index, touches=True)
        except Rejected:
            continue
        if case.touches is not None and set(case.touches.consumers) & set(ZEROERS):
            drawn += 1
            zeroing += zeroes(case)
    return drawn, zeroing


def test_the_generator_draws_zeroers_only_where_vllm_zeroes(kvfuzz_target):
    info = kvfuzz_target.info
    if not set(info.consumers) & set(ZEROERS) or "mamba" not in info.spec_kinds:
        pytest.skip("no block zeroer or no Mamba spec here")
    drawn, zeroing = drawn_zeroers(info, 1500)
    assert drawn == zeroing
    assert drawn >= 50, f"only {drawn} of 1500 cases run a zeroer"


def test_the_cpu_runner_zeroers_run_only_over_backends_the_cpu_platform_selects(kvfuzz_target):
    info = kvfuzz_target.info
    if info.backend("TRITON_ATTN") is None or "LBNHC" not in info.layouts:
        pytest.skip("needs TRITON_ATTN on LBNHC")
    gpu = Case(groups=(attention(), mamba()), num_blocks=2, layout="LBNHC", touches=Touches(consumers=("cpu-zero",), blocks=(1,)))
    assert not on_cpu(gpu) and unrealistic(gpu, info) == CPU_RULE
    assert unrealistic(dataclasses.replace(gpu, touches=Touches(consumers=("zeroer",), blocks=(1,))), info) is None
    if info.backend("CPU_ATTN") is not None:
        spec = dataclasses.replace(attention().spec, block_size=32)
        cpu = dataclasses.replace(attention(), backend="CPU_ATTN", spec=spec, kernel_block_size=32)
        assert on_cpu(Case(groups=(cpu, mamba()), num_blocks=2, layout="LBNHC"))
        assert not on_cpu(Case(groups=(cpu, mamba()), num_blocks=2, layout="LBNHC", platform="rocm"))
    for index in range(1500):
        try:
            case = draw_indexed(info, 1, index, touches=True)
        except Rejected:
            continue
        if case.touches is not None and set(case.touches.consumers) & set(CPU_CONSUMERS):
            assert on_cpu(case), case
