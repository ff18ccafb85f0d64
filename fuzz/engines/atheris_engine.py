"""`kvfuzz run --engine atheris`: the campaign's property, steered by libFuzzer's coverage feedback.

The property is the default engine's: draw a case from the space (`fuzz.space.draw_case`), run it
through target and oracle (`fuzz.runner.run_case`); a Finding is a failure. Here the draws come
from libFuzzer's bytes (`ProviderSource` over `atheris.FuzzedDataProvider`), and the vLLM modules
that hold the KV-cache reshape/view logic are instrumented, so inputs reaching new branches there
are kept and mutated further.

Processes. The coordinator (`run_atheris`, no vLLM import) starts a child (`python -m
fuzz.engines.atheris_engine CONFIG`) with the target's vLLM first on PYTHONPATH. The child loads
the target, instruments the modules under test, writes `ready.json` and calls atheris.Fuzz(),
which never returns. TestOneInput never raises for a finding: a new finding (signature not yet in
the corpus) is written to the corpus atomically before it returns, and verdicts are counted.
The child ends itself at the deadline (`-max_total_time` is the backstop).

Crash attribution. Before each case the child copies libFuzzer's input bytes into a small
memory-mapped slot file (a few microseconds, versus tens for the case as JSON), and counts each
verdict there after it. A process killed by anything (a signal, libFuzzer's -timeout or
-rss_limit_mb, the kernel's OOM killer, the coordinator's watchdog) leaves the slot behind; the
coordinator redraws the case from those bytes (`draw_case` is a pure function of bytes and the
target's declarations, as `draw_indexed` is of seed and index for the default engine), records a
crash-signal / hang / oom finding, and starts a new child for the time left. libFuzzer's own
artifact (`-artifact_prefix`) is the fallback when the slot holds no case in flight.

Inputs: libFuzzer's corpus starts from 64 random inputs (deterministic in --seed), and an input
that killed a process is moved out of it before the restart.

Coverage: libFuzzer's status lines (`#N NEW cov: C ft: F corp: ...`) are parsed from the child's
log; cov only grows when libFuzzer prints a line, so the last one is the run's coverage. The
libFuzzer input corpus lives in the work folder and survives restarts. New findings are minimized
after fuzzing, in a plain (uninstrumented) worker of `fuzz.pool.Pool`.
"""

from __future__ import annotations

import base64
import contextlib
import faulthandler
import importlib
import inspect
import json
import math
import mmap
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TextIO, TypeVar

from fuzz import corpus
from fuzz.case import Case, load
from fuzz.errors import TargetError, UsageError
from fuzz.findings import Finding
from fuzz.releases import TargetSource, resolve, worker_environment
from fuzz.space import Rejected, draw_case
from fuzz.targets.base import TargetInfo

T = TypeVar("T")

# Modules that hold vLLM's KV-cache reshape/view logic; those the loaded target imported are
# instrumented, with the modules of the attention backends it uses.
VLLM_MODULES = (
    "vllm.v1.kv_cache_interface",
    "vllm.v1.worker.utils",
    "vllm.v1.worker.gpu.attn_utils",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.kv_cache_layout",
    "vllm.v1.attention.backend",
    "vllm.v1.attention.backends.utils",
)
STATUSES = ("pass", "finding", "rejected", "skipped", "unbuildable")
PROCESS_KINDS = ("crash-signal", "hang", "oom")
MAX_INPUT = 512  # bytes; a case consumes well under 200
SEED_INPUT_BYTES = 160
START_TIMEOUT = 300.0
STATS_INTERVAL = 1.0
PROGRESS_INTERVAL = 10.0
MINIMIZE_STEPS = {"value": 600, "process": 40}  # a process candidate may cost a restart or a timeout
DEFAULT_TARGET = "fuzz.targets:load_local"
_STATUS_LINE = re.compile(r"^#(\d+)\s+(\w+)\s+cov: (\d+) ft: (\d+)(?: corp: (\d+)/)?")
# faulthandler's names for the fatal signals it reports.
_FATAL = {"Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
          "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL"}


# ---------------------------------------------------------------------------------- the source


