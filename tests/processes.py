"""Processes as /proc shows them, for tests of what a campaign leaves running (tests/test_chaos.py, tests/test_standby.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def parents() -> dict[int, int]:
    """Every process's parent, by pid (zombies included)."""
    found: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[int(stat.parent.name)] = int(fields[1])
    return found


def children(pid: int) -> set[int]:
    """The live children of `pid`."""
    return {child for child, parent in parents().items() if parent == pid and alive(child)}


def descendants(pid: int) -> set[int]:
    known = parents()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in known.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(condition: Callable[[], bool], seconds: float, what: str, step: float = 0.2) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {seconds} s"
        time.sleep(step)
