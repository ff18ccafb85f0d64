"""Worker processes that survive the target: crashes, hangs, memory hogs and exits become findings."""

import json
import threading
import time

import pytest

from fuzz.campaign import protocol
from fuzz.campaign.engine import Campaign, CampaignOptions
from fuzz.campaign.pool import Pool, RemoteTarget
from fuzz.case import Case, GroupCase, SpecCase, to_dict
from fuzz.targets import releases
from fuzz.verdict.runner import run_case
from tests.hostile import TRIGGERS, make_hostile_checkout, seed_meeting

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def hostile_pool(tmp_path_factory):
    checkout = make_hostile_checkout(tmp_path_factory.mktemp("hostile"))
    with Pool(releases.resolve(str(checkout)), workers=1, case_timeout=2.0, max_memory=256 << 20) as pool:
        yield pool


def full(head: int, blocks: int) -> Case:
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=1, head_size=head)
    return Case(groups=(GroupCase(spec=spec, layers=("l0",), backend="TRITON_ATTN", kernel_block_size=16),), num_blocks=blocks)


def hostile(action: str) -> Case:
    """The case on which the hostile target does `action`."""
    return full(*TRIGGERS[action])


HARMLESS = full(64, 5)  # no trigger: the real function


@pytest.mark.parametrize(("action", "kind", "detail"), [
    ("segfault", "crash-signal", "SIGSEGV"),
    ("abort", "crash-signal", "SIGABRT"),
    ("hang", "hang", "no answer"),
    ("exit", "crash-on-valid", "SystemExit"),
    ("memory", "oom", ""),
])
def test_each_failure_is_a_finding_and_the_worker_comes_back(hostile_pool, action, kind, detail):
    target = RemoteTarget(hostile_pool)
    restarts = hostile_pool.restarts
    verdict = run_case(target, hostile(action), "cpu").verdict
    assert verdict.finding is not None and verdict.finding.kind == kind, verdict
    assert detail in verdict.finding.message
    assert run_case(target, HARMLESS, "cpu").verdict.status == "pass", "the respawned worker works"
    if kind in ("crash-signal", "hang"):
        assert hostile_pool.restarts == restarts + 1


@pytest.mark.slow
def test_campaign_against_a_hostile_target_keeps_every_finding(hostile_pool, tmp_path):
    corpus_dir = tmp_path / "corpus"
    seed, cases = seed_meeting(hostile_pool.info, ("segfault", "hang", "memory"), 300)
    options = CampaignOptions(device="cpu", max_time=300, max_cases=cases, seed=seed, corpus_dir=corpus_dir, shrink_seconds=3.0)
    report = Campaign(hostile_pool, options).run()
    assert report.cases == cases
    kinds = {r.finding.kind for r in report.findings}
    assert {"crash-signal", "hang", "oom"} <= kinds, kinds
    for record in report.findings:
        saved = json.loads(record.path.read_text())
        assert saved["signature"] == record.finding.signature
    assert report.restarts >= 2


def first_value_finding(pool: Pool, seed: int = 0, limit: int = 400) -> int:
    from fuzz.space import draw_indexed

    target = RemoteTarget(pool)
    for index in range(limit):
        finding = run_case(target, draw_indexed(pool.info, seed, index), "cpu").verdict.finding
        if finding is not None and finding.kind not in ("crash-signal", "hang", "oom"):
            return index
    pytest.skip(f"no value finding in the first {limit} cases of seed {seed}")


def batch(start: int, count: int, number: int = 1) -> dict:
    return {"campaign": "test", "batch": number, "seed": 0, "start": start, "count": count, "synthetic": True, "device": "cpu",
            "known": [], "probe_every": 0, "shrink_seconds": 1.0}


def test_a_worker_waiting_for_its_ack_is_no_hang(hostile_pool):
    """While the coordinator keeps a finding's ack back (it is busy with a case on the spare), the
    worker waits past the case timeout without being taken for a hung one."""
    index = first_value_finding(hostile_pool)
    hostile_pool.start_batch(0, batch(index, 1))
    messages: list = []
    deadline = time.monotonic() + 60
    while not any(name == "finding" for _, name, _ in messages):
        assert time.monotonic() < deadline, "no finding reported"
        found, losses = hostile_pool.poll(0.1)
        assert not losses
        messages += found
    spare = hostile_pool.spare_target()
    restarts = hostile_pool.restarts
    time.sleep(2 * hostile_pool.case_timeout)
    assert run_case(spare, HARMLESS, "cpu").verdict.status == "pass"
    found, losses = hostile_pool.poll(0.1)
    assert not losses and hostile_pool.restarts == restarts, "a worker waiting for its ack is not hung"
    hostile_pool.ack(0)
    deadline = time.monotonic() + 60
    while not any(name == "batch" for _, name, _ in found):
        assert time.monotonic() < deadline, "the batch did not end"
        more, losses = hostile_pool.poll(0.1)
        assert not losses
        found += more
    assert next(payload for _, name, payload in found if name == "batch")["done"] == 1


def test_interrupting_a_busy_worker_is_no_loss_and_leaves_a_fresh_one(hostile_pool):
    hostile_pool.send(hostile_pool.workers[0], "execute", {"id": 0, "case": to_dict(hostile("hang")), "device": "cpu", "probe": False})
    time.sleep(0.5)  # it runs the hanging case
    restarts = hostile_pool.restarts
    batch_id, index, phase = hostile_pool.interrupt(0)
    assert (batch_id, phase) == (-1, protocol.RUNNING)
    assert hostile_pool.poll(0.2) == ([], [])
    assert hostile_pool.restarts == restarts
    assert run_case(RemoteTarget(hostile_pool), HARMLESS, "cpu").verdict.status == "pass"


def test_one_case_on_the_spare_returns_while_another_worker_reports(hostile_pool):
    """What other workers send while `execute` waits is kept for the next poll, and the wait still ends."""
    spare = hostile_pool.spare_target()
    hostile_pool.start_batch(0, batch(200, 8, number=7))
    result: list = []
    waiting = threading.Thread(target=lambda: result.append(run_case(spare, hostile("hang"), "cpu")), daemon=True)
    waiting.start()  # the hanging case: it takes the whole case timeout, the batch far less
    waiting.join(60)
    assert not waiting.is_alive(), "execute never returned"
    assert result[0].verdict.finding.kind == "hang"
    events, deadline = [], time.monotonic() + 60
    while not any(name == "batch" for _, name, _ in events):
        assert time.monotonic() < deadline, events
        messages, losses = hostile_pool.poll(0.1)
        events += messages + [(loss.worker, "loss", {}) for loss in losses]
        if any(name == "finding" for _, name, _ in messages):
            hostile_pool.ack(0)
        if losses:
            break
    assert events and events[0][0] == 0, "worker 0's report, kept while execute waited"
