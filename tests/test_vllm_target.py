"""Against the installed vLLM: corpus replay, a short campaign, and the command line."""

import io
import json
from pathlib import Path

import pytest

from fuzz.cli import main
from fuzz.corpus import entries
from fuzz.replay import replay_entry

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
ENTRIES = list(entries(CORPUS))


def _id(entry):
    kinds = "+".join(g.spec.kind for g in entry.case.groups)
    backends = "+".join(g.backend_name for g in entry.case.groups)
    tag = entry.meta.get("kind", "seed")
    return f"{kinds}-{backends}-{tag}-{entry.path.stem[:12]}"


@pytest.mark.parametrize("entry", ENTRIES, ids=[_id(e) for e in ENTRIES])
def test_corpus_replays(target, entry):
    outcome = replay_entry(target, entry, "cpu")
    assert outcome.status in ("pass", "expected", "fixed", "skipped"), outcome.detail


def test_seed_cases_pass_and_name_their_layout(target):
    seeds = [e for e in ENTRIES if "signature" not in e.meta]
    assert len(seeds) >= 6
    for entry in seeds:
        assert replay_entry(target, entry, "cpu").status == "pass", entry.path


def test_short_campaign_has_no_unexplained_finding(target, tmp_path):
    report_path = tmp_path / "report.json"
    corpus_dir = tmp_path / "findings"
    for entry in ENTRIES:  # known findings are not new
        if "signature" in entry.meta:
            corpus_dir.mkdir(exist_ok=True)
            (corpus_dir / entry.path.name).write_text(entry.path.read_text())
    out = io.StringIO()
    code = main(["run", "--max-cases", "300", "--seed", "3", "--device", "cpu", "--corpus", str(corpus_dir),
                 "--report", str(report_path)], stdout=out)
    report = json.loads(report_path.read_text())
    assert report["cases"] == 300
    assert report["target"]["vllm_version"]
    assert code == 0, report["findings"]


@pytest.mark.parametrize(
    "argv",
    [["run", "--vllm", "banana"], ["run", "--device", "tpu"], ["run", "--max-time", "-1"], ["replay", "/no/such/path"]],
)
def test_bad_input_is_one_line_and_exit_2(argv):
    err = io.StringIO()
    assert main(argv, stdout=io.StringIO(), stderr=err) == 2
    assert len(err.getvalue().strip().splitlines()) <= 2


def test_malformed_case_file_exit_2(tmp_path, target):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": 1, "num_blocks": 2, "groups": [{"layers": ["a"], "spec": {"kind": "full"}}]}))
    err = io.StringIO()
    assert main(["explain", str(bad), "--device", "cpu"], stdout=io.StringIO(), stderr=err) == 2
    assert "groups[0].spec.block_size" in err.getvalue()


def test_explain_prints_both_sides(target):
    out = io.StringIO()
    case = CORPUS / "seeds" / "dsv4-ratio128-1728-page.json"
    assert main(["explain", str(case), "--device", "cpu"], stdout=out) == 0
    text = out.getvalue()
    assert "(2, 1, 2, 584)" in text and "[1728, 584, 584, 1]" in text
    data_out = io.StringIO()
    main(["explain", str(case), "--device", "cpu", "--json"], stdout=data_out)
    data = json.loads(data_out.getvalue())
    assert data["layers"]["l0"]["expected"]["shape"] == data["layers"]["l0"]["actual"]["shape"] == [2, 1, 2, 584]
