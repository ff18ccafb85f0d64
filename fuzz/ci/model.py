"""What a `kvfuzz ci` run found: the failures it checked, each with its verdict, and the run around them."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzz.case import Case, dumps
from fuzz.ci.diff import ChangedFunction, ranges_text
from fuzz.verdict.findings import Finding, variants_of

# How a checked failure ends. Only the first two fail the job.
INTRODUCED = "introduced"  # reproducible; the baseline passes the same case (or cannot express it)
NEW = "new"  # reproducible; no baseline to tell whether the change introduced it
PRE_EXISTING = "pre-existing"  # reproducible, and the baseline fails the case too
FLAKY = "flaky"  # the fresh processes did not both fail with the same signature
FAILING = (INTRODUCED, NEW)
STATUSES = (INTRODUCED, NEW, PRE_EXISTING, FLAKY)  # the order reports list them in, worst first

CORPUS, CAMPAIGN = "corpus", "campaign"  # where a failure came from: the replayed corpus, or fuzzing


@dataclass(frozen=True)
class Location:
    """A place in vLLM's source, relative to the repository root (`vllm/...`)."""

    path: str
    start_line: int
    end_line: int | None = None
    function: str | None = None


@dataclass
class Checked:
    """One failure: a corpus case that failed unexpectedly, or a new finding of the campaign."""

    origin: str  # CORPUS or CAMPAIGN
    path: Path  # its case file
    case: Case
    finding: Finding  # as first seen: the signature the reruns must show
    reruns: list[str] = field(default_factory=list)  # per fresh process: the signature it gave, or its verdict
    baseline: str | None = None  # what the baseline gave, in the same form; None without one
    # Any finding on the baseline, even in another form: a failure the change started from is not the change's.
    baseline_failed: bool = False
    status: str = ""
    explain: str = ""  # `kvfuzz explain` text of the first rerun
    locations: list[Location] = field(default_factory=list)  # where in vLLM: the line that raised, else the functions under test

    @property
    def reproduced(self) -> bool:
        return bool(self.reruns) and all(run == self.finding.signature for run in self.reruns)

    @property
    def fails_job(self) -> bool:
        return self.status in FAILING


@dataclass(eq=False)
class Bug:
    """One signature and every checked failure that showed it: reports count bugs, not case files."""

    signature: str
    items: list[Checked]

    @property
    def status(self) -> str:
        """The worst status among its cases: one case the change broke makes the bug the change's."""
        return min((item.status for item in self.items), key=_rank)

    @property
    def fails_job(self) -> bool:
        return self.status in FAILING

    @property
    def example(self) -> Checked:
        """The case to show: the smallest of those with the bug's status (findings are minimized, corpus cases are not always)."""
        return min((item for item in self.items if item.status == self.status), key=lambda item: len(dumps(item.case)))

    @property
    def kind(self) -> str:
        return self.example.finding.kind

    @property
    def statuses(self) -> Counter[str]:
        return Counter(item.status for item in self.items)

    @property
    def origins(self) -> Counter[str]:
        return Counter(item.origin for item in self.items)

    @property
    def variants(self) -> dict[str, list[str]]:
        """The spec kinds, backends and layouts its cases showed it under."""
        return variants_of(item.finding for item in self.items)

    @property
    def locations(self) -> list[Location]:
        """The example's locations first, then any other place its cases point to."""
        found: dict[Location, None] = {}
        for item in [self.example, *self.items]:
            found.update(dict.fromkeys(item.locations))
        return list(found)


def group_bugs(checked: list[Checked]) -> list[Bug]:
    """One Bug per signature, worst status first, then the most cases first (stable otherwise)."""
    grouped: dict[str, list[Checked]] = {}
    for item in checked:
        grouped.setdefault(item.finding.signature, []).append(item)
    bugs = [Bug(signature, items) for signature, items in grouped.items()]
    return sorted(bugs, key=lambda bug: (_rank(bug.status), -len(bug.items)))


def _rank(status: str) -> int:
    return STATUSES.index(status) if status in STATUSES else len(STATUSES)


@dataclass
class InternalFailure:
    """An exception in kvfuzz's own code during the campaign: the job fails, and not because of the change."""

    message: str
    count: int
    case_file: str | None = None  # the first case that hit it, kept in internal-errors/
    traceback: str | None = None


def internal_errors(campaign: dict[str, Any]) -> list[InternalFailure]:
    """The campaign report's internal errors: its `internal_error_details` (entries holding `error`, `count`,
    `case_file`, `traceback`), else `internal_errors` as `{message: count}`, `{message: entry}` or a list of entries.
    A traceback missing from the report is read from the kept case file when it records one."""
    raw = campaign.get("internal_error_details") or campaign.get("internal_errors") or {}
    cases = campaign.get("internal_error_cases") or {}
    pairs = raw.items() if isinstance(raw, dict) else [(entry.get("error", "?"), entry) for entry in raw if isinstance(entry, dict)]
    found = []
    for message, value in pairs:
        entry = value if isinstance(value, dict) else {"count": value}
        case_file = entry.get("case_file") or cases.get(message)
        found.append(InternalFailure(str(message), int(entry.get("count") or 1), case_file, entry.get("traceback") or _traceback_in(case_file)))
    return found


