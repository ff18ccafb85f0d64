"""kvfuzz's own errors carry their traceback and name their frames (issue 26): the one-line summary names the innermost
kvfuzz frame and the innermost vLLM frame; a campaign's report and the file it keeps under internal-errors/ hold the
traceback, and `replay` prints it. Running out of memory in kvfuzz's own code is kvfuzz's bug, in vLLM's code vLLM's."""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fuzz import SOURCE_ROOT
from fuzz.tracebacks import describe, format_traceback, innermost_is_kvfuzz

REPO = Path(__file__).resolve().parent.parent
FUNCTION = "vllm.v1.worker.utils.allocate_kv_cache"  # the installed vLLM's (0.29 and later)
ISSUE_CASE = Path(__file__).parent / "data" / "issue-26-region-memory.json"


def planted(path: Path, source: str, name: str) -> Any:
    """A function compiled as if it were in the file `path`: its frames are that file's (the file need not exist)."""
    namespace: dict[str, Any] = {}
    exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 - test code of our own
    return namespace[name]


KVFUZZ_FILE = SOURCE_ROOT / "fuzz" / "planted_by_a_test.py"


def kvfuzz_function(body: str, name: str = "own", arguments: str = "") -> Any:
    return planted(KVFUZZ_FILE, f"def {name}({arguments}):\n    {body}\n", name)


def vllm_function(body: str, name: str = "theirs", arguments: str = "") -> Any:
    vllm = pytest.importorskip("vllm")
    return planted(Path(vllm.__path__[0]) / "planted_by_a_test.py", f"def {name}({arguments}):\n    {body}\n", name)


def raised(call: Any) -> BaseException:
    try:
        call()
    except BaseException as error:  # noqa: BLE001 - what the test looks at
        return error
    raise AssertionError("it did not raise")


# ---------------------------------------------------------------------------------------- the summary and the traceback


def test_the_summary_names_the_innermost_kvfuzz_frame_past_library_frames():
    own = kvfuzz_function("import numpy; return numpy.unique(numpy.zeros(3), axis=5)")
    described = describe(raised(own))
    assert described.kvfuzz is not None and (described.kvfuzz.path, described.kvfuzz.line, described.kvfuzz.function) == (
        "fuzz/planted_by_a_test.py", 2, "own")
    assert described.vllm is None
    assert described.summary.endswith("(kvfuzz: fuzz/planted_by_a_test.py:2 own)"), described.summary
    assert described.summary.startswith("AxisError: ")
    # The traceback is whole: this test's frame, kvfuzz's and numpy's, and the error.
    assert 'planted_by_a_test.py", line 2, in own' in described.traceback and "numpy" in described.traceback
    assert described.traceback.rstrip().splitlines()[-1].startswith("numpy.exceptions.AxisError")


def test_the_summary_names_both_frames_when_vllm_called_kvfuzz_code():
    own = kvfuzz_function("raise KeyError('l0')", arguments="")
    theirs = vllm_function("return own()", arguments="own")
    described = describe(raised(lambda: theirs(own)))
    assert described.summary == "KeyError: 'l0' (kvfuzz: fuzz/planted_by_a_test.py:2 own; vLLM: vllm/planted_by_a_test.py:2 theirs)"


def test_an_error_without_a_message_is_its_type_and_a_long_traceback_keeps_its_innermost_frames():
    assert describe(raised(kvfuzz_function("raise MemoryError()"))).summary == "MemoryError (kvfuzz: fuzz/planted_by_a_test.py:2 own)"
    deep = kvfuzz_function("return deep(n - 1, deep) if n else 1 / 0", "deep", "n, deep")
    error = raised(lambda: deep(300, deep))
    assert format_traceback(error) == "".join(traceback.format_exception(error))
    text = format_traceback(error, limit=240)
    assert len(text) <= 240 + 100
    assert text.startswith("Traceback (most recent call last):\n  ... (") and "characters of outer frames cut" in text
    assert text.rstrip().endswith("ZeroDivisionError: division by zero")


