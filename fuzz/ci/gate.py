"""The regression gate: every corpus case replayed on the target, the failing ones kept for checking.

Without a baseline the corpus files decide, as `kvfuzz replay` does: a finding kept for the target's
release is expected, anything else that fails is unexpected. With a baseline every failing case is
checked against it instead, whatever releases its file names: a source checkout has no release
number (vLLM calls it "dev"), and the question for a change is only whether it fails where its
starting point did not.
"""

from __future__ import annotations

from collections import Counter

from fuzz.ci.model import CORPUS, Checked
from fuzz.corpus.replay import replay_entry
from fuzz.corpus.store import Entry, expected_signatures
from fuzz.targets.base import Target
from fuzz.verdict.runner import run_case


def replay_gate(target: Target, found: list[Entry], device: str, with_baseline: bool) -> tuple[Counter[str], list[Checked]]:
    """Replay statuses by count, and the failures to check (reruns, then the baseline)."""
    known = expected_signatures(found, target.info.vllm_version)
    tally: Counter[str] = Counter()
    failing = []
    for entry in found:
        outcome = replay_entry(target, entry, device, known=known)
        if outcome.status not in ("unexpected", "expected") or (outcome.status == "expected" and not with_baseline):
            tally[outcome.status] += 1
            continue
        # A kept finding that did not reproduce as recorded may pass now (fixed) or fail another way.
        finding = outcome.finding or run_case(target, entry.case, device).verdict.finding
        if finding is None:
            tally["fixed"] += 1
            continue
        tally["checked"] += 1
        failing.append(Checked(CORPUS, entry.path, entry.case, finding))
    return tally, failing
