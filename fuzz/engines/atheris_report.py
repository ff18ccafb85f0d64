"""After an atheris run's fuzzing: its new findings gathered, minimized, and reported.

The children log their findings to `findings.jsonl` in the work folder; the coordinator keeps the
process deaths it attributed (`RunState.crash_records`). Both are shrunk in a plain
(uninstrumented) worker of `fuzz.campaign.pool.Pool` within the run's minimize time, and the report is the
default engine's (`fuzz.campaign.engine.Report`) plus coverage, startup, minimize time, instrumentation
and the process deaths.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, TextIO

from fuzz.case import Case
from fuzz.corpus import file as corpus_file
from fuzz.corpus import store as corpus
from fuzz.engines.atheris_state import RunState
from fuzz.engines.libfuzzer import libfuzzer_seed
from fuzz.verdict.findings import PROCESS_KINDS, Finding

MINIMIZE_STEPS = {"value": 600, "process": 40}  # a process candidate may cost a restart or a timeout


def gather_records(state: RunState) -> list[dict[str, Any]]:
    """This run's new findings: the children's log, then the process failures, by time found."""
    records: list[dict[str, Any]] = []
    log = state.work / "findings.jsonl"
    if log.exists():
        for line in log.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return sorted(records + state.crash_records, key=lambda r: r["seconds_until"])


def minimize_records(state: RunState, records: list[dict[str, Any]], budget: float) -> float:
    """Shrink each new finding in an uninstrumented worker process, rewriting its corpus file;
    `budget` seconds in all, after the worker started. Returns the seconds spent, startup included."""
    from fuzz.campaign.pool import Pool, RemoteTarget
    from fuzz.corpus.minimize import shrink_finding
    from fuzz.verdict.runner import run_case

    assert state.info is not None
    began = time.monotonic()
    with Pool(state.source, workers=1, case_timeout=state.options["case_timeout"], max_memory=state.options["max_memory"] << 20) as pool:
        deadline = time.monotonic() + budget  # the worker's vLLM import is not shrinking time
        target = RemoteTarget(pool)
        for record in records:
            if time.monotonic() > deadline:
                break
            finding = Finding.from_dict(record["finding"])

            def find(candidate: Case) -> Finding | None:
                return run_case(target, candidate, state.options["device"]).verdict.finding

            old = Path(record["path"])
            stored = corpus_file.read(old)
            small, smallest, _ = shrink_finding(stored.case, finding, find, state.info, max_seconds=deadline - time.monotonic(),
                                                max_steps=MINIMIZE_STEPS["process" if finding.kind in PROCESS_KINDS else "value"])
            record["finding"] = smallest.to_dict()
            meta = {k: v for k, v in stored.meta.items() if k != "reproduce"}
            path = corpus.save_finding(old.parent, small, {**meta, **record["finding"], "minimized": True})
            if path != old:
                old.unlink(missing_ok=True)
            record["path"], record["minimized"] = str(path), True
    return time.monotonic() - began


def build_report(state: RunState, records: list[dict[str, Any]], minimize_s: float) -> dict[str, Any]:
    from fuzz.campaign.engine import FoundRecord, Report

    assert state.info is not None and state.started is not None
    target = {"spec": state.source.spec, "label": state.source.label, "vllm_version": state.info.vllm_version,
              "generation": state.info.generation, "contract": state.info.contract.name, "checks_off": list(state.info.checks_off),
              "uncovered": list(state.info.uncovered)}
    found = [FoundRecord(Finding.from_dict(r["finding"]), Path(r["path"]), r["cases_until"] - 1, r["cases_until"], r["seconds_until"],
                         bool(r.get("minimized"))) for r in records]
    elapsed = (state.ended or time.monotonic()) - state.started
    report = Report(target=target, workers=1, cases=state.cases, elapsed_s=elapsed, verdicts=state.verdicts, rejections=state.rejections,
                    skips=state.skips, findings=found, duplicates=state.duplicates, restarts=state.restarts,
                    stop_reason=state.stop_reason or "max-time")
    data = report.to_dict()
    libfuzzer = {"corpus_inputs": state.coverage.corpus, "execs": state.coverage.execs, "seed": libfuzzer_seed(state.options["seed"], 0)}
    data.update(engine="atheris", coverage={"edges": state.coverage.edges, "features": state.coverage.features}, libfuzzer=libfuzzer,
                startup_s=round(state.startup_s, 3), minimize_s=round(minimize_s, 3), instrumented=state.ready.get("instrumented", {}),
                process_deaths=state.deaths)
    return data


def print_summary(report: dict[str, Any], out: TextIO) -> None:
    coverage = report["coverage"]
    print(f"kvfuzz: {report['cases']} cases in {report['elapsed_s']} s ({report['cases_per_s']} cases/s), "
          f"stopped by {report['stop_reason']}: {report['verdicts']}; coverage {coverage['edges']} edges, "
          f"{coverage['features']} features; {report['restarts']} restarts", file=out)
    for finding in report["findings"]:
        latent = " (latent: synthetic backend)" if finding["latent"] else ""
        print(f"  NEW {finding['kind']}{latent}: {finding['signature']}\n      {finding['case_file']}", file=out)
