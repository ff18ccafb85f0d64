"""A fuzz campaign: the coordinator that hands out work, keeps findings and owns the corpus.

Case i of a campaign is drawn from (seed, i) alone, so any worker can run any case and the
coordinator can redraw the case a dead worker was running. Work goes out in batches of
consecutive indices; workers stream back tallies and findings. A new finding is written to the
corpus (atomically) before its worker is allowed to go on, then shrunk by that worker and
rewritten. A worker the target kills (signal, hang, memory) is replaced by a fresh fork and its
batch goes on after the case that killed it; the case is written to the corpus at once, then run
again on a fresh spare worker (twice for a hang, each with the full case timeout). Only a case that
fails the same way again is a finding (then shrunk on the spare); one that does not is flaky: its
file is removed and the report keeps it, with what the reruns gave.

The campaign ends on time whatever the target does: nothing starts that cannot finish by the
deadline (a rerun or shrink candidate needs a whole case timeout), batches still running at the
deadline get a short grace and are then stopped (no finding), and SIGINT or SIGTERM stop it at
the next wait (fuzz.campaign.stop). A target kvfuzz cannot call (the first cases all fail with the
same call mismatch), a target process that cannot go on, or a corpus that cannot be written ends
it with an error in the report, after what was found is kept.
"""

from __future__ import annotations

import hashlib
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzz.campaign import protocol, stop
from fuzz.campaign.pool import ANSWER_MARGIN, Loss, Pool
from fuzz.case import Case, from_dict, to_dict
from fuzz.corpus import file as corpus_file
from fuzz.corpus import store as corpus
from fuzz.corpus.minimize import shrink_finding
from fuzz.errors import CaseError, InternalError, TargetError
from fuzz.space import Rejected, draw_indexed
from fuzz.targets.base import TargetInfo
from fuzz.verdict.findings import PROCESS_KINDS, RERUNS, Finding, normalize, observed, variants_of
from fuzz.verdict.runner import run_case

MIN_BATCH, MAX_BATCH = 8, 256
STOP_GRACE = 2.0  # seconds the batches running at the deadline get to finish before they are stopped
FIRST_CASES = 8  # kvfuzz's calls not fitting vLLM this often, before any case passed, stop the campaign


@dataclass
class FoundRecord:
    finding: Finding
    path: Path | None  # None: the corpus could not be written (the report carries the case)
    index: int
    cases_until: int
    seconds_until: float
    minimized: bool = False
    case: Case | None = None
    confirmed: bool = True  # a process finding: failed the same way again in a fresh worker
    note: str = ""  # what cut its shrinking short, or why it is not on disk


@dataclass
class FlakyRecord:
    """A process finding whose case did not fail the same way again, or could not be rerun in time."""

    finding: Finding
    case: Case
    index: int
    rerun: str  # what the reruns gave
    path: Path | None = None  # an unconfirmed case stays on disk (marked so), a flaky one does not

    @property
    def status(self) -> str:
        return "unconfirmed" if self.path is not None else "flaky"


