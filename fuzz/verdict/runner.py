"""Run one case through the target and the oracle, and judge the difference."""

from __future__ import annotations

from dataclasses import dataclass

import oracles
from fuzz.case import Case
from fuzz.targets.base import Execution, Outcome, Target
from fuzz.verdict import probe
from fuzz.verdict.compare import Verdict, compare, spec_kind_of
from fuzz.verdict.findings import Finding
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
    if execution.skipped is not None:
        return CaseResult(execution.case, Verdict("skipped", reason=execution.skipped))
    if execution.refused is not None:
        return CaseResult(execution.case, Verdict("rejected", reason=f"backend refused the spec: {execution.refused}"))
    assert execution.outcome is not None
    expectation = oracles.expect(execution.case, target_contract)
    mismatch = check_specs(execution.case, execution.outcome)
    verdict = Verdict("finding", mismatch) if mismatch is not None else compare(execution.case, expectation, execution.outcome)
    if verdict.status == "pass" and execution.outcome.probe is not None:
        difference = probe.check(expectation, execution.outcome)
        if difference is not None:
            layer = difference.split(":")[0]
            verdict = Verdict("finding", Finding("probe-mismatch", spec_kind_of(execution.case, layer), "physical-probe", difference,
                                                 layer, execution.case.is_latent))
    return CaseResult(execution.case, verdict, expectation, execution.outcome)


def run_case(target: Target, case: Case, device: str = "cpu", probe: bool = False) -> CaseResult:
    return judge(target.execute(case, case.device or device, probe=probe), target.info.contract)
