"""Campaign lifecycle: Ctrl-C flushes the report, a second run with the same corpus resumes."""

import json
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")


def start(corpus, report, *extra):
    # A fixed ratio of deeper checks: the schedule runs them by time, so a rerun of the same cases could run others.
    # One worker: the cases an interrupted run completed are then the first N (with two, each worker's batch stops
    # part-way and the N completed cases are not cases 0 .. N-1, so a rerun of N cases meets cases never run).
    return subprocess.Popen([sys.executable, "-m", "fuzz.cli", "run", "--device", "cpu", "--seed", "2", "--corpus", str(corpus),
                             "--workers", "1", "--consumers-every", "8", "--report", str(report), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigint_flushes_the_report_and_a_rerun_resumes(tmp_path):
    corpus, report = tmp_path / "corpus", tmp_path / "report.json"
    process = start(corpus, report, "--max-time", "300")
    header = process.stdout.readline()
    assert header.startswith("kvfuzz:"), header
    time.sleep(4)
    process.send_signal(signal.SIGINT)
    process.wait(timeout=60)
    data = json.loads(report.read_text())
    assert data["stop_reason"] == "SIGINT"
    assert data["cases"] > 0 and data["elapsed_s"] < 100
    found = {f["signature"] for f in data["findings"]}
    assert all((corpus / f["case_file"].split("/")[-1]).exists() for f in data["findings"])

    rerun = start(corpus, tmp_path / "again.json", "--max-cases", str(data["cases"]), "--max-time", "300", "--quiet")
    assert rerun.wait(timeout=300) == 0, "the same cases again: every finding is already known"
    again = json.loads((tmp_path / "again.json").read_text())
    assert not {f["signature"] for f in again["findings"]} & found


def test_a_pool_serves_campaigns_one_after_another(tmp_path):
    """Workers outlive campaigns; what one campaign found must not be hidden from the next."""
    from fuzz.campaign.engine import Campaign, CampaignOptions
    from fuzz.campaign.pool import Pool
    from fuzz.targets import releases

    with Pool(releases.resolve("installed"), workers=1) as pool:
        runs = [Campaign(pool, CampaignOptions(max_cases=600, seed=1, corpus_dir=tmp_path / str(n))).run() for n in range(2)]
    first, second = ({r.finding.signature for r in run.findings} for run in runs)
    assert first and first == second
