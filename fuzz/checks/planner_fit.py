"""planner-fit (fuzz/targets/planner_fit.py, fuzz/verdict/planner.py): the groups planned again from memory, without
the block-count override. The target leaves it out when the worker names it among the checks to skip."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from fuzz.case import Case, replace

NAME = "planner-fit"


@dataclass(frozen=True)
class PlannerFit:
    name: str = NAME

    def applies(self, case: Case) -> bool:
        return bool(case.groups)

    def key(self, case: Case) -> Hashable:
        # The planner sees the specs, layers, packing, platform and layout; not the runners, consumers or cache writes.
        return replace(case, touches=None, device=None, runner="v2")

    def without(self, case: Case) -> Case:
        return case


CHECK = PlannerFit()
