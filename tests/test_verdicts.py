"""Verdicts that hide nothing, on the installed vLLM: what happens while a case is declared is judged like any vLLM error,
a case that contradicts vLLM's own derivations is a case error, and kvfuzz's own errors are never blamed on vLLM."""

from __future__ import annotations

import pytest

from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend
from fuzz.tracebacks import vllm_failure
from fuzz.verdict.runner import run_case


@pytest.fixture(scope="module")
def target():
    pytest.importorskip("vllm")
    from fuzz.targets.loader import load_local

    loaded = load_local()
    if not loaded.info.contract.layout_placed:
        pytest.skip("these cases use the layout-placed API")
    return loaded


def case_of(spec: SpecCase, backend: str | None = None, kernel: int | None = None, layout: str = "LBHNC",
            synthetic: SyntheticBackend | None = None) -> Case:
    group = GroupCase(spec=spec, layers=("l0",), backend=backend, synthetic_backend=synthetic,
                      kernel_block_size=kernel or spec.block_size)
    return Case(groups=(group,), num_blocks=2, layout=layout)


def test_an_assertion_while_declaring_a_valid_case_is_crash_on_valid_naming_the_function(target):
    if "ROCM_ATTN" not in target.backend_classes:
        pytest.skip("ROCM_ATTN is not importable here")
    # ROCM_ATTN stores K and V as two head slots and asserts they are the same size.
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, head_size_v=32, dtype="bfloat16")
    verdict = run_case(target, case_of(spec, "ROCM_ATTN"), "cpu").verdict
    assert verdict.finding is not None
    assert (verdict.finding.kind, verdict.finding.function) == ("crash-on-valid", "customize_spec"), verdict


def test_a_value_error_while_declaring_a_valid_case_is_refused_valid(target):
    if "ROCM_AITER_FA" not in target.backend_classes:
        pytest.skip("ROCM_AITER_FA is not importable here")
    # Encoder-only groups keep their manager block, so an 8-token block is no kernel split; the backend refuses it anyway.
    spec = SpecCase(kind="encoder_only", block_size=8, num_kv_heads=2, head_size=64, dtype="bfloat16")
    verdict = run_case(target, case_of(spec, "ROCM_AITER_FA"), "cpu").verdict
    assert verdict.finding is not None and verdict.finding.kind == "refused-valid", verdict
    assert "multiple of" in verdict.finding.message


def test_a_kernel_block_size_vllm_derives_differently_is_a_case_error_naming_both(target):
    spec = SpecCase(kind="full", block_size=64, num_kv_heads=2, head_size=64, dtype="bfloat16")
    backend = SyntheticBackend("sixteen", kernel_block_sizes=("x16",))
    verdict = run_case(target, case_of(spec, kernel=16, synthetic=backend), "cpu").verdict
    # vLLM's rule keeps the 64-token block (the backend takes any multiple of 16); the case says 16.
    assert verdict.status == "case-error", verdict
    assert "groups[0].kernel_block_size" in verdict.reason and "16" in verdict.reason and "64" in verdict.reason


def test_a_kernel_block_size_vllm_derives_none_for_is_a_case_error(target):
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
    verdict = run_case(target, case_of(spec, synthetic=SyntheticBackend("odd", kernel_block_sizes=(48,))), "cpu").verdict
    assert verdict.status == "case-error" and "derives none" in verdict.reason, verdict


def test_an_error_no_vllm_frame_took_part_in_is_kvfuzz_s_own():
    try:
        raise KeyError("kvfuzz bug")
    except KeyError as error:
        assert vllm_failure(error) is None


def test_fail_on_decides_which_severities_fail_a_campaign():
    from fuzz.commands import fails

    assert fails("crash-on-valid", "error") and fails("declaration", "error") and fails("page-escape", "error")
    assert not fails("refused-valid", "error") and not fails("assert-on-invalid", "error")
    assert fails("refused-valid", "warning") and fails("crash-on-invalid", "warning")
    assert not fails("crash-on-valid", "never")


def test_an_internal_error_keeps_its_case_and_fails_the_run_with_status_2(tmp_path):
    import argparse
    import json
    from types import SimpleNamespace

    from fuzz.campaign.engine import Campaign, CampaignOptions
    from fuzz.case import to_dict
    from fuzz.commands import _write_reports
    from tests.conftest import synthetic_info

    pool = SimpleNamespace(info=synthetic_info(), source=SimpleNamespace(spec="installed", label="installed"), workers=[0],
                           fuzzers=lambda: [0])
    campaign = Campaign(pool, CampaignOptions(corpus_dir=tmp_path / "findings", seed=4))  # type: ignore[arg-type]
    case = case_of(SpecCase(kind="full", block_size=16), synthetic=SyntheticBackend("any"))
    item = {"error": "KeyError: 'l0'", "index": 7, "case": to_dict(case)}
    campaign._on_batch(0, {"batch": 1, "done": 8, "elapsed": 0.1, "verdicts": {"pass": 6, "internal-error": 2},
                           "errors": {"KeyError: 'l0'": 2}, "internal": [item, item]})
    data = campaign.report.to_dict()
    kept = data["internal_error_cases"]["KeyError: 'l0'"]
    assert json.loads(open(kept).read())["index"] == 7 and kept.startswith(str(tmp_path / "internal-errors"))
    args = argparse.Namespace(report=None, junit=None, fail_on="error")
    assert _write_reports(args, data) == 2
    assert _write_reports(args, {**data, "internal_errors": {}}) == 0