# ---------------------------------------------------------------------------------------- whose out-of-memory error it is


def test_memory_running_out_in_kvfuzz_code_is_kvfuzz_s_even_when_vllm_called_it():
    from fuzz.tracebacks import vllm_failure

    own = kvfuzz_function("raise MemoryError()")
    theirs = vllm_function("return own()", arguments="own")
    error = raised(lambda: theirs(own))
    assert innermost_is_kvfuzz(error) and vllm_failure(error) is None
    # Any other error raised through vLLM's code stays vLLM's, named after vLLM's function.
    other = vllm_failure(raised(lambda: theirs(kvfuzz_function("raise KeyError('l0')"))))
    assert other is not None and (other.error_type, other.error_function) == ("KeyError", "theirs")


def test_memory_running_out_in_vllm_code_is_vllm_s_naming_its_function():
    from fuzz.tracebacks import vllm_failure

    theirs = vllm_function("raise MemoryError()", "register_kv_caches")
    own = kvfuzz_function("return theirs()", arguments="theirs")
    outcome = vllm_failure(raised(lambda: own(theirs)))
    assert outcome is not None and (outcome.error_type, outcome.error_function, outcome.error_file) == (
        "MemoryError", "register_kv_caches", "planted_by_a_test.py")
    # torch's allocators say so instead of raising MemoryError: the same rule.
    ran_out = kvfuzz_function("raise RuntimeError(\"DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 TiB\")")
    assert vllm_failure(raised(lambda: vllm_function("return own()", arguments="own")(ran_out))) is None


# ---------------------------------------------------------------------------------------- the coordinator and the command line


def test_a_campaign_keeps_the_traceback_in_its_report_and_the_kept_file(tmp_path):
    import argparse
    import io

    from fuzz.campaign.engine import Campaign, CampaignOptions
    from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend, to_dict
    from fuzz.commands import _print_summary, _write_reports
    from tests.conftest import synthetic_info

    pool = SimpleNamespace(info=synthetic_info(), source=SimpleNamespace(spec="installed", label="installed"), workers=[0],
                           fuzzers=lambda: [0])
    campaign = Campaign(pool, CampaignOptions(corpus_dir=tmp_path / "findings", seed=4))  # type: ignore[arg-type]
    case = Case(groups=(GroupCase(spec=SpecCase(kind="full", block_size=16), layers=("l0",), synthetic_backend=SyntheticBackend("any"),
                                  kernel_block_size=16),), num_blocks=2)
    described = describe(raised(kvfuzz_function("raise KeyError('l0')")))
    item = {"error": described.summary, "index": 7, "case": to_dict(case), "traceback": described.traceback}
    campaign._on_batch(0, {"batch": 1, "done": 8, "elapsed": 0.1, "verdicts": {"pass": 6, "internal-error": 2},
                           "errors": {described.summary: 2}, "internal": [item, item]})
    data = campaign.report.to_dict()
    assert data["internal_errors"] == {described.summary: 2}
    [entry] = data["internal_error_details"]
    kept = data["internal_error_cases"][described.summary]
    assert entry == {"error": described.summary, "count": 2, "case_file": kept, "traceback": described.traceback}
    saved = json.loads(Path(kept).read_text())
    assert saved["traceback"] == described.traceback and saved["error"] == described.summary and saved["index"] == 7
    out = io.StringIO()
    _print_summary(campaign.report, data, out)
    assert f"kvfuzz internal error (2x, please report): {described.summary}\n      case and traceback: {kept}" in out.getvalue()
    assert _write_reports(argparse.Namespace(report=None, junit=None, fail_on="error"), data) == 2


