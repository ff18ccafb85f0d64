"""`kvfuzz ci`'s reports count bugs, not case files: a CI result whose failures repeat signatures gives one row,
one JUnit test case and one SARIF result per signature, the first introduced bug explained inline (its case in
vLLM's terms, the rows of `kvfuzz explain` that differ, the reproducer); kvfuzz's own internal errors fail the
job as kvfuzz's, with the traceback."""

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

from fuzz.case import SpecCase, dumps
from fuzz.ci.junit import write_ci_junit
from fuzz.ci.model import CAMPAIGN, CORPUS, FLAKY, INTRODUCED, PRE_EXISTING, Checked, CiResult, Location
from fuzz.ci.present import differing_rows, vllm_terms
from fuzz.ci.sarif import sarif_log
from fuzz.ci.summary import markdown, terminal
from fuzz.corpus.builtin import builtin_corpus
from fuzz.corpus.store import entries
from fuzz.verdict.findings import Finding
from tests.conftest import one_group
from tests.test_sarif import sarif_errors

HEAD = f"{'layer':12} {'tensor':6} {'side':8} {'shape':22} {'dtype':13} {'byte strides':28} {'first byte':>10} buffer"
SEEDS = sorted((entry for entry in entries(builtin_corpus() / "seeds")), key=lambda entry: len(dumps(entry.case)))
RAISED = Location("vllm/v1/kv_cache_interface.py", 356, None, "compute_layout_strides")
VIEWS = Location("vllm/v1/kv_cache_interface.py", 377, 441, "create_kv_cache_views")
MAPPING = Location("vllm/v1/worker/utils.py", 460, 473, "map_kv_caches_to_kernel_blocks")


def row(layer: str, side: str, shape: tuple, strides: tuple) -> str:
    """A row as `kvfuzz explain` prints it (fuzz/explain/picture_text.py)."""
    return f"{layer:12} {0:<6} {side:8} {str(shape):22} {'uint8':13} {str(strides):28} {0:>10} 0"


def explain(differs: bool = True) -> str:
    """Two layers, the first one's view half as deep as the oracle's when `differs`."""
    got, strides = ((4, 2, 8, 256), (2048, 512, 256, 1)) if differs else ((8, 2, 8, 256), (1024, 512, 256, 1))
    compared = ("-> 4,096 of 8,192 bytes differ; first at byte 4,096: expected g0.l0[0] element (4, 0, 0, 0) byte 0 (block 1), actual nothing"
                if differs else "-> same 8,192 bytes")
    return "\n".join(["full/FLASH_ATTN/LBNHC  ·  4 blocks  ·  vLLM dev, contract placed-0.32",
                      "finding: shape | reshape | shape [#, #, #, #] instead of [#, #, #, #]",
                      "buffer bytes: expected [8192]  actual [8192]", HEAD,
                      row("g0.l0", "expected", (8, 2, 8, 256), (1024, 512, 256, 1)), row("g0.l0", "actual", got, strides),
                      " " * 20 + compared,
                      row("g0.l1", "expected", (8, 2, 8, 256), (1024, 512, 256, 1)), row("g0.l1", "actual", (8, 2, 8, 256), (1024, 512, 256, 1)),
                      " " * 20 + "-> same 8,192 bytes"])


def failure(status: str, kind: str, function: str, message: str, number: int, origin: str = CORPUS, spec_kind: str = "full",
            backend: str = "FLASH_ATTN", seed: int = 0, where: Location = VIEWS) -> Checked:
    finding = Finding(kind, spec_kind, function, message, "g0.l0", False, backend, "LBNHC")
    reruns = [finding.signature, "pass" if status == FLAKY else finding.signature]
    baseline = finding.signature if status == PRE_EXISTING else "pass"
    folder = "corpus/findings" if origin == CORPUS else ".kvfuzz-corpus/findings"
    return Checked(origin, Path(f"{folder}/{number}.json"), SEEDS[seed].case, finding, reruns, baseline, status == PRE_EXISTING, status,
                   explain(), [where])


SHAPE = "shape | reshape | shape [#, #, #, #] instead of [#, #, #, #]"
ACCEPTED = "accepted-invalid | reshape | accepted a case the contract rejects: a kernel block must hold # states"
ASSERT = "assert-on-invalid | compute_layout_strides | AssertionError: Padded KV pages do not support kernel block splitting."


