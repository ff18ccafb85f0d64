"""Run one case through the oracle and the target, and judge the difference."""

from __future__ import annotations

from dataclasses import dataclass

import oracles
from fuzz.case import Case
from fuzz.compare import Verdict, compare
from fuzz.targets.base import Outcome, Target
from oracles.expectation import Expectation


@dataclass(frozen=True)
class CaseResult:
    case: Case
    verdict: Verdict
    expectation: Expectation | None = None
    outcome: Outcome | None = None
    skipped: str | None = None


def run_case(target: Target, case: Case, device: str = "cpu") -> CaseResult:
    """Declaring is idempotent, so cases that already carry their backends' fields may be re-run."""
    reason = target.unsupported(case)
    if reason is not None:
        return CaseResult(case, Verdict("skipped", reason=reason), skipped=reason)
    try:
        case = target.declare(case)
    except Exception as error:  # noqa: BLE001 - the backend refuses the spec at config time
        reason = f"backend refused the spec: {type(error).__name__}: {error}".splitlines()[0]
        return CaseResult(case, Verdict("rejected", reason=reason))
    expectation = oracles.expect(case, target.info.contract)
    outcome = target.run(case, case.device or device)
    return CaseResult(case, compare(case, expectation, outcome), expectation, outcome)