@dataclass
class Report:
    target: dict[str, Any]
    workers: int = 1
    cases: int = 0
    elapsed_s: float = 0.0  # the campaign's own time, from when the target was ready: what --max-time bounds
    start_s: float | None = None  # from the command's start until the target's workers were ready (not in elapsed_s)
    verdicts: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    skips: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # kvfuzz's own failures: bugs to report, not findings
    error_cases: dict[str, str] = field(default_factory=dict)  # kvfuzz error -> file holding the first case it hit
    error_tracebacks: dict[str, str] = field(default_factory=dict)  # kvfuzz error -> the traceback of its first case
    findings: list[FoundRecord] = field(default_factory=list)
    duplicates: int = 0  # findings whose signature was already known
    restarts: int = 0
    stop_reason: str = ""
    flaky: list[FlakyRecord] = field(default_factory=list)
    stopped_workers: int = 0  # workers busy when the campaign ended, stopped (their case in flight is not counted)
    error: str = ""  # why the campaign could not go on (stop_reason "error")
    # Per bug (signature), the (spec kind, backend, layout) variants it showed under in this campaign.
    variants: dict[str, set[tuple[str, ...]]] = field(default_factory=dict)
    # Per deeper check, its workers' tallies added up (fuzz/campaign/schedule.py CheckTally).
    checks: dict[str, Counter[str]] = field(default_factory=dict)

    def check_rows(self) -> list[dict[str, Any]]:
        """Per deeper check: cases that asked for it, keys seen and checked, reused verdicts, its share of the workers' time."""
        spent = max(self.elapsed_s * max(self.workers, 1), 1e-9)
        return [{"check": name, **{k: round(v, 3) if isinstance(v, float) else v for k, v in tally.items()},
                 "time_share": round(tally["seconds"] / spent, 4)} for name, tally in sorted(self.checks.items())]

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
            "start_s": None if self.start_s is None else round(self.start_s, 3),
            "fuzz_s": round(self.elapsed_s, 3),  # the same as elapsed_s: fuzzing time, the start not counted
            "cases_per_s": round(self.cases_per_s, 1),
            "stop_reason": self.stop_reason,
            "error": self.error or None,
            "verdicts": dict(self.verdicts),
            "rejections": dict(self.rejections.most_common()),
            "skipped": dict(self.skips.most_common()),
            "internal_errors": dict(self.errors.most_common()),
            "internal_error_cases": dict(self.error_cases),
            # Each internal error whole: its count, the file keeping its first case, and that case's traceback.
            "internal_error_details": [{"error": message, "count": count, "case_file": self.error_cases.get(message),
                                        "traceback": self.error_tracebacks.get(message)} for message, count in self.errors.most_common()],
            "checks": self.check_rows(),
            "restarts": self.restarts,
            "stopped_workers": self.stopped_workers,
            "duplicates": self.duplicates,
            "findings": [
                {**r.finding.to_dict(), "variants": variants_of(self.variants.get(r.finding.signature, {r.finding.variant})),
                 "case_file": None if r.path is None else str(r.path), "case_index": r.index,
                 "cases_until_found": r.cases_until, "seconds_until_found": round(r.seconds_until, 3), "minimized": r.minimized,
                 **({"case": to_dict(r.case)} if r.path is None and r.case is not None else {}), **({"note": r.note} if r.note else {})}
                for r in self.findings
            ],
            "flaky": [
                {**r.finding.to_dict(), "status": r.status, "rerun": r.rerun, "case_index": r.index,
                 "case_file": None if r.path is None else str(r.path), "case": to_dict(r.case)}
                for r in self.flaky
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
    probe_kind: str = "physical"  # what the probe every probe_every-th case is: "physical" or "kernel"
    # Run the case's consumers (fuzz/targets/consumers.py) on every K-th case (0: never), the V1 runner and planner-fit on
    # every case; None: every deeper check where the worker's schedule says (fuzz/campaign/schedule.py).
    consumers_every: int | None = 0
    scale: str = "small"
    max_buffer_bytes: int = 1 << 30
    # Shrinking a case that kills its worker costs a restart or a whole case timeout per candidate.
    shrink_seconds: float = 60.0
    known: frozenset[str] = frozenset()  # signatures not to report as new, beside those in corpus_dir
    # When the campaign must be over (time.monotonic()); None: max_time after run() starts, the target already ready.
    deadline: float | None = None


class Campaign:
    def __init__(self, pool: Pool, options: CampaignOptions, progress: Callable[[Report], None] | None = None,
                 until: Callable[[FoundRecord], bool] | None = None, direction: Any = None) -> None:
        """`pool`: a fuzz.campaign.pool.Pool or anything with its campaign interface (fuzz.cluster.pool.RayPool).
        `until`: stop the campaign once a new finding satisfies it (benchmarks of time to first finding).
        `direction`: a fuzz.ci.direct.Direction: workers trace the changed lines it names and draw by its policy (kvfuzz ci)."""
        self.direction = direction
        assert pool.info is not None
        self.pool = pool
        self.info: TargetInfo = pool.info
        self.options = options
        self.progress = progress
        # Known per release; a checkout's version names no release, so every kept finding is known there.
        release = None if getattr(pool.source, "kind", None) == "checkout" else self.info.vllm_version
        self.known = corpus.known_signatures(options.corpus_dir, release) | options.known
        # Files of earlier runs are never removed (an unconfirmed case found flaky now, or shrunk again, stays as it was).
        self.inherited = set(options.corpus_dir.rglob("*.json")) if options.corpus_dir.exists() else set()
        target = {"spec": pool.source.spec, "label": pool.source.label, "vllm_version": self.info.vllm_version,
                  "generation": self.info.generation, "contract": self.info.contract.name, "checks_off": list(self.info.checks_off),
                  "uncovered": list(self.info.uncovered)}
        self.report = Report(target=target, workers=len(pool.fuzzers()))
        self.case_timeout = float(getattr(pool, "case_timeout", 60.0))
        self.next_index = 0
        self.batches: dict[int, dict[str, Any]] = {}  # batch id -> task
        self.batch_counter = 0
        self.records: dict[tuple[int, int], FoundRecord] = {}
        self.held: dict[int, int | None] = {number: None for number in pool.fuzzers()}  # worker -> the batch it runs
        self.batch_size = MIN_BATCH
        self.id = uuid.uuid4().hex
        self.until = until
        self.reason = ""  # why the loop ends, once it must
        self.reached = 0  # cases that passed, until one shows that kvfuzz's calls fit this vLLM
        self.mismatched: Counter[str] = Counter()
        self.calls_fit = False

    # ------------------------------------------------------------------ the loop

    def run(self) -> Report:
        self.start = time.monotonic()
        self.deadline = self.options.deadline if self.options.deadline is not None else self.start + self.options.max_time
        with stop.handling():
            try:
                self._loop()
            except stop.Stopped:
                pass
            except TargetError as error:  # the target's processes cannot go on, or kvfuzz cannot call this vLLM
                self._fail(str(error))
            try:
                self._wind_down()
            except stop.Stopped:
                pass
            except TargetError as error:
                self._fail(self.report.error or str(error))
            signum = stop.requested()
        self._record_variants()
        self.report.elapsed_s = time.monotonic() - self.start
        self.report.restarts = self.pool.restarts
        if self.report.error:
            self.report.stop_reason = "error"
        elif signum is not None:
            self.report.stop_reason = signal.Signals(signum).name
        else:
            self.report.stop_reason = self.reason or "max-time"
        return self.report

    def _loop(self) -> None:
        last_progress = 0.0
        for worker in self.held:
            self._dispatch(worker)
        while self._busy():
            if self._ending():
                return
            messages, losses = self.pool.poll(0.1)
            self._take(messages, losses)
            for worker, batch in self.held.items():
                if batch is None:
                    self._dispatch(worker)
            self.report.elapsed_s = time.monotonic() - self.start
            if self.progress and time.monotonic() - last_progress >= 0.5:
                last_progress = time.monotonic()
                self.progress(self.report)
        self.reason = self.reason or ("max-cases" if self.next_index >= self.options.max_cases else "max-time")

    def _ending(self) -> bool:
        """Whether the campaign must stop now (a signal, a goal met, an error, or its time is up)."""
        if time.monotonic() >= self.deadline and not self.reason:
            self.reason = "max-time"
        return bool(self.reason) or stop.requested() is not None

    def _take(self, messages: list[tuple[int, str, dict[str, Any]]], losses: list[Loss]) -> None:
        for worker, name, payload in messages:
            self._on_message(worker, name, payload)
        for loss in losses:
            self._on_loss(loss)

    def _busy(self) -> bool:
        return any(batch is not None for batch in self.held.values())

    def _time_left(self) -> float:
        return self.deadline - time.monotonic()

    def _budget_left(self) -> bool:
        return not self._ending() and self.next_index < self.options.max_cases

    def _fail(self, message: str) -> None:
        self.report.error = self.report.error or message
        self.reason = "error"

    def _wind_down(self) -> None:
        """Batches under way at the deadline get a short grace; then (or at once after a signal or
        an error) every worker still busy is stopped. What already arrived is taken first."""
        if self.reason in ("max-time", "max-cases") and stop.requested() is None:
            grace = time.monotonic() + STOP_GRACE
            while self._busy() and time.monotonic() < grace and stop.requested() is None and not self.report.error:
                self._take(*self.pool.poll(0.1))
        if self._busy():
            self._take(*self.pool.poll(0.0))
        interrupt = getattr(self.pool, "interrupt", None)  # a Ray pool has none: closing it ends the actors' batches
        for worker, batch in self.held.items():
            if batch is None:
                continue
            self.held[worker] = None
            self.report.stopped_workers += 1
            if interrupt is None:
                continue
            _, index, phase = interrupt(worker)
            task = self.batches.pop(batch, None)
            if task is not None and task["start"] <= index < task["start"] + task["count"]:
                self.report.cases += index - task["start"] + (phase != protocol.RUNNING)

    def _dispatch(self, worker: int) -> None:
        if not self._budget_left():
            return
        count = min(self.batch_size, self.options.max_cases - self.next_index)
        self.batch_counter += 1
        task = protocol.Task(self.batch_counter, self.options.seed, self.next_index, count, self.options.synthetic, self.options.device,
                             campaign=self.id, known=tuple(sorted(self.known)), probe_every=self.options.probe_every,
                             probe_kind=self.options.probe_kind, consumers_every=self.options.consumers_every, scale=self.options.scale,
                             max_buffer_bytes=self.options.max_buffer_bytes,
                             **(self.direction.task() if self.direction is not None else {})).to_dict()
        self.next_index += count
        self._hand(worker, task)

    def _hand(self, worker: int, task: dict[str, Any]) -> None:
        # A worker shrinks its findings only while the campaign has time left.
        task = {**task, "known": sorted(self.known), "shrink_seconds": max(0.0, min(self.options.shrink_seconds, self._time_left()))}
        self.batches[task["batch"]] = task
        self.held[worker] = task["batch"]
        self.pool.start_batch(worker, task)

    # ------------------------------------------------------------------ what workers say

    def _on_message(self, worker: int, name: str, payload: dict[str, Any]) -> None:
        if name == protocol.BATCH:
            self._on_batch(worker, payload)
        elif name == protocol.FINDING:
            self._on_finding(worker, payload)
        elif name == protocol.MINIMIZED:
            self._on_minimized(payload)

    def _on_batch(self, worker: int, payload: dict[str, Any]) -> None:
        if self.held.get(worker) == payload["batch"]:
            self.held[worker] = None
        self.batches.pop(payload["batch"], None)
        self.report.cases += payload["done"]
        for key in ("verdicts", "rejections", "skips", "errors"):
            getattr(self.report, key).update(payload.get(key, {}))
        for item in payload.get("internal", ()):
            self._save_internal_error(item)
        for name, tally in payload.get("checks", {}).items():
            self.report.checks.setdefault(name, Counter()).update(tally)
        for signature, *variant in payload.get("variants", ()):
            self.report.variants.setdefault(signature, set()).add(tuple(variant))
        if self.direction is not None and "reach" in payload:
            self.direction.take(payload["reach"])
        mismatches = payload.get("mismatches", {})
        self.report.errors.update(mismatches)
        self._check_calls(payload["verdicts"], mismatches)
        # Size batches to about half a second: small enough to stop on time, large enough to amortize.
        rate = payload["done"] / max(payload["elapsed"], 1e-3)
        self.batch_size = max(MIN_BATCH, min(MAX_BATCH, int(rate * 0.5)))

    def _save_internal_error(self, item: dict[str, Any]) -> None:
        """A kvfuzz error is a bug to report: keep the first case that hit it beside the corpus (internal-errors/)."""
        if item["error"] in self.report.error_cases:
            return
        if item.get("traceback"):
            self.report.error_tracebacks.setdefault(item["error"], item["traceback"])
        folder = self.options.corpus_dir.parent / "internal-errors"
        folder.mkdir(parents=True, exist_ok=True)
        case = from_dict(item["case"])
        path = folder / f"{hashlib.sha256(item['error'].encode()).hexdigest()[:12]}-{case.content_hash()}.json"
        corpus.write_atomic(path, {"error": item["error"], "seed": self.options.seed, "index": item["index"],
                                   "target": self.report.target, "traceback": item.get("traceback"), "case": item["case"]})
        self.report.error_cases[item["error"]] = str(path)

    def _check_calls(self, verdicts: dict[str, int], mismatches: dict[str, int]) -> None:
        """Stop with an error when the first cases that reach vLLM all fail in kvfuzz's own call into it
        (the adapter does not fit this vLLM): those are not vLLM's findings."""
        if self.calls_fit:
            return
        # Only a case that passed went through every call kvfuzz makes: one that vLLM refused or failed early (in the
        # planner, say) proves nothing about the calls after it.
        self.reached += verdicts.get("pass", 0)
        self.mismatched.update(mismatches)
        if self.reached:
            self.calls_fit = True
        elif sum(self.mismatched.values()) >= FIRST_CASES:
            self._fail(self.mismatched.most_common(1)[0][0])

    def _on_finding(self, worker: int, payload: dict[str, Any]) -> None:
        finding = Finding.from_dict(payload["finding"])
        case = from_dict(payload["case"])
        self._record(finding, case, payload["index"], payload["batch"])
        self.pool.ack(worker)

    def _on_minimized(self, payload: dict[str, Any]) -> None:
        record = self.records.get((payload["batch"], payload["index"]))
        if record is not None:
            self._replace(record, from_dict(payload["case"]), Finding.from_dict(payload["finding"]))

    # ------------------------------------------------------------------ the corpus

    def _record(self, finding: Finding, case: Case, index: int, batch: int, confirmed: bool = True) -> FoundRecord | None:
        if finding.signature in self.known:
            self.report.duplicates += 1
            return None
        self.known.add(finding.signature)
        self.report.variants.setdefault(finding.signature, set()).add(finding.variant)
        record = FoundRecord(finding, None, index, index + 1, time.monotonic() - self.start, case=case, confirmed=confirmed)
        self._save(record, case, finding)
        self.report.findings.append(record)
        self.records[(batch, index)] = record
        if self.until is not None and self.until(record):
            self.reason = self.reason or "goal"
        return record

    def _save(self, record: FoundRecord, case: Case, finding: Finding, minimized: bool = False) -> bool:
        """Write the record's case to the corpus; a corpus that cannot be written ends the campaign with an error."""
        try:
            path = corpus.save_finding(self.options.corpus_dir, case, self._meta(finding, minimized, record.confirmed))
        except OSError as error:
            record.note = f"not written: {error.strerror or error}"
            self._fail(f"cannot write findings to {self.options.corpus_dir}: {error}; the report keeps the cases it could not write")
            return False
        if record.path is not None and path != record.path:
            self._remove(record.path)
        record.path, record.case, record.finding, record.minimized = path, case, finding, minimized
        return True

    def _remove(self, path: Path) -> None:
        if path not in self.inherited:
            path.unlink(missing_ok=True)

    def _replace(self, record: FoundRecord, small: Case, finding: Finding) -> None:
        self._save(record, small, finding, minimized=True)  # the small case's own finding: its layer, numbers and latency

    def _record_variants(self) -> None:
        """Each new bug's corpus file lists every variant the campaign met it under (found after the file was first written)."""
        for record in self.report.findings:
            if record.path is None or not record.path.exists():
                continue
            wanted = variants_of(self.report.variants.get(record.finding.signature, {record.finding.variant}))
            try:
                stored = corpus_file.read(record.path)
                if stored.meta.get("variants") != wanted:
                    stored.updated(variants=wanted).write()
            except (OSError, CaseError):
                continue  # the file as first written still holds the finding

    def _meta(self, finding: Finding, minimized: bool, confirmed: bool) -> dict[str, Any]:
        meta = {**finding.to_dict(), "variants": variants_of(self.report.variants.get(finding.signature, {finding.variant})),
                "vllm_version": self.info.vllm_version, "generation": self.info.generation,
                "contract": self.info.contract.name, "minimized": minimized, "target": self.report.target["spec"]}
        if finding.kind in PROCESS_KINDS:
            meta["confirmed"] = confirmed  # an unconfirmed case is not a known signature (fuzz.corpus.store)
        return meta

    # ------------------------------------------------------------------ lost workers

    def _on_loss(self, loss: Loss) -> None:
        """A worker died: record what killed it, let its batch go on after that case, then check the case again."""
        if loss.worker not in self.held:
            return  # the spare, idle: it comes back on its next case
        batch = self.held[loss.worker]
        task = self.batches.get(batch) if batch is not None else None
        if task is None or loss.batch != batch or loss.index is None:
            self._resume(loss.worker, task, None)  # it died between cases: its batch starts over
            return
        if loss.phase != protocol.RUNNING:
            # Killed while shrinking a finding (or waiting for its ack): the raw finding is on disk.
            record = self.records.get((batch, loss.index))
            if record is not None and not record.minimized:
                record.note = f"shrinking cut short: a candidate ended its worker ({loss.kind}: {loss.detail})"
            self._resume(loss.worker, task, loss.index)
            return
        try:
            if task.get("changed") and self.direction is not None:  # a directed draw: the task's policy picked the case
                case: Case | None = self.direction.redraw(self.info, task, loss.index)
            else:
                case = draw_indexed(self.info, task["seed"], loss.index, synthetic=task["synthetic"], scale=task["scale"])
        except Rejected:
            case = None
        record = None
        if case is not None:
            finding = observed(case, loss.kind, "worker", loss.detail)
            record = self._record(finding, case, loss.index, task["batch"], confirmed=False)
        self.report.verdicts["finding"] += 1
        self._resume(loss.worker, task, loss.index)
        if record is not None and record.path is not None:
            self._confirm(record)

    def _resume(self, worker: int, task: dict[str, Any] | None, failed_index: int | None) -> None:
        """The rest of the lost worker's batch, after `failed_index` (or all of it), on its new fork."""
        self.held[worker] = None
        if task is None:
            return
        self.batches.pop(task["batch"], None)
        end = task["start"] + task["count"]
        resume_at = (failed_index + 1) if failed_index is not None else task["start"]
        self.report.cases += resume_at - task["start"]
        if resume_at < end and not self._ending():
            self._hand(worker, {**task, "start": resume_at, "count": end - resume_at})

    # ------------------------------------------------------------------ process findings

    def _confirm(self, record: FoundRecord) -> None:
        """Run a case that killed its worker again on a fresh spare worker: a finding when it fails the
        same way each time (then shrunk there), flaky when it does not, unconfirmed when time runs out."""
        assert record.case is not None
        kind = record.finding.kind
        gave: list[str] = []
        try:
            for _ in range(RERUNS.of_kind(kind)):
                if self._ending() or self._time_left() < self.case_timeout + ANSWER_MARGIN:
                    self._set_aside(record, "; ".join([*gave, "not rerun: the campaign ended first"]), keep=True)
                    return
                got, text = self._rerun(record.case)
                gave.append(text)
                if got != kind:
                    self._set_aside(record, "; ".join(gave), keep=False)
                    return
        except stop.Stopped:
            self._set_aside(record, "; ".join([*gave, "not rerun: the campaign was stopped"]), keep=True)
            raise
        record.confirmed = True
        if self._save(record, record.case, record.finding):
            self._shrink_process_failure(record)

    def _rerun(self, case: Case) -> tuple[str | None, str]:
        """The process kind the case ended its fresh worker with (None: it did not), and what happened, as text."""
        target = self.pool.spare_target(fresh=True)
        try:
            finding = run_case(target, case, self.options.device).verdict.finding
        except Exception as error:  # noqa: BLE001 - kvfuzz could not run or judge it: not the same failure
            return None, f"rerun: kvfuzz could not run it ({type(error).__name__}: {error})"
        if finding is None:
            return None, "rerun: no finding"
        if finding.kind in PROCESS_KINDS:
            return finding.kind, f"rerun: {finding.kind} ({finding.message})"
        return None, f"rerun: {finding.signature}"

    def _set_aside(self, record: FoundRecord, rerun: str, keep: bool) -> None:
        """Take a process finding out of the findings: flaky (its file removed), or unconfirmed (kept on disk, marked so)."""
        assert record.case is not None
        self.report.findings.remove(record)
        if not keep and record.path is not None:
            self._remove(record.path)
        self.report.flaky.append(FlakyRecord(record.finding, record.case, record.index, rerun, record.path if keep else None))

    def _shrink_process_failure(self, record: FoundRecord) -> None:
        """Shrink a confirmed process finding on the spare, one candidate per (respawned) worker run, while
        a whole case timeout still fits before the deadline; the rest stays unshrunk."""
        assert record.case is not None
        budget = min(self.options.shrink_seconds, self._time_left() - self.case_timeout - ANSWER_MARGIN)
        if budget <= 0:
            record.note = "not shrunk: the campaign's time ran out"
            return
        target = self.pool.spare_target()

        def find(candidate: Case) -> Finding | None:
            if self._time_left() < self.case_timeout + ANSWER_MARGIN:
                return None  # no time for a whole candidate: the minimizer stops at its deadline
            try:
                return run_case(target, candidate, self.options.device).verdict.finding
            except Exception as error:  # noqa: BLE001 - a candidate kvfuzz cannot run or judge: reported, not kept
                message = f"shrinking: {type(error).__name__}: {error}".splitlines()[0][:400]
                self.report.errors[message] += 1
                if isinstance(error, InternalError):
                    self.report.error_tracebacks.setdefault(message, error.traceback)
                return None

        try:
            small, smallest, _ = shrink_finding(record.case, record.finding, find, self.info, max_seconds=budget)
        except stop.Stopped:
            record.note = "shrinking stopped with the campaign"
            raise
        if small != record.case:
            self._replace(record, small, smallest)


__all__ = ["Campaign", "CampaignOptions", "FlakyRecord", "FoundRecord", "Report", "normalize"]
