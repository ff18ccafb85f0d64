"""`kvfuzz bisect`: one case on every release of a range, and where its verdict changes.

Bugs come and go, so every release is replayed (no binary search); releases run in parallel,
each in its own worker process.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fuzz.campaign.pool import Pool, RemoteTarget
from fuzz.case import Case
from fuzz.errors import KvfuzzError
from fuzz.targets import releases
from fuzz.verdict.runner import run_case


@dataclass(frozen=True)
class Row:
    version: str
    status: str  # "pass", "fail", "cannot express", "rejected", "error"
    detail: str = ""
    generation: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"version": self.version, "status": self.status, "detail": self.detail, "generation": self.generation}


def replay_on(case: Case, version: str, device: str, case_timeout: float = 60.0) -> Row:
    """The case on one release; a case that does not answer within `case_timeout` is a hang there."""
    try:
        with Pool(releases.resolve(version), workers=1, case_timeout=case_timeout) as pool:
            target = RemoteTarget(pool)
            verdict = run_case(target, case, device).verdict
    except KvfuzzError as error:
        return Row(version, "error", str(error))
    generation = target.info.generation
    if verdict.finding is not None:
        return Row(version, "fail", verdict.finding.signature, generation)
    status = {"skipped": "cannot express", "rejected": "rejected"}.get(verdict.status, "pass")
    return Row(version, status, verdict.reason or "", generation)


def bisect_case(case: Case, versions: Sequence[str], device: str = "cpu", jobs: int = 2, case_timeout: float = 60.0) -> list[Row]:
    with ThreadPoolExecutor(max_workers=jobs) as executor:
        return list(executor.map(lambda v: replay_on(case, v, device, case_timeout), versions))


def transitions(rows: Sequence[Row]) -> list[str]:
    """Where the failure appeared and where it went away (by signature)."""
    notes = []
    for before, after in zip(rows, rows[1:], strict=False):
        if before.status != "fail" and after.status == "fail":
            notes.append(f"failure appears in {after.version} ({after.detail})")
        elif before.status == "fail" and after.status != "fail":
            notes.append(f"fixed in {after.version} ({after.status})")
        elif before.status == "fail" and after.status == "fail" and before.detail != after.detail:
            notes.append(f"failure changes in {after.version}: {after.detail}")
    return notes


def format_table(rows: Sequence[Row]) -> str:
    lines = [f"{'release':10} {'api':4} {'result':15} detail"]
    lines += [f"{r.version:10} {r.generation:4} {r.status:15} {r.detail[:140]}" for r in rows]
    lines += [""] + (transitions(rows) or ["no transition: the same result on every release"])
    return "\n".join(lines)
