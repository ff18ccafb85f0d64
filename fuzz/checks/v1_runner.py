"""The V1 model runner beside the V2 runner (fuzz/targets/runner_v1.py), and the comparison of their layouts
(fuzz/verdict/runners.py): run on a case drawn for both runners."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from fuzz.case import Case, replace

NAME = "v1-runner"


@dataclass(frozen=True)
class V1Runner:
    name: str = NAME

    def applies(self, case: Case) -> bool:
        return case.runner == "both"

    def key(self, case: Case) -> Hashable:
        # The runner builds its views from the whole configuration; consumers and cache writes run on the V2 walk only.
        return replace(case, touches=None, device=None)

    def without(self, case: Case) -> Case:
        return replace(case, runner="v2")


CHECK = V1Runner()