class ProviderSource:
    """The space's Source protocol over an atheris.FuzzedDataProvider.

    Every choice is ConsumeIntInRange (libFuzzer takes integers from the end of its input). An
    exhausted provider answers the lower bound: the first option, False for chance(), so short
    inputs draw the simplest cases, as Hypothesis' shrinker would.
    """

    def __init__(self, provider: Any) -> None:
        self.provider = provider

    @classmethod
    def from_bytes(cls, data: bytes) -> ProviderSource:
        import atheris

        return cls(atheris.FuzzedDataProvider(data))

    def integer(self, low: int, high: int) -> int:
        return int(self.provider.ConsumeIntInRange(low, high))

    def choice(self, options: Sequence[T]) -> T:
        return options[self.provider.ConsumeIntInRange(0, len(options) - 1)]

    def chance(self, percent: int) -> bool:
        return bool(self.provider.ConsumeIntInRange(0, 99) >= 100 - percent)

    def reject(self) -> NoReturn:
        raise Rejected


def case_from_bytes(data: bytes, info: TargetInfo, synthetic: bool = True) -> Case | None:
    """The case these fuzzer bytes draw, or None when they make no valid case."""
    try:
        return draw_case(ProviderSource.from_bytes(data), info, synthetic=synthetic)
    except Rejected:
        return None


# ---------------------------------------------------------------------------------- the slot


@dataclass(frozen=True)
class SlotState:
    busy: bool  # a case was running when the slot was read
    data: bytes  # the input of the last case begun
    counts: dict[str, int]


class InputSlot:
    """The case in flight and the verdict counts, in a memory-mapped file that outlives the process.

    Layout: busy flag, input length, one counter per status, then the input bytes.
    """

    HEAD = struct.Struct("<qq" + "q" * len(STATUSES))
    CAPACITY = 4096  # above libFuzzer's -max_len: a corpus file from elsewhere may be longer
    SIZE = HEAD.size + CAPACITY

    def __init__(self, path: Path) -> None:
        if not path.exists() or path.stat().st_size < self.SIZE:
            path.write_bytes(b"\0" * self.SIZE)
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, self.SIZE)
        self._counts = dict(self.read().counts)

    def begin(self, data: bytes) -> None:
        data = data[:self.CAPACITY]
        self._map[self.HEAD.size:self.HEAD.size + len(data)] = data
        struct.pack_into("<qq", self._map, 0, 1, len(data))

    def end(self, status: str) -> None:
        self._counts[status] += 1
        struct.pack_into("<q", self._map, 16 + 8 * STATUSES.index(status), self._counts[status])
        struct.pack_into("<q", self._map, 0, 0)

    def read(self) -> SlotState:
        busy, length, *counts = self.HEAD.unpack_from(self._map, 0)
        data = bytes(self._map[self.HEAD.size:self.HEAD.size + min(max(length, 0), self.CAPACITY)])
        return SlotState(bool(busy), data, dict(zip(STATUSES, counts, strict=True)))

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)


# ---------------------------------------------------------------------------------- instrumentation


def modules_under_test(target: Any) -> list[str]:
    """The reshape/view modules the loaded target imported, and its backends' modules (with their
    vLLM base classes'), in a stable order."""
    names = [name for name in VLLM_MODULES if name in sys.modules]
    for cls in getattr(target, "backend_classes", {}).values():
        names += [klass.__module__ for klass in cls.__mro__ if klass.__module__.startswith("vllm.")]
    return list(dict.fromkeys(names))


def instrument_modules(names: Sequence[str]) -> dict[str, int]:
    """Add atheris' coverage and comparison tracing to every function defined in these modules
    (methods, static and class methods, properties and wrapped functions included); returns the
    number of functions instrumented per module.

    instrument_imports() cannot select modules below a top-level package (its include list keeps
    only "vllm"), which would instrument all of vLLM; patching the selected modules' code objects
    right after the import, before Fuzz(), gives the same counters to just the code under test.
    """
    import atheris

    counts: dict[str, int] = {}
    for name in names:
        module = importlib.import_module(name)
        functions = {id(f): f for f in _functions_of(module)}
        for function in functions.values():
            atheris.instrument_func(function)
        counts[name] = len(functions)
    return counts


def _functions_of(module: types.ModuleType) -> Iterator[types.FunctionType]:
    seen: set[int] = set()
    for value in list(vars(module).values()):
        yield from _functions_in(value, module.__name__, seen)


