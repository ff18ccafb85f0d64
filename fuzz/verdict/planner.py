"""The planner-fit check: planned from memory without the block-count override, the groups hold the blocks
that memory fits at the bytes per block the override's plan spends, in tensors of that many blocks
(fuzz/targets/planner_fit.py asks; oracles/planner.py says how many)."""

from __future__ import annotations

from fuzz.case import Case
from fuzz.targets.base import Outcome
from fuzz.verdict.findings import Finding, observed
from oracles import planner

PLANNER = "get_kv_cache_config_from_groups"


def check_planner_fit(case: Case, outcome: Outcome) -> Finding | None:
    fit = outcome.planner_fit
    if fit is None:
        return None
    memory, per_block = fit["memory"], fit["bytes_per_block"]
    expected, expected_bytes = planner.fitted(memory, per_block)
    if "error" in fit:
        if expected == 0 and fit["error"].startswith("ValueError"):
            return None  # memory for no block at all: refusing it with a message is the planner's right
        return observed(case, "planner-fit", fit.get("function") or PLANNER, f"planned from {memory} bytes: {fit['error']}")
    if fit["num_blocks"] != expected:
        return observed(case, "planner-fit", PLANNER,
                        f"{memory} bytes of memory at {per_block} bytes per block give {fit['num_blocks']} blocks instead of {expected}")
    if fit["tensor_bytes"] != expected_bytes:
        return observed(case, "planner-fit", PLANNER, f"{fit['num_blocks']} blocks planned from memory take {fit['tensor_bytes']} bytes "
                        f"of tensors instead of {expected_bytes}")
    return None
