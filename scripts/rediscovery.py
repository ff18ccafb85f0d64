"""Time and cases to the first #38831 finding on vLLM 0.22.0, over several campaign seeds.

Usage: python scripts/rediscovery.py [--seeds 10] [--max-time 120] [--vllm 0.22.0]
Each seed runs the default campaign (same generators as for every target) until the first
crash-on-valid on a compressed MLA case in _reshape_kv_cache, or the time budget. Prints one row
per seed and the median and worst time and case count.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from fuzz.campaign.engine import Campaign, CampaignOptions, FoundRecord
from fuzz.campaign.pool import Pool
from fuzz.case import MLA_KINDS
from fuzz.targets import releases


def is_38831(record: FoundRecord) -> bool:
    f = record.finding
    return f.kind == "crash-on-valid" and f.spec_kind in MLA_KINDS and f.function == "_reshape_kv_cache"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--max-time", type=float, default=120.0)
    parser.add_argument("--vllm", default="0.22.0")
    args = parser.parse_args()
    rows = []
    with Pool(releases.resolve(args.vllm), workers=1) as pool:
        for seed in range(1, args.seeds + 1):
            with tempfile.TemporaryDirectory() as corpus:
                options = CampaignOptions(max_time=args.max_time, seed=seed, corpus_dir=Path(corpus))
                report = Campaign(pool, options, until=is_38831).run()
            hit = next((r for r in report.findings if is_38831(r)), None)
            rows.append((seed, hit))
            print(f"seed {seed:2}: " + (f"found after {hit.seconds_until:6.2f} s, {hit.cases_until:6} cases: {hit.finding.signature[:110]}"
                                        if hit else f"NOT FOUND in {report.elapsed_s:.0f} s, {report.cases} cases"), flush=True)
    found = [hit for _, hit in rows if hit]
    print(f"found for {len(found)} of {len(rows)} seeds")
    if found:
        seconds, cases = [h.seconds_until for h in found], [h.cases_until for h in found]
        print(f"time to first: median {statistics.median(seconds):.2f} s, worst {max(seconds):.2f} s; "
              f"cases to first: median {statistics.median(cases):.0f}, worst {max(cases)}")


if __name__ == "__main__":
    main()
