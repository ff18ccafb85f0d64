"""The view path's verdict on one runner's outcome: the process did not die, the specs vLLM built are the case's, the
views match the oracle under that runner's contract, and bytes written through them land where the oracle says."""

from __future__ import annotations

from dataclasses import dataclass

import oracles
from fuzz.case import Case
from fuzz.targets.base import Outcome
from fuzz.verdict import probe
from fuzz.verdict.compare import PROCESS_FAILURES, Verdict, compare
from fuzz.verdict.findings import Finding, observed
from fuzz.verdict.specs import check_specs
from oracles.expectation import Expectation

KERNEL_CHOICE = "select_common_block_size"  # where vLLM's kernel block size rule lives (vllm/v1/worker/utils.py)


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
    if verdict.status == "pass" and outcome.kernel_rule:
        verdict = Verdict("finding", kernel_rule_broken(case, outcome.kernel_rule))
    return Judged(verdict, expectation)


def kernel_rule_broken(case: Case, broken: dict[int, list[int]]) -> Finding:
    """vLLM picked a kernel block size its rule does not (oracles/contract.py kernel_block_size) and built right views at
    it: smaller kernel blocks than the rule's cost speed (more block-table entries, smaller tiles), not correctness."""
    index = min(broken)
    picked, rule = broken[index]
    group = case.groups[index]
    message = (f"for {group.spec.block_size}-token blocks on {group.backend_name} vLLM picks {picked}-token kernel blocks; its rule "
               f"picks {rule} (the block itself where the backend takes it, else the largest declared size dividing it)")
    return observed(case, "kernel-block-choice", KERNEL_CHOICE, message, group.layers[0] if group.layers else None)
