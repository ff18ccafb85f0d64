"""The kernel probe (fuzz/targets/kernel_probe.py): tokens written through each backend's own cache write, on the
V2 walk's views of the case."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from fuzz.case import Case, replace

NAME = "kernel-probe"


@dataclass(frozen=True)
class KernelProbe:
    name: str = NAME

    def applies(self, case: Case) -> bool:
        return case.touches is not None and bool(case.touches.tokens)

    def key(self, case: Case) -> Hashable:
        assert case.touches is not None
        mine = replace(case.touches, consumers=(), blocks=(), copies=())
        return replace(case, touches=mine, device=None, runner="v2")

    def without(self, case: Case) -> Case:
        touches = case.touches
        assert touches is not None
        kept = replace(touches, tokens=())
        return replace(case, touches=kept if kept.size else None)


CHECK = KernelProbe()
