"""`kvfuzz ci`: the gate, locations, the reports, and whole runs (slow) against the installed vLLM and a
source checkout laid out like a git clone of vllm-project/vllm, once unchanged and once with a seeded bug."""

import importlib.util
import inspect
import json
import shutil
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest
import torch

from fuzz.case import CaseError, SpecCase
from fuzz.ci.gate import replay_gate
from fuzz.ci.junit import write_ci_junit
from fuzz.ci.locate import functions_under_test, locate, package_folder
from fuzz.ci.model import CAMPAIGN, CORPUS, FLAKY, INTRODUCED, NEW, PRE_EXISTING, Checked, CiResult, Location
from fuzz.ci.reproduce import rerun, settle
from fuzz.ci.summary import MAX_DETAILS, markdown, terminal
from fuzz.cli import main
from fuzz.corpus.builtin import builtin_corpus
from fuzz.corpus.store import entries
from fuzz.targets.base import Execution, Outcome
from fuzz.targets.releases import TargetSource, resolve, worker_environment
from fuzz.tracebacks import capture
from fuzz.verdict.findings import Finding
from tests.conftest import one_group, synthetic_info
from tests.test_sarif import sarif_errors

REPO = Path(__file__).resolve().parents[1]
VLLM = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]) if importlib.util.find_spec("vllm") else None
needs_vllm = pytest.mark.skipif(VLLM is None, reason="no installed vLLM")
# The seeded bug: create_kv_cache_views (0.29+) places every view one byte past where the tensor starts.
VIEW_CALL = """    view_5d = torch.as_strided(
        raw,
        size=logical_shape,
        stride=strides,
        storage_offset=raw.storage_offset() + kv_cache_tensor.offset,
    )
"""
SEEDED = ("    view_5d = torch.as_strided(raw, size=logical_shape, stride=strides, "
          "storage_offset=raw.storage_offset() + kv_cache_tensor.offset + 1)\n")


def checked(status: str, origin: str = CAMPAIGN, kind: str = "crash-on-valid", message: str = "RuntimeError: boom 3",
            number: int = 0) -> Checked:
    finding = Finding(kind, "full", "create_kv_cache_views", message, "l0")
    case = next(entries(builtin_corpus() / "seeds")).case
    item = Checked(origin, Path(f"corpus/findings/{number}.json"), case, finding, reruns=[finding.signature] * 2,
                   baseline="pass" if status == INTRODUCED else finding.signature, status=status, explain=f"explain text {number}",
                   locations=[Location("vllm/v1/kv_cache_interface.py", 428, None, "create_kv_cache_views")])
    if status == FLAKY:
        item.reruns = [finding.signature, "pass"]
    return item


def result_of(*items: Checked) -> CiResult:
    target = {"spec": "./vllm-branch", "label": "checkout", "vllm_version": "dev", "generation": "G6", "contract": "placed-0.32"}
    campaign = {"cases": 1234, "elapsed_s": 10.0, "cases_per_s": 123.4, "stop_reason": "max-time", "findings": [], "internal_errors": {}}
    return CiResult(target, {"spec": "0.32.0", "vllm_version": "0.32.0"}, Path(".kvfuzz-corpus"), Counter({"pass": 3}), campaign, list(items))


# ------------------------------------------------------------------ verdicts and reports


def test_only_reproducible_failures_the_change_introduced_fail_the_job():
    assert result_of(checked(PRE_EXISTING), checked(FLAKY)).exit_status == 0
    assert result_of(checked(PRE_EXISTING), checked(INTRODUCED)).exit_status == 1
    assert result_of(checked(NEW)).exit_status == 1
    assert result_of().exit_status == 0
    assert not checked(FLAKY).reproduced and checked(PRE_EXISTING).reproduced


def test_summary_names_each_failure_with_reproducer_explain_and_case():
    items = [checked(INTRODUCED, number=1), checked(PRE_EXISTING, CORPUS, number=2, message="RuntimeError: other 2"),
             checked(FLAKY, number=3, message="RuntimeError: third 3")]
    text = markdown(result_of(*items))
    assert text.startswith("## kvfuzz ci: **1 bug(s) introduced by the change** (1 reproducible failing case(s))")
    assert (text.index("### Introduced by this change") < text.index("### First introduced bug") < text.index("<b>1 pre-existing bug(s)</b>")
            < text.index("<b>1 flaky bug(s)</b>"))
    assert "kvfuzz replay corpus/findings/1.json --vllm ./vllm-branch" in text
    assert "explain text 1" in text and "`vllm/v1/kv_cache_interface.py:428` (create_kv_cache_views)" in text
    assert text.count("<summary>minimized case</summary>") == 3 and '"num_blocks"' in text
    assert text.count("reruns in fresh processes: the same signature in 2 of 2") == 2 and ", `pass`" in text  # the flaky one
    # A signature's bars are escaped in the table only.
    assert "crash-on-valid \\| create_kv_cache_views" in text and "### First introduced bug: `crash-on-valid | create_kv_cache_views" in text
    assert "no new reproducible failure" in markdown(result_of(checked(PRE_EXISTING)))


