"""Campaign throughput on Ray against the local pool, on this machine.

Ray nodes are simulated with ray.cluster_utils.Cluster (single-CPU nodes on one box). Every
campaign has the same seed and case budget and a fresh corpus. Local runs alternate with Ray runs
at the same worker count, so both see the same background load:

  phase 1: a 1-node Ray cluster (1 actor)    vs  a local Pool with 1 worker
  phase 2: the same cluster with a 2nd node  vs  a local Pool with 2 workers   (2 actors, one per node)

Usage: .venv/bin/python scripts/bench_ray.py [--cases 20000] [--repeats 3] [--seed 0] [--vllm installed]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuzz import releases  # noqa: E402
from fuzz.campaign import Campaign, CampaignOptions  # noqa: E402
from fuzz.pool import Pool  # noqa: E402
from fuzz.ray_pool import RayPool, open_ray_pool  # noqa: E402

NODE = {"num_cpus": 1, "object_store_memory": 100 << 20}


def campaign_rate(pool: Pool | RayPool, args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory(prefix="kvfuzz-bench-") as folder:
        options = CampaignOptions(device="cpu", max_time=3600, max_cases=args.cases, seed=args.seed, corpus_dir=Path(folder))
        report = Campaign(pool, options).run()
    assert report.cases == args.cases, report.cases
    return report.cases_per_s


def alternate(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Median cases/s of each run, the runs taking turns."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            rates[name].append(run())
            print(f"  {name:12} {rates[name][-1]:8.1f} cases/s", flush=True)
    return {name: statistics.median(values) for name, values in rates.items()}


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
    medians: dict[str, float] = {}
    try:
        for workers in (1, 2):
            if workers == 2:
                cluster.add_node(**NODE)
            print(f"phase {workers}: {workers} Ray node(s) against {workers} local worker(s)", flush=True)
            with Pool(source, workers=workers) as local, open_ray_pool(source, cluster.address, device="cpu") as remote:
                assert len(remote.fuzzers()) == workers
                runs = {f"local x{workers}": lambda: campaign_rate(local, args), f"ray x{workers}": lambda: campaign_rate(remote, args)}
                medians.update(alternate(runs, args.repeats))
    finally:
        cluster.shutdown()

    print("\nmedian cases/s:")
    for name, rate in medians.items():
        print(f"  {name:12} {rate:8.1f}")
    print("ratios:")
    print(f"  ray 2 nodes / ray 1 node      {medians['ray x2'] / medians['ray x1']:.2f}x   (aim >= 1.7x)")
    print(f"  local 2 / local 1 (reference) {medians['local x2'] / medians['local x1']:.2f}x")
    for workers in (1, 2):
        overhead = 1 - medians[f"ray x{workers}"] / medians[f"local x{workers}"]
        print(f"  ray overhead at {workers} worker(s)   {overhead:+.1%}   (aim <= 10%)")


if __name__ == "__main__":
    main()
