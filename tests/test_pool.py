"""Worker processes that survive the target: crashes, hangs, memory hogs and exits become findings."""

import json

import pytest

from fuzz.campaign.engine import Campaign, CampaignOptions
from fuzz.campaign.pool import Pool, RemoteTarget
from fuzz.case import Case, GroupCase, SpecCase
from fuzz.targets import releases
from fuzz.verdict.runner import run_case
from tests.hostile import make_hostile_checkout

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def hostile_pool(tmp_path_factory):
    checkout = make_hostile_checkout(tmp_path_factory.mktemp("hostile"))
    with Pool(releases.resolve(str(checkout)), workers=1, case_timeout=2.0, max_memory=256 << 20) as pool:
        yield pool


def full(head: int, blocks: int) -> Case:
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=1, head_size=head)
    return Case(groups=(GroupCase(spec=spec, layers=("l0",), backend="TRITON_ATTN", kernel_block_size=16),), num_blocks=blocks)


@pytest.mark.parametrize(("head", "blocks", "kind", "detail"), [
    (80, 1, "crash-signal", "SIGSEGV"),
    (96, 2, "crash-signal", "SIGABRT"),
    (32, 3, "hang", "no answer"),
    (16, 4, "crash-on-valid", "SystemExit"),
    (128, 2, "oom", ""),
])
def test_each_failure_is_a_finding_and_the_worker_comes_back(hostile_pool, head, blocks, kind, detail):
    target = RemoteTarget(hostile_pool)
    restarts = hostile_pool.restarts
    verdict = run_case(target, full(head, blocks), "cpu").verdict
    assert verdict.finding is not None and verdict.finding.kind == kind, verdict
    assert detail in verdict.finding.message
    assert run_case(target, full(64, 1), "cpu").verdict.status == "pass", "the respawned worker works"
    if kind in ("crash-signal", "hang"):
        assert hostile_pool.restarts == restarts + 1


@pytest.mark.slow
def test_campaign_against_a_hostile_target_keeps_every_finding(hostile_pool, tmp_path):
    corpus_dir = tmp_path / "corpus"
    options = CampaignOptions(device="cpu", max_time=300, max_cases=300, seed=4, corpus_dir=corpus_dir, shrink_seconds=3.0)
    report = Campaign(hostile_pool, options).run()
    assert report.cases == 300
    kinds = {r.finding.kind for r in report.findings}
    assert {"crash-signal", "hang", "oom"} <= kinds, kinds
    for record in report.findings:
        saved = json.loads(record.path.read_text())
        assert saved["signature"] == record.finding.signature
    assert report.restarts >= 2