def test_summary_shows_the_first_failures_in_full_and_lists_every_one():
    items = [checked(INTRODUCED, number=n, message=f"RuntimeError: kind {chr(97 + n % 26)}{n}") for n in range(MAX_DETAILS + 5)]
    text = markdown(result_of(*items))
    assert text.count("<summary>full kvfuzz explain</summary>") == MAX_DETAILS
    assert text.count("| crash-on-valid | `crash-on-valid") == MAX_DETAILS + 5
    assert "5 more in the summary" in terminal(result_of(*items), limit=MAX_DETAILS)


def test_junit_fails_only_what_fails_the_job(tmp_path):
    path = tmp_path / "junit.xml"
    write_ci_junit(path, result_of(checked(INTRODUCED, number=1), checked(PRE_EXISTING, number=2, message="RuntimeError: other 2"),
                                checked(FLAKY, number=3, message="RuntimeError: third 3")))
    suite = ET.parse(path).getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("5", "1", "2")
    failures = suite.findall("testcase/failure")
    assert len(failures) == 1 and "introduced: RuntimeError: boom 3 (1 case(s))" == failures[0].get("message")
    assert "kvfuzz replay corpus/findings/1.json --vllm ./vllm-branch" in failures[0].text
    assert sorted(s.get("message").split(":")[0] for s in suite.findall("testcase/skipped")) == ["flaky", "pre-existing"]


class ScriptedPool:
    """A pool whose target raises the scripted error of its round: what each fresh process would give."""

    opened: list["ScriptedPool"] = []

    def __init__(self, errors: list[str]) -> None:
        self.info, self.errors, self.ran = synthetic_info(), errors, 0
        self.source = TargetSource("scripted", "installed", None, None)
        ScriptedPool.opened.append(self)

    def __enter__(self) -> "ScriptedPool":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def execute(self, case, device, probe=False, worker=0) -> Execution:
        self.ran += 1
        message = self.errors[len(ScriptedPool.opened) - 1]
        return Execution(case, outcome=Outcome(error_type="RuntimeError", error_message=message, error_function="create_kv_cache_views"))


def test_a_failure_counts_only_when_both_fresh_processes_repeat_it():
    case = one_group(SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, dtype="float16"))
    finding = Finding("crash-on-valid", "full", "create_kv_cache_views", "RuntimeError: bad view 7", "l0")
    firsts = []
    for errors, status in ((["bad view 3", "bad view 9"], NEW), (["bad view 3", "another error"], FLAKY)):
        ScriptedPool.opened = []
        item = Checked(CAMPAIGN, Path("x.json"), case, finding)
        rerun(TargetSource("x", "installed", None, None), [item], "cpu", lambda source, e=errors: ScriptedPool(e),
              lambda item, result, target: firsts.append(result.verdict.finding.signature))
        assert [pool.ran for pool in ScriptedPool.opened] == [1, 1]  # one fresh pool per rerun
        assert settle(item, with_baseline=False) == status
    assert firsts == [finding.signature] * 2  # `first` sees the first rerun only
    item.reruns, item.baseline_failed = [finding.signature] * 2, True
    assert settle(item, with_baseline=True) == PRE_EXISTING
    item.baseline_failed = False
    assert settle(item, with_baseline=True) == INTRODUCED


def test_ci_corpus_records_each_verdict_and_sets_flaky_findings_apart(tmp_path):
    from fuzz.ci.run import record_verdicts
    from fuzz.corpus.store import save_finding

    corpus = tmp_path / "corpus"
    items = []
    for number, status in enumerate((INTRODUCED, FLAKY)):
        item = checked(status, number=number, message=f"RuntimeError: kind {'ab'[number]}")
        item.path = save_finding(corpus / "findings", item.case, {**item.finding.to_dict(), "vllm_version": "dev"})
        items.append(item)
    introduced, flaky = items
    record_verdicts(result_of(*items, checked(PRE_EXISTING, CORPUS, number=5)), corpus)  # a corpus case's file is left alone
    kept = {entry.path.parent.name: entry.meta["ci"] for entry in entries(corpus)}
    assert kept["findings"] == {"status": INTRODUCED, "reruns": introduced.reruns, "baseline": "0.32.0", "on_baseline": "pass"}
    assert kept["flaky"]["status"] == FLAKY and kept["flaky"]["reruns"][1] == "pass"
    assert flaky.path.parent == corpus / "flaky" and not (corpus / "findings" / flaky.path.name).exists()


