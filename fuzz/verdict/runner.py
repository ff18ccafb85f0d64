"""Run one case through the target and the oracle, and judge the difference."""

from __future__ import annotations

from dataclasses import dataclass

import oracles
from fuzz.case import Case
from fuzz.targets.base import Execution, Outcome, Target
from fuzz.verdict import probe, touch
from fuzz.verdict.compare import PROCESS_FAILURES, Verdict, compare
from fuzz.verdict.findings import observed
from fuzz.verdict.specs import check_specs
from oracles.expectation import Expectation


@dataclass(frozen=True)
class CaseResult:
    case: Case  # as the target declared it
    verdict: Verdict
    expectation: Expectation | None = None
    outcome: Outcome | None = None


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
    failure = PROCESS_FAILURES.get(execution.outcome.error_type or "")
    if failure is not None:
        # The process died, hung or ran out of memory: the case may never have been declared, and
        # no expectation is needed to say so.
        outcome = execution.outcome
        finding = observed(case, failure, outcome.error_function or "?", outcome.error_message or "", outcome.error_layer)
        return CaseResult(case, Verdict("finding", finding), None, outcome)
    expectation = oracles.expect(case, target_contract)
    mismatch = check_specs(case, execution.outcome)
    verdict = Verdict("finding", mismatch) if mismatch is not None else compare(case, expectation, execution.outcome)
    if verdict.status == "pass" and execution.outcome.probe is not None:
        difference = probe.check(expectation, execution.outcome)
        if difference is not None:
            layer = difference.split(":")[0]
            verdict = Verdict("finding", observed(case, "probe-mismatch", "physical-probe", difference, layer))
    if verdict.status == "pass" and execution.outcome.touches:
        touched = touch.check(case, expectation, execution.outcome)
        if touched is not None:
            verdict = Verdict("finding", touched)
    return CaseResult(case, verdict, expectation, execution.outcome)


def run_case(target: Target, case: Case, device: str = "cpu", probe: bool | str = False) -> CaseResult:
    return judge(target.execute(case, case.device or device, probe=probe), target.info.contract)
