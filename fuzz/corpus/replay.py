"""Replaying corpus entries: seeds must pass; kept findings must fail as recorded on their releases."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from fuzz.corpus.store import Entry
from fuzz.errors import CaseError
from fuzz.targets.base import Target
from fuzz.verdict.findings import Finding
from fuzz.verdict.runner import run_case


@dataclass(frozen=True)
class ReplayOutcome:
    status: str  # "pass", "expected" (a kept finding reproduced), "fixed", "skipped", "unexpected"
    detail: str
    finding: Finding | None = None  # what the target got wrong, for an unexpected finding


def replay_entry(target: Target, entry: Entry, device: str, probe: bool | str = False,
                 known: Collection[str] = frozenset()) -> ReplayOutcome:
    """`known`: signatures the corpus expects on this release. A case kept for one bug may meet
    another kept bug on a release its own bug does not affect; that is expected, not news."""
    verdict = run_case(target, entry.case, device, probe=probe).verdict
    if verdict.status == "case-error":
        raise CaseError(f"{entry.path}: {verdict.reason}")
    if verdict.status == "skipped":
        return ReplayOutcome("skipped", verdict.reason or "")
    got = verdict.finding.signature if verdict.finding else None
    expected = entry.expected_signature
    if expected is not None and target.info.vllm_version in entry.affected_versions:
        if got == expected:
            return ReplayOutcome("expected", f"known finding reproduced: {got}")
        return ReplayOutcome("unexpected", f"known finding did not reproduce (got {got or verdict.status})")
    if got is None:
        return ReplayOutcome("pass" if expected is None else "fixed", verdict.status + (f" ({verdict.reason})" if verdict.reason else ""))
    if got in known:
        return ReplayOutcome("expected", f"another kept finding: {got}")
    return ReplayOutcome("unexpected", got, verdict.finding)