def repeated() -> list[Checked]:
    """Seven failures the change introduced under three signatures, with pre-existing and flaky ones beside them."""
    return [
        failure(INTRODUCED, "shape", "reshape", "shape [8, 2, 8, 256] instead of [4, 2, 8, 256]", 1, seed=5),
        failure(INTRODUCED, "shape", "reshape", "shape [16, 1, 8, 128] instead of [8, 1, 8, 128]", 2, spec_kind="mla", backend="CPU_MLA"),
        failure(PRE_EXISTING, "shape", "reshape", "shape [2, 1, 64, 584] instead of [1, 1, 64, 584]", 3, seed=1),
        failure(INTRODUCED, "shape", "reshape", "shape [6, 4, 16, 64] instead of [3, 4, 16, 64]", 4, spec_kind="sink", seed=3),
        failure(INTRODUCED, "assert-on-invalid", "compute_layout_strides", "AssertionError: Padded KV pages do not support kernel block "
                "splitting.", 5, where=RAISED),
        failure(INTRODUCED, "assert-on-invalid", "compute_layout_strides", "AssertionError: Padded KV pages do not support kernel block "
                "splitting.", 6, origin=CAMPAIGN, backend="ROCM_AITER_FA", where=RAISED),
        failure(INTRODUCED, "assert-on-invalid", "compute_layout_strides", "AssertionError: Padded KV pages do not support kernel block "
                "splitting.", 7, where=MAPPING),
        failure(INTRODUCED, "accepted-invalid", "reshape", "accepted a case the contract rejects: a kernel block must hold 2 states", 8,
                origin=CAMPAIGN),
        failure(PRE_EXISTING, "crash-on-invalid", "round_up", "ZeroDivisionError: integer division or modulo by zero", 9),
        failure(PRE_EXISTING, "crash-on-invalid", "round_up", "ZeroDivisionError: integer division or modulo by zero", 10),
        failure(FLAKY, "hang", "worker", "no answer within 60 s", 11, origin=CAMPAIGN, where=VIEWS),
    ]


def ci_result(items: list[Checked], campaign: dict | None = None) -> CiResult:
    target = {"spec": "./vllm-branch", "label": "checkout", "vllm_version": "dev", "generation": "G6", "contract": "placed-0.32"}
    report = {"cases": 5000, "elapsed_s": 120.0, "cases_per_s": 41.7, "stop_reason": "max-time", "findings": [{}, {}], "internal_errors": {},
              **(campaign or {})}
    return CiResult(target, {"spec": "../vllm-base", "vllm_version": "dev"}, Path(".kvfuzz-corpus"), Counter({"checked": 9, "pass": 40}),
                    report, items)


def table(text: str, heading: str) -> list[str]:
    """The rows of the first table after `heading`."""
    lines = text[text.index(heading):].splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("|---")) + 1
    end = next((n for n, line in enumerate(lines[start:], start) if not line.startswith("|")), len(lines))
    return lines[start:end]


def cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.replace("\\|", "¦").strip("|").split("|")]


# ------------------------------------------------------------------ one row, one test case, one result per signature


def test_summary_has_one_row_per_signature_with_cases_variants_and_origins():
    result = ci_result(repeated())
    text = markdown(result)
    assert text.startswith("## kvfuzz ci: **3 bug(s) introduced by the change** (7 reproducible failing case(s))\n")
    introduced = [cells(line) for line in table(text, "### Introduced by this change")]
    assert [row[1].replace("¦", "|").strip("`") for row in introduced] == [SHAPE, ASSERT, ACCEPTED]
    shape, asserted, accepted = introduced
    assert shape[2] == "4 (3 introduced, 1 pre-existing)" and asserted[2] == "3" and accepted[2] == "1"
    assert shape[3] == "full, mla, sink / CPU_MLA, FLASH_ATTN / LBNHC"
    assert asserted[3] == "full / FLASH_ATTN, ROCM_AITER_FA / LBNHC"
    assert (shape[4], asserted[4], accepted[4]) == ("corpus 4", "campaign 1, corpus 2", "campaign 1")
    assert asserted[5] == "`vllm/v1/kv_cache_interface.py:356`"
    # Pre-existing and flaky bugs: one line each with a count, their table inside.
    assert "<details><summary><b>1 pre-existing bug(s)</b> in 2 case(s): the baseline fails them too</summary>" in text
    assert "<details><summary><b>1 flaky bug(s)</b> in 1 case(s)" in text
    assert [cells(line)[0] for line in table(text, "<b>1 pre-existing bug(s)</b>")] == ["crash-on-invalid"]
    assert [cells(line)[0] for line in table(text, "<b>1 flaky bug(s)</b>")] == ["hang"]
    # Each signature is one table row, whatever number of case files showed it.
    for signature in {item.finding.signature for item in result.checked}:
        assert text.count(f"| `{signature.replace('|', chr(92) + '|')}` |") == 1, signature


