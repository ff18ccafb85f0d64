"""The surface map of one vLLM: the functions found (find.py), what a campaign ran of them (coverage.py) and why
the rest is not run (reasons.py)."""

from __future__ import annotations

import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from fuzz.surface import coverage
from fuzz.surface.find import Function, find
from fuzz.surface.reasons import KINDS, Rule, reason
from fuzz.targets.releases import TargetSource


@dataclass(frozen=True)
class Entry:
    function: Function
    lines: int  # executable lines (nested code included)
    executed: int | None = None  # None: not measured
    calls: int | None = None
    first: int | None = None  # the first case (1-based) that called it
    reason: Rule | None = None  # for a function not driven (or not measured), the first rule that matches

    @property
    def driven(self) -> bool | None:
        return None if self.calls is None else self.calls > 0

    @property
    def status(self) -> str:
        if self.driven:
            return "driven"
        if self.driven is None:
            return "not measured"
        return "not driven" if self.reason is not None else "unexplained"


@dataclass
class Survey:
    vllm: str  # the --vllm spec
    version: str
    root: str
    entries: list[Entry]
    seconds: float = 0.0  # campaign seconds; 0: static map only
    cases: int = 0
    probe: str = "metadata"
    error: str | None = None
    seed: int = 0
    crashed: list[int] = field(default_factory=list)  # indices of the cases skipped: the tracing process died or hung on them

    @property
    def measured(self) -> bool:
        return self.seconds > 0

    def driven(self) -> list[Entry]:
        return [e for e in self.entries if e.driven]

    def not_driven(self) -> list[Entry]:
        return [e for e in self.entries if e.driven is False]

    def unexplained(self) -> list[Entry]:
        return [e for e in self.entries if e.status == "unexplained"]

    def by_kind(self) -> dict[str, int]:
        kinds = Counter(e.reason.kind for e in self.not_driven() if e.reason is not None)
        return {kind: kinds[kind] for kind in KINDS if kinds[kind]}

    def line_coverage(self) -> tuple[int, int]:
        """(executed, executable) lines of the driven functions."""
        driven = self.driven()
        return sum(e.executed or 0 for e in driven), sum(e.lines for e in driven)


def version_of(root: Path) -> str:
    """The tree's version from vllm/_version.py (read, not imported); "dev" for a checkout without one."""
    try:
        text = (root / "vllm" / "_version.py").read_text()
    except OSError:
        return "dev"
    match = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text)
    return match.group(1) if match else "dev"


def survey(source: TargetSource, root: Path, seconds: float = 0.0, *, seed: int = 0, probe: str = "metadata",
           max_cases: int | None = None) -> Survey:
    """The map of the tree at `root`; with seconds > 0, measured by a campaign of that many seconds (or max_cases cases)."""
    functions, version = find(root), version_of(root)
    lines = coverage.executable_lines(root, functions)
    measured: coverage.Coverage | None = None
    if seconds > 0:
        with tempfile.TemporaryDirectory(prefix="kvfuzz-surface-") as work:
            measured = coverage.measure(source, root, functions, seconds, Path(work), seed=seed, probe=probe, max_cases=max_cases)
    entries = []
    for index, function in enumerate(functions):
        if measured is None:
            entries.append(Entry(function, len(lines[index]), reason=reason(function, version)))
            continue
        calls = measured.calls.get(index, 0)
        executed = len(measured.lines.get(index, set()) & lines[index])
        why = None if calls else reason(function, version)
        entries.append(Entry(function, len(lines[index]), executed, calls, measured.first.get(index), why))
    return Survey(source.spec, version, str(root), entries, seconds if measured else 0.0, measured.cases if measured else 0,
                  probe, measured.error if measured else None, seed, measured.crashed if measured else [])
