"""The schedule of deeper checks (fuzz/campaign/schedule.py) and their keys (fuzz/checks).

A reused verdict must be the verdict the check gives when it runs: drawn cases judged with every check run, then again
through a schedule that runs each new key and reuses every key it met, get the same verdicts. A key must hold every
fact its check reads (changing one changes the key) and nothing it does not read (so keys repeat).
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from fuzz.campaign.schedule import CheckTally, Schedule
from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend, Touches
from fuzz.checks import block_copy, timing, zeroer
from fuzz.checks import kernel_probe as kernel_check
from fuzz.checks import planner_fit as planner_check
from fuzz.checks import v1_runner as v1_check
from fuzz.space import Rejected, draw_indexed
from fuzz.verdict.findings import Finding
from fuzz.verdict.runner import CaseResult, run_case


def a_case(**changes: object) -> Case:
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64)
    group = GroupCase(spec=spec, layers=("l0", "l1"), synthetic_backend=SyntheticBackend("any"), kernel_block_size=16)
    touches = Touches(consumers=("zeroer", "copy"), blocks=(1,), copies=((0, 2),), tokens=((1, 3),))
    return dataclasses.replace(Case(groups=(group,), num_blocks=4, runner="both", touches=touches), **changes)


def with_touches(**changes: object) -> Case:
    case = a_case()
    assert case.touches is not None
    return dataclasses.replace(case, touches=dataclasses.replace(case.touches, **changes))


OTHER_SPEC = dataclasses.replace(a_case().groups[0], spec=SpecCase(kind="full", block_size=16, num_kv_heads=4, head_size=64))
# What each check's code under test and its judgement read, and what they do not: written here from what each check
# runs (fuzz/targets/consumers.py, kernel_probe.py, runner_v1.py, planner_fit.py), not from the key functions.
READS = {
    "consumer": {"groups": a_case(groups=(OTHER_SPEC,)), "num_blocks": a_case(num_blocks=5), "layout": a_case(layout="LBHNC"),
                 "packing": a_case(packing="uniform_type"), "platform": a_case(platform="rocm"), "blocks": with_touches(blocks=(2,)),
                 "copies": with_touches(copies=((1, 3),)), "spec_source": a_case(spec_source="vllm")},
    "kernel": {"groups": a_case(groups=(OTHER_SPEC,)), "num_blocks": a_case(num_blocks=5), "layout": a_case(layout="LBHNC"),
               "tokens": with_touches(tokens=((2, 0),)), "spec_source": a_case(spec_source="vllm")},
    "v1": {"groups": a_case(groups=(OTHER_SPEC,)), "num_blocks": a_case(num_blocks=5), "layout": a_case(layout="LBHNC"),
           "kv_sharing": a_case(groups=(dataclasses.replace(a_case().groups[0], layers=("l0", "l1", "l2")),), kv_sharing=(("l2", "l0"),)),
           "packing": a_case(packing="cross_layers"), "spec_source": a_case(spec_source="vllm")},
    "planner": {"groups": a_case(groups=(OTHER_SPEC,)), "num_blocks": a_case(num_blocks=5), "packing": a_case(packing="cross_layers"),
                "platform": a_case(platform="rocm")},
}
IGNORES = {
    "consumer": {"runner": a_case(runner="v2"), "tokens": with_touches(tokens=()), "other consumers": with_touches(consumers=("zeroer",)),
                 "device": a_case(device="cpu")},
    "kernel": {"runner": a_case(runner="v2"), "consumers": with_touches(consumers=(), blocks=(), copies=())},
    "v1": {"touches": a_case(touches=None), "device": a_case(device="cpu")},
    "planner": {"runner": a_case(runner="v2"), "touches": a_case(touches=None)},
}
KEYS = {"consumer": block_copy.CHECK.key, "kernel": kernel_check.CHECK.key, "v1": v1_check.CHECK.key, "planner": planner_check.CHECK.key}


@pytest.mark.parametrize(("check", "fact"), [(c, f) for c, facts in READS.items() for f in facts])
def test_a_key_holds_every_fact_its_check_reads(check: str, fact: str) -> None:
    assert KEYS[check](READS[check][fact]) != KEYS[check](a_case())


@pytest.mark.parametrize(("check", "fact"), [(c, f) for c, facts in IGNORES.items() for f in facts])
def test_a_key_leaves_out_what_its_check_does_not_read(check: str, fact: str) -> None:
    assert KEYS[check](IGNORES[check][fact]) == KEYS[check](a_case())


def test_leaving_a_check_out_keeps_the_rest_of_the_case() -> None:
    case = a_case()
    assert zeroer.CHECK.without(case).touches == Touches(consumers=("copy",), blocks=(1,), copies=((0, 2),), tokens=((1, 3),))
    assert kernel_check.CHECK.without(case).touches == Touches(consumers=("zeroer", "copy"), blocks=(1,), copies=((0, 2),))
    assert v1_check.CHECK.without(case) == dataclasses.replace(case, runner="v2")
    alone = with_touches(consumers=("copy",), tokens=())
    assert block_copy.CHECK.without(alone).touches is None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_schedule_defers_a_check_past_its_share_and_reuses_a_judged_key() -> None:
    clock = Clock()
    schedule = Schedule((block_copy.CHECK,), share=0.5, floor=1.0, clock=clock)
    copy_only = with_touches(consumers=("copy",), tokens=())
    judged = CaseResult(copy_only, verdict=None, checks={"copy": None})  # type: ignore[arg-type]
    for blocks in range(3):  # the warm-up keys run whatever they cost
        plan = schedule.plan(dataclasses.replace(copy_only, num_blocks=4 + blocks))
        assert plan.running
        schedule.record(plan, judged, seconds=10.0)
    clock.now = 40.0  # 30 s of the check in 40 s: past half the time
    later = schedule.plan(dataclasses.replace(copy_only, num_blocks=9))
    assert not later.running and later.case.touches is None
    again = schedule.plan(dataclasses.replace(copy_only, num_blocks=4))
    assert again.reuse == {"copy": None} and again.case.touches is None
    tally = schedule.tally["copy"]
    assert (tally.offered, tally.keys_seen, tally.keys_checked, tally.reused, tally.deferred) == (5, 4, 3, 1, 1)


def drawn(target, count: int) -> list[Case]:
    cases = []
    for index in range(count * 2):
        try:
            cases.append(draw_indexed(target.info, 11, index, touches=True))
        except Rejected:
            continue
        if len(cases) == count:
            break
    return cases


def outcome_of(result: CaseResult) -> tuple[str, str | None]:
    return result.verdict.status, None if result.verdict.finding is None else result.verdict.finding.signature


@pytest.mark.slow
def test_reused_verdicts_are_the_verdicts_every_check_gives(kvfuzz_target) -> None:
    target = kvfuzz_target
    if not hasattr(target, "runs"):
        pytest.skip("the schedule runs in the worker process of an in-process target")
    cases = drawn(target, 200)
    every = [outcome_of(run_case(target, case, "cpu")) for case in cases]
    schedule = Schedule(target.checks(), share=1.0, floor=1.0)
    again = list(range(len(cases)))  # a second pass meets every key again, in another order
    random.Random(0).shuffle(again)
    order = list(range(len(cases))) + again
    reused = 0
    for index in order:
        plan = schedule.plan(cases[index])
        reused += bool(plan.reuse)
        result = run_case(target, plan.case, "cpu", checks=plan.running, reuse=plan.reuse)
        schedule.record(plan, result, 0.0)
        assert outcome_of(result) == every[index], cases[index]
    assert reused > len(cases) // 4


def test_a_check_is_charged_its_own_seconds_and_an_unmeasured_one_the_rest() -> None:
    schedule = Schedule((block_copy.CHECK, zeroer.CHECK), share=1.0, floor=1.0, clock=Clock())
    view_only = schedule.plan(a_case(touches=None, runner="v2"))
    schedule.record(view_only, None, seconds=2.0)  # the view path's running mean starts at 2 s
    plan = schedule.plan(with_touches(tokens=()))
    assert set(plan.running) == {"copy", "zeroer"}
    judged = CaseResult(plan.case, verdict=None, checks={"copy": None, "zeroer": None})  # type: ignore[arg-type]
    schedule.record(plan, judged, seconds=12.0, spent={"copy": 0.5})
    assert schedule.tally["copy"].seconds == pytest.approx(0.5)
    assert schedule.tally["zeroer"].seconds == pytest.approx(12.0 - 2.0 - 0.5)


def test_a_check_timed_inside_another_is_charged_to_itself_only(monkeypatch) -> None:
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    timing.take()
    with timing.timed("v1-runner"):
        now[0] += 3.0
        with timing.timed("planner-fit"):
            now[0] += 2.0
        with timing.timed("v1-runner"):
            now[0] += 1.0
    assert timing.take() == {"v1-runner": 4.0, "planner-fit": 2.0}
    assert timing.take() == {}


def test_every_check_judged_on_a_case_reports_its_time(kvfuzz_target) -> None:
    target = kvfuzz_target
    if not hasattr(target, "runs"):
        pytest.skip("checks time themselves in the process that runs them: an in-process target")
    judged_checks: set[str] = set()
    for case in drawn(target, 150):
        timing.take()
        started = time.perf_counter()
        result = run_case(target, case, "cpu")
        wall = time.perf_counter() - started
        spent = timing.take()
        assert set(result.checks) <= set(spent), case
        assert all(seconds >= 0 for seconds in spent.values()) and sum(spent.values()) <= wall
        judged_checks |= set(result.checks)
    assert {"v1-runner", "planner-fit", "kernel-probe", "copy", "offload"} <= judged_checks


def tallied(schedule: Schedule, name: str, seen: int, checked: int, seconds: float, findings: int = 0, new: int = 0) -> None:
    schedule.tally[name] = CheckTally(offered=seen, keys_seen=seen, keys_checked=checked, seconds=seconds, findings=findings,
                                      new_findings=new)


def test_a_check_that_needs_little_leaves_the_rest_of_the_budget_to_the_others() -> None:
    clock = Clock()
    schedule = Schedule((block_copy.CHECK, zeroer.CHECK), share=0.5, floor=0.1, clock=clock)
    clock.now = 100.0
    tallied(schedule, "zeroer", seen=50, checked=50, seconds=0.5)  # 10 ms a key, every key checked: needs 0.6 %
    tallied(schedule, "copy", seen=1000, checked=20, seconds=20.0)  # 1 s a key, one key in fifty: needs 10 s a second
    allowed = schedule.allowances()
    need = 1.25 * 50 / 100 * 0.01
    assert allowed["zeroer"] == pytest.approx(need)
    assert allowed["copy"] == pytest.approx(0.5 - need)  # by yield alone it would get its floor, 0.05


def test_checks_that_all_want_more_split_the_budget_by_yield_above_their_floors() -> None:
    clock = Clock()
    schedule = Schedule((block_copy.CHECK, zeroer.CHECK, kernel_check.CHECK), share=0.5, floor=0.1, clock=clock)
    clock.now = 100.0
    tallied(schedule, "copy", seen=10_000, checked=300, seconds=3.0)  # 100 keys a second of its time
    tallied(schedule, "zeroer", seen=10_000, checked=100, seconds=10.0)  # 10
    tallied(schedule, "kernel-probe", seen=10_000, checked=10, seconds=10.0, findings=5, new=1)  # (10 + 20 x 1 new) / 10 = 3
    allowed = schedule.allowances()
    assert sum(allowed.values()) == pytest.approx(0.5)
    rest = 0.5 - 3 * 0.05
    assert allowed["copy"] == pytest.approx(0.05 + rest * 100 / 113)
    assert allowed["zeroer"] == pytest.approx(0.05 + rest * 10 / 113)
    assert allowed["kernel-probe"] == pytest.approx(0.05 + rest * 3 / 113)


def test_only_a_bug_new_to_the_worker_adds_to_a_checks_yield() -> None:
    clock = Clock()
    schedule = Schedule((block_copy.CHECK,), share=1.0, floor=1.0, clock=clock)
    copy_only = with_touches(consumers=("copy",), tokens=())
    known = Finding("consumer-mismatch", "full", "copy_kv_cache_blocks_inplace", "block 3 copied to 7", "l0", backend="A", layout="NHD")
    found = [known, dataclasses.replace(known, message="block 1 copied to 2"),  # the same bug: numbers are not its signature
             dataclasses.replace(known, backend="B"),  # the same bug under another backend is still that bug
             dataclasses.replace(known, message="block 0 left unzeroed"),  # another bug
             None, known]
    for blocks, finding in enumerate(found):
        clock.now += 100.0  # time enough for every key
        plan = schedule.plan(dataclasses.replace(copy_only, num_blocks=4 + blocks))
        schedule.record(plan, CaseResult(plan.case, verdict=None, checks={"copy": finding}), seconds=1.0)  # type: ignore[arg-type]
    tally = schedule.tally["copy"]
    assert (tally.keys_checked, tally.findings, tally.new_findings) == (6, 5, 2)