def _functions_in(value: Any, module: str, seen: set[int]) -> Iterator[types.FunctionType]:
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        for accessor in (value.fget, value.fset, value.fdel):
            yield from _functions_in(accessor, module, seen)
        return
    value = getattr(value, "func", value)  # functools.cached_property
    try:
        value = inspect.unwrap(value)  # functools.wraps / lru_cache
    except ValueError:
        return
    if isinstance(value, types.FunctionType) and value.__module__ == module:
        yield value
    elif isinstance(value, type) and value.__module__ == module:
        for member in list(vars(value).values()):
            yield from _functions_in(member, module, seen)


# ---------------------------------------------------------------------------------- the child


@dataclass
class Harness:
    """TestOneInput and what it keeps: runs in the atheris child."""

    target: Any
    config: dict[str, Any]
    slot: InputSlot
    started: float
    deadline: float
    known: set[str]
    cases: int = 0
    tallies: dict[str, Counter[str]] = field(default_factory=lambda: {"rejections": Counter(), "skips": Counter()})
    last_stats: float = 0.0
    first: bool = True

    def __post_init__(self) -> None:
        from fuzz.findings import normalize
        from fuzz.runner import run_case

        self.run_case, self.normalize = run_case, normalize

    def test_one_input(self, data: bytes) -> None:
        if self.first:
            # Chained in front of libFuzzer's handlers: names the signal, prints the Python stack,
            # then hands over, and libFuzzer writes its crash artifact.
            faulthandler.enable()
            self.first = False
        self._maybe_stop()
        self.cases += 1
        self.slot.begin(data)
        case = case_from_bytes(data, self.target.info, self.config["synthetic"])
        if case is None:
            self.slot.end("unbuildable")
            return
        verdict = self.run_case(self.target, case, self.config["device"]).verdict
        if verdict.status == "rejected":
            self.tallies["rejections"][self.normalize(verdict.reason or "")[:160]] += 1
        elif verdict.status == "skipped":
            self.tallies["skips"][verdict.reason or ""] += 1
        if verdict.finding is not None and verdict.finding.signature not in self.known:
            self.known.add(verdict.finding.signature)
            self._record(verdict.finding, case, data)
        self.slot.end(verdict.status)

    def _record(self, finding: Finding, case: Case, data: bytes) -> None:
        info = self.target.info
        meta = finding_meta(finding, info, self.config["spec"], data)
        path = corpus.save_finding(Path(self.config["corpus_dir"]), case, meta)
        line = {"finding": finding.to_dict(), "path": str(path), "cases_until": self.config["cases_offset"] + self.cases,
                "seconds_until": time.monotonic() - self.started}
        with open(self.config["findings_log"], "a") as log:
            log.write(json.dumps(line) + "\n")

    def _maybe_stop(self) -> None:
        now = time.monotonic()
        if now >= self.deadline:
            self.finish("max-time")
        if self.cases >= self.config["max_cases"]:
            self.finish("max-cases")
        if now - self.last_stats >= STATS_INTERVAL:
            self.write_stats(None)
            self.last_stats = now

    def write_stats(self, stop_reason: str | None) -> None:
        data = {"rejections": dict(self.tallies["rejections"]), "skips": dict(self.tallies["skips"]), "stop_reason": stop_reason}
        corpus.write_atomic(Path(self.config["stats"]), data)

    def finish(self, reason: str) -> NoReturn:
        self.write_stats(reason)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def finding_meta(finding: Finding, info: TargetInfo, spec: str, data: bytes | None) -> dict[str, Any]:
    """A corpus file's metadata, as the default engine writes it, plus the engine and its input."""
    meta = {**finding.to_dict(), "vllm_version": info.vllm_version, "generation": info.generation, "contract": info.contract.name,
            "minimized": False, "target": spec, "engine": "atheris"}
    if data is not None:
        meta["fuzzer_input"] = base64.b64encode(data).decode()
    return meta


def _load_target(factory: str) -> Any:
    module, _, name = factory.partition(":")
    return getattr(importlib.import_module(module), name)()


def _resident_mb() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    except (OSError, IndexError, ValueError):
        return 0


