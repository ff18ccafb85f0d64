"""Against the installed vLLM (or --kvfuzz-vllm): corpus replay, a short campaign, the command line."""

import io
import json
import shutil
from pathlib import Path

import pytest

from fuzz.cli import main
from fuzz.corpus.replay import replay_entry
from fuzz.corpus.store import Entry, entries

CORPUS = Path(__file__).resolve().parent.parent / "corpus"


def test_corpus_replays(kvfuzz_target, kvfuzz_device, kvfuzz_entry, kvfuzz_known):
    outcome = replay_entry(kvfuzz_target, kvfuzz_entry, kvfuzz_device, known=kvfuzz_known)
    assert outcome.status in ("pass", "expected", "fixed", "skipped"), outcome.detail


def test_a_case_meeting_another_kept_bug_is_expected_only_when_that_bug_is_kept(kvfuzz_target, kvfuzz_device, kvfuzz_known):
    # A case kept for a bug of other releases that fails here as a finding this release keeps.
    here = kvfuzz_target.info.vllm_version
    kept = next((e for e in entries(CORPUS / "findings") if here in e.affected_versions), None)
    if kept is None:
        pytest.skip(f"the corpus keeps no finding of {here}")
    elsewhere = Entry(kept.path, kept.case, {**kept.meta, "signature": "another bug", "affected_versions": ["0.0.1"]})
    assert kept.expected_signature in kvfuzz_known
    assert replay_entry(kvfuzz_target, elsewhere, kvfuzz_device, known=kvfuzz_known).status == "expected"
    outcome = replay_entry(kvfuzz_target, elsewhere, kvfuzz_device)
    assert (outcome.status, outcome.detail) == ("unexpected", kept.expected_signature)


def test_seed_cases_pass(kvfuzz_target, kvfuzz_device):
    seeds = [e for e in entries(CORPUS / "seeds")]
    assert len(seeds) >= 6
    statuses = {e.path.name: replay_entry(kvfuzz_target, e, kvfuzz_device).status for e in seeds}
    assert set(statuses.values()) <= {"pass", "skipped"}, statuses
    assert list(statuses.values()).count("pass") >= 4, statuses


@pytest.fixture
def known_findings(tmp_path):
    """A corpus folder holding the known findings, so a campaign reports only new ones."""
    folder = tmp_path / "findings"
    shutil.copytree(CORPUS / "findings", folder)
    return folder


def test_short_campaign_has_no_unexplained_finding(kvfuzz_target, known_findings, tmp_path):
    report_path = tmp_path / "report.json"
    out = io.StringIO()
    code = main(["run", "--max-cases", "400", "--max-time", "300", "--seed", "3", "--device", "cpu", "--corpus", str(known_findings),
                 "--report", str(report_path), "--junit", str(tmp_path / "junit.xml"), "--quiet"], stdout=out)
    report = json.loads(report_path.read_text())
    assert report["cases"] == 400
    assert report["target"]["vllm_version"] == kvfuzz_target.info.vllm_version
    assert code == 0, report["findings"]
    assert "<testsuite" in (tmp_path / "junit.xml").read_text()


def test_a_minimized_finding_names_a_layer_of_its_own_case(tmp_path):
    # With no known findings, the latent findings of the installed release are new again.
    report_path = tmp_path / "report.json"
    main(["run", "--max-cases", "400", "--max-time", "300", "--seed", "3", "--device", "cpu", "--corpus", str(tmp_path / "findings"),
          "--report", str(report_path), "--quiet"], stdout=io.StringIO())
    findings = json.loads(report_path.read_text())["findings"]
    assert findings
    for record in findings:
        saved = json.loads(Path(record["case_file"]).read_text())
        assert saved["minimized"]
        layers = {name for group in saved["case"]["groups"] for name in group["layers"]} | set(saved["case"]["kv_sharing"])
        assert saved["layer"] is None or saved["layer"] in layers, (saved["layer"], layers)


@pytest.mark.parametrize(
    "argv",
    [["run", "--vllm", "banana"], ["run", "--device", "tpu"], ["run", "--max-time", "-1"], ["replay", "/no/such/path"],
     ["run", "--vllm", "/no/such/checkout"], ["run", "--workers", "0"]],
)
def test_bad_input_is_one_line_and_exit_2(argv):
    err = io.StringIO()
    assert main(argv, stdout=io.StringIO(), stderr=err) == 2
    assert len(err.getvalue().strip().splitlines()) <= 2


def test_malformed_case_file_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": 1, "num_blocks": 2, "groups": [{"layers": ["a"], "spec": {"kind": "full"}}]}))
    err = io.StringIO()
    assert main(["explain", str(bad), "--device", "cpu"], stdout=io.StringIO(), stderr=err) == 2
    assert "groups[0].spec.block_size" in err.getvalue() and len(err.getvalue().splitlines()) == 1


def test_explain_prints_both_sides(kvfuzz_target):
    if not kvfuzz_target.info.contract.layout_placed:
        pytest.skip("this seed uses a 0.29+ layout name")
    out = io.StringIO()
    case = CORPUS / "seeds" / "dsv4-ratio128-1728-page.json"
    assert main(["explain", str(case), "--device", "cpu"], stdout=out) == 0
    text = out.getvalue()
    assert "(2, 1, 2, 584)" in text and "(1728, 584, 584, 1)" in text and text.count("(2, 1, 2, 584)") == 2
    data_out = io.StringIO()
    main(["explain", str(case), "--device", "cpu", "--json"], stdout=data_out)
    layer = json.loads(data_out.getvalue())["layers"]["l0"]
    assert layer["expected"][0]["shape"] == layer["actual"][0]["shape"] == [2, 1, 2, 584]
