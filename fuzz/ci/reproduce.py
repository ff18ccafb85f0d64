"""Checking a failure: again in fresh target processes, then on the baseline.

A rerun process is a new target pool (a zygote that imports vLLM anew, and a worker forked from
it), never one the campaign used, so a failure that needed the campaign's history does not count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fuzz.campaign.pool import Pool, RemoteTarget
from fuzz.ci.model import FLAKY, INTRODUCED, NEW, PRE_EXISTING, Checked
from fuzz.targets.releases import TargetSource
from fuzz.verdict.findings import RERUNS
from fuzz.verdict.runner import CaseResult, run_case


def verdict_text(result: CaseResult) -> str:
    """A signature for a finding, else the verdict (pass, rejected, skipped)."""
    return result.verdict.finding.signature if result.verdict.finding is not None else result.verdict.status


def rerun(source: TargetSource, checked: list[Checked], device: str, open_pool: Callable[[TargetSource], Pool],
          first: Callable[[Checked, CaseResult, RemoteTarget], None]) -> None:
    """Each failure once in each of RERUNS.ci fresh processes; `first` sees each result of the first one."""
    for round_ in range(RERUNS.ci):
        with open_pool(source) as pool:
            target = RemoteTarget(pool)
            for item in checked:
                result = run_case(target, item.case, device)
                item.reruns.append(verdict_text(result))
                if round_ == 0:
                    first(item, result, target)


def on_baseline(source: TargetSource, checked: list[Checked], device: str, open_pool: Callable[[TargetSource], Pool]) -> dict[str, Any]:
    """Each failure once on the baseline; returns the baseline's description."""
    with open_pool(source) as pool:
        target = RemoteTarget(pool)
        for item in checked:
            result = run_case(target, item.case, device)
            item.baseline, item.baseline_failed = verdict_text(result), result.verdict.finding is not None
        return describe(pool)


def describe(pool: Pool) -> dict[str, Any]:
    """The target a pool runs, as reports name it."""
    assert pool.info is not None
    return {"spec": pool.source.spec, "label": pool.source.label, "vllm_version": pool.info.vllm_version,
            "generation": pool.info.generation, "contract": pool.info.contract.name}


def settle(item: Checked, with_baseline: bool) -> str:
    """The status of a checked failure: flaky unless every rerun repeated it; then new, pre-existing or introduced."""
    if not item.reproduced:
        return FLAKY
    if not with_baseline:
        return NEW
    return PRE_EXISTING if item.baseline_failed else INTRODUCED
