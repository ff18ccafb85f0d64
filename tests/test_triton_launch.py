"""Kernels launched inside `launching` (fuzz/targets/triton_interp.py) under Triton's interpreter: triton.language is
patched once per launch, not again at every call of a jitted device function inside it, and a kernel computes the same
bytes either way."""

from __future__ import annotations

import pytest
import torch

from fuzz.targets import triton_interp

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

if not triton_interp.interpreting():
    pytest.skip("Triton compiles kernels here: the interpreter's patching does not apply", allow_module_level=True)

from triton.runtime import interpreter  # noqa: E402 - only where the interpreter runs


@triton.jit
def scaled(x, factor):
    return x * factor + 1


@triton.jit
def twice_scaled(x, factor):
    return scaled(scaled(x, factor), factor)


@triton.jit
def map_kernel(source, out, count, factor, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(source + offsets, mask=offsets < count, other=0)
    tl.store(out + offsets, twice_scaled(values, factor), mask=offsets < count)


def launched() -> torch.Tensor:
    source = torch.arange(100, dtype=torch.int32)
    out = torch.zeros(100, dtype=torch.int32)
    map_kernel[(4,)](source, out, 100, 3, BLOCK=32)
    return out


def counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    patch = interpreter._patch_lang

    def counted(fn):
        calls.append(1)
        return patch(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", counted)
    return calls


def test_a_launch_patches_the_language_once_and_computes_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counting(monkeypatch)
    plain = launched()
    per_call = len(calls)
    calls.clear()
    with triton_interp.launching(torch.device("cpu")):
        once = launched()
        again = launched()
    assert per_call == 1 + 4 * 3  # the launch, then three device calls in each of four programs
    assert len(calls) == 2  # one per launch
    expected = ((torch.arange(100, dtype=torch.int32) * 3 + 1) * 3 + 1)
    assert torch.equal(plain, expected) and torch.equal(once, expected) and torch.equal(again, expected)


def test_the_language_is_left_as_it_was_after_a_launch() -> None:
    before = {name: getattr(tl, name) for name in ("load", "store", "arange", "program_id")}
    with triton_interp.launching(torch.device("cpu")):
        launched()
    assert {name: getattr(tl, name) for name in before} == before
    assert interpreter._patch_lang.__name__ == "_patch_lang"
