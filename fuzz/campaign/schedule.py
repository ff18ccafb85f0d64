"""Which deeper checks run on a drawn case: a worker's schedule, not a fixed ratio.

Every case runs the view path. Each deeper check a case asks for (fuzz/checks) is, by the key of the facts it reads:
- reused when the worker judged that key before: its verdict stands in for the run (fuzz/verdict/runner.py `judge`);
- run when the key is new and the check is within its share of the campaign's time;
- deferred otherwise (left out of this case; its key is not remembered, so a later case with it still runs it).

The deeper checks together get at most `share` of the worker's time (`allowances`). Each check is first given up to
`floor` of that budget, so that none starves; the rest goes to the checks by what each has been yielding (keys judged
and new findings per second of its own time), none past what it needs to check every key it meets, so that a cheap check's
unneeded part goes to the others. The first few keys of each check always run, to measure it. A check's time is what
its own code took, in the target and in the verdict (fuzz/checks/timing.py); one that reports none is charged what its
case took beyond the view path's running mean (split evenly among such checks of the case). A finding adds to a check's
yield only the first time the worker meets its bug (its signature; a bug met under another spec kind, backend or layout
is still that one bug): a check that keeps hitting one known bug earns its time by its keys alone.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fuzz.campaign.distinct import DistinctCount
from fuzz.case import Case
from fuzz.checks.protocol import Check
from fuzz.verdict.findings import Finding
from fuzz.verdict.runner import CaseResult

# Where a campaign asks for a fixed ratio instead (--consumers-every, or the kernel probe on every case): the consumers run
# on every K-th case, and the V1 runner and planner-fit on every case.
CONSUMERS_EVERY = 8
SHARE = 0.5  # of a worker's time, for all deeper checks together
FLOOR = 0.1  # of the deeper budget, for every check
WARMUP = 3  # keys of each check run before its share is measured
MEMO_LIMIT = 2_048  # judged keys remembered per check, the oldest going first: each holds its case (about 5 KB), and drawn keys
# seldom repeat (a 5-minute one-worker campaign reused about 80 verdicts in 185,000 cases), so more buys little but memory
FINDING_WEIGHT = 20  # a new finding counts as this many judged keys in a check's yield
BASE_SMOOTHING = 0.05  # weight of the newest view-only case in the view path's running mean
REPLAN_SECONDS = 0.1  # the allowances are worked out again at most this often
HEADROOM = 1.25  # a check's need, over what its keys cost so far: one that keeps up is not deferred by its own noise


@dataclass
class CheckTally:
    """One check's work in a worker so far."""

    offered: int = 0  # cases that asked for the check
    keys_seen: int = 0  # distinct keys among them
    keys_checked: int = 0  # keys the check ran on and judged
    reused: int = 0  # cases whose verdict came from an earlier key
    deferred: int = 0  # cases left without it for its share of time
    seconds: float = 0.0
    findings: int = 0  # judged keys whose verdict was a finding
    new_findings: int = 0  # of those, the ones whose bug (signature) the worker met first

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "seconds": round(self.seconds, 3)}


class HashedKey:
    """A check's key with its hash taken once: a key holds a whole case, whose hash walks every group and spec, and the
    schedule looks each key up several times."""

    __slots__ = ("value", "hash")

    def __init__(self, value: Hashable) -> None:
        self.value, self.hash = value, hash(value)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HashedKey) and self.hash == other.hash and self.value == other.value


@dataclass
class Plan:
    """A drawn case as it runs: without the checks left out, the ones it runs (by key) and the verdicts it reuses."""

    case: Case
    running: dict[str, HashedKey] = field(default_factory=dict)
    reuse: dict[str, Finding | None] = field(default_factory=dict)


