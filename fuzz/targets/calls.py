"""How kvfuzz's calls meet vLLM's signatures: reading an entry point's parameters, and telling a
call that does not fit apart from a failure of vLLM's.

Adapters tell API generations apart by parameter names, read through wrappers (`__wrapped__`,
as functools.wraps leaves it). A signature of only `*args, **kwargs` tells nothing: that is an
error, never a guess. A TypeError raised while binding the arguments of kvfuzz's own call into
vLLM (at the call site in fuzz/targets/, or in the frame of the function it called: a wrapper
passing them on) is kvfuzz calling the function wrongly, not a bug of vLLM's: `call_mismatch`
names the function and the signature kvfuzz saw, and the adapter raises it as a TargetError.
"""

from __future__ import annotations

import inspect
import os
import re
from types import FrameType, ModuleType
from typing import Any

TARGETS = os.path.dirname(os.path.realpath(__file__))
# CPython's messages for arguments that do not bind: "f() got an unexpected keyword argument 'x'", ...
_BINDING = re.compile(r"^(?P<function>[\w.<>]+)\(\) (got an unexpected keyword argument|missing \d+ required|takes |"
                      r"got multiple values for argument|got some positional-only)")


def hidden_parameters(name: str, signature: inspect.Signature) -> str:
    """The error for an entry point whose signature, even unwrapped, is only *args / **kwargs."""
    return (f"cannot tell which vLLM API generation {name}{signature} belongs to: a wrapper hides its parameters "
            "(functools.wraps keeps them); kvfuzz will not guess how to call it")


def call_mismatch(error: BaseException) -> str | None:
    """One line when `error` is kvfuzz's call into vLLM not fitting the called function's signature."""
    match = _BINDING.match(str(error)) if type(error) is TypeError else None
    if match is None:
        return None
    frames: list[FrameType] = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    ours = [i for i, frame in enumerate(frames) if os.path.dirname(os.path.realpath(frame.f_code.co_filename)) == TARGETS]
    if not ours or len(frames) - 1 - ours[-1] > 1:
        return None  # raised deeper inside vLLM: vLLM's own call
    name = match["function"].rsplit(".", 1)[-1]
    function = _called(frames[ours[-1]], name)
    if function is None:
        return None  # not a function kvfuzz called
    try:
        seen = f"{name}{inspect.signature(function)}"
    except (TypeError, ValueError):
        seen = f"{name}(?)"
    return f"kvfuzz's call does not fit vLLM's {seen}: TypeError: {error}"


def _called(frame: FrameType, name: str) -> Any:
    """The function called `name` that kvfuzz's frame holds: a local, an attribute of its adapter, or in a module it holds."""
    owner = frame.f_locals.get("self")
    candidates = [*frame.f_locals.values(), *(vars(owner).values() if hasattr(owner, "__dict__") else ())]
    for value in candidates:
        if isinstance(value, ModuleType):
            value = getattr(value, name, None)
        if callable(value) and getattr(value, "__name__", None) == name:
            return value
    return None