def _traceback_in(case_file: str | None) -> str | None:
    """The traceback an internal-error case file records, when it records one."""
    if not case_file:
        return None
    try:
        data = json.loads(Path(case_file).read_text())
    except (OSError, ValueError):
        return None
    return data.get("traceback") if isinstance(data, dict) else None


@dataclass
class FunctionCoverage:
    """One changed function: which of its changed lines the cases executed, and how many cases did."""

    function: ChangedFunction
    executed: tuple[int, ...]
    cases: int | None  # None: import-time code, run when vLLM is imported rather than by a case

    @property
    def unexercised(self) -> tuple[int, ...]:
        return tuple(line for line in self.function.lines if line not in self.executed)

    def to_dict(self) -> dict[str, Any]:
        f = self.function
        return {"path": f.path, "function": f.qualname, "start_line": f.start, "end_line": f.end, "changed_lines": list(f.lines),
                "executed_lines": list(self.executed), "unexercised_lines": list(self.unexercised), "cases": self.cases,
                "import_time": f.import_time}


@dataclass
class DiffCoverage:
    """The change's lines and what the campaign's cases did with them (fuzz/ci/diff.py, direct.py)."""

    functions: list[FunctionCoverage]
    directed: bool  # the campaign drew towards the changed lines (else: --undirected)
    cases: int = 0  # campaign cases traced
    reached: int = 0  # of those, cases that executed a changed line
    counts: dict[str, int] = field(default_factory=dict)  # directed_cases, directed_hits, undirected_cases, undirected_hits
    compared: int = 0  # reaching cases also run on the baseline

    @property
    def changed(self) -> int:
        return sum(len(f.function.lines) for f in self.functions)

    @property
    def executed(self) -> int:
        return sum(len(f.executed) for f in self.functions)

    def unexercised(self) -> list[str]:
        """`vllm/x.py:512-518` per function with changed lines no case executed."""
        return [ranges_text(f.function.path, f.unexercised) for f in self.functions if f.unexercised]

    def to_dict(self) -> dict[str, Any]:
        return {"directed": self.directed, "changed_lines": self.changed, "executed_lines": self.executed, "cases": self.cases,
                "cases_reaching": self.reached, "counts": dict(self.counts), "compared_on_baseline": self.compared,
                "functions": [f.to_dict() for f in self.functions], "unexercised": self.unexercised()}


@dataclass(frozen=True)
class LayerMove:
    layer: str
    tensor: int
    branch: str  # the view, described
    baseline: str
    bytes: int | None  # bytes covered on one side and not the other; None: too large to count


@dataclass
class BehaviourChange:
    """A case that reached a changed line and behaves differently on the baseline, without failing on the branch."""

    case: Case
    branch: str  # verdict text on each side
    baseline: str
    moves: list[LayerMove]
    what: str

    @property
    def layers(self) -> list[str]:
        return sorted({move.layer for move in self.moves})

    @property
    def bytes(self) -> int:
        return sum(move.bytes or 0 for move in self.moves)

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "case": self.case.describe(), "branch": self.branch, "baseline": self.baseline,
                "layers": self.layers, "bytes_moved": self.bytes,
                "moves": [{"layer": m.layer, "tensor": m.tensor, "branch": m.branch, "baseline": m.baseline, "bytes": m.bytes}
                          for m in self.moves]}


@dataclass
class CiResult:
    target: dict[str, Any]  # spec, label, vllm_version, contract
    baseline: dict[str, Any] | None  # the same for the baseline, None without one
    corpus: Path
    gate: Counter[str] = field(default_factory=Counter)  # corpus files by replay status
    campaign: dict[str, Any] = field(default_factory=dict)  # the campaign report (fuzz.campaign.engine.Report.to_dict)
    checked: list[Checked] = field(default_factory=list)
    aborted: InternalFailure | None = None  # kvfuzz's own code raised outside the campaign (the gate, a rerun): the run stopped there
    coverage: DiffCoverage | None = None  # with --baseline: the change's lines and the cases that executed them
    behaviour: list[BehaviourChange] = field(default_factory=list)  # notes, not failures

    @property
    def bugs(self) -> list[Bug]:
        """The checked failures by signature; a run kvfuzz's own error stopped before their checks ended has none to show."""
        return group_bugs([item for item in self.checked if item.status in STATUSES])

    @property
    def internal_errors(self) -> list[InternalFailure]:
        return ([self.aborted] if self.aborted else []) + internal_errors(self.campaign)

    @property
    def exit_status(self) -> int:
        """1 for a reproducible failure the change introduced; else 2 when kvfuzz itself failed (the job is not green); else 0."""
        if any(item.fails_job for item in self.checked):
            return 1
        return 2 if self.internal_errors else 0

    def reproducer(self, item: Checked) -> str:
        return f"kvfuzz replay {item.path} --vllm {self.target['spec']}"
