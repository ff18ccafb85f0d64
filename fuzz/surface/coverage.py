"""Which surface functions kvfuzz's cases run, and which of their lines.

`measure` starts `python -m fuzz.surface.coverage CONFIG OUT` with the target's vLLM first on the path.
That process loads the target as a campaign worker does, then runs the campaign's cases (seed, index)
in-process for the given seconds, with the campaign's schedule (consumers on every 8th case, the
kernel probe only when asked), under a trace function that follows only the code objects of the
surface functions: a frame of any other code is declined at its call event, so the rest of vLLM and
kvfuzz run untraced. It writes what ran every few seconds, so a case that kills the process leaves
what was reached before it.

A function's lines are those its code objects (nested functions, lambdas and comprehensions
included) map bytecode to, compiled here from the file by this Python: the lines a line event can
report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzz import SOURCE_ROOT
from fuzz.campaign import stop
from fuzz.errors import TargetError
from fuzz.surface.find import Function
from fuzz.targets.releases import TargetSource, worker_environment

FLUSH_S = 2.0
START_MARGIN_S = 300.0  # importing vLLM and probing the target, on a busy machine
CONSUMERS_EVERY = 8  # as `kvfuzz run`'s default


@dataclass
class Coverage:
    """What a campaign of `seconds` ran: per function (by index into the map), its calls and executed lines."""

    seconds: float
    cases: int = 0
    calls: dict[int, int] = field(default_factory=dict)
    lines: dict[int, set[int]] = field(default_factory=dict)
    error: str | None = None  # why the tracing process ended early, if it did


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
    """Run the tracing process to its end (or `seconds` plus the start margin) and read what it reached."""
    config = {"functions": [{"path": f.path, "start": f.start, "end": f.end} for f in functions], "seconds": seconds, "seed": seed,
              "synthetic": synthetic, "probe": probe, "device": device,
              "max_cases": max_cases or 10**12}
    config_path, out, log = work / "surface.json", work / "covered.json", work / "surface.log"
    config_path.write_text(json.dumps(config))
    env = worker_environment(source)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), str(SOURCE_ROOT)]))
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "fuzz.surface.coverage", str(config_path), str(out)], env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        ended = _wait(process, seconds + START_MARGIN_S)
    if not out.exists():
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        raise TargetError(f"--vllm {source.spec}: the tracing process failed before any case ran: {(lines or ['no output'])[-1][:300]}")
    data = json.loads(out.read_text())
    error = None if ended and process.returncode == 0 else f"the tracing process {'was killed' if not ended else f'exited {process.returncode}'}"
    return Coverage(seconds=seconds, cases=data["cases"], calls={int(k): v for k, v in data["calls"].items()},
                    lines={int(k): set(v) for k, v in data["lines"].items()}, error=error)


def _wait(process: subprocess.Popen[str], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    try:
        while process.poll() is None:
            stop.check()
            if time.monotonic() > deadline:
                _kill(process)
                return False
            time.sleep(0.1)
    except stop.Stopped:
        _kill(process)
        raise
    return True


def _kill(process: subprocess.Popen[str]) -> None:
    try:
        os.killpg(process.pid, 9)
    except ProcessLookupError:
        pass
    process.wait()


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

    from fuzz.space import Rejected, draw_indexed, for_run
    from fuzz.targets import load_local
    from fuzz.verdict.runner import run_case

    config = json.loads(Path(config_path).read_text())
    target = load_local()
    tracer = Tracer(Path(vllm.__file__).resolve().parent.parent, config["functions"])
    kernel = config["probe"] == "kernel"
    probe: bool | str = "kernel" if kernel else False

    def flush(cases: int) -> None:
        data = {"cases": cases, "calls": tracer.calls, "lines": {k: sorted(v) for k, v in tracer.lines.items()}}
        Path(out_path + ".tmp").write_text(json.dumps(data))
        os.replace(out_path + ".tmp", out_path)

    flush(0)
    deadline = time.monotonic() + config["seconds"]
    last, index, cases = time.monotonic(), 0, 0
    sys.settrace(tracer.call)
    try:
        while time.monotonic() < deadline and cases < config["max_cases"]:
            try:
                case = draw_indexed(target.info, config["seed"], index, synthetic=config["synthetic"], touches=True)
            except Rejected:
                index += 1
                continue
            case = for_run(case, consumers=index % CONSUMERS_EVERY == 0, kernel=kernel)
            try:
                run_case(target, case, config["device"], probe=probe)
            except Exception:  # noqa: BLE001 - kvfuzz's own error on one case: a campaign reports it, coverage goes on
                pass
            index, cases = index + 1, cases + 1
            if time.monotonic() - last > FLUSH_S:
                last = time.monotonic()
                flush(cases)
    finally:
        sys.settrace(None)
        flush(cases)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    main(sys.argv[1], sys.argv[2])
