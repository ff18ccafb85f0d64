"""What runs inside the atheris child process: instrumentation, TestOneInput, and the slot it fills.

The coordinator (`fuzz.engines.atheris_engine`) starts `python -m fuzz.engines.atheris_child
CONFIG` with the target's vLLM first on PYTHONPATH. `child_main` loads the target, instruments
the modules under test (those of VLLM_MODULES the target imported, and its backends' modules),
writes `ready.json` and calls atheris.Fuzz(), which never returns.

TestOneInput (`Harness.test_one_input`) never raises for a finding: it copies libFuzzer's input
into the `InputSlot` before each case and counts the verdict there after it, and a new finding
(signature not yet in the corpus) is written to the corpus atomically, and to the findings log,
before it returns. The child ends itself at the deadline or after its share of cases
(`-max_total_time` is the backstop), leaving its rejection and skip reasons in its stats file.
"""

from __future__ import annotations

import base64
import faulthandler
import importlib
import inspect
import json
import math
import os
import sys
import time
import types
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from fuzz.case import Case
from fuzz.corpus import store as corpus
from fuzz.engines.provider import InputSlot, case_from_bytes
from fuzz.targets.base import TargetInfo
from fuzz.verdict.findings import Finding

# Modules that hold vLLM's KV-cache reshape/view logic; those the loaded target imported are
# instrumented, with the modules of the attention backends it uses.
VLLM_MODULES = (
    "vllm.v1.kv_cache_interface",
    "vllm.v1.worker.utils",
    "vllm.v1.worker.gpu.attn_utils",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.kv_cache_planning",
    "vllm.v1.kv_cache_layout",
    "vllm.v1.attention.backend",
    "vllm.v1.attention.backends.utils",
)
STATS_INTERVAL = 1.0  # seconds between the child's stats files


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
        from fuzz.verdict.findings import normalize
        from fuzz.verdict.runner import run_case

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
    """The Target a "module:function" factory builds."""
    module, _, name = factory.partition(":")
    return getattr(importlib.import_module(module), name)()


def _resident_mb() -> int:
    """This process's resident memory in MiB (0 where /proc cannot tell)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    except (OSError, IndexError, ValueError):
        return 0


def child_main(config_path: str) -> None:
    """The child's life, from the config the coordinator wrote: load, instrument, say ready, fuzz until the deadline."""
    began = time.monotonic()
    config = json.loads(Path(config_path).read_text())
    import atheris

    import fuzz.verdict.runner  # noqa: F401 - torch and the oracle load before the deadline is set

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


if __name__ == "__main__":
    child_main(sys.argv[1])
