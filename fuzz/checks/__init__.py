"""The checks a campaign runs beyond the views, each behind one small interface the worker and the scheduler call.

A deeper check (the V1 model runner and the runner comparison, each consumer, the kernel probe, planner-fit) says
whether a drawn case asks for it, the key of the facts its code under test and its judgement read, and how to run the
case without it. The code under test is a deterministic function of what the key holds, so a worker that has judged a
key once reuses that verdict for the key (fuzz/campaign/schedule.py); adding a check is adding a module here and
naming it in CHECKS.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

from fuzz.case import Case
from fuzz.checks import consumers, kernel_probe, planner_fit, v1_runner


class DeeperCheck(Protocol):
    name: str

    def applies(self, case: Case) -> bool:
        """Whether the drawn case asks for this check."""

    def key(self, case: Case) -> Hashable:
        """What the check's code under test and its judgement read of the case."""

    def without(self, case: Case) -> Case:
        """The case as it runs when the check is left out."""


@dataclass(frozen=True)
class ConsumerCheck:
    """One consumer (fuzz/targets/consumers.py), e.g. `zeroer`: each is scheduled and keyed on its own."""

    consumer: str

    @property
    def name(self) -> str:
        return consumers.name(self.consumer)

    def applies(self, case: Case) -> bool:
        return consumers.asks_for(case, self.consumer)

    def key(self, case: Case) -> Hashable:
        return consumers.key(case, self.consumer)

    def without(self, case: Case) -> Case:
        return consumers.without(case, self.consumer)


def checks_for(consumer_names: tuple[str, ...], runs_v1: bool, fits_planner: bool) -> tuple[DeeperCheck, ...]:
    """The deeper checks a target offers, in the order a case meets them."""
    found: list[DeeperCheck] = []
    if runs_v1:
        found.append(v1_runner.CHECK)
    if fits_planner:
        found.append(planner_fit.CHECK)
    found.extend(ConsumerCheck(name) for name in consumer_names)
    found.append(kernel_probe.CHECK)
    return tuple(found)
