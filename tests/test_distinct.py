"""A campaign's memory stays bounded however long it runs: the count of keys each check met (fuzz/campaign/distinct.py),
the schedule's memo (fuzz/campaign/schedule.py) and the synthetic backend classes a target builds (fuzz/targets/spec_making.py).

A worker meets hundreds of new keys a second; when the schedule remembered every key it met, a one-worker campaign on the
installed vLLM grew by about 2.5 MiB a second (9 GiB an hour), so a week-long campaign could not have run.
"""

from __future__ import annotations

import dataclasses
import random
import tracemalloc

import pytest

from fuzz.campaign import distinct, schedule
from fuzz.campaign.distinct import DistinctCount
from fuzz.campaign.schedule import Schedule
from fuzz.case import GroupCase, SpecCase, SyntheticBackend
from fuzz.checks import block_copy
from fuzz.verdict.runner import CaseResult
from tests.test_schedule import with_touches


def test_the_count_is_exact_while_few() -> None:
    rng = random.Random(1)
    hashes = [rng.getrandbits(64) - (1 << 63) for _ in range(5_000)] + [0, -1, -2, 1, 2]  # hash(-1) == hash(-2) in Python
    counted = DistinctCount()
    for value in hashes + hashes[:2_000]:
        counted.add(value)
    assert counted.exact is not None and len(counted) == len(set(hashes))


@pytest.mark.parametrize("kind", ["random", "consecutive", "tuples"])
@pytest.mark.parametrize("count", [80_000, 400_000])
def test_past_the_exact_limit_the_estimate_is_within_three_per_cent(kind: str, count: int) -> None:
    """Four standard errors of a 2^14-register sketch; the hashes a schedule feeds it are Python's, which for small ints are
    the ints themselves (hence the consecutive ones)."""
    rng = random.Random(count)
    make = {"random": lambda i: rng.getrandbits(64), "consecutive": lambda i: i, "tuples": lambda i: hash((i % 997, i // 997, "k"))}[kind]
    counted = DistinctCount()
    for index in range(count):
        value = make(index)
        counted.add(value)
        if index % 3 == 0:
            counted.add(value)  # seen again: not counted again
    assert counted.exact is None
    assert abs(len(counted) - count) / count < 0.03, len(counted)


def test_the_count_holds_no_more_than_its_limit_and_its_registers() -> None:
    counted = DistinctCount()
    for value in range(distinct.EXACT_LIMIT + 10):
        counted.add(value)
    assert counted.exact is None and len(counted.registers) == 1 << distinct.PRECISION


def _judged_copy_cases(schedule_: Schedule, count: int, start: int) -> None:
    """`count` copy cases, each with a key of its own (its block count), every one run and judged."""
    for blocks in range(start, start + count):
        plan = schedule_.plan(dataclasses.replace(with_touches(consumers=("copy",), tokens=()), num_blocks=blocks))
        schedule_.record(plan, CaseResult(plan.case, verdict=None, checks=dict.fromkeys(plan.running)), seconds=0.0)  # type: ignore[arg-type]


def test_a_schedule_meeting_new_keys_stops_growing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its memo's limit and the count's exact limit, a schedule that meets only new keys holds no more memory."""
    monkeypatch.setattr(schedule, "MEMO_LIMIT", 300)
    monkeypatch.setattr(distinct, "EXACT_LIMIT", 300)
    checked = Schedule((block_copy.CHECK,), share=1.0, floor=1.0)
    _judged_copy_cases(checked, 2_000, start=10)  # both limits reached
    tracemalloc.start()
    try:
        _judged_copy_cases(checked, 3_000, start=10_000)  # the memo now holds only keys made while traced
        before = tracemalloc.get_traced_memory()[0]
        _judged_copy_cases(checked, 6_000, start=20_000)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    tally = checked.tally["copy"]
    assert tally.keys_checked == 11_000 and abs(tally.keys_seen - 11_000) < 550, tally
    assert len(checked.memo["copy"]) == 300
    # Each key holds a case of a few hundred bytes: 6,000 more of them would be over a megabyte.
    assert grown < 100_000, grown


def test_a_target_keeps_a_bounded_number_of_synthetic_backend_classes(kvfuzz_target, monkeypatch: pytest.MonkeyPatch) -> None:
    from fuzz.targets import spec_making

    adapter = kvfuzz_target
    if not hasattr(adapter, "backend_class"):
        pytest.skip("the target runs in a worker process (--kvfuzz-vllm)")
    monkeypatch.setattr(spec_making, "SYNTHETIC_CLASSES", 4)
    monkeypatch.setattr(adapter, "_synthetic", type(adapter._synthetic)())
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64)

    def group(size: int) -> GroupCase:
        backend = SyntheticBackend(f"kept{size}", kernel_block_sizes=(size,))
        return GroupCase(spec=spec, layers=("l0",), synthetic_backend=backend, kernel_block_size=size)

    classes = {size: adapter.backend_class(group(size)) for size in (1, 2, 4, 8, 16, 32)}
    assert len(adapter._synthetic) == 4
    assert adapter.backend_class(group(32)) is classes[32]  # a recent one is reused
    again = adapter.backend_class(group(1))  # an evicted one is built again, alike
    assert again is not classes[1]
    assert again.get_name() == classes[1].get_name() and again.get_supported_kernel_block_sizes() == [1]