def test_the_first_introduced_bug_is_explained_inline():
    text = markdown(ci_result(repeated()))
    first = text[text.index(f"### First introduced bug: `{SHAPE}`"):text.index("### The other 2")]
    smallest = SEEDS[0].case  # the shape bug's smallest introduced case is the example (number 2)
    assert f"Minimal case (`corpus/findings/2.json`), as vLLM builds it:\n\n```text\n{vllm_terms(smallest)}\n```" in first
    inline = first[first.index("the rows that differ"):first.index("Reproduce:")]
    assert "g0.l0        0      actual   (4, 2, 8, 256)" in inline and "g0.l1" not in inline and "(1 other tensor(s) as expected)" in inline
    assert "```bash\nkvfuzz replay corpus/findings/2.json --vllm ./vllm-branch\n```" in first
    assert "g0.l1" in first[first.index("full kvfuzz explain"):]  # the whole text, collapsed
    assert "- in vLLM: `vllm/v1/kv_cache_interface.py:377` (create_kv_cache_views)" in first
    assert first.count("- introduced, corpus: `corpus/findings/") == 3 and "- pre-existing, corpus: `corpus/findings/3.json`" in first
    # The other introduced bugs follow collapsed, each in full.
    assert text.count("<details><summary>introduced: <code>") == 2


def test_junit_has_one_test_case_per_signature(tmp_path):
    path = tmp_path / "junit.xml"
    result = ci_result(repeated())
    write_ci_junit(path, result)
    suite = ET.parse(path).getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped"), suite.get("errors")) == ("7", "3", "2", "0")
    names = [case.get("name") for case in suite.findall("testcase")[2:]]
    assert names == [SHAPE, ASSERT, ACCEPTED, "crash-on-invalid | round_up | ZeroDivisionError: integer division or modulo by zero",
                     "hang | worker | no answer within # s"]
    shape = suite.findall("testcase")[2].find("failure")
    assert shape.get("message").endswith("(4 case(s))") and shape.get("type") == "shape"
    assert all(f"corpus/findings/{n}.json" in shape.text for n in (1, 2, 3, 4))
    assert "4 case(s) (corpus 4) under full, mla, sink / CPU_MLA, FLASH_ATTN / LBNHC" in shape.text


def test_sarif_has_one_result_per_signature_with_the_other_places_related():
    log = sarif_log(ci_result(repeated()), "0.2.0")
    assert sarif_errors(log) == []
    results = log["runs"][0]["results"]
    found = [(r["properties"]["signature"], r["level"], r["properties"]["cases"]) for r in results]
    assert found[:2] == [(SHAPE, "error", 4), (ASSERT, "error", 3)]
    assert [r["level"] for r in results] == ["error", "error", "error", "warning", "note"]
    assert results[0]["properties"]["caseFiles"] == [f"corpus/findings/{n}.json" for n in (1, 2, 3, 4)]
    assert results[0]["properties"]["statuses"] == {INTRODUCED: 3, PRE_EXISTING: 1}
    asserted = results[1]
    region = asserted["locations"][0]["physicalLocation"]
    assert (region["artifactLocation"]["uri"], region["region"]) == ("vllm/v1/kv_cache_interface.py", {"startLine": 356})
    related = [loc["physicalLocation"]["artifactLocation"]["uri"] for loc in asserted["relatedLocations"]]
    assert related == ["vllm/v1/worker/utils.py"]  # the third case pointed elsewhere
    assert "3 case(s) (campaign 1, corpus 2)" in asserted["message"]["text"]
    assert log["runs"][0]["invocations"] == [{"executionSuccessful": True}]


def test_terminal_lists_bugs_not_case_files():
    text = terminal(ci_result(repeated()))
    assert text.splitlines()[0] == ("kvfuzz ci: checked 11 failing case(s): 5 bug(s): 3 introduced (8 case(s)), 1 pre-existing (2 case(s)), "
                                    "1 flaky (1 case(s))")
    assert text.count("  INTRODUCED ") == 3 and "4 case(s) (corpus 4) under full, mla, sink" in text
    assert text.splitlines()[-1] == "kvfuzz ci: 3 bug(s) introduced by the change (7 reproducible failing case(s))"


