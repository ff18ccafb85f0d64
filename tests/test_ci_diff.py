"""`kvfuzz ci` with a baseline: the change located, directed draws, diff coverage in the reports, behaviour changes."""

import importlib.util
import json
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from fuzz.campaign.protocol import Task
from fuzz.case import SpecCase
from fuzz.ci.behaviour import Compared, moved_views
from fuzz.ci.diff import IMPORT_TIME, ChangedFunction, changed_lines, diff_lines, locate_change, parse_unified, ranges_text
from fuzz.ci.direct import (
    MAX_TAPES,
    UNDIRECTED,
    BatchReach,
    Direction,
    ReachStats,
    TapeSource,
    draw,
    draw_taped,
    features,
    undirected,
)
from fuzz.ci.model import DiffCoverage, FunctionCoverage
from fuzz.ci.report import report
from fuzz.ci.sarif import sarif_log
from fuzz.ci.summary import markdown
from fuzz.ci.trace import ChangeTracer
from fuzz.space import Rejected, draw_case
from fuzz.targets.base import Outcome, ViewRecord
from fuzz.verdict.compare import Verdict
from fuzz.verdict.runner import CaseResult
from tests.conftest import one_group, synthetic_info
from tests.test_ci import VLLM, make_checkout, needs_vllm, result_of, run_ci
from tests.test_sarif import sarif_errors

BASE = '''"""A module."""

LIMIT = 4


class Spec:
    size: int = 2

    def page(self, blocks):
        total = blocks * self.size
        return total

    @property
    def bytes(self):
        return self.size * 8


def views(spec, blocks):
    # how many
    n = spec.page(blocks)
    return [n for _ in range(blocks)]


def unused(x):
    if x > 100:
        return x - 1
    return x
'''
# Edits, by the line of HEAD they land on: 3 (a constant: import time), 8 (a field default: import time), 11 (Spec.page),
# 20 -> 21 (a comment and a statement in views: only 21 runs), 27 (the far branch of unused), and a deleted line.
HEAD = '''"""A module."""

LIMIT = 5


class Spec:
    size: int = 2
    extra: int = 0

    def page(self, blocks):
        total = blocks * self.size + self.extra
        return total

    @property
    def bytes(self):
        return self.size * 8


def views(spec, blocks):
    # how many pages
    n = spec.page(blocks) + 0
    return [n for _ in range(blocks)]


def unused(x):
    if x > 100:
        return x - 2
'''


def write_tree(root: Path, source: str) -> Path:
    path = root / "vllm" / "v1" / "demo.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    (root / "vllm" / "outside.py").write_text(source)  # not under SCOPE: never compared
    return root


def test_diff_lines_marks_changes_additions_and_the_line_after_a_deletion():
    assert diff_lines(["a", "b", "c"], ["a", "B", "c"]) == {2}
    assert diff_lines(["a", "c"], ["a", "b", "c"]) == {2}
    assert diff_lines(["a", "b", "c"], ["a", "c"]) == {2}
    assert diff_lines(["a", "b"], ["a"]) == {1}


def test_changed_lines_are_mapped_to_their_functions(tmp_path):
    base, head = write_tree(tmp_path / "base", BASE), write_tree(tmp_path / "head", HEAD)
    (head / "vllm" / "outside.py").write_text("changed = True\n")
    assert changed_lines(base, head) == {"vllm/v1/demo.py": {3, 8, 11, 20, 21, 27}}
    found = {f.qualname: f for f in locate_change(base, head)}
    assert set(found) == {IMPORT_TIME, "Spec.page", "views", "unused"}
    assert found["Spec.page"].lines == (11,) and (found["Spec.page"].start, found["Spec.page"].end) == (10, 12)
    assert found["views"].lines == (21,)  # the comment on line 20 runs nothing
    assert found["unused"].lines == (27,)  # the deleted `return x` is marked on the line before it
    assert found[IMPORT_TIME].lines == (3, 8) and found[IMPORT_TIME].import_time
    assert ranges_text("vllm/v1/demo.py", [3, 4, 5, 9]) == "vllm/v1/demo.py:3-5, 9"


def test_a_changed_signature_is_a_header_line():
    base = "def f(a, b):\n    return a\n"
    head = "def f(a, c):\n    return a\n"
    from fuzz.ci.diff import map_to_functions

    (function,) = map_to_functions("vllm/v1/x.py", head, diff_lines(base.splitlines(), head.splitlines()))
    assert function.lines == (1,) and function.header == (1,)


