"""Campaigns on a Ray cluster: several single-CPU nodes on this machine (ray.cluster_utils.Cluster)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fuzz.campaign.engine import Campaign, CampaignOptions, Report
from fuzz.corpus.file import load
from fuzz.errors import TargetError, UsageError
from fuzz.targets import releases
from tests.hostile import make_hostile_checkout, seed_meeting

try:
    import ray
    from ray.cluster_utils import Cluster
except ImportError:
    ray = None

NODE = {"num_cpus": 1, "object_store_memory": 100 << 20}


def ray_test(function):
    """Marked `ray`, and skipped where Ray is not installed."""
    return pytest.mark.ray(pytest.mark.skipif(ray is None, reason="needs Ray (pip install ray)")(function))


@pytest.fixture(scope="module")
def cluster():
    """A head and one more node, one CPU each; the driver (this process) joins it through open_ray_pool."""
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    cluster.add_node(**NODE)
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def open_pool(cluster, spec: str = "installed", case_timeout: float = 30.0, max_memory: int = 1 << 30):
    from fuzz.cluster.pool import open_ray_pool

    return open_ray_pool(releases.resolve(spec), cluster.address, device="cpu", case_timeout=case_timeout, max_memory=max_memory)


def options(tmp_path: Path, cases: int, seed: int = 0) -> CampaignOptions:
    return CampaignOptions(device="cpu", max_time=300, max_cases=cases, seed=seed, corpus_dir=tmp_path / "corpus", shrink_seconds=5.0)


def assert_every_finding_on_disk(report: Report, corpus: Path) -> None:
    paths = {record.path for record in report.findings}
    assert all(path.exists() for path in paths)
    assert set(corpus.glob("*.json")) == paths, "the corpus holds exactly the findings reported"
    for record in report.findings:
        assert json.loads(record.path.read_text())["signature"] == record.finding.signature


def test_open_ray_pool_without_ray_says_how_to_install(monkeypatch):
    from fuzz.cluster.pool import open_ray_pool

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(UsageError, match=r"pip install 'kvfuzz\[ray\]'"):
        open_ray_pool(releases.resolve("installed"))


@ray_test
def test_campaign_spreads_over_the_nodes_then_fails_clearly_when_all_are_gone(cluster, tmp_path):
    pytest.importorskip("vllm")
    with open_pool(cluster) as pool:
        assert len(pool.fuzzers()) == 2, "one worker per CPU the cluster offers"
        report = Campaign(pool, options(tmp_path, 400)).run()
        assert report.cases == 400
        busy = [node for node in pool.nodes() if node["cases"] > 0]
        assert len(busy) >= 2, pool.nodes()
        assert sum(node["cases"] for node in pool.nodes()) == 400
        assert_every_finding_on_disk(report, tmp_path / "corpus")

        for member in pool.members:
            ray.kill(member.handle, no_restart=True)
        pool.start_batch(0, {"batch": 1, "seed": 0, "start": 0, "count": 8, "synthetic": True, "device": "cpu", "known": [],
                             "probe_every": 0})
        # Ray tells a killed actor from a restarting one within seconds on an idle box; on a loaded one it took over 60 s.
        deadline = time.monotonic() + 180
        with pytest.raises(TargetError, match="all 2 Ray workers are gone"):
            while time.monotonic() < deadline:
                pool.poll(0.2)


@pytest.mark.sweep
@ray_test
def test_a_node_lost_mid_campaign_loses_no_case_and_no_finding(cluster, tmp_path):
    pytest.importorskip("vllm")
    doomed = cluster.add_node(**NODE)
    removed_at: list[int] = []
    with open_pool(cluster) as pool:
        assert len(pool.fuzzers()) == 3
        doomed_node = next(m.node for m in pool.members if m.node == doomed.node_id)

        def remove_when_under_way(report: Report) -> None:
            ours = next(n for n in pool.nodes() if n["node"] == doomed_node)
            if not removed_at and ours["cases"] > 0 and report.cases >= 200:
                removed_at.append(report.cases)
                cluster.remove_node(doomed)

        report = Campaign(pool, options(tmp_path, 1000), progress=remove_when_under_way).run()
        nodes = {node["node"]: node for node in pool.nodes()}
        reruns = pool.reruns
    assert removed_at and removed_at[0] < 1000, "the node went away in the middle of the campaign"
    assert report.cases == 1000, "every case counted once"
    assert sum(node["cases"] for node in nodes.values()) == 1000, "the lost node's unfinished batch ran again elsewhere, once"
    assert nodes[doomed_node]["workers"] == 0 and nodes[doomed_node]["restarts"] >= 1
    assert report.restarts >= 1 and reruns >= 1
    assert_every_finding_on_disk(report, tmp_path / "corpus")


@pytest.mark.sweep
@ray_test
def test_a_release_is_shipped_to_the_nodes_and_finds_the_compressed_mla_crash(cluster, tmp_path, monkeypatch):
    if Path("/tmp/whl").is_dir() and "KVFUZZ_WHEELHOUSE" not in os.environ:
        monkeypatch.setenv("KVFUZZ_WHEELHOUSE", "/tmp/whl")
    try:
        releases.resolve("0.22.0")
    except TargetError as error:
        if "could not download" in str(error) or "is it reachable" in str(error):
            pytest.skip(f"package index unreachable: {error}")
        raise
    with open_pool(cluster, "0.22.0") as pool:
        hellos = ray.get([member.handle.hello.remote() for member in pool.members])
        report = Campaign(pool, options(tmp_path, 300, seed=1)).run()
    assert {h["info"]["vllm_version"] for h in hellos} == {"0.22.0"}
    shipped = Path(tempfile.gettempdir()) / "kvfuzz-ray"
    assert all(Path(h["target_path"]).parent == shipped for h in hellos), "the nodes import the shipped tree"
    assert report.target["vllm_version"] == "0.22.0" and report.cases == 300
    crashes = [r for r in report.findings if r.finding.kind == "crash-on-valid" and r.finding.function == "_reshape_kv_cache"]
    compressed = [r for r in crashes if any(g.spec.is_mla and g.spec.compress_ratio > 1 for g in load(r.path).groups)]
    assert compressed, [r.finding.signature for r in report.findings]
    assert all(r.minimized for r in compressed)
    assert_every_finding_on_disk(report, tmp_path / "corpus")


@pytest.mark.sweep
@ray_test
@pytest.mark.slow
def test_a_target_that_kills_its_process_on_a_node_is_recorded_as_on_one_machine(cluster, tmp_path):
    """Segfaults, aborts, hangs and memory hogs inside an actor are its local pool's losses: findings, not lost nodes."""
    pytest.importorskip("vllm")
    checkout = make_hostile_checkout(tmp_path / "hostile")
    with open_pool(cluster, str(checkout), case_timeout=2.0, max_memory=256 << 20) as pool:
        seed, cases = seed_meeting(pool.info, ("segfault", "hang", "memory"), 300)
        report = Campaign(pool, options(tmp_path, cases, seed=seed)).run()
        reruns = pool.reruns
    assert report.cases == cases
    kinds = {r.finding.kind for r in report.findings}
    assert {"crash-signal", "hang", "oom"} <= kinds, kinds
    assert report.restarts >= 2 and reruns == 0, "the workers died, not the actors"
    assert_every_finding_on_disk(report, tmp_path / "corpus")
