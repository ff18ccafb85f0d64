"""Hypothesis strategies over the case space of fuzz/space.py.

The space is defined once; here Hypothesis supplies the choices, so its shrinker walks every
choice toward the simplest option (one group, one layer, one block, default dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn, TypeVar

from hypothesis import reject
from hypothesis import strategies as st

from fuzz.case import Case
from fuzz.space import accepts, choose_kernel_block_size, draw_case
from fuzz.targets.base import TargetInfo

T = TypeVar("T")


class HypothesisSource:
    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw

    def integer(self, low: int, high: int) -> int:
        return self.draw(st.integers(low, high))

    def choice(self, options: Sequence[T]) -> T:
        return self.draw(st.sampled_from(options))

    def chance(self, percent: int) -> bool:
        return self.draw(st.integers(0, 99)) >= 100 - percent

    def reject(self) -> NoReturn:
        reject()


@st.composite
def cases(draw: st.DrawFn, info: TargetInfo, synthetic: bool = True) -> Case:
    """Cases for the target described by `info`."""
    return draw_case(HypothesisSource(draw), info, synthetic=synthetic)


__all__ = ["HypothesisSource", "accepts", "cases", "choose_kernel_block_size"]
