"""The seconds each deeper check spends on the case being run, measured where its code runs (the target's run of it and
its judgement), so that a worker's schedule charges every check its own time rather than an even share of the whole
case's: a cheap check that shares a case with an interpreted Triton kernel would otherwise look as costly as the kernel.

Per process: a worker takes what a case spent right after running it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

_spent: dict[str, float] = {}
_open: list[list[float]] = []  # per timed section open now, outermost first: [seconds spent in sections inside it]


@contextmanager
def timed(check: str) -> Iterator[None]:
    """Time the block as the check's; a check timed inside another's block (planner-fit inside the V1 runner's walk) is
    charged to itself only."""
    inner = [0.0]
    _open.append(inner)
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        _open.pop()
        _spent[check] = _spent.get(check, 0.0) + elapsed - inner[0]
        if _open:
            _open[-1][0] += elapsed


def take() -> dict[str, float]:
    """Each check's seconds since the last call."""
    spent = dict(_spent)
    _spent.clear()
    return spent
