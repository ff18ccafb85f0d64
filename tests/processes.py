"""Processes as /proc shows them, for tests of what a campaign leaves running (tests/test_chaos.py, tests/test_standby.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def run_in_release(version: str, script: str, cwd: Path) -> dict:
    """Runs `script` in a worker environment of the release (its vLLM tree first on the path, kvfuzz after it) and returns
    the JSON of its last line starting with "RESULT "."""
    from fuzz.targets import releases

    env = releases.worker_environment(releases.resolve(version))
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(Path(__file__).absolute().parent.parent)])
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, cwd=cwd)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])