def test_unified_diff_hunks_as_new_lines():
    text = ("diff --git a/vllm/v1/a.py b/vllm/v1/a.py\n--- a/vllm/v1/a.py\n+++ b/vllm/v1/a.py\n"
            "@@ -3 +3 @@\n-x\n+y\n@@ -10,2 +10,0 @@\n-p\n-q\n@@ -20,0 +19,2 @@\n+r\n+s\n")
    assert parse_unified(text) == {"vllm/v1/a.py": {3, 11, 19, 20}}


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_worktrees_of_one_repository_are_compared_with_git(tmp_path):
    repo = write_tree(tmp_path / "repo", BASE)

    def git(*args: str, cwd: Path = repo) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "base")
    git("worktree", "add", "-q", str(tmp_path / "base"), "HEAD")
    (repo / "vllm" / "v1" / "demo.py").write_text(HEAD)  # uncommitted, as on a branch being worked on
    (repo / "vllm" / "v1" / "new.py").write_text("x = 1\n")
    assert changed_lines(tmp_path / "base", repo) == {"vllm/v1/demo.py": {3, 8, 11, 20, 21, 27}, "vllm/v1/new.py": {1}}


def test_the_tracer_records_the_changed_lines_each_call_runs(tmp_path):
    path = write_tree(tmp_path / "head", HEAD) / "vllm" / "v1" / "demo.py"
    spec = importlib.util.spec_from_file_location("kvfuzz_demo_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    functions = [ChangedFunction("vllm/v1/demo.py", "Spec.page", 10, 12, (10, 11), (10,)),
                 ChangedFunction("vllm/v1/demo.py", "unused", 25, 27, (27,))]
    tracer = ChangeTracer(functions)
    before = sys.gettrace()
    tracer.start()
    module.views(module.Spec(), 2)
    module.unused(3)
    hits = tracer.stop()
    assert hits == {("vllm/v1/demo.py", 10), ("vllm/v1/demo.py", 11)}
    tracer.start()
    module.unused(300)
    assert tracer.stop() == {("vllm/v1/demo.py", 27)}
    assert not ChangeTracer([ChangedFunction("vllm/v1/demo.py", IMPORT_TIME, 1, 27, (3,))])  # nothing to trace per case
    assert sys.gettrace() is before


# ------------------------------------------------------------------ directed draws


def test_the_policy_favours_features_that_reach():
    stats = ReachStats()
    for _ in range(50):
        stats.add(frozenset({"kind=mla", "layout=LBNHC"}), True)
        stats.add(frozenset({"kind=full", "layout=LBNHC"}), False)
        stats.add(frozenset({"kind=full", "layout=LHBNC"}), False)
    weights = stats.policy()["weights"]
    assert weights["kind=mla"] > 0 > weights["kind=full"]
    assert weights["kind=mla"] > weights["layout=LBNHC"] > weights["layout=LHBNC"]
    unseen = ReachStats()
    unseen.add(frozenset({"a", "b"}), False)
    unseen.add(frozenset({"a"}), False)
    explore = unseen.policy()
    assert explore["base"] == 0 and explore["weights"]["b"] > explore["weights"]["a"]  # before any hit, the rarer feature


def test_directed_draws_lean_towards_the_policy_keep_an_undirected_share_and_are_reproducible():
    info = synthetic_info()
    policy = {"weights": {f"kind={kind}": (3.0 if kind == "mla" else -1.0) for kind in info.spec_kinds}, "base": 0.05}
    plain = Counter()
    directed = Counter()
    sides = Counter()
    for index in range(150):
        try:
            plain["kind=mla" in features(draw(info, 7, index, None)[0])] += 1
            case, was_directed = draw(info, 7, index, policy)
        except Exception:  # noqa: BLE001 - an unbuildable index on both sides alike
            continue
        sides[was_directed] += 1
        directed["kind=mla" in features(case)] += 1
        assert was_directed != undirected(7, index)
        assert draw(info, 7, index, policy) == (case, was_directed)
    assert directed[True] > 2 * plain[True]
    assert 0.5 * UNDIRECTED < sides[False] / sum(sides.values()) < 2 * UNDIRECTED
    task = Task(batch=1, seed=7, start=0, count=8, synthetic=True, device="cpu", policy=policy).to_dict()
    assert Direction([]).redraw(info, task, 3) == draw(info, 7, 3, policy, touches=True)[0]


