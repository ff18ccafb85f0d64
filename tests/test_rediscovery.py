"""The acceptance test of the whole tool: kvfuzz rediscovers vLLM PR #38831 on its own.

0.22.0 computed kernel blocks per KV block from block_size instead of the compressed
storage_block_size, so compressed MLA caches split into kernel blocks demanded
compress_ratio times their storage; 0.23.0 (PR #43988) fixed it. The generators are the same
as for every target: no hint, no special case."""

import pytest

from fuzz.campaign.engine import Campaign, CampaignOptions
from fuzz.campaign.pool import Pool
from fuzz.case import MLA_KINDS
from fuzz.corpus.bisect import bisect_case, transitions
from fuzz.corpus.store import entries
from fuzz.targets import releases

pytestmark = pytest.mark.releases
SEED, CASES = 1, 1500


def is_38831(record) -> bool:
    finding = record.finding
    return finding.kind == "crash-on-valid" and finding.spec_kind in MLA_KINDS and finding.function == "_reshape_kv_cache"


@pytest.fixture(scope="module")
def campaign_on_0220(tmp_path_factory):
    corpus_dir = tmp_path_factory.mktemp("corpus-0.22.0")
    with Pool(releases.resolve("0.22.0"), workers=1) as pool:
        report = Campaign(pool, CampaignOptions(max_time=600, max_cases=CASES, seed=SEED, corpus_dir=corpus_dir)).run()
    return report, corpus_dir


def test_0220_crashes_on_a_compressed_mla_case_and_minimizes_it(campaign_on_0220):
    report, corpus_dir = campaign_on_0220
    found = [r for r in report.findings if is_38831(r)]
    assert found, [r.finding.signature for r in report.findings]
    record = found[0]
    assert record.minimized
    case = next(e.case for e in entries(record.path))
    assert len(case.groups) == 1 and len(case.groups[0].layers) == 1
    spec = case.groups[0].spec
    assert spec.compress_ratio > 1, "storage_block_size < block_size"
    assert case.groups[0].kernel_block_size < spec.block_size, "kernel-block splitting"
    assert case.num_blocks == 1, "the smallest block count that still fails"
    assert record.finding.layer in case.layer_names, "the finding names a layer of its minimized case"


def test_0230_does_not_have_it(campaign_on_0220, tmp_path):
    before, _ = campaign_on_0220
    with Pool(releases.resolve("0.23.0"), workers=1) as pool:
        after = Campaign(pool, CampaignOptions(max_time=600, max_cases=CASES, seed=SEED, corpus_dir=tmp_path)).run()
    fixed = {r.finding.signature for r in before.findings if is_38831(r)}
    assert fixed and not fixed & {r.finding.signature for r in after.findings}


def test_bisect_names_0220_failing_and_0230_fixed(campaign_on_0220):
    report, _ = campaign_on_0220
    record = next(r for r in report.findings if is_38831(r))
    case = next(e.case for e in entries(record.path))
    rows = bisect_case(case, ["0.22.0", "0.23.0"], jobs=2)
    assert [r.status for r in rows] == ["fail", "pass"]
    assert transitions(rows) == ["fixed in 0.23.0 (pass)"]