def child_main(config_path: str) -> None:
    began = time.monotonic()
    config = json.loads(Path(config_path).read_text())
    import atheris

    import fuzz.runner  # noqa: F401 - torch and the oracle load before the deadline is set

    target = _load_target(config["target_factory"])
    names = config["instrument"] if config["instrument"] is not None else modules_under_test(target)
    instrumented = instrument_modules([*names, *config["also_instrument"]])
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    corpus_dir = Path(config["corpus_dir"])
    known = corpus.known_signatures(corpus_dir)
    now = time.monotonic()
    started = config["started"] if config["started"] is not None else now
    deadline = config["deadline"] if config["deadline"] is not None else now + config["budget"]
    rss = _resident_mb()
    ready = {"info": target.info.to_dict(), "pid": os.getpid(), "started": started, "deadline": deadline,
             "instrumented": instrumented, "startup_s": now - began, "rss_mb": rss}
    corpus.write_atomic(Path(config["ready"]), ready)
    harness = Harness(target, config, InputSlot(Path(config["slot"])), started, deadline, known)
    if deadline - now < 0.5:
        harness.finish("max-time")
    argv = [sys.argv[0], *config["libfuzzer"], f"-max_total_time={math.ceil(deadline - now) + 1}",
            f"-rss_limit_mb={rss + config['max_memory_mb']}", config["inputs"]]
    atheris.Setup(argv, harness.test_one_input)
    atheris.Fuzz()


# ---------------------------------------------------------------------------------- the coordinator


def write_seed_inputs(folder: Path, seed: int, count: int) -> None:
    """Start an empty libFuzzer corpus from `count` random inputs of random lengths."""
    if count <= 0 or any(folder.iterdir()):
        return
    rng = random.Random(seed)
    for number in range(count):
        (folder / f"seed-{number:04d}").write_bytes(rng.randbytes(rng.randint(8, SEED_INPUT_BYTES)))


def libfuzzer_seed(seed: int, attempt: int) -> int:
    """libFuzzer's -seed for a campaign seed and process number (libFuzzer reads 0 as 'pick one')."""
    return (seed * 1_000_003 + attempt) % 2_147_483_646 + 1


def libfuzzer_flags(seed: int, attempt: int, case_timeout: float, artifacts: Path, extra: Sequence[str] = ()) -> list[str]:
    """The flags the coordinator sets; the child adds -max_total_time and -rss_limit_mb."""
    return [f"-seed={libfuzzer_seed(seed, attempt)}", f"-timeout={max(1, math.ceil(case_timeout))}", f"-max_len={MAX_INPUT}",
            f"-artifact_prefix={artifacts}{os.sep}", *extra]


@dataclass
class Coverage:
    edges: int = 0
    features: int = 0
    corpus: int = 0
    execs: int = 0


def parse_coverage(text: str) -> Coverage:
    """The last coverage figures libFuzzer printed in this log."""
    found = Coverage()
    for line in text.splitlines():
        match = _STATUS_LINE.match(line)
        if match:
            found = Coverage(int(match[3]), int(match[4]), int(match[5] or found.corpus), int(match[1]))
    return found


def classify_exit(returncode: int, log: str, case_timeout: float, watchdog: bool = False) -> tuple[str, str]:
    """(finding kind, message) for a child that did not end by itself; messages match the default
    engine's (fuzz.pool) so one bug has one signature whichever engine found it."""
    if watchdog or "ERROR: libFuzzer: timeout" in log:
        return "hang", f"no answer within {case_timeout:g} s"
    if "ERROR: libFuzzer: out-of-memory" in log:
        return "oom", "resident memory passed the worker's cap"
    if "=== Uncaught Python exception: ===" in log:
        lines = log.split("=== Uncaught Python exception: ===", 1)[1].strip().splitlines()
        return "crash-signal", f"uncaught {(lines or ['exception'])[0].split(':')[0].strip()} in the harness"
    for words, name in _FATAL.items():
        if f"Fatal Python error: {words}" in log:
            return "crash-signal", f"killed by {name}"
    if returncode < 0:
        number = -returncode
        if number == signal.SIGKILL:
            return "oom", "killed by SIGKILL (the kernel's out-of-memory killer?)"
        return "crash-signal", f"killed by {signal.Signals(number).name}"
    if "ERROR: libFuzzer: deadly signal" in log:
        return "crash-signal", "killed by a deadly signal"
    return "crash-signal", f"exited with status {returncode}"


def _spec_kinds(case: Case) -> str:
    return "+".join(sorted({g.spec.kind for g in case.groups}))


