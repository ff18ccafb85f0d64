"""Which surface functions kvfuzz's cases run, and which of their lines.

`measure` starts `python -m fuzz.surface.coverage CONFIG OUT` with the target's vLLM first on the path.
That process loads the target as a campaign worker does, then runs the campaign's cases (seed, index)
in-process for the given seconds (or cases), each with every check it names (its consumers on every
case, the kernel probe only when asked): the map measures what kvfuzz's cases can reach, not what a
campaign's schedule (fuzz/campaign/schedule.py) chose to run in its time. A trace function follows
only the code objects of the surface functions: a frame of any other code is declined at its call
event, so the rest of vLLM and kvfuzz run untraced.

A consumer whose kernel writes outside its buffers (the zeroer under Triton's interpreter writes
host memory) can corrupt the process's heap: the process then dies or hangs, on that case or a
later one. So the process loads the target once and traces the cases in a forked child, which writes
what it reached after every case and the index of the case it is running before it, and gives up on
a case that runs past CASE_LIMIT_S; when a child dies, the process forks a new one from the loaded
target (no new import), which goes on after the last case written, without the case the old one ended
on (`Coverage.crashed`). Should the process itself die, `measure` starts a new one the same way.

A function's lines are those its code objects (nested functions, lambdas and comprehensions
included) map bytecode to, compiled here from the file by this Python: the lines a line event can
report.
"""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzz import SOURCE_ROOT
from fuzz.campaign import stop
from fuzz.errors import TargetError
from fuzz.surface.find import Function
from fuzz.targets.releases import TargetSource, worker_environment

CASE_LIMIT_S = 30.0  # one case; the slowest (a zeroer under Triton's interpreter on a large cache) take a few seconds
START_MARGIN_S = 300.0  # importing vLLM and probing the target, on a busy machine
MAX_CRASHES = 20  # cases that end the tracing process before the measurement stops there
GAVE_UP = 3  # the tracing process's exit status when MAX_CRASHES cases have killed its children


@dataclass
class Coverage:
    """What a campaign of `seconds` ran: per function (by index into the map), its calls and executed lines."""

    seconds: float
    cases: int = 0
    calls: dict[int, int] = field(default_factory=dict)
    lines: dict[int, set[int]] = field(default_factory=dict)
    first: dict[int, int] = field(default_factory=dict)  # the number of the first case that called it (1-based)
    crashed: list[int] = field(default_factory=list)  # indices of the cases the tracing process died or hung on (skipped)
    error: str | None = None  # why the tracing process ended early, if it did


@dataclass
class Progress:
    """What the tracing processes reached so far: written by the process after every case, read to resume after a crash."""

    cases: int = 0
    index: int = 0  # the next case index to draw
    ran_s: float = 0.0  # seconds spent running cases
    calls: dict[int, int] = field(default_factory=dict)
    lines: dict[int, set[int]] = field(default_factory=dict)
    first: dict[int, int] = field(default_factory=dict)
    crashed: list[int] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> Progress:
        data = json.loads(path.read_text())
        return cls(data["cases"], data["index"], data["ran_s"], {int(k): v for k, v in data["calls"].items()},
                   {int(k): set(v) for k, v in data["lines"].items()}, {int(k): v for k, v in data["first"].items()}, data["crashed"])

    def write(self, path: Path) -> None:
        data = {"cases": self.cases, "index": self.index, "ran_s": self.ran_s, "calls": self.calls,
                "lines": {k: sorted(v) for k, v in self.lines.items()}, "first": self.first, "crashed": self.crashed}
        Path(f"{path}.tmp").write_text(json.dumps(data))
        os.replace(f"{path}.tmp", path)


