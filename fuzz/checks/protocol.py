"""What a deeper check is: the one interface the target, the worker, the schedule, the verdict and the reports use.

A deeper check runs vLLM code beyond the view path (a block zeroer, a connector's registration, a cache write, the
planner asked again) on the walk that built a case's views, and judges what that code did against the oracle. It lives
in one module under fuzz/checks/ and is listed once in CHECKS (fuzz/checks/registry.py); nothing outside fuzz/checks/
names it. Its parts, in the order a case meets them:

- `offer(probe)`: on the target, once: the function that runs it on this vLLM (found through the entry-point probe),
  `Off(why)` when the release has the code but kvfuzz cannot drive it, None when the release has no such code;
- `applies(case)`, `key(case)`, `without(case)`: whether a drawn case asks for it, the facts its code under test and
  its judgement read (a worker that judged a key once reuses the verdict), and the case as it runs without it;
- the run (in the worker, on the walk): plain JSON, never vLLM or torch objects. It raises `Unusable` to skip (a record
  that says why, never a finding); an exception raised in vLLM's code that the run does not catch itself becomes a
  `raised` record, judged the same for every check (a crash, or a refusal, on views the oracle accepts);
- `judge(judging, record)`: the finding, or None;
- `kinds`, `warnings`: the finding kinds it reports that the view path does not, each with its one-line meaning, and
  which of them are warnings;
- `exports`, `setting`, `required_layout`: its export templates, the vLLM option that switches its code on, and the
  layout that code asks vLLM for.

A check whose name a case lists in `touches.consumers` (`drawn`) is drawn by the generator on cases where vLLM runs its
code (`unrealistic(case)` is None; otherwise it says why vLLM never does); the others are asked by the case's shape.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fuzz.case import Case, Touches, replace

if TYPE_CHECKING:
    from fuzz.targets.base import Outcome
    from fuzz.targets.entry_points import Probe
    from fuzz.targets.walk import Walk
    from fuzz.verdict.compare import Verdict
    from fuzz.verdict.findings import Finding
    from oracles.contract import Contract
    from oracles.expectation import Expectation

Record = dict[str, Any]
Run = Callable[["Walk"], Record]


class Unusable(Exception):
    """The check cannot run on this walk: why, one line (a skip, never a finding)."""


@dataclass(frozen=True)
class Off:
    """The release has the check's code, and kvfuzz cannot drive it here: why, one line (listed among the checks off)."""

    reason: str


@dataclass(frozen=True)
class Export:
    """An export template of a check's (fuzz/export): the finding kinds and the vLLM function it writes a standalone test for,
    and where it lives ("module:function", imported when a finding is exported). It is called with the finding, its
    reach and the check."""

    kinds: tuple[str, ...]
    function: str
    template: str


@dataclass(frozen=True)
class Judging:
    """What a check's judgement may read: the case as declared, the contract, and the view path's own result."""

    case: Case
    contract: Contract
    expected: Expectation | None  # None only where the view path never got as far as the oracle
    outcome: Outcome
    verdict: Verdict  # the view path's: "pass", or "rejected" for checks that run without views


class Check(Protocol):
    name: str
    # The check's name may be drawn into a case's touches.consumers (where `unrealistic` says vLLM runs its code).
    drawn: bool
    # It, or the vLLM code it drives, may read bytes of the raw buffers nobody wrote: they must come zeroed, as vLLM
    # allocates them (a check that fills every buffer first, or reads none, leaves them unfilled: a faster walk).
    reads_buffers: bool
    # It runs on the view path's views (False: on the case alone, even where the view path refused it).
    needs_views: bool
    # The `--probe` value that asks for it on every case whatever the case names, if any.
    probe: str | None
    # Finding kinds of its own (kind -> what it means, one line), and those of them that are warnings (the rest are errors).
    kinds: dict[str, str]
    warnings: tuple[str, ...]
    # Its export templates, if any.
    exports: tuple[Export, ...]
    # The vLLM option that switches its code on, in a user's words (a KV connector's --kv-transfer-config), and the cache
    # layout that code asks vLLM for (a connector's get_required_kvcache_layout), where it has them.
    setting: str | None
    required_layout: str | None

    def offer(self, probe: Probe) -> Run | Off | None: ...

    def unrealistic(self, case: Case) -> str | None: ...

    def applies(self, case: Case) -> bool: ...

    def key(self, case: Case) -> Hashable: ...

    def without(self, case: Case) -> Case: ...

    def judge(self, judging: Judging, record: Record) -> Finding | None: ...


class TouchCheck:
    """The common parts of a check a case names in `touches.consumers` (its blocks, copies and tokens are the case's):
    asked when named, keyed by the V2 walk's case with only its own name, left out by dropping its name."""

    name = ""
    drawn = True
    reads_buffers = True
    needs_views = True
    probe: str | None = None
    kinds: dict[str, str] = {}  # noqa: RUF012 - read only
    warnings: tuple[str, ...] = ()
    exports: tuple[Export, ...] = ()
    setting: str | None = None
    required_layout: str | None = None

    def unrealistic(self, case: Case) -> str | None:
        return None

    def applies(self, case: Case) -> bool:
        return case.touches is not None and self.name in case.touches.consumers

    def key(self, case: Case) -> Hashable:
        touches = case.touches
        assert touches is not None
        mine = Touches(consumers=(self.name,), blocks=touches.blocks, copies=touches.copies, tokens=())
        return replace(case, touches=mine, device=None, runner="v2")

    def without(self, case: Case) -> Case:
        touches = case.touches
        assert touches is not None
        left = tuple(name for name in touches.consumers if name != self.name)
        kept = replace(touches, consumers=left)
        if not left:
            kept = replace(kept, blocks=(), copies=())
        return replace(case, touches=kept if kept.size else None)
