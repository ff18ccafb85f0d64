"""What the atheris coordinator knows of one run and of each child process it started.

Shared by the coordinator (`fuzz.engines.atheris_engine`) and the report it builds afterwards
(`fuzz.engines.atheris_report`).
"""

from __future__ import annotations

import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from fuzz.engines.libfuzzer import Coverage
from fuzz.targets.base import TargetInfo
from fuzz.targets.releases import TargetSource


@dataclass
class Attempt:
    """One atheris child process."""

    number: int
    folder: Path
    process: subprocess.Popen[bytes]
    log: Path
    slot: Path
    stats: Path
    ready: Path


@dataclass
class RunState:
    """What the coordinator knows of one run, added up over its child processes."""

    source: TargetSource
    work: Path
    options: dict[str, Any]
    out: TextIO
    known: set[str]
    info: TargetInfo | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    started: float | None = None
    deadline: float | None = None
    cases: int = 0
    verdicts: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    skips: Counter[str] = field(default_factory=Counter)
    crash_records: list[dict[str, Any]] = field(default_factory=list)
    deaths: list[dict[str, Any]] = field(default_factory=list)  # every child that did not end by itself
    coverage: Coverage = field(default_factory=Coverage)
    restarts: int = 0
    duplicates: int = 0
    stop_reason: str = ""
    startup_s: float = 0.0
    ended: float | None = None
