"""Run one case through the target and the oracle, and judge the difference.

A case run by both model runners gets each runner's outcome judged against the oracle under that
runner's contract; a finding of either is the case's (the V2 runner's first), and when both satisfy
the oracle their layouts must agree with each other (fuzz/verdict/runners.py, `runner-mismatch`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import oracles
from fuzz.case import Case, replace
from fuzz.checks.timing import timed
from fuzz.targets.base import Execution, Outcome, Target
from fuzz.verdict import probe, touch
from fuzz.verdict.compare import PROCESS_FAILURES, Verdict, compare
from fuzz.verdict.findings import Finding, observed
from fuzz.verdict.planner import check_planner_fit
from fuzz.verdict.runners import compare_runners
from fuzz.verdict.specs import check_specs
from oracles.expectation import Expectation


@dataclass(frozen=True)
class CaseResult:
    case: Case  # as the target declared it
    verdict: Verdict
    expectation: Expectation | None = None
    outcome: Outcome | None = None
    # A case run by both model runners: the V1 runner's own result (this one's expectation and outcome are the V2 runner's).
    v1: CaseResult | None = None
    # The verdict of each deeper check (fuzz/checks) judged on this case, by check name: its finding, or None when it
    # found nothing. A check that did not run, or whose turn never came (an earlier finding), is absent.
    checks: dict[str, Finding | None] = field(default_factory=dict)


V1_RUNNER = "v1-runner"
PLANNER_FIT = "planner-fit"
KERNEL_PROBE = "kernel-probe"
CONSUMER = "consumer:"


@dataclass(frozen=True)
class Reuse:
    """The verdicts of deeper checks left out of an execution because a worker judged their key before
    (fuzz/campaign/schedule.py), by check name, and the consumers of the case as drawn, in the order it named them."""

    verdicts: Mapping[str, Finding | None] = field(default_factory=dict)
    consumers: tuple[str, ...] = ()


NO_REUSE = Reuse()


def judge(execution: Execution, target_contract: oracles.Contract, reuse: Reuse = NO_REUSE) -> CaseResult:
    """The verdict on one execution; the oracle sees only the declared case and the contract. A reused verdict stands
    where the left-out check's own judgement would, in the same order, so a case gets the verdict it gets with every
    check run."""
    case = execution.case
    if execution.skipped is not None:
        return CaseResult(case, Verdict("skipped", reason=execution.skipped))
    if execution.case_error is not None:
        return CaseResult(case, Verdict("case-error", reason=execution.case_error))
    if execution.declaration is not None:
        function, message, layer = execution.declaration
        finding = observed(case, "declaration", function, message, layer)
        return CaseResult(case, Verdict("finding", finding))
    assert execution.outcome is not None
    primary = _judge_outcome(case, execution.outcome, target_contract, reuse)
    found = primary.verdict.status == "finding"
    if execution.v1 is None:
        reused = reuse.verdicts.get(V1_RUNNER)
        return primary if found or reused is None else replace(primary, verdict=Verdict("finding", reused))
    with timed(V1_RUNNER):
        v1 = _judge_outcome(case, execution.v1, target_contract, reuse)
        verdict = primary.verdict if found else v1.verdict
        if verdict.status != "finding":
            mismatch = compare_runners(case, (primary.verdict, primary.expectation, execution.outcome),
                                       (v1.verdict, v1.expectation, execution.v1))
            verdict = mismatch or primary.verdict
    checks = primary.checks if found else {**primary.checks, V1_RUNNER: verdict.finding}
    return CaseResult(case, verdict, primary.expectation, primary.outcome, v1, checks)


def _judge_outcome(case: Case, outcome: Outcome, target_contract: oracles.Contract, reuse: Reuse) -> CaseResult:
    """One runner's outcome against the oracle under that runner's contract."""
    failure = PROCESS_FAILURES.get(outcome.error_type or "")
    if failure is not None:
        # The process died, hung or ran out of memory: the case may never have been declared, and
        # no expectation is needed to say so.
        finding = observed(case, failure, outcome.error_function or "?", outcome.error_message or "", outcome.error_layer)
        return CaseResult(case, Verdict("finding", finding), None, outcome)
    expectation = oracles.expect(case, target_contract, outcome.runner)
    mismatch = check_specs(case, outcome)
    verdict = Verdict("finding", mismatch) if mismatch is not None else compare(case, expectation, outcome)
    if verdict.status == "pass" and outcome.probe is not None:
        difference = probe.check(expectation, outcome)
        if difference is not None:
            layer = difference.split(":")[0]
            verdict = Verdict("finding", observed(case, "probe-mismatch", "physical-probe", difference, layer))
    checks: dict[str, Finding | None] = {}
    if verdict.status != "pass":
        return CaseResult(case, verdict, expectation, outcome)
    for finding in _deeper(case, expectation, outcome, reuse, checks):
        if finding is not None:
            return CaseResult(case, Verdict("finding", finding), expectation, outcome, checks=checks)
    return CaseResult(case, verdict, expectation, outcome, checks=checks)


def _deeper(case: Case, expectation: Expectation, outcome: Outcome, reuse: Reuse, checks: dict[str, Finding | None]) -> Iterator[Finding | None]:
    """Each deeper check's verdict on a runner's outcome whose views passed, in the order they are looked for
    (planner-fit, each consumer, the kernel probe): judged here and recorded in `checks`, or reused where left out."""
    reused = reuse.verdicts

    def judged(name: str, judge: Callable[[], Finding | None]) -> Finding | None:
        with timed(name):
            checks[name] = verdict = judge()
        return verdict

    if outcome.planner_fit is not None:
        yield judged(PLANNER_FIT, lambda: check_planner_fit(case, outcome))
    elif PLANNER_FIT in reused:
        yield reused[PLANNER_FIT]
    touched = outcome.touches or {}
    ran = touched.get("consumers", {})
    named = [*reuse.consumers, *(case.touches.consumers if case.touches is not None else ())]
    for name in dict.fromkeys(named):
        if name in ran:
            yield judged(CONSUMER + name, lambda: touch.check(case, expectation, replace(outcome, touches={"consumers": {name: ran[name]}})))
        elif CONSUMER + name in reused:
            yield reused[CONSUMER + name]
    if touched.get("kernel"):
        yield judged(KERNEL_PROBE, lambda: touch.check(case, expectation, replace(outcome, touches={"kernel": touched["kernel"]})))
    elif KERNEL_PROBE in reused:
        yield reused[KERNEL_PROBE]


def run_case(target: Target, case: Case, device: str = "cpu", probe: bool | str = False, skip: frozenset[str] = frozenset(),
             reuse: Reuse = NO_REUSE) -> CaseResult:
    """One case through the target and the oracle; `skip` and `reuse` come from a campaign's schedule (fuzz/campaign/schedule.py)."""
    device = case.device or device
    # Only adapters take `skip`; targets in other processes (replay, bisect) run every check.
    execution = target.execute(case, device, probe=probe, skip=skip) if skip else target.execute(case, device, probe=probe)
    return judge(execution, target.info.contract, reuse)