def test_kvfuzz_s_own_error_on_the_command_line_is_its_traceback_then_one_line_naming_the_frame(tmp_path, monkeypatch):
    import io

    from fuzz import commands
    from fuzz.cli import main
    from fuzz.errors import InternalError

    def from_a_worker(args: Any, out: Any) -> int:
        raise InternalError("KeyError: 'l0' (kvfuzz: fuzz/targets/common.py:992 record_view)",
                            'Traceback (most recent call last):\n  File "x", line 1, in record_view\nKeyError: \'l0\'\n')

    case = tmp_path / "case.json"
    case.write_text("{}")
    for handler, check in ((from_a_worker, "record_view"), (lambda args, out: kvfuzz_function("raise KeyError('l0')")(), "own")):
        monkeypatch.setattr(commands, "explain", handler)
        stderr = io.StringIO()
        assert main(["explain", str(case)], stdout=io.StringIO(), stderr=stderr) == 2
        lines = stderr.getvalue().rstrip().splitlines()
        assert lines[0] == "Traceback (most recent call last):" and any(f"in {check}" in line for line in lines), lines
        assert lines[-1].startswith("kvfuzz: error: kvfuzz internal error (please report): KeyError: 'l0' (kvfuzz: ")
        assert lines[-1].endswith(f" {check})"), lines[-1]


# ---------------------------------------------------------------------------------------- in a worker, end to end

# From its first call on, the tree's allocate_kv_cache leaves kvfuzz's dtype table no mapping: kvfuzz's own view recording
# (fuzz/targets/common.py record_view) then raises in the worker, after vLLM's call returned.
BREAK_KVFUZZ = '''
import functools as _functools
import sys as _sys


@_functools.wraps(_real)
def _chaos_wrapper(*args, **kwargs):
    _sys.modules["fuzz.targets.walker"].DTYPE_NAMES = []
    return _real(*args, **kwargs)
'''


def kvfuzz(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fuzz.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
def test_kvfuzz_code_raising_in_a_worker_is_reported_with_its_traceback_kept_and_replayed(tmp_path):
    pytest.importorskip("vllm")
    from tests.chaos_trees import make_tree

    tree = make_tree(tmp_path / "tree", FUNCTION, define=BREAK_KVFUZZ)
    report_file = tmp_path / "report.json"
    result = kvfuzz("run", "--vllm", str(tree), "--max-time", "120", "--max-cases", "30", "--workers", "1", "--corpus",
                    str(tmp_path / "corpus"), "--report", str(report_file), "--quiet")
    assert result.returncode == 2, result
    report = json.loads(report_file.read_text())
    [entry] = [e for e in report["internal_error_details"] if "record_view" in e["error"]]
    assert entry["error"].startswith("AttributeError: 'list' object has no attribute 'get' (kvfuzz: fuzz/targets/walker.py:")
    assert entry["error"].endswith(" record_view)") and "vLLM:" not in entry["error"]
    assert 'fuzz/targets/walker.py", line' in entry["traceback"] and "in record_view" in entry["traceback"]
    assert f"kvfuzz internal error ({entry['count']}x, please report): {entry['error']}" in result.stdout
    kept = json.loads(Path(entry["case_file"]).read_text())
    assert kept["traceback"] == entry["traceback"] and kept["error"] == entry["error"]

    replayed = kvfuzz("replay", entry["case_file"], "--vllm", str(tree))
    assert replayed.returncode == 2, replayed
    lines = replayed.stderr.rstrip().splitlines()
    assert "Traceback (most recent call last):" in lines and any("in record_view" in line for line in lines), replayed.stderr
    assert lines[-1] == f"kvfuzz: error: kvfuzz internal error (please report): {entry['error']}"


@pytest.mark.slow
@pytest.mark.releases
def test_the_issue_s_connector_region_case_runs_on_0_34_within_a_gib():
    """The case of issue 26: kvfuzz enumerated every byte of an offload connector's region (fuzz/targets/readback.py) and
    ran out of memory. Whatever it finds, it is no kvfuzz internal error."""
    result = kvfuzz("replay", str(ISSUE_CASE), "--vllm", "0.34.0", "--max-memory", "1024")
    assert "internal error" not in result.stderr and "MemoryError" not in result.stderr + result.stdout, result
    assert result.returncode in (0, 1), result