def executable_lines(root: Path, functions: Sequence[Function]) -> list[set[int]]:
    """For each function, the lines its code objects hold (compiled from the tree at `root`)."""
    result: list[set[int]] = [set() for _ in functions]
    by_path: dict[str, list[int]] = {}
    for index, function in enumerate(functions):
        by_path.setdefault(function.path, []).append(index)
    for path, indices in by_path.items():
        try:
            module = compile((root / path).read_text(encoding="utf-8", errors="replace"), str(root / path), "exec")
        except (SyntaxError, ValueError, OSError):
            continue
        for code in _nested(module):
            owner = _owner([(functions[i].start, functions[i].end, i) for i in indices], code.co_firstlineno)
            if owner is not None and code.co_name != "<module>":
                result[owner].update(line for _, _, line in code.co_lines() if line is not None)
    return result


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def _owner(ranges: Sequence[tuple[int, int, int]], line: int) -> int | None:
    """The innermost (start, end, index) range holding `line`."""
    inside = [(end - start, index) for start, end, index in ranges if start <= line <= end]
    return min(inside)[1] if inside else None


def measure(source: TargetSource, root: Path, functions: Sequence[Function], seconds: float, work: Path, *, seed: int = 0,
            synthetic: bool = True, probe: str = "metadata", device: str = "cpu", max_cases: int | None = None) -> Coverage:
    """Run the tracing process to its end (or `seconds` plus the start margin) and read what it reached. A case that ends
    the process (it died or hung) is skipped: a new process goes on after the last case written."""
    config = {"functions": [{"path": f.path, "start": f.start, "end": f.end} for f in functions], "seconds": seconds, "seed": seed,
              "synthetic": synthetic, "probe": probe, "device": device,
              "max_cases": max_cases or 10**12}
    config_path, out, log = work / "surface.json", work / "covered.json", work / "surface.log"
    config_path.write_text(json.dumps(config))
    env = worker_environment(source)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), str(SOURCE_ROOT)]))
    error = None
    for _ in range(MAX_CRASHES + 1):
        returncode = _run_once(env, config_path, out, log, seconds)
        if not out.exists():
            lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
            raise TargetError(f"--vllm {source.spec}: the tracing process failed before any case ran: {(lines or ['no output'])[-1][:300]}")
        if returncode == 0:
            break
        if returncode == GAVE_UP:
            error = f"gave up after {MAX_CRASHES} cases killed the tracing process"
            break
        error = "the tracing process was killed" if returncode is None else f"the tracing process exited {returncode}"
        progress, crashed = Progress.read(out), _running(out)
        if returncode is None or crashed is None or crashed in progress.crashed or crashed < progress.index:
            break
        progress.crashed.append(crashed)
        progress.write(out)
        error = None
    else:
        error = f"gave up after {MAX_CRASHES} cases killed the tracing process"
    progress = Progress.read(out)
    return Coverage(seconds=seconds, cases=progress.cases, calls=progress.calls, lines=progress.lines, first=progress.first,
                    crashed=progress.crashed, error=error)


def _run_once(env: dict[str, str], config: Path, out: Path, log: Path, seconds: float) -> int | None:
    """One tracing process, resuming from `out` if it exists: its exit status, or None when it ran past its time."""
    Path(f"{out}.at").unlink(missing_ok=True)
    with open(log, "a") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "fuzz.surface.coverage", str(config), str(out)], env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        ended = stop.wait_or_kill(process, seconds + START_MARGIN_S)
    return process.returncode if ended else None


def _running(out: Path) -> int | None:
    """The index of the case the last tracing process was running when it ended."""
    try:
        return int(Path(f"{out}.at").read_text().strip())
    except (OSError, ValueError):
        return None


