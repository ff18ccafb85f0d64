"""`kvfuzz run --engine atheris`: the campaign's property, steered by libFuzzer's coverage feedback.

The property is the default engine's: draw a case from the space (`fuzz.space.draw_case`), run it
through target and oracle (`fuzz.verdict.runner.run_case`); a Finding is a failure. Here the draws come
from libFuzzer's bytes (`fuzz.engines.provider.ProviderSource` over `atheris.FuzzedDataProvider`),
and the vLLM modules that hold the KV-cache reshape/view logic are instrumented, so inputs
reaching new branches there are kept and mutated further.

This module is the coordinator (`run_atheris`, no vLLM import). It starts a child (`python -m
fuzz.engines.atheris_child CONFIG`, see that module) with the target's vLLM first on PYTHONPATH,
waits for it, and adds up what it counted. A child killed by anything (a signal, libFuzzer's
-timeout or -rss_limit_mb, the kernel's OOM killer, the coordinator's watchdog) leaves its
`InputSlot` behind; the coordinator redraws the case in flight from those bytes (`draw_case` is a
pure function of bytes and the target's declarations, as `draw_indexed` is of seed and index for
the default engine), records a crash-signal / hang / oom finding, moves the input out of
libFuzzer's corpus and starts a new child for the time left (`fuzz.engines.libfuzzer` reads the
exit, the log's coverage and the artifacts). New findings are minimized after fuzzing, in a
plain (uninstrumented) worker of `fuzz.campaign.pool.Pool`, unless SIGINT stopped the run (as the default engine, it
stops at once: the findings are on disk as found, and `kvfuzz minimize` shrinks one later), and the report is the
default engine's plus coverage, startup and instrumentation.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from fuzz import SOURCE_ROOT
from fuzz.corpus import store as corpus
from fuzz.engines.atheris_child import finding_meta, instrument_modules, modules_under_test
from fuzz.engines.atheris_report import build_report, gather_records, minimize_records, print_summary
from fuzz.engines.atheris_state import Attempt, RunState
from fuzz.engines.libfuzzer import (
    STATUS_LINE,
    Coverage,
    classify_exit,
    libfuzzer_flags,
    newest_artifact,
    parse_coverage,
    quarantine,
    write_seed_inputs,
)
from fuzz.engines.provider import InputSlot, ProviderSource, SlotState, case_from_bytes
from fuzz.errors import TargetError, UsageError
from fuzz.targets.base import TargetInfo
from fuzz.targets.releases import TargetSource, resolve, worker_environment
from fuzz.verdict.findings import observed

START_TIMEOUT = 300.0
PROGRESS_INTERVAL = 10.0
DEFAULT_TARGET = "fuzz.targets.loader:load_local"


# ---------------------------------------------------------------------------------- the run


def run_atheris(source: TargetSource | str, *, device: str, max_time: float, seed: int, corpus_dir: Path, synthetic: bool = True,
                case_timeout: float = 60.0, out: TextIO, max_memory: int = 4096, max_cases: int | None = None,
                minimize_time: float = 60.0, quiet: bool = False, work_dir: Path | None = None, seed_inputs: int = 64,
                extra_flags: Sequence[str] = (), target_factory: str = DEFAULT_TARGET,
                instrument: Sequence[str] | None = None, also_instrument: Sequence[str] = ()) -> dict[str, Any]:
    """Fuzz `source` with atheris for `max_time` seconds of fuzzing (the first vLLM import is not
    counted; a restart's is); returns the report dict (the default engine's fields plus
    engine, coverage, startup_s, minimize_s, instrumented) and prints a summary to `out`.

    max_memory: MiB a child may grow by after its import (libFuzzer -rss_limit_mb).
    minimize_time: seconds for shrinking this run's new findings afterwards (0: keep them raw; so does SIGINT).
    work_dir: keeps libFuzzer's input corpus (and logs) there, so a later run resumes its coverage.
    seed_inputs: random inputs (from `seed`) an empty input corpus starts from. From empty input
      libFuzzer first grows short inputs, which draw the simplest cases; random ones reach deep
      cases at once (vLLM #38831 on 0.22: case ~10 instead of ~3000-6000).
    extra_flags: more libFuzzer flags, e.g. -use_value_profile=1.
    target_factory / instrument: "module:function" building the Target, and the modules to
      instrument (None: the vLLM reshape/view modules and backends the target loaded); for tests.
    also_instrument: modules instrumented besides those (e.g. the oracle's).
    """
    from fuzz.engines import atheris_available

    if not atheris_available():
        raise UsageError("--engine atheris needs atheris: pip install 'kvfuzz[atheris]' (or pip install atheris)")
    source = resolve(source) if isinstance(source, str) else source
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="kvfuzz-atheris-"))
    (work / "inputs").mkdir(parents=True, exist_ok=True)
    write_seed_inputs(work / "inputs", seed, seed_inputs)
    corpus_dir = Path(corpus_dir).absolute()
    options = {"device": device, "max_time": max_time, "seed": seed, "corpus_dir": str(corpus_dir), "synthetic": synthetic,
               "case_timeout": case_timeout, "max_memory": max_memory, "max_cases": max_cases if max_cases is not None else 10**15,
               "extra_flags": list(extra_flags), "target_factory": target_factory,
               "instrument": None if instrument is None else list(instrument), "also_instrument": list(also_instrument), "quiet": quiet}
    state = RunState(source, work, options, out, corpus.known_signatures(corpus_dir))
    (work / "findings.jsonl").unlink(missing_ok=True)
    try:
        _fuzz(state)
        records = gather_records(state)
        shrink = records and minimize_time > 0 and state.stop_reason != "SIGINT"
        minimize_s = minimize_records(state, records, minimize_time) if shrink else 0.0
        report = build_report(state, records, minimize_s)
    finally:
        if work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print_summary(report, out)
    return report


def _fuzz(state: RunState) -> None:
    """Run children until one ends by itself (the deadline or the case budget), recording each that was killed."""
    attempt = 0
    while True:
        child = _start(state, attempt)
        returncode, watchdog = _wait(state, child)
        state.ended = time.monotonic()
        _collect(state, child)
        if returncode == 0 and not watchdog:
            state.stop_reason = state.stop_reason or "max-time"
            return
        if state.stop_reason:  # interrupted
            return
        _on_crash(state, child, returncode, watchdog)
        assert state.deadline is not None
        left = state.deadline - time.monotonic()
        if left < state.startup_s + 1.0 or state.cases >= state.options["max_cases"]:
            state.stop_reason = "max-cases" if state.cases >= state.options["max_cases"] else "max-time"
            return
        state.restarts += 1
        attempt += 1
        if not state.options["quiet"]:
            print(f"kvfuzz: atheris process {attempt} starting ({left:.0f} s left)", file=state.out, flush=True)


def _start(state: RunState, number: int) -> Attempt:
    """Write child `number`'s config, start it in a session of its own, and wait until it is ready."""
    folder = state.work / f"process-{number}"
    shutil.rmtree(folder, ignore_errors=True)  # a kept work folder holds the last run's processes
    folder.mkdir()
    options = state.options
    config = {"spec": state.source.spec, "corpus_dir": options["corpus_dir"], "device": options["device"],
              "synthetic": options["synthetic"], "max_memory_mb": options["max_memory"],
              "max_cases": options["max_cases"] - state.cases, "cases_offset": state.cases, "started": state.started,
              "deadline": state.deadline, "budget": options["max_time"], "target_factory": options["target_factory"],
              "instrument": options["instrument"], "also_instrument": options["also_instrument"],
              "inputs": str(state.work / "inputs"), "slot": str(folder / "slot"),
              "stats": str(folder / "stats.json"), "ready": str(folder / "ready.json"),
              "findings_log": str(state.work / "findings.jsonl"),
              "libfuzzer": libfuzzer_flags(options["seed"], number, options["case_timeout"], folder, options["extra_flags"])}
    corpus.write_atomic(folder / "config.json", config)
    env = worker_environment(state.source)
    root = str(SOURCE_ROOT)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), root]))
    log = folder / "log.txt"
    with open(log, "wb") as handle:
        process = subprocess.Popen([sys.executable, "-m", "fuzz.engines.atheris_child", str(folder / "config.json")],
                                   env=env, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    child = Attempt(number, folder, process, log, folder / "slot", folder / "stats.json", folder / "ready.json")
    try:
        _await_ready(state, child)
    except BaseException:
        _kill(process)
        raise
    return child


def _await_ready(state: RunState, child: Attempt) -> None:
    """Wait for the child's ready.json; the first child's fixes the run's target, start and deadline."""
    began = time.monotonic()  # just after the spawn: startup counts the interpreter, imports and instrumentation
    while not child.ready.exists():
        if child.process.poll() is not None:
            raise TargetError(f"--vllm {state.source.spec}: the atheris process did not start: {_last_error(child.log)}")
        if time.monotonic() - began > START_TIMEOUT:
            _kill(child.process)
            raise TargetError(f"--vllm {state.source.spec}: the atheris process did not start within {START_TIMEOUT:.0f} s")
        time.sleep(0.1)
    ready = json.loads(child.ready.read_text())
    if state.info is None:
        state.info = TargetInfo.from_dict(ready["info"])
        state.ready, state.started, state.deadline = ready, ready["started"], ready["deadline"]
        state.startup_s = time.monotonic() - began
        _print_header(state)


def _wait(state: RunState, child: Attempt) -> tuple[int, bool]:
    """The child's exit status, and whether the watchdog had to kill it."""
    assert state.deadline is not None
    # libFuzzer ends a hung case after about 1.5 x -timeout; past that the child is stuck for good.
    limit = state.deadline + 1.5 * state.options["case_timeout"] + 30.0
    last_progress = time.monotonic()
    try:
        while True:
            returncode = child.process.poll()
            if returncode is not None:
                return returncode, False
            if time.monotonic() > limit:
                _kill(child.process)
                return child.process.wait(), True
            if not state.options["quiet"] and time.monotonic() - last_progress >= PROGRESS_INTERVAL:
                last_progress = time.monotonic()
                _print_progress(state, child)
            time.sleep(0.1)
    except KeyboardInterrupt:
        state.stop_reason = "SIGINT"
        _kill(child.process)
        return child.process.wait(), False


def _kill(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _collect(state: RunState, child: Attempt) -> None:
    """Add what this child counted: verdicts from its slot, reasons from its last stats file, coverage."""
    if child.slot.exists():
        slot = _read_slot(child.slot)
        state.verdicts.update({k: v for k, v in slot.counts.items() if v})
        state.cases += sum(slot.counts.values())
    if child.stats.exists():
        stats = json.loads(child.stats.read_text())
        state.rejections.update(stats["rejections"])
        state.skips.update(stats["skips"])
        state.stop_reason = state.stop_reason or (stats["stop_reason"] or "")
    coverage = parse_coverage(child.log.read_text(errors="replace"))
    state.coverage = Coverage(max(state.coverage.edges, coverage.edges), max(state.coverage.features, coverage.features),
                              max(state.coverage.corpus, coverage.corpus), state.coverage.execs + coverage.execs)


def _read_slot(path: Path) -> SlotState:
    """A child's slot as it left it."""
    slot = InputSlot(path)
    try:
        return slot.read()
    finally:
        slot.close()


def _on_crash(state: RunState, child: Attempt, returncode: int, watchdog: bool) -> None:
    """Record what killed the child: the case in its slot, else the one in libFuzzer's newest artifact."""
    log = child.log.read_text(errors="replace")
    kind, detail = classify_exit(returncode, log, state.options["case_timeout"], watchdog)
    slot = _read_slot(child.slot) if child.slot.exists() else None
    data = slot.data if slot is not None and slot.busy else newest_artifact(child.folder)
    if not state.options["quiet"]:
        print(f"kvfuzz: atheris process {child.number} died: {kind} ({detail})", file=state.out, flush=True)
    tail = [line.strip() for line in log.splitlines() if line.strip() and not STATUS_LINE.match(line)][-4:]
    state.deaths.append({"process": child.number, "returncode": returncode, "kind": kind, "detail": detail,
                         "case_in_flight": data is not None, "log_tail": tail})
    if data is None or state.info is None:
        return
    quarantine(state.work / "inputs", data, state.work / "quarantine")
    state.cases += 1
    state.verdicts["finding"] += 1
    case = case_from_bytes(data, state.info, state.options["synthetic"])
    if case is None:
        return
    finding = observed(case, kind, "worker", detail)
    if finding.signature in state.known:
        state.duplicates += 1
        return
    state.known.add(finding.signature)
    assert state.started is not None
    path = corpus.save_finding(Path(state.options["corpus_dir"]), case, finding_meta(finding, state.info, state.source.spec, data))
    state.crash_records.append({"finding": finding.to_dict(), "path": str(path), "cases_until": state.cases,
                                "seconds_until": time.monotonic() - state.started})


# ---------------------------------------------------------------------------------- output


def _print_header(state: RunState) -> None:
    info = state.info
    assert info is not None
    count = sum(state.ready.get("instrumented", {}).values())
    print(f"kvfuzz: {state.source.label}: vLLM {info.vllm_version} ({info.generation}, contract {info.contract.name}), "
          f"atheris on {state.options['device']}, seed {state.options['seed']}, {count} functions instrumented in "
          f"{len(state.ready.get('instrumented', {}))} modules (startup {state.startup_s:.1f} s)", file=state.out, flush=True)
    for line in info.checks_off:
        print(f"kvfuzz: check off: {line}", file=state.out, flush=True)


def _print_progress(state: RunState, child: Attempt) -> None:
    assert state.started is not None and state.deadline is not None
    slot = _read_slot(child.slot) if child.slot.exists() else None
    cases = state.cases + (sum(slot.counts.values()) if slot else 0)
    coverage = parse_coverage(child.log.read_text(errors="replace"))
    elapsed = time.monotonic() - state.started
    print(f"kvfuzz: {cases} cases, {cases / max(elapsed, 1e-9):.0f}/s, cov {coverage.edges} ft {coverage.features}, "
          f"{elapsed:.0f} s elapsed, {max(0.0, state.deadline - time.monotonic()):.0f} s left, {state.restarts} restarts",
          file=state.out, flush=True)


def _last_error(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line]
    return (errors or lines or ["exited"])[-1].strip()[:300]


# InputSlot, ProviderSource, case_from_bytes, classify_exit, instrument_modules, libfuzzer_flags, modules_under_test and
# parse_coverage live in provider.py, atheris_child.py and libfuzzer.py; they stay importable from here as before.
__all__ = ["InputSlot", "ProviderSource", "case_from_bytes", "classify_exit", "instrument_modules", "libfuzzer_flags",
           "modules_under_test", "parse_coverage", "run_atheris"]
