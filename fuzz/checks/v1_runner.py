"""v1-runner: the V1 model runner (GPUModelRunner.initialize_kv_cache_tensors, fuzz/targets/runner_v1.py) beside the V2
runner, on a case drawn for both. Its views are judged against the oracle under its own contract, and where both
runners satisfy the oracle (or both refuse the case) their layouts must agree (`runner-mismatch`, fuzz/verdict/runners.py)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from fuzz.case import Case, replace
from fuzz.checks.protocol import Export, Judging, Off, Record, Run
from fuzz.targets.base import Outcome
from fuzz.verdict.findings import Finding
from fuzz.verdict.runners import compare_runners
from fuzz.verdict.views import judge_views

if TYPE_CHECKING:
    from fuzz.targets.entry_points import Probe
    from fuzz.targets.walk import Walk


class V1Runner:
    name = "v1-runner"
    drawn = False
    reads_buffers = False  # it walks the case again on buffers of its own
    needs_views = False  # judged where the V2 runner refuses the case too
    probe = None
    kinds: dict[str, str] = {}  # noqa: RUF012 - runner-mismatch is the comparator's kind (fuzz/verdict/findings.py)
    warnings = ()
    exports = (Export(("runner-mismatch",), "GPUModelRunner.initialize_kv_cache_tensors", "fuzz.export.runner_compare:runner_compare_test"),)
    setting = None
    required_layout = None
    # What `kvfuzz explain` shows its record as: another runner's views of the case (other_outcome).
    label = "V1 model runner (GPUModelRunner.initialize_kv_cache_tensors)"

    def offer(self, probe: Probe) -> Run | Off:
        if probe.find("V1 runner") is None:
            return Off(probe.missing("V1 runner") + "; cases for the V1 model runner are not drawn")
        return rerun

    def unrealistic(self, case: Case) -> str | None:
        return None

    def applies(self, case: Case) -> bool:
        return case.runner == "both"

    def key(self, case: Case) -> Hashable:
        # The runner builds its views from the whole configuration; consumers and cache writes run on the V2 walk only.
        return replace(case, touches=None, device=None)

    def without(self, case: Case) -> Case:
        return replace(case, runner="v2")

    def other_outcome(self, record: Record) -> Outcome:
        return Outcome.from_dict(record)

    def judge(self, judging: Judging, record: Record) -> Finding | None:
        outcome = self.other_outcome(record)
        judged = judge_views(judging.case, outcome, judging.contract)
        if judged.verdict.finding is not None:
            return judged.verdict.finding
        mismatch = compare_runners(judging.case, (judging.verdict, judging.expected, judging.outcome),
                                   (judged.verdict, judged.expectation, outcome))
        return None if mismatch is None else mismatch.finding


def rerun(walk: Walk) -> Record:
    return walk.rerun("v1").to_dict()


CHECK = V1Runner()
