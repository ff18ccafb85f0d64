"""One campaign on one tree, for `kvfuzz mutate`: `python -m fuzz.mutate.one CONFIG OUT`.

A process of its own per mutant (its zygote imports the mutant's vLLM), so mutants run side by
side and a mutant that wrecks its process takes nothing else with it. The campaign starts from a
corpus that knows the unmutated tree's findings and stops at the first finding beyond them; OUT
gets the status (`found`, `quiet` or `stillborn`), that finding and its case.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from fuzz.campaign.engine import Campaign, CampaignOptions, FoundRecord
from fuzz.campaign.pool import Pool
from fuzz.case import to_dict
from fuzz.corpus import store
from fuzz.errors import KvfuzzError
from fuzz.targets.releases import TargetSource


def beyond(baseline: dict[str, int], signature: str, index: int) -> bool:
    """Whether a finding at case `index` is one the unmutated tree does not show on that case. `baseline`: the case index
    at which the unmutated tree first showed each signature; the same seed draws the same case at each index, so a
    signature met earlier than that (or never met there) is met on a case where the unmutated tree does not show it."""
    return index < baseline.get(signature, index + 1)


def run(config: dict) -> dict:
    # This process's PYTHONPATH already puts the tree (a mutant's, or the unmutated one) first.
    source = TargetSource(spec="mutant", kind="installed", version=None, python_path=None)
    corpus_dir = Path(config["corpus"])
    baseline: dict[str, int] = config.get("first_index", {})

    def beyond_baseline(record: FoundRecord) -> bool:
        return beyond(baseline, record.finding.signature, record.index)

    starting = time.monotonic()
    try:
        # The unmutated tree's zygote leaves a standby; a mutant's zygote is a fork of it with the mutated function swapped
        # in (fuzz/mutate/swap.py), or where that cannot be, an import of the mutant's tree, which leaves none.
        fork_of = config.get("fork_of")
        pool = Pool(source, workers=1, case_timeout=config["case_timeout"], max_memory=config["max_memory"], keep_warm=fork_of is None,
                    fork_of=(fork_of["key"], fork_of["patch"]) if fork_of else None)
    except KvfuzzError as error:
        return {"status": "stillborn", "detail": str(error)}
    start_s = round(time.monotonic() - starting, 2)
    standby_key, warm, fork_failure = pool.standby_key, pool.warm, pool.fork_failure
    with pool:
        options = CampaignOptions(device=config["device"], max_time=config["budget"], seed=config["seed"], corpus_dir=corpus_dir,
                                  synthetic=config["synthetic"], shrink_seconds=config.get("shrink_seconds", 0.0))
        campaign = Campaign(pool, options, until=beyond_baseline if config["stop_at_new"] else None)
        report = campaign.run()
    new = [r for r in report.findings if beyond_baseline(r)]
    result: dict = {"status": "found" if new else "quiet", "cases": report.cases, "start_s": start_s, "elapsed_s": round(report.elapsed_s, 2),
                    "standby_key": standby_key, "forked": warm, "fork_failure": fork_failure,
                    "signatures": sorted(r.finding.signature for r in report.findings),
                    "first_index": {r.finding.signature: r.index for r in report.findings}}
    if new:
        first = new[0]
        entry = next(store.entries(first.path))
        result.update({"signature": first.finding.signature, "kind": first.finding.kind, "index": first.index,
                       "case": to_dict(entry.case)})
    return result


def main(config_path: str, out_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    store.write_atomic(Path(out_path), run(config))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
