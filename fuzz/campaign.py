"""A fuzz campaign: draw cases with Hypothesis, judge each, minimize and save new findings."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, seed, settings

from fuzz import corpus
from fuzz.case import Case
from fuzz.findings import Finding
from fuzz.minimize import minimize
from fuzz.runner import run_case
from fuzz.strategies import cases
from fuzz.targets.base import Target

CHUNK = 200


@dataclass
class FoundRecord:
    finding: Finding
    path: Path
    cases_until: int
    seconds_until: float


@dataclass
class Report:
    target: dict[str, Any]
    cases: int = 0
    elapsed_s: float = 0.0
    verdicts: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    skips: Counter[str] = field(default_factory=Counter)
    findings: list[FoundRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "cases": self.cases,
            "elapsed_s": round(self.elapsed_s, 3),
            "cases_per_s": round(self.cases / self.elapsed_s, 1) if self.elapsed_s else 0.0,
            "verdicts": dict(self.verdicts),
            "rejections": dict(self.rejections.most_common()),
            "skipped": dict(self.skips),
            "findings": [
                {**r.finding.to_dict(), "case_file": str(r.path), "cases_until_found": r.cases_until,
                 "seconds_until_found": round(r.seconds_until, 3)}
                for r in self.findings
            ],
        }


def run_campaign(target: Target, *, device: str, max_time: float, max_cases: int, seed_value: int,
                 corpus_dir: Path, synthetic: bool = True, progress: Any = None) -> Report:
    info = target.info
    report = Report(target={"vllm_version": info.vllm_version, "generation": info.generation, "contract": info.contract.name})
    known = corpus.known_signatures(corpus_dir)
    start = time.monotonic()
    strategy = cases(info, synthetic=synthetic)

    def out_of_budget() -> bool:
        return report.cases >= max_cases or time.monotonic() - start >= max_time

    def body(case: Case) -> None:
        if out_of_budget():
            return
        result = run_case(target, case, device)
        report.cases += 1
        report.verdicts[result.verdict.status] += 1
        if result.verdict.status == "rejected":
            report.rejections[_reason_key(result.verdict.reason or "")] += 1
        elif result.verdict.status == "skipped":
            report.skips[result.verdict.reason or ""] += 1
        finding = result.verdict.finding
        if finding is not None and finding.signature not in known:
            known.add(finding.signature)
            _record(target, case, finding, device, corpus_dir, report, time.monotonic() - start)
        if progress is not None:
            progress(report)

    chunk = 0
    while not out_of_budget():
        test = settings(max_examples=CHUNK, database=None, deadline=None, derandomize=False,
                        suppress_health_check=list(HealthCheck))(given(strategy)(body))
        seed(seed_value * 1_000_003 + chunk)(test)()
        chunk += 1
    report.elapsed_s = time.monotonic() - start
    return report


def _record(target: Target, case: Case, finding: Finding, device: str, corpus_dir: Path,
            report: Report, elapsed: float) -> None:
    meta = _meta(target, finding, minimized=False)
    raw_path = corpus.save_finding(corpus_dir, case, meta)  # on disk before anything else runs

    def same_bug(candidate: Case) -> bool:
        verdict = run_case(target, candidate, device).verdict
        return verdict.finding is not None and verdict.finding.signature == finding.signature

    small = minimize(case, same_bug, target.info)
    path = corpus.save_finding(corpus_dir, small, _meta(target, finding, minimized=True))
    if path != raw_path:
        raw_path.unlink(missing_ok=True)
    report.findings.append(FoundRecord(finding, path, report.cases, elapsed))


def _meta(target: Target, finding: Finding, minimized: bool) -> dict[str, Any]:
    return {
        **finding.to_dict(),
        "vllm_version": target.info.vllm_version,
        "generation": target.info.generation,
        "minimized": minimized,
    }


def _reason_key(reason: str) -> str:
    from fuzz.findings import normalize

    return normalize(reason)[:160]
