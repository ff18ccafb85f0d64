"""Run one case through the target and the oracle, and judge the difference.

The view path is judged first (fuzz/verdict/views.py). Where it passed, each deeper check that ran (fuzz/checks) judges
its own record, in the registry's order, until one finds something; a check the worker's schedule left out because it had
judged the same key before stands in with that verdict. Checks that need no views (the other model runner) are judged
also where the view path refused the case.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import oracles
from fuzz.case import Case
from fuzz.checks.protocol import Judging
from fuzz.checks.registry import CHECKS
from fuzz.checks.timing import timed
from fuzz.targets.base import Execution, Outcome, Target
from fuzz.verdict.compare import REFUSALS, Verdict
from fuzz.verdict.findings import Finding, observed
from fuzz.verdict.views import judge_views
from oracles.expectation import Expectation


@dataclass(frozen=True)
class CaseResult:
    case: Case  # as the target declared it
    verdict: Verdict
    expectation: Expectation | None = None
    outcome: Outcome | None = None
    # The verdict of each deeper check (fuzz/checks) judged on this case, by check name: its finding, or None when it
    # found nothing. A check that did not run, or whose turn never came (an earlier finding), is absent.
    checks: dict[str, Finding | None] = field(default_factory=dict)


def judge(execution: Execution, target_contract: oracles.Contract, reuse: Mapping[str, Finding | None] | None = None) -> CaseResult:
    """The verdict on one execution; the oracle sees only the declared case and the contract. `reuse`: the verdicts of checks
    left out of the execution, by name; each stands where the check's own judgement would, so a case gets the verdict it
    gets with every check run."""
    case = execution.case
    if execution.skipped is not None:
        return CaseResult(case, Verdict("skipped", reason=execution.skipped))
    if execution.case_error is not None:
        return CaseResult(case, Verdict("case-error", reason=execution.case_error))
    if execution.declaration is not None:
        function, message, layer = execution.declaration
        finding = observed(case, "declaration", function, message, layer)
        return CaseResult(case, Verdict("finding", finding))
    outcome = execution.outcome
    assert outcome is not None
    judged = judge_views(case, outcome, target_contract)
    verdict, expectation = judged.verdict, judged.expectation
    checks: dict[str, Finding | None] = {}
    if verdict.status not in ("pass", "rejected"):
        return CaseResult(case, verdict, expectation, outcome)
    reused = reuse or {}
    judging = Judging(case, target_contract, expectation, outcome, verdict)
    for check in CHECKS:
        if verdict.status == "rejected" and check.needs_views:
            continue
        record = outcome.checks.get(check.name)
        if record is not None:
            with timed(check.name):
                found = checks[check.name] = raised(case, check.name, record) if "raised" in record else check.judge(judging, record)
        elif check.name in reused:
            found = reused[check.name]
        else:
            continue
        if found is not None:
            return CaseResult(case, Verdict("finding", found), expectation, outcome, checks)
    return CaseResult(case, verdict, expectation, outcome, checks)


def raised(case: Case, check: str, record: Mapping[str, Any]) -> Finding:
    """vLLM raised in a check's run outside the code the check judges (the runner's own set-up of what it drives: layers
    bound, metadata built) on views the oracle accepts: a crash, or with vLLM's refusal errors a refusal, as in the views."""
    error = record["raised"]
    kind = "refused-valid" if error["type"] in REFUSALS else "crash-on-valid"
    return observed(case, kind, error.get("function") or "?", f"{check}: {error['type']}: {error['message']}")


def other_runners(result: CaseResult, contract: oracles.Contract) -> list[tuple[str, CaseResult]]:
    """The views other model runners built for the case (checks with `other_outcome`), each judged against the oracle under
    its own contract, labelled by the check: what `kvfuzz explain` shows below the view path's."""
    found = []
    for check in CHECKS:
        other = getattr(check, "other_outcome", None)
        record = result.outcome.checks.get(check.name) if result.outcome is not None else None
        if other is None or record is None or "views" not in record:
            continue
        outcome = other(record)
        judged = judge_views(result.case, outcome, contract)
        found.append((check.label, CaseResult(result.case, judged.verdict, judged.expectation, outcome)))  # type: ignore[attr-defined]
    return found


def run_case(target: Target, case: Case, device: str = "cpu", probe: bool | str = False, checks: Collection[str] | None = None,
             reuse: Mapping[str, Finding | None] | None = None) -> CaseResult:
    """One case through the target and the oracle; `checks` and `reuse` come from a campaign's schedule
    (fuzz/campaign/schedule.py): the deeper checks to run, and the verdicts of those left out."""
    device = case.device or device
    execution = target.execute(case, device, probe=probe, checks=checks)
    return judge(execution, target.info.contract, reuse)