@dataclass
class Attempt:
    """One atheris child process."""

    number: int
    folder: Path
    process: subprocess.Popen[bytes]
    log: Path
    slot: Path
    stats: Path
    ready: Path


@dataclass
class RunState:
    source: TargetSource
    work: Path
    options: dict[str, Any]
    out: TextIO
    known: set[str]
    info: TargetInfo | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    started: float | None = None
    deadline: float | None = None
    cases: int = 0
    verdicts: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    skips: Counter[str] = field(default_factory=Counter)
    crash_records: list[dict[str, Any]] = field(default_factory=list)
    deaths: list[dict[str, Any]] = field(default_factory=list)  # every child that did not end by itself
    coverage: Coverage = field(default_factory=Coverage)
    restarts: int = 0
    duplicates: int = 0
    stop_reason: str = ""
    startup_s: float = 0.0
    ended: float | None = None


def run_atheris(source: TargetSource | str, *, device: str, max_time: float, seed: int, corpus_dir: Path, synthetic: bool = True,
                case_timeout: float = 60.0, out: TextIO, max_memory: int = 4096, max_cases: int | None = None,
                minimize_time: float = 60.0, quiet: bool = False, work_dir: Path | None = None, seed_inputs: int = 64,
                extra_flags: Sequence[str] = (), target_factory: str = DEFAULT_TARGET,
                instrument: Sequence[str] | None = None, also_instrument: Sequence[str] = ()) -> dict[str, Any]:
    """Fuzz `source` with atheris for `max_time` seconds of fuzzing (the first vLLM import is not
    counted; a restart's is); returns the report dict (the default engine's fields plus
    engine, coverage, startup_s, minimize_s, instrumented) and prints a summary to `out`.

    max_memory: MiB a child may grow by after its import (libFuzzer -rss_limit_mb).
    minimize_time: seconds for shrinking this run's new findings afterwards (0: keep them raw).
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
        records = _records(state)
        minimize_s = _minimize_records(state, records, minimize_time) if records and minimize_time > 0 else 0.0
        report = _report(state, records, minimize_s)
    finally:
        if work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    _print_summary(report, out)
    return report


def _fuzz(state: RunState) -> None:
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
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), root]))
    log = folder / "log.txt"
    with open(log, "wb") as handle:
        process = subprocess.Popen([sys.executable, "-m", "fuzz.engines.atheris_engine", str(folder / "config.json")],
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
    data = slot.data if slot is not None and slot.busy else _newest_artifact(child.folder)
    if not state.options["quiet"]:
        print(f"kvfuzz: atheris process {child.number} died: {kind} ({detail})", file=state.out, flush=True)
    tail = [line.strip() for line in log.splitlines() if line.strip() and not _STATUS_LINE.match(line)][-4:]
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
    finding = Finding(kind, _spec_kinds(case), "worker", detail, None, case.is_latent)
    if finding.signature in state.known:
        state.duplicates += 1
        return
    state.known.add(finding.signature)
    assert state.started is not None
    path = corpus.save_finding(Path(state.options["corpus_dir"]), case, finding_meta(finding, state.info, state.source.spec, data))
    state.crash_records.append({"finding": finding.to_dict(), "path": str(path), "cases_until": state.cases,
                                "seconds_until": time.monotonic() - state.started})


def quarantine(inputs: Path, data: bytes, folder: Path) -> list[Path]:
    """Move inputs holding these bytes out of libFuzzer's corpus: a seed (or an input that crashes
    only sometimes) would otherwise kill every restarted process while it loads the corpus."""
    moved = []
    for path in inputs.iterdir():
        if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
            folder.mkdir(exist_ok=True)
            moved.append(Path(shutil.move(path, folder / path.name)))
    return moved


def _newest_artifact(folder: Path) -> bytes | None:
    files = [p for p in folder.iterdir() if p.name.split("-")[0] in ("crash", "timeout", "oom")]
    return max(files, key=lambda p: p.stat().st_mtime).read_bytes() if files else None


def _records(state: RunState) -> list[dict[str, Any]]:
    """This run's new findings: the children's log, then the process failures, by time found."""
    records: list[dict[str, Any]] = []
    log = state.work / "findings.jsonl"
    if log.exists():
        for line in log.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return sorted(records + state.crash_records, key=lambda r: r["seconds_until"])


def _minimize_records(state: RunState, records: list[dict[str, Any]], budget: float) -> float:
    """Shrink each new finding in an uninstrumented worker process, rewriting its corpus file;
    `budget` seconds in all, after the worker started. Returns the seconds spent, startup included."""
    from fuzz.minimize import minimize
    from fuzz.pool import Pool, RemoteTarget
    from fuzz.runner import run_case

    assert state.info is not None
    began = time.monotonic()
    with Pool(state.source, workers=1, case_timeout=state.options["case_timeout"], max_memory=state.options["max_memory"] << 20) as pool:
        deadline = time.monotonic() + budget  # the worker's vLLM import is not shrinking time
        target = RemoteTarget(pool)
        for record in records:
            if time.monotonic() > deadline:
                break
            finding = Finding.from_dict(record["finding"])
            process = finding.kind in PROCESS_KINDS

            def still_fails(candidate: Case) -> bool:
                if time.monotonic() > deadline:
                    return False
                found = run_case(target, candidate, state.options["device"]).verdict.finding
                return found is not None and (found.kind == finding.kind if process else found.signature == finding.signature)

            old = Path(record["path"])
            small, _ = minimize(load(old), still_fails, state.info, max_steps=MINIMIZE_STEPS["process" if process else "value"])
            meta = {k: v for k, v in json.loads(old.read_text()).items() if k not in ("case", "reproduce")}
            path = corpus.save_finding(old.parent, small, {**meta, "minimized": True})
            if path != old:
                old.unlink(missing_ok=True)
            record["path"], record["minimized"] = str(path), True
    return time.monotonic() - began


def _report(state: RunState, records: list[dict[str, Any]], minimize_s: float) -> dict[str, Any]:
    from fuzz.campaign import FoundRecord, Report

    assert state.info is not None and state.started is not None
    target = {"spec": state.source.spec, "label": state.source.label, "vllm_version": state.info.vllm_version,
              "generation": state.info.generation, "contract": state.info.contract.name}
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


# ---------------------------------------------------------------------------------- output


def _print_header(state: RunState) -> None:
    info = state.info
    assert info is not None
    count = sum(state.ready.get("instrumented", {}).values())
    print(f"kvfuzz: {state.source.label}: vLLM {info.vllm_version} ({info.generation}, contract {info.contract.name}), "
          f"atheris on {state.options['device']}, seed {state.options['seed']}, {count} functions instrumented in "
          f"{len(state.ready.get('instrumented', {}))} modules (startup {state.startup_s:.1f} s)", file=state.out, flush=True)


def _print_progress(state: RunState, child: Attempt) -> None:
    assert state.started is not None and state.deadline is not None
    slot = _read_slot(child.slot) if child.slot.exists() else None
    cases = state.cases + (sum(slot.counts.values()) if slot else 0)
    coverage = parse_coverage(child.log.read_text(errors="replace"))
    elapsed = time.monotonic() - state.started
    print(f"kvfuzz: {cases} cases, {cases / max(elapsed, 1e-9):.0f}/s, cov {coverage.edges} ft {coverage.features}, "
          f"{elapsed:.0f} s elapsed, {max(0.0, state.deadline - time.monotonic()):.0f} s left, {state.restarts} restarts",
          file=state.out, flush=True)


def _print_summary(report: dict[str, Any], out: TextIO) -> None:
    coverage = report["coverage"]
    print(f"kvfuzz: {report['cases']} cases in {report['elapsed_s']} s ({report['cases_per_s']} cases/s), "
          f"stopped by {report['stop_reason']}: {report['verdicts']}; coverage {coverage['edges']} edges, "
          f"{coverage['features']} features; {report['restarts']} restarts", file=out)
    for finding in report["findings"]:
        latent = " (latent: synthetic backend)" if finding["latent"] else ""
        print(f"  NEW {finding['kind']}{latent}: {finding['signature']}\n      {finding['case_file']}", file=out)


def _last_error(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line]
    return (errors or lines or ["exited"])[-1].strip()[:300]


__all__ = ["InputSlot", "ProviderSource", "case_from_bytes", "classify_exit", "instrument_modules", "libfuzzer_flags",
           "modules_under_test", "parse_coverage", "run_atheris"]


if __name__ == "__main__":
    child_main(sys.argv[1])
