"""The coordinator's dealings with libFuzzer itself: its flags and input corpus, its log, its exits.

The input corpus starts from random inputs (deterministic in the campaign's seed) and survives
restarts in the work folder; an input that killed a process is quarantined out of it. Coverage
comes from libFuzzer's status lines (`#N NEW cov: C ft: F corp: ...`): cov only grows when
libFuzzer prints a line, so the last one is the run's coverage. A child that did not end by
itself is classified from its exit status and log (libFuzzer's -timeout and -rss_limit_mb,
faulthandler's fatal signals, an uncaught exception); libFuzzer's own artifact
(`-artifact_prefix`) holds the input when the slot has no case in flight.
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

MAX_INPUT = 512  # bytes; a case consumes well under 200
SEED_INPUT_BYTES = 160
# libFuzzer's status lines: "#N NEW cov: C ft: F corp: I/S ...".
STATUS_LINE = re.compile(r"^#(\d+)\s+(\w+)\s+cov: (\d+) ft: (\d+)(?: corp: (\d+)/)?")
# faulthandler's names for the fatal signals it reports.
_FATAL = {"Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
          "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL"}


# ---------------------------------------------------------------------------------- flags and inputs


def write_seed_inputs(folder: Path, seed: int, count: int) -> None:
    """Start an empty libFuzzer corpus from `count` random inputs of random lengths."""
    if count <= 0 or any(folder.iterdir()):
        return
    rng = random.Random(seed)
    for number in range(count):
        (folder / f"seed-{number:04d}").write_bytes(rng.randbytes(rng.randint(8, SEED_INPUT_BYTES)))


def libfuzzer_seed(seed: int, attempt: int) -> int:
    """libFuzzer's -seed for a campaign seed and process number (libFuzzer reads 0 as 'pick one')."""
    return (seed * 1_000_003 + attempt) % 2_147_483_646 + 1


def libfuzzer_flags(seed: int, attempt: int, case_timeout: float, artifacts: Path, extra: Sequence[str] = ()) -> list[str]:
    """The flags the coordinator sets; the child adds -max_total_time and -rss_limit_mb."""
    return [f"-seed={libfuzzer_seed(seed, attempt)}", f"-timeout={max(1, math.ceil(case_timeout))}", f"-max_len={MAX_INPUT}",
            f"-artifact_prefix={artifacts}{os.sep}", *extra]


def quarantine(inputs: Path, data: bytes, folder: Path) -> list[Path]:
    """Move inputs holding these bytes out of libFuzzer's corpus: a seed (or an input that crashes
    only sometimes) would otherwise kill every restarted process while it loads the corpus."""
    moved = []
    for path in inputs.iterdir():
        if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
            folder.mkdir(exist_ok=True)
            moved.append(Path(shutil.move(path, folder / path.name)))
    return moved


def newest_artifact(folder: Path) -> bytes | None:
    """The input of libFuzzer's newest crash, timeout or oom artifact in this folder, if any."""
    files = [p for p in folder.iterdir() if p.name.split("-")[0] in ("crash", "timeout", "oom")]
    return max(files, key=lambda p: p.stat().st_mtime).read_bytes() if files else None


# ---------------------------------------------------------------------------------- the log and the exit


@dataclass
class Coverage:
    """libFuzzer's figures: edges (cov), features (ft), inputs in its corpus (corp) and executions."""

    edges: int = 0
    features: int = 0
    corpus: int = 0
    execs: int = 0


def parse_coverage(text: str) -> Coverage:
    """The last coverage figures libFuzzer printed in this log."""
    found = Coverage()
    for line in text.splitlines():
        match = STATUS_LINE.match(line)
        if match:
            found = Coverage(int(match[3]), int(match[4]), int(match[5] or found.corpus), int(match[1]))
    return found


def classify_exit(returncode: int, log: str, case_timeout: float, watchdog: bool = False) -> tuple[str, str]:
    """(finding kind, message) for a child that did not end by itself; messages match the default
    engine's (fuzz.campaign.pool) so one bug has one signature whichever engine found it."""
    if watchdog or "ERROR: libFuzzer: timeout" in log:
        return "hang", f"no answer within {case_timeout:g} s"
    if "ERROR: libFuzzer: out-of-memory" in log:
        return "oom", "resident memory passed the worker's cap"
    if "=== Uncaught Python exception: ===" in log:
        lines = log.split("=== Uncaught Python exception: ===", 1)[1].strip().splitlines()
        return "crash-signal", f"uncaught {(lines or ['exception'])[0].split(':')[0].strip()} in the harness"
    for words, name in _FATAL.items():
        if f"Fatal Python error: {words}" in log:
            return "crash-signal", f"killed by {name}"
    if returncode < 0:
        number = -returncode
        if number == signal.SIGKILL:
            return "oom", "killed by SIGKILL (the kernel's out-of-memory killer?)"
        return "crash-signal", f"killed by {signal.Signals(number).name}"
    if "ERROR: libFuzzer: deadly signal" in log:
        return "crash-signal", "killed by a deadly signal"
    return "crash-signal", f"exited with status {returncode}"

