"""Which lines of the functions under mutation a campaign's cases execute.

Runs in a process of its own with the target's vLLM first on the path (`python -m
fuzz.mutate.reach CONFIG OUT`): draws the campaign's cases (seed, index) and runs each through the
target and the oracle in-process, tracing only the code objects of the selected functions, and
writes the executed lines per file to OUT every few seconds (a case that kills the process
leaves what was reached so far). A mutant on a line no case executed is `unreached`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FLUSH_S = 2.0


def code_objects(module_name: str, qualname: str) -> list[types.CodeType]:
    """The function's code and every code object nested in it (comprehensions, lambdas)."""
    return list(_nested(defined_function(importlib.import_module(module_name), qualname).__code__))


def defined_function(module: types.ModuleType, qualname: str) -> types.FunctionType:
    """The Python function a module defines as `qualname`: a property's getter, a static or class method's function,
    a cached property's, each unwrapped from its decorators."""
    value: Any = module
    try:
        for part in qualname.split("."):
            value = inspect.getattr_static(value, part)
    except AttributeError:
        raise LookupError(f"no definition of {qualname}") from None
    if isinstance(value, property):
        value = value.fget
    elif isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    value = getattr(value, "func", value)  # functools.cached_property
    value = inspect.unwrap(value)
    if not isinstance(value, types.FunctionType):
        raise TypeError(f"{qualname} is a {type(value).__name__}, not a Python function")
    return value


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def main(config_path: str, out_path: str) -> None:
    from fuzz.space import Rejected, draw_indexed
    from fuzz.targets.loader import load_local
    from fuzz.verdict.runner import run_case

    config = json.loads(Path(config_path).read_text())
    target = load_local()
    files: dict[str, str] = {}  # co_filename -> path relative to the tree
    codes: set[types.CodeType] = set()
    for function in config["functions"]:
        for code in code_objects(module_name(function["path"]), function["qualname"]):
            codes.add(code)
            files[code.co_filename] = function["path"]
    reached: dict[str, set[int]] = {path: set() for path in files.values()}

    def local(frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            reached[files[frame.f_code.co_filename]].add(frame.f_lineno)
        return local

    def calls(frame: types.FrameType, event: str, arg: Any) -> Any:
        if frame.f_code in codes:
            reached[files[frame.f_code.co_filename]].add(frame.f_code.co_firstlineno)
            return local
        return None

    def flush(cases: int) -> None:
        Path(out_path).write_text(json.dumps({"cases": cases, "lines": {p: sorted(lines) for p, lines in reached.items()}}))

    flush(0)  # the target is up: the session says so
    deadline = time.monotonic() + config["seconds"]
    last, index = time.monotonic(), 0
    sys.settrace(calls)
    try:
        while time.monotonic() < deadline and index < config["max_cases"]:
            try:
                case = draw_indexed(target.info, config["seed"], index, synthetic=config["synthetic"])
            except Rejected:
                index += 1
                continue
            try:
                run_case(target, case, config["device"])
            except Exception:  # noqa: BLE001 - kvfuzz's own error on one case: the campaign reports it, reach goes on
                pass
            index += 1
            if time.monotonic() - last > FLUSH_S:
                last = time.monotonic()
                flush(index)
    finally:
        sys.settrace(None)
        flush(index)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
