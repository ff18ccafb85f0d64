"""Cases that reached a changed line, run on the branch and on the baseline, compared.

A change shows even when both sides pass the oracle: the views one side builds for a case may sit on other
bytes than the other side's. Each reaching case the campaign kept (fuzz/ci/direct.py, at most MAX_SAMPLES)
runs once on each side:
- it fails on the branch and passes on the baseline: the change's failure; it goes on to the reruns like
  any other (`Compared.failure`);
- both pass and the views differ: a `behaviour-change` note (not a failure) naming the layers and bytes that moved;
- it passes on the branch and fails on the baseline: a note too (the change fixed or hid something).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fuzz.case import Case
from fuzz.ci.model import BehaviourChange, LayerMove
from fuzz.ci.reproduce import verdict_text
from fuzz.targets.base import Outcome, ViewRecord
from fuzz.verdict.findings import Finding
from fuzz.verdict.runner import CaseResult

MAX_ELEMENTS = 1 << 22  # a view larger than this is compared by its metadata only (bytes moved not counted)


@dataclass
class Compared:
    case: Case
    branch: CaseResult
    baseline: CaseResult

    @property
    def failure(self) -> Finding | None:
        """The branch's finding, when the baseline passes the case."""
        return self.branch.verdict.finding if self.baseline.verdict.finding is None else None

    def note(self) -> BehaviourChange | None:
        branch, baseline = self.branch.verdict, self.baseline.verdict
        if branch.finding is None and baseline.finding is not None:
            return BehaviourChange(self.case, verdict_text(self.branch), verdict_text(self.baseline), [],
                                   "the baseline fails this case and the branch passes it")
        if branch.finding is not None or baseline.finding is not None or branch.status != baseline.status:
            return None
        moves = moved_views(self.branch.outcome, self.baseline.outcome)
        if not moves:
            return None
        return BehaviourChange(self.case, verdict_text(self.branch), verdict_text(self.baseline), moves,
                               "both sides pass the oracle, and the views differ")


def moved_views(branch: Outcome | None, baseline: Outcome | None) -> list[LayerMove]:
    """Per layer and tensor whose view differs between the two sides: both descriptions and the bytes that moved."""
    if branch is None or baseline is None:
        return []
    moves = []
    for layer in sorted(set(branch.views) | set(baseline.views)):
        ours, theirs = branch.views.get(layer, ()), baseline.views.get(layer, ())
        for tensor in range(max(len(ours), len(theirs))):
            a = ours[tensor] if tensor < len(ours) else None
            b = theirs[tensor] if tensor < len(theirs) else None
            if a == b:
                continue
            moves.append(LayerMove(layer, tensor, _describe(a), _describe(b), moved_bytes(a, b)))
    return moves


def moved_bytes(a: ViewRecord | None, b: ViewRecord | None) -> int | None:
    """Bytes the view covers on one side and not the other (same shape and item size: bytes whose element moved).
    None when a view is too large to enumerate."""
    if a is None or b is None:
        other = a or b
        return None if other is None else math.prod(other.shape) * other.element_size
    if max(math.prod(a.shape), math.prod(b.shape)) > MAX_ELEMENTS:
        return None
    if a.shape == b.shape and a.element_size == b.element_size and a.buffer == b.buffer:
        return int(np.count_nonzero(_starts(a) != _starts(b))) * a.element_size
    ours, theirs = _bytes(a), _bytes(b)
    if a.buffer != b.buffer:
        return int(ours.size + theirs.size)
    return int(np.setxor1d(ours, theirs, assume_unique=False).size)


def _starts(view: ViewRecord) -> np.ndarray:
    starts = np.array([view.offset_bytes], dtype=np.int64)
    for size, stride in zip(view.shape, view.byte_strides, strict=True):
        starts = (starts[:, None] + np.arange(size, dtype=np.int64) * stride).ravel()
    return starts


def _bytes(view: ViewRecord) -> np.ndarray:
    return np.unique((_starts(view)[:, None] + np.arange(view.element_size, dtype=np.int64)).ravel())


def _describe(view: ViewRecord | None) -> str:
    if view is None:
        return "none"
    return f"{tuple(view.shape)} {view.dtype} byte strides {tuple(view.byte_strides)} at byte {view.offset_bytes}"
