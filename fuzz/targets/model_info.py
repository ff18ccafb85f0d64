"""vLLM's model-class inspection, run in a fork of the target process instead of a fresh interpreter.

Building a ModelConfig asks vLLM's model registry what the model class supports. Without an entry in vLLM's model-info
cache (a fresh machine), the registry runs that inspection in a new Python process (`_run_in_subprocess`, so that the
caller never initializes CUDA), which imports vLLM and torch all over again: about 9 s of a 20 s cold start on 2 cores.
A fork of the target process has vLLM imported already and keeps CUDA out of the caller just the same. The registry
still writes its cache; anything unexpected (no such function in this release, a fork that fails) falls back to vLLM's
own subprocess.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

REGISTRY = "vllm.model_executor.models.registry"
FORK_LIMIT = 120.0  # seconds the fork may take before it is killed and vLLM's subprocess runs instead


@contextlib.contextmanager
def inspection_in_fork() -> Iterator[None]:
    """While inside, the registry's `_run_in_subprocess` runs its function in a fork of this process."""
    try:
        registry = importlib.import_module(REGISTRY)
    except Exception:  # noqa: BLE001 - a release without this module inspects as it always did
        yield
        return
    original = getattr(registry, "_run_in_subprocess", None)
    if not callable(original):
        yield
        return
    registry._run_in_subprocess = lambda fn: run_in_fork(fn, original)
    try:
        yield
    finally:
        registry._run_in_subprocess = original


def run_in_fork(fn: Callable[[], Any], fallback: Callable[[Callable[[], Any]], Any]) -> Any:
    """`fn()` computed in a child of this process and unpickled here; `fallback(fn)` when the child does not deliver."""
    with tempfile.TemporaryDirectory(prefix="kvfuzz-inspect-") as folder:
        path = os.path.join(folder, "result.pickle")
        pid = os.fork()
        if pid == 0:
            _child(fn, path)
        _wait(pid)
        if os.path.exists(path):  # renamed into place whole: the child finished
            with open(path, "rb") as file:
                return pickle.load(file)  # noqa: S301 - written by our own child just now
    return fallback(fn)


def _child(fn: Callable[[], Any], path: str) -> None:
    status = 1
    try:
        result = fn()
        with open(f"{path}.partial", "wb") as file:
            pickle.dump(result, file)
        os.replace(f"{path}.partial", path)
        status = 0
    finally:
        os._exit(status)


def _wait(pid: int) -> None:
    """Until the child has ended; killed after FORK_LIMIT seconds. A child some other reaper of this process collected
    (waitpid(-1)) has ended too."""
    deadline = time.monotonic() + FORK_LIMIT
    with contextlib.suppress(ChildProcessError):
        while time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
