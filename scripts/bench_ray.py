"""Campaign throughput on Ray against the local pool, on this machine.

Ray nodes are simulated with ray.cluster_utils.Cluster (single-CPU nodes on one box). Every
campaign has the same seed and case budget and a fresh corpus. Local runs alternate with Ray runs
at the same worker count, so both see the same background load:

  phase 1: a 1-node Ray cluster (1 actor)    vs  a local Pool with 1 worker
  phase 2: the same cluster with a 2nd node  vs  a local Pool with 2 workers   (2 actors, one per node)

Three figures per campaign: cases per wall-clock second; CPU milliseconds per case spent by every
process involved (coordinator, Ray's daemons, actors, zygotes, workers); and how busy the workers
were (the share of wall time they spent inside batches, not waiting for the coordinator). The last
two hardly move with the machine's background load, so they show Ray's overhead even on a busy box.

Usage: .venv/bin/python scripts/bench_ray.py [--cases 20000] [--repeats 3] [--seed 0] [--vllm installed]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuzz.campaign import protocol
from fuzz.campaign.engine import Campaign, CampaignOptions  # noqa: E402
from fuzz.campaign.pool import Pool  # noqa: E402
from fuzz.cluster.pool import RayPool, open_ray_pool  # noqa: E402
from fuzz.targets import releases  # noqa: E402

NODE = {"num_cpus": 1, "object_store_memory": 100 << 20}
TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Run:
    rate: float  # cases per second
    cpu_ms: float  # CPU milliseconds per case
    busy: float  # worker time inside batches / (workers x wall time)


class Metered:
    """A pool that adds up the time its workers report having spent on batches."""

    def __init__(self, pool: Pool | RayPool) -> None:
        self.pool = pool
        self.busy_s = 0.0

    def __getattr__(self, name: str) -> object:
        return getattr(self.pool, name)

    def poll(self, timeout: float) -> tuple[list, list]:
        messages, losses = self.pool.poll(timeout)
        self.busy_s += sum(payload["elapsed"] for _, name, payload in messages if name == protocol.BATCH)
        return messages, losses


def process_cpu(pid: int) -> float:
    """CPU seconds of a process and of its children it has reaped."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(value) for value in fields[11:15]) / TICK


def tree_cpu(root: int) -> float:
    """CPU seconds of `root` and all its live descendants (Ray's daemons and actors descend from this process)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += process_cpu(pid)
        stack += children.get(pid, [])
    return total


def local_cpu(pool: Pool) -> float:
    """The local pool's share: the coordinating thread, and the zygote with its workers."""
    assert pool.zygote is not None
    return time.thread_time() + tree_cpu(pool.zygote.pid)


def campaign(pool: Pool | RayPool, args: argparse.Namespace, cpu: Callable[[], float]) -> Run:
    with tempfile.TemporaryDirectory(prefix="kvfuzz-bench-") as folder:
        options = CampaignOptions(device="cpu", max_time=3600, max_cases=args.cases, seed=args.seed, corpus_dir=Path(folder))
        metered = Metered(pool)
        before = cpu()
        report = Campaign(metered, options).run()  # type: ignore[arg-type]
        spent = cpu() - before
    assert report.cases == args.cases, report.cases
    return Run(report.cases_per_s, 1000 * spent / report.cases, metered.busy_s / (len(pool.fuzzers()) * report.elapsed_s))


def alternate(runs: dict[str, Callable[[], Run]], repeats: int) -> dict[str, Run]:
    """Median figures of each run, the runs taking turns."""
    results: dict[str, list[Run]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            results[name].append(run())
            print(f"  {describe(name, results[name][-1])}  (load {os.getloadavg()[0]:.1f})", flush=True)
    return {name: Run(*(statistics.median(getattr(r, key) for r in rs) for key in ("rate", "cpu_ms", "busy"))) for name, rs in results.items()}


def describe(name: str, run: Run) -> str:
    return f"{name:10} {run.rate:8.1f} cases/s {run.cpu_ms:7.3f} CPU ms/case  workers busy {run.busy:6.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm", default="installed")
    args = parser.parse_args()

    from ray.cluster_utils import Cluster

    source = releases.resolve(args.vllm)
    print(f"kvfuzz bench: --vllm {args.vllm}, seed {args.seed}, {args.cases} cases a campaign, median of {args.repeats}", flush=True)
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    medians: dict[str, Run] = {}
    try:
        for workers in (1, 2):
            if workers == 2:
                cluster.add_node(**NODE)
            print(f"phase {workers}: {workers} Ray node(s) against {workers} local worker(s)", flush=True)
            with Pool(source, workers=workers) as local, open_ray_pool(source, cluster.address, device="cpu") as remote:
                assert len(remote.fuzzers()) == workers
                runs = {f"local x{workers}": lambda: campaign(local, args, lambda: local_cpu(local)),
                        f"ray x{workers}": lambda: campaign(remote, args, lambda: tree_cpu(os.getpid()))}
                medians.update(alternate(runs, args.repeats))
    finally:
        cluster.shutdown()

    print(f"\nmedians (load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores):")
    for name, run in medians.items():
        print(f"  {describe(name, run)}")
    print("ratios:")
    print(f"  ray 2 nodes / 1 node, cases/s     {medians['ray x2'].rate / medians['ray x1'].rate:.2f}x   (aim >= 1.7x)")
    print(f"  local 2 / 1 workers, cases/s      {medians['local x2'].rate / medians['local x1'].rate:.2f}x   (what this box allows)")
    for workers in (1, 2):
        ray_run, local_run = medians[f"ray x{workers}"], medians[f"local x{workers}"]
        print(f"  ray vs local, {workers} worker(s): cases/s {ray_run.rate / local_run.rate - 1:+.1%}, "
              f"CPU per case {ray_run.cpu_ms / local_run.cpu_ms - 1:+.1%}, workers busy {ray_run.busy - local_run.busy:+.1%} points"
              "   (aim: overhead <= 10%)")


if __name__ == "__main__":
    main()
