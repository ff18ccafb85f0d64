"""Run one case through the target and the oracle, and judge the difference.

A case run by both model runners gets each runner's outcome judged against the oracle under that
runner's contract; a finding of either is the case's (the V2 runner's first), and when both satisfy
the oracle their layouts must agree with each other (fuzz/verdict/runners.py, `runner-mismatch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import oracles
from fuzz.case import Case
from fuzz.targets.base import Execution, Outcome, Target
from fuzz.verdict import probe, touch
from fuzz.verdict.compare import PROCESS_FAILURES, Verdict, compare
from fuzz.verdict.findings import observed
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


def judge(execution: Execution, target_contract: oracles.Contract) -> CaseResult:
    """The verdict on one execution; the oracle sees only the declared case and the contract."""
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
    primary = _judge_outcome(case, execution.outcome, target_contract)
    if execution.v1 is None:
        return primary
    v1 = _judge_outcome(case, execution.v1, target_contract)
    verdict = primary.verdict if primary.verdict.status == "finding" else v1.verdict
    if verdict.status != "finding":
        mismatch = compare_runners(case, (primary.verdict, primary.expectation, execution.outcome), (v1.verdict, v1.expectation, execution.v1))
        verdict = mismatch or primary.verdict
    return CaseResult(case, verdict, primary.expectation, primary.outcome, v1)


def _judge_outcome(case: Case, outcome: Outcome, target_contract: oracles.Contract) -> CaseResult:
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
    if verdict.status == "pass" and (misfit := check_planner_fit(case, outcome)) is not None:
        verdict = Verdict("finding", misfit)
    if verdict.status == "pass" and outcome.touches:
        touched = touch.check(case, expectation, outcome)
        if touched is not None:
            verdict = Verdict("finding", touched)
    return CaseResult(case, verdict, expectation, outcome)


def run_case(target: Target, case: Case, device: str = "cpu", probe: bool | str = False) -> CaseResult:
    return judge(target.execute(case, case.device or device, probe=probe), target.info.contract)