def test_a_tape_replayed_draws_the_same_case_whatever_comes_after_it():
    info = synthetic_info()
    for index in range(40):
        try:
            case, _, tape = draw_taped(info, 5, index, None)
        except Rejected:
            continue
        replayed = draw_case(TapeSource(random.Random(index + 1000), tape), info)
        assert replayed == case
        assert draw_taped(info, 5, index, None)[2] == tape


def test_directed_draws_from_reaching_tapes_keep_what_no_named_choice_steers():
    """Splitting into kernel blocks comes from a drawn block size (an integer, not a named option): weights alone
    cannot steer it, neighbours of the tapes of splitting cases keep it."""
    info = synthetic_info()
    split = "split=kernel-blocks"
    plain: list[bool] = []
    tapes: list[list[float]] = []
    for index in range(400):
        try:
            case, _, tape = draw_taped(info, 3, index, None)
        except Rejected:
            continue
        plain.append(split in features(case))
        if plain[-1] and len(tapes) < 8:
            tapes.append(tape)
    assert tapes and sum(plain) < 0.5 * len(plain)
    weights = {split: 0.0}  # no feature a choice can be weighted by
    policy = {"weights": weights, "base": 0.05, "tapes": tapes}
    directed: list[bool] = []
    for index in range(400, 600):
        try:
            case, was_directed = draw(info, 3, index, policy)
        except Rejected:
            continue
        if was_directed:
            directed.append(split in features(case))
            assert draw(info, 3, index, policy) == (case, was_directed)
    assert sum(directed) / len(directed) > 2 * sum(plain) / len(plain)
    without = [draw(info, 3, index, {"weights": weights, "base": 0.05})[0] for index in range(400, 440) if not undirected(3, index)]
    assert sum(split in features(case) for case in without) / len(without) < sum(directed) / len(directed)


def test_batches_add_up_in_the_direction():
    function = ChangedFunction("vllm/v1/demo.py", "views", 19, 22, (21,))
    case = one_group(SpecCase("full", 16))
    batch = BatchReach([function], set())
    batch.add(case, {("vllm/v1/demo.py", 21)}, True, 0, case)
    batch.add(case, set(), False, 1, case)
    batch.add(case, {("vllm/v1/demo.py", 21)}, False, 2, case)
    direction = Direction([function, ChangedFunction("vllm/v1/demo.py", IMPORT_TIME, 1, 30, (3,))])
    assert direction.task()["policy"] is None  # not warmed up: undirected draws
    direction.take(json.loads(json.dumps(batch.to_dict())))
    coverage = direction.coverage(compared=1)
    assert (coverage.cases, coverage.reached, coverage.executed, coverage.changed) == (3, 2, 2, 2)
    assert coverage.counts == {"directed_cases": 1, "directed_hits": 1, "undirected_cases": 2, "undirected_hits": 1}
    assert [row.cases for row in coverage.functions] == [2, None]
    assert len(direction.samples) == 1  # the same case twice is one sample
    assert [f["qualname"] for f in direction.task()["changed"]] == ["views"]
    # Reaching cases' tapes go to the coordinator, which hands the newest MAX_TAPES out with the policy.
    taped = BatchReach([function], set())
    for index in range(MAX_TAPES + 80):
        taped.add(case, {("vllm/v1/demo.py", 21)}, True, index, case, [index / 1000])
        if len(taped.tapes) == 4:
            direction.take(json.loads(json.dumps(taped.to_dict())))
            taped = BatchReach([function], set())
    direction.stats.cases = 10_000
    tapes = direction.task()["policy"]["tapes"]
    assert len(tapes) == MAX_TAPES and tapes[-1] == [(MAX_TAPES + 79) / 1000]


# ------------------------------------------------------------------ reports


def coverage() -> DiffCoverage:
    reached = ChangedFunction("vllm/v1/kv_cache_interface.py", "create_kv_cache_views", 377, 440, (401, 402))
    missed = ChangedFunction("vllm/v1/worker/utils.py", "KVBlockZeroer.warmup", 505, 520, (512, 513, 514, 515, 516, 517, 518))
    return DiffCoverage([FunctionCoverage(reached, (401, 402), 812), FunctionCoverage(missed, (), 0)], True, 4000, 812,
                        {"directed_cases": 2800, "directed_hits": 790}, 24)


