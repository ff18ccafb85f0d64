"""What a `kvfuzz ci` run found: the failures it checked, each with its verdict, and the run around them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzz.case import Case
from fuzz.verdict.findings import Finding

# How a checked failure ends. Only the first two fail the job.
INTRODUCED = "introduced"  # reproducible; the baseline passes the same case (or cannot express it)
NEW = "new"  # reproducible; no baseline to tell whether the change introduced it
PRE_EXISTING = "pre-existing"  # reproducible, and the baseline fails the case too
FLAKY = "flaky"  # the fresh processes did not both fail with the same signature
FAILING = (INTRODUCED, NEW)

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


@dataclass
class CiResult:
    target: dict[str, Any]  # spec, label, vllm_version, contract
    baseline: dict[str, Any] | None  # the same for the baseline, None without one
    corpus: Path
    gate: Counter[str] = field(default_factory=Counter)  # corpus files by replay status
    campaign: dict[str, Any] = field(default_factory=dict)  # the campaign report (fuzz.campaign.engine.Report.to_dict)
    checked: list[Checked] = field(default_factory=list)

    def by_status(self, *statuses: str) -> list[Checked]:
        return [item for item in self.checked if item.status in statuses]

    @property
    def exit_status(self) -> int:
        return 1 if any(item.fails_job for item in self.checked) else 0

    def reproducer(self, item: Checked) -> str:
        return f"kvfuzz replay {item.path} --vllm {self.target['spec']}"
