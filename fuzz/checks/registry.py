"""Every deeper check, once: the worker, the target, the schedule, the verdict and the reports loop over CHECKS and name
none. A check is judged in this order after the view path passed (the V1 runner's also after the V2 runner refused)."""

from __future__ import annotations

from fuzz.checks import (
    attention,
    block_copy,
    cpu_zero,
    cpu_zeroer,
    decode_bench,
    example_connector,
    hisparse,
    kernel_probe,
    mooncake,
    moriio,
    nixl,
    offload,
    planner_fit,
    planner_workers,
    umbp,
    v1_runner,
    zeroer,
)
from fuzz.checks.protocol import Check
from fuzz.targets.base import TargetInfo
from fuzz.verdict import findings

CHECKS: tuple[Check, ...] = (
    planner_fit.CHECK,
    planner_workers.CHECK,
    zeroer.CHECK,
    cpu_zero.CHECK,
    cpu_zeroer.CHECK,
    block_copy.CHECK,
    offload.CHECK,
    nixl.CHECK,
    mooncake.CHECK,
    hisparse.CHECK,
    decode_bench.CHECK,
    example_connector.CHECK,
    moriio.CHECK,
    umbp.CHECK,
    kernel_probe.CHECK,
    attention.CHECK,
    v1_runner.CHECK,
)
BY_NAME: dict[str, Check] = {check.name: check for check in CHECKS}
for _check in CHECKS:  # the finding kinds each check reports beyond the view path's, with their severities
    findings.add_kinds(_check.kinds, _check.warnings)


def offered_checks(info: TargetInfo) -> tuple[Check, ...]:
    """The checks a target offers, as its TargetInfo lists them (a target in another process)."""
    return tuple(check for check in CHECKS if check.name in info.checks)

# Every finding kind, the view path's and the checks', with what each means and its severity.
KINDS, DESCRIPTIONS, SEVERITY = findings.KINDS, findings.DESCRIPTIONS, findings.SEVERITY