def test_a_run_with_nothing_introduced_says_so_then_what_was_checked():
    items = [item for item in repeated() if item.status != INTRODUCED]
    text = markdown(ci_result(items))
    lines = text.splitlines()
    assert lines[0] == "## kvfuzz ci: **no new reproducible failure**"
    assert lines[2:6] == ["- target: `--vllm ./vllm-branch` (checkout, vLLM dev, contract placed-0.32)",
                          "- baseline: `--vllm ../vllm-base`, vLLM dev", "- corpus gate: 49 cases replayed: 9 checked, 40 pass",
                          "- campaign: 5,000 cases in 120 s (41.7 cases/s), 2 new signature(s); CI corpus `.kvfuzz-corpus`"]
    assert "### Introduced" not in text and "First introduced bug" not in text
    assert "<b>2 pre-existing bug(s)</b> in 3 case(s)" in text


# ------------------------------------------------------------------ the explain text, cut


def test_explain_is_cut_to_the_tensors_that_differ():
    cut = differing_rows(explain()).splitlines()
    assert cut[:4] == explain().splitlines()[:4]  # the case, the finding, the buffers, the column heads
    assert [line.split()[0] for line in cut[4:7]] == ["g0.l0", "g0.l0", "->"] and cut[7:] == ["(1 other tensor(s) as expected)"]
    assert differing_rows(explain(differs=False)) == "\n".join(explain().splitlines()[:3])  # nothing differs: the head says it all
    assert differing_rows("vLLM raised RuntimeError") == "vLLM raised RuntimeError"  # no table: unchanged


def test_explain_of_a_crash_keeps_the_head_not_the_empty_views():
    rows = [row(f"g0.l{n}", "expected", (8, 2, 8, 256), (1024, 512, 256, 1)) for n in range(3)]
    head = ["case", "vLLM raised RuntimeError in create_kv_cache_views: setStorage out of bounds", "buffer bytes: expected [8192]  actual -"]
    text = "\n".join([*head, HEAD, *[line for expected in rows for line in (expected, expected.replace("expected", "actual  ", 1)[:29] + "-",
                                                                      " " * 20 + "-> 8,192 of 8,192 bytes differ")]])
    cut = differing_rows(text).splitlines()
    assert cut == [*head, "(vLLM built no views: all 3 expected tensor(s) are in the full text)"]


def test_a_case_in_vllm_terms():
    case = one_group(SpecCase(kind="mla", block_size=64, num_kv_heads=1, head_size=576, dtype="float16", cache_dtype="fp8"),
                     layout="LBNHC", blocks=3, kernel=32)
    assert vllm_terms(case).splitlines() == [
        "num_blocks=3, layout LBNHC (= NHD), model runner v2",
        "group 0: MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.float16, cache_dtype='fp8')",
        "  layers l0; synthetic backend SYNTHETIC_ANY (kvfuzz's: kernel block sizes ['x1'], layouts any), kernel block size 32"]


# ------------------------------------------------------------------ kvfuzz's own errors


TRACEBACK = 'Traceback (most recent call last):\n  File "fuzz/verdict/runner.py", line 80, in run_case\nKeyError: \'g0.l9\'\n'


def test_an_internal_error_fails_the_job_as_kvfuzz_s_with_its_traceback(tmp_path):
    kept = tmp_path / "internal-errors" / "abc.json"
    kept.parent.mkdir()
    kept.write_text(json.dumps({"error": "KeyError: 'g0.l9'", "traceback": TRACEBACK, "case": {}}))
    result = ci_result([item for item in repeated() if item.status == PRE_EXISTING],
                       {"internal_errors": {"KeyError: 'g0.l9'": 3}, "internal_error_cases": {"KeyError: 'g0.l9'": str(kept)}})
    assert result.exit_status == 2
    text = markdown(result)
    assert text.startswith("## kvfuzz ci: **failed: the job failed because of a kvfuzz internal error, not because of the change**\n")
    assert "**kvfuzz failed, not your change:**" in text and f"(3x, first case kept in `{kept}`)" in text
    assert f"<details><summary>traceback</summary>\n\n```text\n{TRACEBACK.rstrip()}\n```\n</details>" in text
    shown = terminal(result)
    assert shown.splitlines()[-1] == "kvfuzz ci: failed: the job failed because of a kvfuzz internal error, not because of the change"
    assert "KVFUZZ INTERNAL ERROR (3x" in shown and "      KeyError: 'g0.l9'" in shown
    log = sarif_log(result, "0.2.0")
    assert sarif_errors(log) == [] and log["runs"][0]["invocations"][0]["executionSuccessful"] is False
    path = tmp_path / "junit.xml"
    write_ci_junit(path, result)
    error = ET.parse(path).getroot().find("testcase/error")
    assert error is not None and TRACEBACK.strip() in error.text