class Schedule:
    def __init__(self, checks: tuple[Check, ...], share: float = SHARE, floor: float = FLOOR,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.checks = checks
        self.share, self.floor, self.clock = share, floor, clock
        self.started = clock()
        self.memo: dict[str, dict[Hashable, Finding | None]] = {c.name: {} for c in checks}
        self.seen: dict[str, DistinctCount] = {c.name: DistinctCount() for c in checks}  # keys met, by hash only
        self.tally: dict[str, CheckTally] = {c.name: CheckTally() for c in checks}
        self.base_seconds: float | None = None  # running mean of a view-only case
        self.bugs_met: set[str] = set()  # the signature of each finding judged so far
        self.reported: dict[str, dict[str, Any]] = {}  # the tallies as the last batch report gave them
        self._allowed: dict[str, float] | None = None
        self._allowed_at = self.started

    def plan(self, case: Case) -> Plan:
        running: dict[str, HashedKey] = {}
        reused: dict[str, Finding | None] = {}
        drawn = case
        for check in self.checks:
            if not check.applies(drawn):
                continue
            tally, key = self.tally[check.name], HashedKey(check.key(drawn))
            tally.offered += 1
            if key in self.memo[check.name]:
                tally.reused += 1
                reused[check.name] = self.memo[check.name][key]
            elif self._may_run(check.name):
                running[check.name] = key  # counted as met once judged (record)
                continue
            else:
                tally.deferred += 1
            self._met(check.name, key)
            case = check.without(case)
        return Plan(case, running, reused)

    def record(self, plan: Plan, result: CaseResult | None, seconds: float, spent: Mapping[str, float] | None = None) -> None:
        """What the planned case took (in all, and `spent` by each check) and found; a key whose check was judged is
        remembered with its verdict."""
        if not plan.running:
            self.base_seconds = seconds if self.base_seconds is None else (
                (1 - BASE_SMOOTHING) * self.base_seconds + BASE_SMOOTHING * seconds)
            return
        spent = spent or {}
        unmeasured = [name for name in plan.running if name not in spent]
        rest = seconds - (self.base_seconds or 0.0) - sum(spent.get(name, 0.0) for name in plan.running)
        extra = max(0.0, rest) / len(unmeasured) if unmeasured else 0.0
        judged = result.checks if result is not None else {}
        for name, key in plan.running.items():
            tally = self.tally[name]
            tally.seconds += spent.get(name, extra)
            if name not in judged:
                continue  # its turn never came (an earlier finding, a skip): not met yet
            tally.keys_checked += 1
            self._met(name, key)
            finding = judged[name]
            if finding is not None:
                tally.findings += 1
                if finding.signature not in self.bugs_met:
                    self.bugs_met.add(finding.signature)
                    tally.new_findings += 1
            memo = self.memo[name]
            if len(memo) >= MEMO_LIMIT:
                memo.pop(next(iter(memo)))
            memo[key] = finding

    def _met(self, name: str, key: HashedKey) -> None:
        seen, tally = self.seen[name], self.tally[name]
        seen.add(key.hash)
        # Never falling, nor below the keys judged: past EXACT_LIMIT the count is an estimate, and a key the memo has forgotten
        # is judged again.
        tally.keys_seen = max(tally.keys_seen, len(seen), tally.keys_checked)

    def _may_run(self, name: str) -> bool:
        tally = self.tally[name]
        if tally.keys_checked < WARMUP:
            return True
        now = self.clock()
        if self._allowed is None or now - self._allowed_at >= REPLAN_SECONDS:
            self._allowed, self._allowed_at = self.allowances(), now
        return tally.seconds <= max(now - self.started, 1e-6) * self._allowed.get(name, 0.0)

    def allowances(self) -> dict[str, float]:
        """Each check's part of the worker's time: `floor` of the deeper budget first, then the rest of the budget by
        yield, water-filled so that no check gets past what it needs to check every key it has met at its cost so far."""
        elapsed = max(self.clock() - self.started, 1e-6)
        offered = {name: tally for name, tally in self.tally.items() if tally.offered}
        needs = {name: HEADROOM * t.keys_seen / elapsed * t.seconds / max(t.keys_checked, 1) for name, t in offered.items()}
        yields = {name: (t.keys_checked + FINDING_WEIGHT * t.new_findings) / max(t.seconds, 1e-3) for name, t in offered.items()}
        allowed = {name: min(self.floor * self.share, need) for name, need in needs.items()}
        left = self.share - sum(allowed.values())
        hungry = {name for name in offered if allowed[name] < needs[name]}
        while hungry and left > 1e-9:
            total = sum(yields[name] for name in hungry)
            given = {name: left * yields[name] / total if total else left / len(hungry) for name in hungry}
            full = {name for name in hungry if allowed[name] + given[name] >= needs[name]}
            if not full:
                for name in hungry:
                    allowed[name] += given[name]
                break
            for name in full:
                left -= needs[name] - allowed[name]
                allowed[name] = needs[name]
            hungry -= full
        return allowed

    def take_tallies(self) -> dict[str, dict[str, Any]]:
        """The tallies since the last call, for the batch report (the coordinator adds them up)."""
        now = {name: tally.to_dict() for name, tally in self.tally.items() if tally.offered}
        delta = {name: {key: round(value - self.reported.get(name, {}).get(key, 0), 3) for key, value in figures.items()}
                 for name, figures in now.items()}
        self.reported = now
        return delta
