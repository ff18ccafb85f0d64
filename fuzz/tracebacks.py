"""Where an error happened: the innermost kvfuzz frame, the innermost vLLM frame and the traceback, for kvfuzz's own errors.

A kvfuzz internal error is a bug to report, so what reports it (a campaign's report and the file it keeps under
`internal-errors/`, and `replay`, `explain` and `minimize`) carries the traceback, and its one-line summary names both
frames: `MemoryError (kvfuzz: fuzz/targets/readback.py:95 region_of)`, with vLLM on the stack
`TYPE: MESSAGE (kvfuzz: fuzz/FILE:LINE FUNCTION; vLLM: vllm/FILE:LINE FUNCTION)`.

An error raised in (or through) vLLM's code is no bug of kvfuzz's but an outcome to judge (`vllm_failure`, `capture`):
it names the innermost vLLM frame. The same frames decide whose an out-of-memory error is: one whose innermost frame of
the two is kvfuzz's is kvfuzz's bug, even when vLLM called that code.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from fuzz import SOURCE_ROOT
from fuzz.errors import CaseMismatch, Inexpressible, TargetError
from fuzz.targets.base import Outcome
from fuzz.targets.calls import call_mismatch

# Enough for any stack kvfuzz and vLLM build; the innermost frames are kept when a traceback is longer.
TRACEBACK_CHARS = 12_000
SUMMARY_CHARS = 200  # the error's own line in a summary (the frames come on top)
KVFUZZ_PACKAGES = ("fuzz", "oracles")
OUT_OF_MEMORY_TEXT = "can't allocate memory"  # torch's allocators say so instead of raising MemoryError


@dataclass(frozen=True)
class Frame:
    path: str  # posix, relative to the repository (kvfuzz) or starting at vllm/ (vLLM)
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.function}"


@dataclass(frozen=True)
class Described:
    """An error as a report shows it: one line naming the frames, and its traceback."""

    summary: str
    traceback: str
    kvfuzz: Frame | None = None
    vllm: Frame | None = None


def describe(error: BaseException) -> Described:
    """The summary and traceback of `error`. Never raises: an error met with memory running out may leave too little for
    its own traceback, which then says so."""
    head = one_line(error)[:SUMMARY_CHARS]
    try:
        if out_of_memory(error):
            _release_locals(error.__traceback__)
        kvfuzz, vllm = innermost_frames(error)
        return Described(summary(head, kvfuzz, vllm), format_traceback(error), kvfuzz, vllm)
    except MemoryError:
        return Described(head, f"{head}\n(no traceback: memory ran out while it was formatted)\n")


def one_line(error: BaseException) -> str:
    """`Type: message`, its first line; the type alone when the message is empty (MemoryError often has none)."""
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return (text.splitlines() or ["?"])[0][:400]


def summary(head: str, kvfuzz: Frame | None, vllm: Frame | None) -> str:
    where = "; ".join(f"{who}: {frame}" for who, frame in (("kvfuzz", kvfuzz), ("vLLM", vllm)) if frame is not None)
    return f"{head} ({where})" if where else head


def format_traceback(error: BaseException, limit: int = TRACEBACK_CHARS) -> str:
    """The formatted traceback (chained errors included), its outer frames cut when it is longer than `limit`."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    if len(text) <= limit:
        return text
    tail = text[len(text) - limit:]
    tail = tail[tail.find("\n") + 1:]  # start at a whole line
    return f"Traceback (most recent call last):\n  ... ({len(text) - len(tail)} characters of outer frames cut)\n{tail}"


def innermost_frames(error: BaseException) -> tuple[Frame | None, Frame | None]:
    """The innermost frame of `error`'s traceback in kvfuzz's packages, and the innermost in vLLM's."""
    kvfuzz: Frame | None = None
    vllm: Frame | None = None
    for entry in traceback.extract_tb(error.__traceback__):
        if (path := kvfuzz_path(entry.filename)) is not None:
            kvfuzz = Frame(path, entry.lineno or 0, entry.name)
        elif (path := vllm_path(entry.filename)) is not None:
            vllm = Frame("vllm/" + path, entry.lineno or 0, entry.name)
    return kvfuzz, vllm