def test_summary_sarif_and_report_give_the_diff_coverage():
    result = result_of()
    result.coverage = coverage()
    text = markdown(result)
    assert "### Diff coverage" in text
    assert "| `vllm/v1/kv_cache_interface.py` create_kv_cache_views | 2/2 | 812 | - |" in text
    assert "| `vllm/v1/worker/utils.py` KVBlockZeroer.warmup | 0/7 | 0 | `vllm/v1/worker/utils.py:512-518` |" in text
    assert "- kvfuzz did not exercise: `vllm/v1/worker/utils.py:512-518`" in text
    log = sarif_log(result, "0.0")
    assert sarif_errors(log) == []
    run = log["runs"][0]
    assert run["properties"]["diffCoverage"]["unexercised"] == ["vllm/v1/worker/utils.py:512-518"]
    (note,) = [r for r in run["results"] if r["ruleId"] == "unexercised-change"]
    assert note["level"] == "note" and run["tool"]["driver"]["rules"][note["ruleIndex"]]["id"] == "unexercised-change"
    region = note["locations"][0]["physicalLocation"]["region"]
    assert (region["startLine"], region["endLine"]) == (512, 518)
    assert "kvfuzz did not exercise: vllm/v1/worker/utils.py:512-518" in note["message"]["text"]
    data = report(result)
    assert data["diff_coverage"]["executed_lines"] == 2 and data["diff_coverage"]["changed_lines"] == 9
    assert result.exit_status == 0  # unexercised lines are notes, not failures
    plain = result_of()
    assert "Diff coverage" not in markdown(plain) and "properties" not in sarif_log(plain, "0.0")["runs"][0]


def view(shape, stride, offset=0) -> ViewRecord:
    return ViewRecord(tuple(shape), tuple(stride), offset, "bfloat16", 2, 0)


def passed(outcome: Outcome) -> CaseResult:
    return CaseResult(one_group(SpecCase("full", 16)), Verdict("pass"), outcome=outcome)


def test_views_that_differ_between_two_passing_sides_are_a_behaviour_change():
    same = Outcome(views={"l0": (view((2, 4), (4, 1)),)})
    moved = Outcome(views={"l0": (view((2, 4), (4, 1), offset=8),)})
    case = one_group(SpecCase("full", 16))
    assert Compared(case, passed(same), passed(same)).note() is None
    note = Compared(case, passed(moved), passed(same)).note()
    assert note is not None and note.layers == ["l0"] and note.bytes == 16  # every element moved by 8 bytes
    (move,) = moved_views(Outcome(views={"l0": (view((4, 4), (4, 1)),)}), same)
    assert move.bytes == 16  # the larger view covers 16 bytes more
    result = result_of()
    result.coverage, result.behaviour = coverage(), [note]
    assert "### Behaviour changes (1 note(s), not failures)" in markdown(result)
    assert [r["ruleId"] for r in sarif_log(result, "0.0")["runs"][0]["results"]].count("behaviour-change") == 1
    assert result.exit_status == 0


# ------------------------------------------------------------------ a whole run


@pytest.mark.slow
@needs_vllm
def test_ci_locates_a_seeded_change_and_reports_its_lines_executed(tmp_path):
    base = make_checkout(tmp_path / "vllm-base")
    branch = tmp_path / "vllm"
    shutil.copytree(base, branch)
    # A layer of a UniformTypeKVCacheSpecs group whose layers differ in size gets its group's first layer's spec.
    allocation = branch / "vllm" / "v1" / "worker" / "utils.py"
    old = "            spec = spec.kv_cache_specs[layer_name]\n"
    wrong = "            spec = next(iter(spec.kv_cache_specs.values()))\n"
    text = allocation.read_text()
    assert text.count(old) == 1, "the installed vLLM's allocate_kv_cache changed; update the seeded change"
    allocation.write_text(text.replace(old, wrong))
    line = allocation.read_text().splitlines().index(wrong.rstrip("\n")) + 1
    status, out = run_ci(tmp_path, "--vllm", str(branch), "--baseline", str(base), "--budget", "10", "--report", str(tmp_path / "r.json"))
    stdout = (out / "stdout.txt").read_text()
    assert status == 1, stdout[-3000:]
    assert f"allocate_kv_cache: vllm/v1/worker/utils.py:{line}" in stdout
    data = json.loads((tmp_path / "r.json").read_text())["diff_coverage"]
    assert data["executed_lines"] == data["changed_lines"] == 1 and data["cases_reaching"] > 0
    assert "### Diff coverage" in (out / "summary.md").read_text()
    assert VLLM is not None
