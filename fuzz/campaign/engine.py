"""A fuzz campaign: the coordinator that hands out work, keeps findings and owns the corpus.

Case i of a campaign is drawn from (seed, i) alone, so any worker can run any case and the
coordinator can redraw the case a dead worker was running. Work goes out in batches of
consecutive indices; workers stream back tallies and findings. A new finding is written to the
corpus (atomically) before its worker is allowed to go on, then shrunk by that worker and
rewritten. A worker the target kills (signal, hang, memory) becomes a finding of its own,
is replaced by a fresh fork, and its batch continues after the case that killed it.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzz.campaign import protocol
from fuzz.campaign.pool import Loss, Pool
from fuzz.case import Case, from_dict
from fuzz.corpus import store as corpus
from fuzz.corpus.minimize import shrink_finding
from fuzz.space import Rejected, draw_indexed
from fuzz.targets.base import TargetInfo
from fuzz.verdict.findings import Finding, normalize

MIN_BATCH, MAX_BATCH = 8, 256


@dataclass
class FoundRecord:
    finding: Finding
    path: Path
    index: int
    cases_until: int
    seconds_until: float
    minimized: bool = False


@dataclass
class Report:
    target: dict[str, Any]
    workers: int = 1
    cases: int = 0
    elapsed_s: float = 0.0
    verdicts: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    skips: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # kvfuzz's own failures: bugs to report, not findings
    findings: list[FoundRecord] = field(default_factory=list)
    duplicates: int = 0  # findings whose signature was already known
    restarts: int = 0
    stop_reason: str = ""

    @property
    def cases_per_s(self) -> float:
        return self.cases / self.elapsed_s if self.elapsed_s else 0.0

    def findings_by_kind(self) -> Counter[str]:
        return Counter(r.finding.kind for r in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "workers": self.workers,
            "cases": self.cases,
            "elapsed_s": round(self.elapsed_s, 3),
            "cases_per_s": round(self.cases_per_s, 1),
            "stop_reason": self.stop_reason,
            "verdicts": dict(self.verdicts),
            "rejections": dict(self.rejections.most_common()),
            "skipped": dict(self.skips.most_common()),
            "internal_errors": dict(self.errors.most_common()),
            "restarts": self.restarts,
            "duplicates": self.duplicates,
            "findings": [
                {**r.finding.to_dict(), "case_file": str(r.path), "case_index": r.index, "cases_until_found": r.cases_until,
                 "seconds_until_found": round(r.seconds_until, 3), "minimized": r.minimized}
                for r in self.findings
            ],
        }


@dataclass(frozen=True)
class CampaignOptions:
    device: str = "cpu"
    max_time: float = 60.0
    max_cases: int = 10**12
    seed: int = 0
    corpus_dir: Path = Path("corpus/findings")
    synthetic: bool = True
    probe_every: int = 0
    scale: str = "small"
    max_buffer_bytes: int = 1 << 30
    # Shrinking a case that kills its worker costs a restart or a whole case timeout per candidate.
    shrink_seconds: float = 60.0
    known: frozenset[str] = frozenset()  # signatures not to report as new, beside those in corpus_dir


class Campaign:
    def __init__(self, pool: Pool, options: CampaignOptions, progress: Callable[[Report], None] | None = None,
                 until: Callable[[FoundRecord], bool] | None = None) -> None:
        """`until`: stop the campaign once a new finding satisfies it (benchmarks of time to first finding)."""
        assert pool.info is not None
        self.pool = pool
        self.info: TargetInfo = pool.info
        self.options = options
        self.progress = progress
        self.known = corpus.known_signatures(options.corpus_dir) | options.known
        target = {"spec": pool.source.spec, "label": pool.source.label, "vllm_version": self.info.vllm_version,
                  "generation": self.info.generation, "contract": self.info.contract.name, "checks_off": list(self.info.checks_off),
                  "uncovered": list(self.info.uncovered)}
        self.report = Report(target=target, workers=len(pool.workers))
        self.next_index = 0
        self.batches: dict[int, dict[str, Any]] = {}  # batch id -> task
        self.batch_counter = 0
        self.records: dict[tuple[int, int], FoundRecord] = {}
        self.stopping = False
        self.batch_size = MIN_BATCH
        self.busy = {number: False for number in pool.fuzzers()}
        self.id = uuid.uuid4().hex
        self.until = until

    # ------------------------------------------------------------------ the loop

    def run(self) -> Report:
        start = time.monotonic()
        self.start = start
        previous = {s: signal.signal(s, self._stop) for s in (signal.SIGINT, signal.SIGTERM)}
        last_progress = 0.0
        try:
            for worker in self.busy:
                self._dispatch(worker)
            while any(self.busy.values()):
                messages, losses = self.pool.poll(0.1)
                for worker, name, payload in messages:
                    self._on_message(worker, name, payload)
                for loss in losses:
                    self._on_loss(loss)
                for worker, busy in self.busy.items():
                    if not busy:
                        self._dispatch(worker)
                self.report.elapsed_s = time.monotonic() - start
                if self.progress and time.monotonic() - last_progress >= 0.5:
                    last_progress = time.monotonic()
                    self.progress(self.report)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.report.elapsed_s = time.monotonic() - start
        self.report.restarts = self.pool.restarts
        if not self.report.stop_reason:
            self.report.stop_reason = "max-cases" if self.next_index >= self.options.max_cases else "max-time"
        return self.report

    def _stop(self, signum: int, frame: Any) -> None:
        self.stopping = True
        self.report.stop_reason = signal.Signals(signum).name

    def _budget_left(self) -> bool:
        return (not self.stopping and self.next_index < self.options.max_cases
                and time.monotonic() - self.start < self.options.max_time)

    def _dispatch(self, worker: int) -> None:
        if not self._budget_left():
            return
        count = min(self.batch_size, self.options.max_cases - self.next_index)
        self.batch_counter += 1
        task = {"campaign": self.id, "batch": self.batch_counter, "seed": self.options.seed, "start": self.next_index, "count": count,
                "synthetic": self.options.synthetic, "device": self.options.device, "known": sorted(self.known),
                "probe_every": self.options.probe_every, "scale": self.options.scale, "max_buffer_bytes": self.options.max_buffer_bytes}
        self.next_index += count
        self.batches[self.batch_counter] = task
        self.busy[worker] = True
        self.pool.start_batch(worker, task)

    def _on_message(self, worker: int, name: str, payload: dict[str, Any]) -> None:
        if name == protocol.BATCH:
            self._on_batch(worker, payload)
        elif name == protocol.FINDING:
            self._on_finding(worker, payload)
        elif name == protocol.MINIMIZED:
            self._on_minimized(payload)

    def _on_batch(self, worker: int, payload: dict[str, Any]) -> None:
        self.busy[worker] = False
        self.batches.pop(payload["batch"], None)
        self.report.cases += payload["done"]
        for key in ("verdicts", "rejections", "skips", "errors"):
            getattr(self.report, key).update(payload.get(key, {}))
        # Size batches to about half a second: small enough to stop on time, large enough to amortize.
        rate = payload["done"] / max(payload["elapsed"], 1e-3)
        self.batch_size = max(MIN_BATCH, min(MAX_BATCH, int(rate * 0.5)))

    def _on_finding(self, worker: int, payload: dict[str, Any]) -> None:
        finding = Finding.from_dict(payload["finding"])
        case = from_dict(payload["case"])
        self._record(finding, case, payload["index"], payload["batch"])
        self.pool.ack(worker)

    def _record(self, finding: Finding, case: Case, index: int, batch: int) -> FoundRecord | None:
        if finding.signature in self.known:
            self.report.duplicates += 1
            return None
        self.known.add(finding.signature)
        path = corpus.save_finding(self.options.corpus_dir, case, self._meta(finding, minimized=False))
        record = FoundRecord(finding, path, index, index + 1, time.monotonic() - self.start)
        self.report.findings.append(record)
        self.records[(batch, index)] = record
        if self.until is not None and self.until(record):
            self.stopping, self.report.stop_reason = True, "goal"
        return record

    def _on_minimized(self, payload: dict[str, Any]) -> None:
        record = self.records.get((payload["batch"], payload["index"]))
        if record is not None:
            self._replace(record, from_dict(payload["case"]), Finding.from_dict(payload["finding"]))

    def _replace(self, record: FoundRecord, small: Case, finding: Finding) -> None:
        record.finding = finding  # the small case's own: its layer, numbers and latency
        path = corpus.save_finding(self.options.corpus_dir, small, self._meta(record.finding, minimized=True))
        if path != record.path:
            record.path.unlink(missing_ok=True)
        record.path, record.minimized = path, True

    def _on_loss(self, loss: Loss) -> None:
        """A worker died: record what killed it, then let its batch go on after that case."""
        task = self.batches.get(loss.batch if loss.batch is not None else -1)
        if task is None or loss.index is None or loss.phase == protocol.SHRINKING:
            # Killed while shrinking a finding: the raw finding is on disk, its batch goes on after it.
            self._resume(loss, task, loss.index if loss.phase == protocol.SHRINKING else None, crashed=False)
            return
        try:
            case = draw_indexed(self.info, task["seed"], loss.index, synthetic=task["synthetic"], scale=task["scale"])
        except Rejected:
            case = None
        if case is not None:
            finding = Finding(loss.kind, _kinds(case), "worker", loss.detail, None, case.is_latent)
            record = self._record(finding, case, loss.index, task["batch"])
            if record is not None:
                self._shrink_process_failure(record, case)
        self._resume(loss, task, loss.index)

    def _resume(self, loss: Loss, task: dict[str, Any] | None, failed_index: int | None, crashed: bool = True) -> None:
        if loss.worker not in self.busy:
            return
        self.busy[loss.worker] = False
        if task is None:
            return
        self.batches.pop(task["batch"], None)
        end = task["start"] + task["count"]
        resume_at = (failed_index + 1) if failed_index is not None else task["start"]
        self.report.cases += resume_at - task["start"]
        if failed_index is not None and crashed:
            self.report.verdicts["finding"] += 1
        if resume_at < end:
            rest = {**task, "start": resume_at, "count": end - resume_at, "known": sorted(self.known)}
            self.batches[task["batch"]] = rest
            self.busy[loss.worker] = True
            self.pool.start_batch(loss.worker, rest)

    def _shrink_process_failure(self, record: FoundRecord, case: Case) -> None:
        """Shrink a case that kills its worker, one candidate per (respawned) worker run."""
        from fuzz.verdict.runner import judge

        target = self.pool.spare_target()

        def find(candidate: Case) -> Finding | None:
            return judge(target.execute(candidate, self.options.device), self.info.contract).verdict.finding

        small, smallest, _ = shrink_finding(case, record.finding, find, self.info, max_seconds=self.options.shrink_seconds)
        self._replace(record, small, smallest)

    def _meta(self, finding: Finding, minimized: bool) -> dict[str, Any]:
        return {**finding.to_dict(), "vllm_version": self.info.vllm_version, "generation": self.info.generation,
                "contract": self.info.contract.name, "minimized": minimized, "target": self.report.target["spec"]}


def _kinds(case: Case) -> str:
    return "+".join(sorted({g.spec.kind for g in case.groups}))


__all__ = ["Campaign", "CampaignOptions", "FoundRecord", "Report", "normalize"]