# ------------------------------------------------------------------ where a failure sits in vLLM


@needs_vllm
def test_functions_under_test_are_found_by_name_in_the_tree():
    import vllm.v1.kv_cache_interface as kv

    lines, start = inspect.getsourcelines(kv.create_kv_cache_views)
    found = functions_under_test(package_folder(resolve("installed")))
    assert found[0] == Location("vllm/v1/kv_cache_interface.py", start, start + len(lines) - 1, "create_kv_cache_views")
    assert locate(None, found) == found


def test_functions_under_test_of_an_older_generation(tmp_path):
    tree = tmp_path / "vllm" / "v1" / "worker" / "gpu"
    tree.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tree / "attn_utils.py").write_text("import torch\n\n\ndef _reshape_kv_cache(a, b):\n    x = 1\n    return x\n\ndef other():\n    pass\n")
    found = functions_under_test(tmp_path / "vllm")
    assert found == [Location("vllm/v1/worker/gpu/attn_utils.py", 4, 6, "_reshape_kv_cache")]


@needs_vllm
def test_an_exception_is_located_at_the_vllm_line_that_raised():
    import vllm.v1.kv_cache_interface as kv

    outcome = capture(lambda: kv.create_kv_cache_views(torch.zeros(8, dtype=torch.int8), None, 1, None, None))
    assert (outcome.error_type, outcome.error_function) == ("AttributeError", "create_kv_cache_views")
    assert outcome.error_file == "v1/kv_cache_interface.py"
    raising = (VLLM / outcome.error_file).read_text().splitlines()[outcome.error_line - 1]
    assert "kv_cache_tensor.layers" in raising  # the attribute of None the call reads first
    assert locate(outcome, []) == [Location("vllm/v1/kv_cache_interface.py", outcome.error_line, None, "create_kv_cache_views")]
    with pytest.raises(IndexError):  # no vLLM frame: kvfuzz's own error, never a target outcome
        capture(lambda: [][1])


