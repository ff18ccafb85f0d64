"""The view path's verdict on one runner's outcome: the process did not die, the specs vLLM built are the case's, the
views match the oracle under that runner's contract, and bytes written through them land where the oracle says."""

from __future__ import annotations

from dataclasses import dataclass

import oracles
from fuzz.case import Case
from fuzz.targets.base import Outcome
from fuzz.verdict import probe
from fuzz.verdict.compare import PROCESS_FAILURES, Verdict, compare
from fuzz.verdict.findings import observed
from fuzz.verdict.specs import check_specs
from oracles.expectation import Expectation


@dataclass(frozen=True)
class Judged:
    verdict: Verdict
    expectation: Expectation | None  # None where the process died before the oracle was needed


def judge_views(case: Case, outcome: Outcome, contract: oracles.Contract) -> Judged:
    """One runner's outcome against the oracle under that runner's contract."""
    failure = PROCESS_FAILURES.get(outcome.error_type or "")
    if failure is not None:
        # The process died, hung or ran out of memory: the case may never have been declared, and no expectation is needed
        # to say so.
        finding = observed(case, failure, outcome.error_function or "?", outcome.error_message or "", outcome.error_layer)
        return Judged(Verdict("finding", finding), None)
    expectation = oracles.expect(case, contract, outcome.runner)
    mismatch = check_specs(case, outcome)
    verdict = Verdict("finding", mismatch) if mismatch is not None else compare(case, expectation, outcome)
    if verdict.status == "pass" and outcome.probe is not None:
        difference = probe.check(expectation, outcome)
        if difference is not None:
            layer = difference.split(":")[0]
            verdict = Verdict("finding", observed(case, "probe-mismatch", "physical-probe", difference, layer))
    return Judged(verdict, expectation)