def test_internal_errors_read_as_entries_and_without_a_traceback():
    entries_form = ci_result([], {"internal_errors": [{"error": "ValueError: x", "count": 2, "traceback": TRACEBACK}]})
    assert [(e.message, e.count, e.traceback) for e in entries_form.internal_errors] == [("ValueError: x", 2, TRACEBACK)]
    details = ci_result([], {"internal_errors": {"ValueError: x": 2}, "internal_error_details": [
        {"error": "ValueError: x", "count": 2, "case_file": "internal-errors/a.json", "traceback": TRACEBACK}]})
    assert [(e.message, e.count, e.case_file, e.traceback) for e in details.internal_errors] == [
        ("ValueError: x", 2, "internal-errors/a.json", TRACEBACK)]
    bare = ci_result([], {"internal_errors": {"ValueError: x": 1}})
    text = markdown(bare)
    assert bare.exit_status == 2 and "not because of the change" in text.splitlines()[0] and "<summary>traceback</summary>" not in text
    # The change's own bug still decides the verdict; kvfuzz's failure is said beside it.
    both = ci_result(repeated(), {"internal_errors": {"ValueError: x": 1}})
    assert both.exit_status == 1 and markdown(both).startswith("## kvfuzz ci: **3 bug(s) introduced by the change**")
    assert terminal(both).splitlines()[-1] == "kvfuzz ci: kvfuzz also failed on 1 case(s) (an internal error, above)"


def test_kvfuzz_s_own_error_after_the_target_started_is_reported_in_the_result(monkeypatch):
    import fuzz.ci.run as run
    from fuzz.errors import InternalError, TargetError

    def stops_with(error: Exception):
        def _run(options, source, baseline, shipped, kept, results, out):
            results.append(ci_result([]))
            raise error
        return _run

    options = run.CiOptions(vllm="installed", corpus=Path("/nonexistent-ci-corpus"))
    monkeypatch.setattr(run, "_run", stops_with(KeyError("g0.l9")))
    with open("/dev/null", "w") as out:
        result = run.run_ci(options, out)
        assert result.exit_status == 2 and result.aborted is not None
        assert "KeyError: 'g0.l9'" in result.aborted.message and "Traceback (most recent call last)" in result.aborted.traceback
        assert "not because of the change" in markdown(result).splitlines()[0]
        monkeypatch.setattr(run, "_run", stops_with(InternalError("ValueError: x (kvfuzz: fuzz/a.py:1 f)", TRACEBACK)))
        assert run.run_ci(options, out).aborted.traceback == TRACEBACK  # the worker's traceback
        monkeypatch.setattr(run, "_run", stops_with(TargetError("the baseline did not start")))
        with pytest.raises(TargetError):  # a setup error stays one line and exit status 2 (fuzz/cli.py)
            run.run_ci(options, out)


def test_target_processes_do_not_import_vllm_from_the_working_directory(tmp_path, monkeypatch):
    """`kvfuzz ci` runs from a vLLM clone: a target started there (python -m) must import its own vLLM, not the clone's."""
    from fuzz.targets.releases import resolve, worker_environment

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    where = "import importlib.util as u; spec = u.find_spec('vllm'); print(spec.origin if spec else None)"
    env = worker_environment(resolve("installed"))
    found = subprocess.run([sys.executable, "-c", where], capture_output=True, text=True, check=True, env=env).stdout
    assert str(tmp_path) not in found
    env.pop("PYTHONSAFEPATH")
    leaked = subprocess.run([sys.executable, "-c", where], capture_output=True, text=True, check=True, env=env).stdout
    assert str(tmp_path) in leaked  # what the environment prevents


def test_the_reproducer_offers_the_standalone_test_where_kvfuzz_can_export_one():
    from fuzz.ci.present import export_command
    from fuzz.export.code import NoTemplate
    from fuzz.export.finding import read_finding
    from fuzz.export.templates import export

    exportable = None
    for path in sorted((builtin_corpus() / "findings").glob("*.json")):
        try:
            exportable = (path, export(read_finding(path), None).file_name)
            break
        except NoTemplate:  # no template for this one: any other error is the exporter's bug
            continue
    assert exportable is not None, "no shipped finding has an export template"
    path, name = exportable
    assert export_command(path) == f"kvfuzz export {path} --out tests/kvfuzz  # writes {name}: a standalone test, vllm and torch only"
    assert export_command(Path("/nonexistent/finding.json")) is None