def test_an_unbuilt_checkout_runs_as_a_cpu_tree_like_a_release(tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    checkout = TargetSource(str(tmp_path), "checkout", None, tmp_path)
    assert worker_environment(checkout, {})["VLLM_TARGET_DEVICE"] == "cpu"
    (tmp_path / "vllm" / "_C.abi3.so").write_bytes(b"")  # built: vLLM's own platform detection decides
    assert "VLLM_TARGET_DEVICE" not in worker_environment(checkout, {})


# ------------------------------------------------------------------ the gate


@needs_vllm
def test_gate_checks_kept_failures_against_the_baseline_only_when_there_is_one(kvfuzz_target):
    found = list(entries(builtin_corpus()))
    version = kvfuzz_target.info.vllm_version
    kept_here = sum(1 for e in found if e.expected_signature and version in e.affected_versions)
    alone, failing = replay_gate(kvfuzz_target, found, "cpu", with_baseline=False)
    assert failing == [] and alone["expected"] >= kept_here and sum(alone.values()) == len(found)
    with_baseline, failing = replay_gate(kvfuzz_target, found, "cpu", with_baseline=True)
    assert with_baseline["checked"] == len(failing) == alone["expected"] and "expected" not in with_baseline
    assert all(item.origin == CORPUS and item.finding is not None for item in failing)


def test_bad_baseline_is_a_one_line_error(tmp_path):
    err = tmp_path / "err"
    with err.open("w") as stream:
        assert main(["ci", "--baseline", str(tmp_path / "nowhere"), "--corpus", str(tmp_path / "c")], stderr=stream) == 2
    assert err.read_text() == f"kvfuzz: error: --baseline {tmp_path / 'nowhere'}: no such folder\n"


def test_malformed_ci_corpus_file_is_a_one_line_error(tmp_path):
    (tmp_path / "c" / "findings").mkdir(parents=True)
    (tmp_path / "c" / "findings" / "bad.json").write_text("{")
    with pytest.raises(CaseError, match="bad.json: not a readable JSON case"):
        list(entries(tmp_path / "c" / "findings"))
    err = tmp_path / "err"
    with err.open("w") as stream:
        assert main(["ci", "--vllm", "installed", "--corpus", str(tmp_path / "c")], stderr=stream) == 2
    assert "bad.json" in err.read_text()


# ------------------------------------------------------------------ whole runs


def run_ci(tmp_path: Path, *args: str) -> tuple[int, Path]:
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    with (out / "stdout.txt").open("w") as stdout, (out / "stderr.txt").open("w") as stderr:
        status = main(["ci", *args, "--device", "cpu", "--workers", "2", "--corpus", str(out / "corpus"), "--sarif", str(out / "kvfuzz.sarif"),
                       "--junit", str(out / "junit.xml"), "--summary", str(out / "summary.md"), "--quiet"], stdout=stdout, stderr=stderr)
    return status, out


def assert_reports(out: Path) -> dict:
    sarif = json.loads((out / "kvfuzz.sarif").read_text())
    assert sarif_errors(sarif) == []
    ET.parse(out / "junit.xml")
    assert (out / "summary.md").read_text().startswith("## kvfuzz ci: ")
    return sarif


@pytest.mark.slow
@needs_vllm
def test_installed_vllm_passes_with_the_shipped_corpus(tmp_path):
    """The acceptance run, docs/reference/ci.md's `kvfuzz ci --vllm installed` with a shorter budget (a budget bounds the campaign
    only: the gate, the reruns and the reports are the same): exits 0 with a summary, JUnit and valid SARIF."""
    status, out = run_ci(tmp_path, "--vllm", "installed", "--budget", "10")
    assert status == 0, (out / "stdout.txt").read_text()[-3000:]
    sarif = assert_reports(out)
    assert all(r["level"] != "error" for r in sarif["runs"][0]["results"])
    summary = (out / "summary.md").read_text()
    assert "**no new reproducible failure**" in summary and "corpus gate: " in summary


def make_checkout(root: Path) -> Path:
    """A tree laid out like a git clone of vllm-project/vllm: the installed vLLM's Python files, no compiled
    extensions and no generated _version.py (a clone has neither), beside csrc/, tests/ and setup.py."""
    # Bytecode is copied too (as a clone imported once holds it; copies keep the sources' times, so it stays valid).
    shutil.copytree(VLLM, root / "vllm", ignore=shutil.ignore_patterns("*.so", "_version.py"))
    for folder in ("csrc", "tests", "requirements"):
        (root / folder).mkdir()
        (root / folder / "README").write_text("stands in for the folder of a vLLM clone\n")
    (root / "setup.py").write_text("# stands in for vLLM's setup.py\n")
    (root / "pyproject.toml").write_text('[project]\nname = "vllm"\ndynamic = ["version"]\n')
    return root


@pytest.mark.slow
@needs_vllm
def test_source_checkout_passes_unchanged_and_fails_at_a_seeded_bug(tmp_path):
    checkout = make_checkout(tmp_path / "vllm-clone")
    status, out = run_ci(tmp_path / "unchanged", "--vllm", str(checkout), "--baseline", "installed", "--budget", "6")
    assert status == 0, (out / "stdout.txt").read_text()[-3000:]
    assert_reports(out)
    assert "vLLM dev" in (out / "stdout.txt").read_text()  # the checkout runs as itself, not as the installed release

    views = checkout / "vllm" / "v1" / "kv_cache_interface.py"
    text = views.read_text()
    assert VIEW_CALL in text, "the installed vLLM's create_kv_cache_views changed; update the seeded bug"
    views.write_text(text.replace(VIEW_CALL, SEEDED))
    edited = views.read_text().splitlines().index(SEEDED.rstrip("\n")) + 1
    status, out = run_ci(tmp_path / "seeded", "--vllm", str(checkout), "--baseline", "installed", "--budget", "6")
    assert status == 1, (out / "stdout.txt").read_text()[-3000:]
    sarif = assert_reports(out)
    errors = [r for r in sarif["runs"][0]["results"] if r["level"] == "error"]
    assert errors and all(r["baselineState"] == "new" for r in errors)
    lines = {(loc["physicalLocation"]["artifactLocation"]["uri"], loc["physicalLocation"]["region"]["startLine"])
             for r in errors for loc in r.get("locations", [])}
    assert ("vllm/v1/kv_cache_interface.py", edited) in lines, lines
    assert "Introduced by this change" in (out / "summary.md").read_text()
    kept = list(entries(out / "corpus" / "findings"))
    assert kept and {e.meta["ci"]["status"] for e in kept} <= {INTRODUCED, PRE_EXISTING}
