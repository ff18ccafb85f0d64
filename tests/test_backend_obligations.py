"""Backends keep their release's obligations (issue 22): a backend is drawn only with layouts it declares, a synthetic
backend publishes what a real one of its release would, and a corpus knows a finding only on the releases it affects."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from fuzz.campaign.engine import Campaign, CampaignOptions
from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend, to_dict
from fuzz.corpus.minimize import _buildable
from fuzz.corpus.store import known_signatures
from fuzz.space import Rejected, draw_indexed, record_reason, unrealistic
from fuzz.targets.base import BackendInfo, TargetInfo
from fuzz.targets.releases import TargetSource
from fuzz.targets.synthetic import published_state
from oracles import pages
from tests.conftest import synthetic_info

# ROCM_AITER_FA's declaration (0.29 - 0.34 supported_kv_cache_layouts): the layer outermost, heads on either side of blocks.
LAYER_OUTER = ("LBHNC", "LHBNC")


def restricted_info() -> TargetInfo:
    """The synthetic target with one backend that declares two layouts and one that declares a single other one."""
    base = synthetic_info()
    backends = base.backends + (BackendInfo("R", False, (16, 32), LAYER_OUTER, ("bfloat16",), ("auto",)),
                                BackendInfo("C", False, ("x32",), ("LBNHC",), ("bfloat16", "float16"), ("auto",)))
    return dataclasses.replace(base, backends=backends)


def _declared(info: TargetInfo, group: GroupCase) -> tuple[str, ...] | None:
    if group.synthetic_backend is not None:
        return group.synthetic_backend.layouts
    return next((b.layouts for b in info.backends if b.name == group.backend), None)  # a Mamba group has no backend


def test_drawn_layouts_are_ones_every_backend_declares():
    info = restricted_info()
    seen: set[tuple[str, str]] = set()
    for index in range(1500):
        try:
            case = draw_indexed(info, 5, index)
        except Rejected:
            continue
        for group in case.groups:
            declared = _declared(info, group)
            assert declared is None or case.layout in declared, (group.backend_name, case.layout, declared)
            if group.backend in ("R", "C"):
                seen.add((group.backend, case.layout))
    assert {layout for backend, layout in seen if backend == "R"} == set(LAYER_OUTER), "both declared layouts are drawn"
    assert {layout for backend, layout in seen if backend == "C"} == {"LBNHC"}


def _one_layer(layout: str, backend: str | None = "R", synthetic: SyntheticBackend | None = None) -> Case:
    spec = SpecCase(kind="sliding_window", block_size=64, num_kv_heads=2, head_size=16, dtype="bfloat16", sliding_window=128)
    group = GroupCase(spec=spec, layers=("g0.l0",), backend=None if synthetic else backend, synthetic_backend=synthetic, kernel_block_size=32)
    return Case(groups=(group,), num_blocks=1, layout=layout)


def test_a_backend_on_a_layout_it_does_not_declare_is_no_case_vllm_builds():
    info = restricted_info()
    # Issue 22's false alarm: ROCM_AITER_FA on BHLNC, which vLLM's layout resolution refuses before any view exists.
    assert "BHLNC" in (unrealistic(_one_layer("BHLNC"), info) or "")
    assert unrealistic(_one_layer("LHBNC"), info) is None
    fake = SyntheticBackend("alpha", kernel_block_sizes=(32,), layouts=("BHLNC", "LHBNC"))
    assert unrealistic(_one_layer("LBNHC", synthetic=fake), info) is not None, "a synthetic backend takes only the layouts it lists"
    assert unrealistic(_one_layer("BHLNC", synthetic=fake), info) is None


def test_the_minimizer_never_swaps_in_a_backend_that_refuses_the_layout():
    info = restricted_info()
    fake = SyntheticBackend("alpha", kernel_block_sizes=(32,), layouts=("BHLNC",))
    case = _one_layer("BHLNC", synthetic=fake)
    swapped = dataclasses.replace(case, groups=(dataclasses.replace(case.groups[0], synthetic_backend=None, backend="R"),))
    assert _buildable(swapped, info) is None
    simpler = dataclasses.replace(_one_layer("LHBNC"), layout="LBNHC")  # the options pass's simplest layout
    assert _buildable(simpler, info) is None


def test_a_real_backend_is_drawn_only_with_layouts_vllm_lets_it_have(kvfuzz_target):
    """Against the installed vLLM: every drawn case's layout is one each real backend's own supported_kv_cache_layouts
    lists (asked of the backend class, not of kvfuzz's description), and the issue's case is skipped, not judged."""
    info = kvfuzz_target.info
    if not info.contract.layout_placed or not hasattr(kvfuzz_target, "backend_classes"):
        pytest.skip("needs the installed, layout-placed vLLM in process")
    checked = 0
    for index in range(400):
        try:
            case = draw_indexed(info, 11, index)
        except Rejected:
            continue
        for group in case.groups:
            cls = kvfuzz_target.backend_classes.get(group.backend) if group.backend else None
            declared = cls.supported_kv_cache_layouts() if cls is not None and hasattr(cls, "supported_kv_cache_layouts") else None
            if declared is not None:
                assert case.layout in {layout.name for layout in declared}, (group.backend, case.layout)
                checked += 1
    assert checked > 20
    if "ROCM_AITER_FA" in kvfuzz_target.backend_classes:
        execution = kvfuzz_target.execute(_one_layer("BHLNC", backend="ROCM_AITER_FA"), "cpu")
        assert execution.skipped is not None and "BHLNC" in execution.skipped, execution


@pytest.mark.parametrize("cache_dtype, mode", [("int8_per_token_head", "int8_per_token_head"), ("fp8_per_token_head", "fp8_per_token_head"),
                                               ("nvfp4", "nvfp4")])
def test_a_synthetic_backend_publishes_state_bytes_of_packed_and_scaled_dtypes(cache_dtype, mode):
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, dtype="uint8", cache_dtype=cache_dtype, kv_quant_mode=mode)
    published = published_state(spec)
    assert published.state_content_bytes is not None
    # The page vLLM 0.28+ computes from the published bytes is the one the dtype's definition gives.
    assert pages.unpadded_bytes(published, published.block_size) == pages.defined_unpadded_bytes(spec)
    plain = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
    assert published_state(plain) == plain, "dense K/V content publishes nothing"


def _kept(folder: Path, signature: str, affected: list[str]) -> None:
    case = _one_layer("LHBNC")
    data = {"signature": signature, "affected_versions": affected, "case": to_dict(case)}
    (folder / f"{signature}.json").write_text(json.dumps(data))


def test_a_signature_is_known_only_on_the_releases_it_affects(tmp_path):
    _kept(tmp_path, "bug-a", ["0.28.0"])
    _kept(tmp_path, "bug-b", ["0.28.0", "0.32.0"])
    assert known_signatures(tmp_path, "0.32.0") == {"bug-b"}
    assert known_signatures(tmp_path, "0.28.0") == {"bug-a", "bug-b"}
    # A build that is no release (a checkout, a development build) keeps every kept finding known, as before.
    assert known_signatures(tmp_path) == known_signatures(tmp_path, "0.33.0.dev12+gabcdef") == {"bug-a", "bug-b"}


def _campaign(tmp_path: Path, version: str, kind: str) -> Campaign:
    info = dataclasses.replace(synthetic_info(), vllm_version=version)
    pool = SimpleNamespace(info=info, source=TargetSource("x", kind, None, None), fuzzers=lambda: [0])
    return Campaign(pool, CampaignOptions(corpus_dir=tmp_path))  # type: ignore[arg-type]


def test_a_corpus_entry_of_another_release_does_not_hide_the_finding(tmp_path):
    _kept(tmp_path, "bug-a", ["0.28.0"])
    assert "bug-a" not in _campaign(tmp_path, "0.32.0", "release").known
    assert "bug-a" in _campaign(tmp_path, "0.28.0", "release").known
    assert "bug-a" in _campaign(tmp_path, "0.32.0", "checkout").known


@pytest.mark.parametrize(("version", "records"), [("0.28.0", {584}), ("0.30.0", {584, 528}), ("synthetic", {584, 528})])
def test_a_deepseek_record_is_drawn_only_on_releases_that_build_it(version, records):
    """V4.1's 528-byte fp8_ds_mla record exists from vLLM 0.30 (fuzz/space.py RECORDS_SINCE); a 0.28 release builds only
    V4's 584-byte one, so a 528-byte case there is no configuration vLLM builds, drawn or replayed."""
    info = dataclasses.replace(synthetic_info(), vllm_version=version)
    drawn = set()
    for index in range(3000):
        try:
            case = draw_indexed(info, 7, index)
        except Rejected:
            continue
        drawn |= {g.spec.state_content_bytes for g in case.groups if g.spec.cache_dtype == "fp8_ds_mla"}
    assert drawn == records
    v41 = SpecCase(kind="mla", block_size=64, num_kv_heads=1, head_size=512, dtype="uint8", cache_dtype="fp8_ds_mla",
                   model_version="deepseek_v4", state_content_bytes=528)
    reason = record_reason(v41, info)
    assert (reason is None) == (528 in records)
    assert reason is None or reason.startswith("field state_content_bytes: vLLM 0.28.0 builds no fp8_ds_mla cache")
