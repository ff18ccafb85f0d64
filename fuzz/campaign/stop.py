"""SIGINT and SIGTERM as a stop request the coordinator honours at its next wait.

Every wait of the coordinator on its workers (fuzz.campaign.pool) lasts at most a fraction of a
second before it looks at `requested()`, so a campaign stops within a couple of seconds wherever it
is, then writes its report. A wait that a stop cuts short raises `Stopped`, a BaseException like
KeyboardInterrupt, so no `except Exception` on the way swallows it. A second signal exits at once
with 128 + its number; the target processes die with the coordinator (they hold a parent-death
signal, see fuzz.campaign.worker).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_requested: int | None = None
_installed = False


class Stopped(BaseException):
    """A wait cut short by a stop request (or raised where the coordinator checks for one)."""


def requested() -> int | None:
    """The signal that asked the coordinator to stop, if one did."""
    return _requested


def check() -> None:
    if _requested is not None:
        raise Stopped(signal.Signals(_requested).name)


def exit_status(signum: int) -> int:
    """What a shell reports for a process its signal ended: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


def _handle(signum: int, frame: Any) -> None:
    global _requested
    if _requested is not None:
        os.write(2, f"kvfuzz: second {signal.Signals(signum).name}: exiting at once\n".encode())
        os._exit(exit_status(signum))
    _requested = signum


@contextmanager
def handling() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into a stop request while the block runs (nested uses share the
    outermost one; outside the main thread, signals cannot be caught and this does nothing)."""
    global _installed, _requested
    if _installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, _handle) for number in SIGNALS}
    _installed, _requested = True, None
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        _installed, _requested = False, None


def wait_or_kill(process: Any, seconds: float, until: Callable[[], bool] | None = None) -> bool:
    """Wait for a subprocess (started in a session of its own) to end, at most `seconds` and no longer than a stop request;
    False, with its process group killed, when it did not end in time. A stop request kills it and raises Stopped.
    With `until`, also return (True, the process left running) as soon as `until()` holds."""
    deadline = time.monotonic() + seconds
    try:
        while process.poll() is None:
            check()
            if until is not None and until():
                return True
            if time.monotonic() > deadline:
                kill_group(process)
                return False
            time.sleep(0.1)
    except Stopped:
        kill_group(process)
        raise
    return True


def kill_group(process: Any) -> None:
    """SIGKILL the process's group, then reap the process."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