class Tracer:
    """A trace function that follows only the code objects whose (file, first line) fall in a surface function."""

    def __init__(self, root: Path, functions: Sequence[dict[str, Any]]) -> None:
        self.ranges: dict[str, list[tuple[int, int, int]]] = {}
        for index, function in enumerate(functions):
            self.ranges.setdefault(os.path.realpath(root / function["path"]), []).append((function["start"], function["end"], index))
        self.calls: dict[int, int] = {}
        self.lines: dict[int, set[int]] = {}
        self._codes: dict[types.CodeType, tuple[int, set[int]] | None] = {}
        self._files: dict[str, list[tuple[int, int, int]] | None] = {}

    def _resolve(self, code: types.CodeType) -> tuple[int, set[int]] | None:
        ranges = self._files.get(code.co_filename, ())
        if ranges == ():
            ranges = self._files[code.co_filename] = self.ranges.get(os.path.realpath(code.co_filename))
        owner = _owner(ranges, code.co_firstlineno) if ranges else None
        return None if owner is None else (owner, self.lines.setdefault(owner, set()))

    def call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        try:
            entry = self._codes[code]
        except KeyError:
            entry = self._codes[code] = self._resolve(code)
        if entry is None:
            return None
        self.calls[entry[0]] = self.calls.get(entry[0], 0) + 1
        entry[1].add(code.co_firstlineno)
        return self.line

    def line(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            entry = self._codes[frame.f_code]
            if entry is not None:
                entry[1].add(frame.f_lineno)
        return self.line


def main(config_path: str, out_path: str) -> None:
    import vllm

    from fuzz.targets.loader import load_local

    config = json.loads(Path(config_path).read_text())
    out = Path(out_path)
    if not out.exists():
        Progress().write(out)
    target = load_local()
    root = Path(vllm.__file__).resolve().parent.parent
    sys.exit(in_children(out, lambda: _trace_cases(target, root, config, out)))


def in_children(out: Path, trace: Callable[[], None]) -> int:
    """Runs `trace` in forked children until one returns: after a child a case killed (the index it wrote to
    `out`.at), the case joins the crashed ones and the next child goes on without it. Returns the process's exit
    status: 0 when a child finished, GAVE_UP after MAX_CRASHES such cases, 1 when a child died otherwise."""
    while True:
        Path(f"{out}.at").unlink(missing_ok=True)
        child = os.fork()
        if child == 0:
            status = 1
            try:
                trace()
                status = 0
            finally:
                os._exit(status)
        _, wait_status = os.waitpid(child, 0)
        if os.waitstatus_to_exitcode(wait_status) == 0:
            return 0
        progress, crashed = Progress.read(out), _running(out)
        if crashed is None or crashed in progress.crashed or crashed < progress.index:
            return 1  # not a case that killed it: `measure` says how the process ended
        if len(progress.crashed) >= MAX_CRASHES:
            return GAVE_UP
        progress.crashed.append(crashed)
        progress.write(out)


def _trace_cases(target: Any, root: Path, config: dict[str, Any], out: Path) -> None:
    """Run the campaign's cases from where `out` says the last child stopped, tracing the surface functions."""
    from fuzz.space import for_run
    from fuzz.verdict.runner import run_case

    progress = Progress.read(out)
    tracer = Tracer(root, config["functions"])
    tracer.calls, tracer.lines = progress.calls, progress.lines
    kernel = config["probe"] == "kernel"
    probe: bool | str = "kernel" if kernel else False
    skip = set(progress.crashed)
    running = os.open(f"{out}.at", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    started = time.monotonic()
    resumed_s = progress.ran_s

    def flush() -> None:
        progress.ran_s = resumed_s + time.monotonic() - started
        progress.write(out)

    deadline = started + config["seconds"] - resumed_s
    sys.settrace(tracer.call)
    try:
        while time.monotonic() < deadline and progress.cases < config["max_cases"]:
            index = progress.index
            case = None if index in skip else _draw(target.info, config, index)
            if case is not None:
                os.pwrite(running, b"%20d" % index, 0)
                faulthandler.dump_traceback_later(CASE_LIMIT_S, exit=True)
                try:
                    run_case(target, for_run(case, consumers=True, kernel=kernel), config["device"], probe=probe)
                except Exception:  # noqa: BLE001 - kvfuzz's own error on one case: a campaign reports it, coverage goes on
                    pass
                faulthandler.cancel_dump_traceback_later()
                progress.cases += 1
                if len(tracer.calls) > len(progress.first):
                    progress.first.update((function, progress.cases) for function in tracer.calls if function not in progress.first)
            progress.index = index + 1
            if case is not None:
                flush()
    finally:
        sys.settrace(None)
        flush()


def _draw(info: Any, config: dict[str, Any], index: int) -> Any:
    """Case `index` of the campaign, or None where the space rejects it."""
    from fuzz.space import Rejected, draw_indexed

    try:
        return draw_indexed(info, config["seed"], index, synthetic=config["synthetic"], touches=True)
    except Rejected:
        return None


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    main(sys.argv[1], sys.argv[2])