def innermost_is_kvfuzz(error: BaseException) -> bool:
    """Whether the innermost frame that is kvfuzz's or vLLM's (libraries such as numpy and torch aside) is kvfuzz's."""
    owner = None
    for entry in traceback.extract_tb(error.__traceback__):
        if kvfuzz_path(entry.filename) is not None:
            owner = "kvfuzz"
        elif vllm_path(entry.filename) is not None:
            owner = "vllm"
    return owner == "kvfuzz"


def out_of_memory(error: BaseException) -> bool:
    """MemoryError, or the process's memory limit as torch reports it."""
    return isinstance(error, MemoryError) or OUT_OF_MEMORY_TEXT in str(error)


def kvfuzz_path(filename: str) -> str | None:
    """`filename` relative to the repository (posix) when it is in kvfuzz's own packages, else None."""
    root = str(SOURCE_ROOT).rstrip(os.sep) + os.sep
    if not filename.startswith(root):
        return None
    relative = filename[len(root):].replace(os.sep, "/")
    return relative if relative.split("/", 1)[0] in KVFUZZ_PACKAGES else None


def vllm_path(filename: str) -> str | None:
    """`filename` relative to the loaded vllm package (posix), None outside it.

    The package's folders are where it was imported from, the folder its `__file__` names and its
    `__path__` (a checkout that wraps a release names the release's folder in the last two); code
    objects carry the path they were imported by."""
    package = sys.modules.get("vllm")
    spec = getattr(package, "__spec__", None)
    candidates = [getattr(spec, "origin", None), getattr(package, "__file__", None)]
    folders = {os.path.dirname(path) for path in candidates if path}
    folders.update(getattr(package, "__path__", ()) or ())
    for folder in folders:
        prefix = folder.rstrip(os.sep) + os.sep
        if filename.startswith(prefix):
            return filename[len(prefix):].replace(os.sep, "/")
    if folders:
        return None
    parts = filename.replace("\\", "/").rsplit("/vllm/", 1)
    return parts[1] if len(parts) == 2 else None


def _release_locals(tb: TracebackType | None) -> None:
    """Drop the locals of the finished frames: after a MemoryError they may hold the very arrays that filled the memory."""
    traceback.clear_frames(tb)


def capture(call: Callable[[], Outcome]) -> Outcome:
    """Run `call`; an exception raised in vLLM's code becomes an Outcome naming the innermost vLLM function.

    SystemExit and KeyboardInterrupt raised by the target are data too: workers ignore SIGINT,
    so neither can come from the user. An exception no vLLM frame took part in is kvfuzz's own
    and propagates (an internal error), as does a case whose derived fields vLLM derives differently.
    """
    try:
        return call()
    except (CaseMismatch, Inexpressible):
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as error:
        mismatch = call_mismatch(error)
        if mismatch is not None:  # kvfuzz called vLLM wrongly: not an outcome of vLLM's
            raise TargetError(mismatch) from None
        outcome = vllm_failure(error)
        if outcome is None:
            raise
        return outcome


def vllm_failure(error: BaseException) -> Outcome | None:
    """The Outcome of an exception raised in (or through) vLLM's code, naming the innermost vLLM frame;
    None when vLLM took no part in it, or when memory ran out in kvfuzz's own code (fuzz/tracebacks.py)."""
    innermost = None
    tb = error.__traceback__
    while tb is not None:  # the frames as traceback.extract_tb lists them, without reading their source lines
        code = tb.tb_frame.f_code
        path = vllm_path(code.co_filename)
        if path is not None:
            innermost = (code.co_name, path, tb.tb_lineno)
        tb = tb.tb_next
    if innermost is None or (out_of_memory(error) and innermost_is_kvfuzz(error)):  # kvfuzz's own code ran out, even if vLLM called it
        return None
    function, path, line = innermost
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return Outcome(error_type=type(error).__name__, error_message=message[:500], error_function=function,
                   error_layer=layer_in_flight(error), error_file=path, error_line=line)


def layer_in_flight(error: BaseException) -> str | None:
    """The innermost `layer_name` a vLLM frame was handling when it raised."""
    layer = None
    tb = error.__traceback__
    while tb is not None:
        if "/vllm/" in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            candidate = tb.tb_frame.f_locals.get("layer_name")
            if isinstance(candidate, str):
                layer = candidate
        tb = tb.tb_next
    return layer
