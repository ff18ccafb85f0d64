"""Raw buffers left unfilled where no check reads their bytes (fuzz/targets/unfilled.py).

Leaving vLLM's byte buffers unfilled must change no fact the view path compares, and must never reach a run that reads
bytes back (the physical probe, a consumer, a cache write).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import fuzz.targets.common as common
from fuzz.case import replace
from fuzz.space import Rejected, draw_indexed
from fuzz.targets.unfilled import unfilled_buffers


def test_only_byte_buffers_go_unfilled_and_zeros_comes_back() -> None:
    zeros = torch.zeros
    with unfilled_buffers():
        assert torch.zeros is not zeros
        assert torch.zeros(3, 5, dtype=torch.float32).abs().sum().item() == 0
        assert torch.zeros((4,), dtype=torch.bfloat16).abs().sum().item() == 0
        raw = torch.zeros(64, dtype=torch.int8)
        assert (raw.shape, raw.dtype) == ((64,), torch.int8)
    assert torch.zeros is zeros
    with pytest.raises(RuntimeError), unfilled_buffers():
        raise RuntimeError("vLLM raised")
    assert torch.zeros is zeros


def drawn(target, count: int) -> list:
    cases = []
    for index in range(count * 3):
        try:
            cases.append(draw_indexed(target.info, 5, index, touches=True))
        except Rejected:
            continue
        if len(cases) == count:
            return cases
    return cases


@pytest.fixture
def in_process(kvfuzz_target):
    if not hasattr(kvfuzz_target, "deeper_checks"):
        pytest.skip("the adapter runs in this process only for the installed vLLM")
    return kvfuzz_target


def test_unfilled_buffers_give_the_same_views(in_process, monkeypatch) -> None:
    cases = [replace(case, touches=None) for case in drawn(in_process, 150)]
    unfilled = [in_process.execute(case, "cpu").to_dict() for case in cases]
    monkeypatch.setattr(common, "unfilled_buffers", contextlib.nullcontext)
    filled = [in_process.execute(case, "cpu").to_dict() for case in cases]
    assert unfilled == filled
    assert sum(run["outcome"] is not None and not run["outcome"].get("error_type") for run in filled) > len(cases) // 2


def test_only_a_run_that_reads_bytes_it_did_not_write_gets_filled_buffers(in_process, monkeypatch) -> None:
    entered: list[bool] = []

    @contextlib.contextmanager
    def recorded() -> Iterator[None]:
        entered.append(True)
        with unfilled_buffers():
            yield

    monkeypatch.setattr(common, "unfilled_buffers", recorded)
    touching = [replace(case, runner="v2") for case in drawn(in_process, 300) if case.touches is not None]
    kinds = {name: consumer.kind for name, consumer in in_process.consumers.items()}
    region = [case for case in touching if any(kinds.get(name) == "region" for name in case.touches.consumers)]
    filling = [case for case in touching if all(kinds.get(name, "region") != "region" for name in case.touches.consumers)]
    assert region and filling
    for case in region[:20]:
        ran = in_process.execute(case, "cpu")
        if ran.outcome is not None and ran.outcome.views:
            assert not entered, case
        in_process.execute(replace(case, touches=None), "cpu", probe="physical")
        assert not entered, case
    reached = 0
    for case in filling[:20]:
        entered.clear()
        ran = in_process.execute(case, "cpu")
        if ran.outcome is not None and ran.outcome.views:
            assert entered, case
            reached += 1
    assert reached > 5


def test_consumers_and_the_kernel_probe_judge_the_same_on_unfilled_buffers(in_process, monkeypatch) -> None:
    kinds = {name: consumer.kind for name, consumer in in_process.consumers.items()}
    cases = [replace(case, runner="v2") for case in drawn(in_process, 400) if case.touches is not None
             and all(kinds.get(name, "region") != "region" for name in case.touches.consumers)][:80]
    unfilled = [in_process.execute(case, "cpu").to_dict() for case in cases]
    monkeypatch.setattr(common, "unfilled_buffers", contextlib.nullcontext)
    filled = [in_process.execute(case, "cpu").to_dict() for case in cases]
    assert unfilled == filled
    touched = [run["outcome"].get("touches") or {} for run in filled if run["outcome"] is not None]
    assert sum(bool(t.get("kernel")) for t in touched) > 10 and sum(bool(t.get("consumers")) for t in touched) > 10
