"""In a campaign worker: which changed lines each case executes.

Only the changed functions' code objects are traced (found by file and first line: a nested function or
comprehension inside a changed function is part of it); every other frame gets no local tracer, so it
costs one call into `_call` when it starts and nothing per line. A worker given no changed functions
never installs a tracer. A function's changed signature lines (decorators, parameters) count as executed
when the function is called, since no line event names them.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable
from typing import Any

from fuzz.ci.diff import ChangedFunction

_UNKNOWN = object()


class ChangeTracer:
    def __init__(self, functions: Iterable[ChangedFunction]) -> None:
        self.functions = [f for f in functions if not f.import_time]
        self.wanted: dict[str, set[int]] = {}
        self.headers: dict[tuple[str, int], tuple[int, ...]] = {}  # (path, first line) -> its changed signature lines
        self.spans: dict[str, list[tuple[int, int]]] = {}
        for function in self.functions:
            self.wanted.setdefault(function.path, set()).update(function.lines)
            self.spans.setdefault(function.path, []).append((function.start, function.end))
            if function.header:
                self.headers[(function.path, function.start)] = function.header
        self.suffixes = {path: "/" + path for path in self.wanted}
        self.codes: dict[types.CodeType, Any] = {}  # code -> (path, local tracer) or None: decided once per code object
        self.hits: set[tuple[str, int]] = set()  # changed lines the current case executed
        self.previous: Any = None  # a tracer installed before ours (a coverage tool), put back after each case

    def __bool__(self) -> bool:
        return bool(self.functions)

    def start(self) -> None:
        self.hits = set()
        self.previous = sys.gettrace()
        sys.settrace(self._call)

    def stop(self) -> set[tuple[str, int]]:
        sys.settrace(self.previous)
        return self.hits

    def _call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        entry = self.codes.get(code, _UNKNOWN)
        if entry is _UNKNOWN:
            entry = self.codes[code] = self._classify(code)
        if entry is None:
            return None
        path, local = entry
        header = self.headers.get((path, code.co_firstlineno))
        if header and event == "call":
            self.hits.update((path, line) for line in header)
        return local

    def _classify(self, code: types.CodeType) -> tuple[str, Any] | None:
        filename = code.co_filename.replace("\\", "/")
        for path, suffix in self.suffixes.items():
            if filename.endswith(suffix) and any(start <= code.co_firstlineno <= end for start, end in self.spans[path]):
                return path, self._local(path, self.wanted[path])
        return None

    def _local(self, path: str, wanted: set[int]) -> Any:
        hits = self

        def local(frame: types.FrameType, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno in wanted:
                hits.hits.add((path, frame.f_lineno))
            return local

        return local
