"""Fold campaign findings into corpus/findings: one file per signature, with the releases it affects.

Usage: python scripts/curate_findings.py CAMPAIGN_CORPUS_DIR... [--from 0.19.1] [--to 0.32.0] [--out corpus/findings]

Every finding file is replayed on every release of the range (one worker process per release, all
cases through it); a signature's `affected_versions` are the releases where its case fails with
that same signature. Findings whose case is already in the output folder under the same
signature are not duplicated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fuzz import corpus, releases
from fuzz.pool import Pool, RemoteTarget
from fuzz.runner import run_case


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--from", dest="low", default="0.19.1")
    parser.add_argument("--to", dest="high", default=None)
    parser.add_argument("--out", type=Path, default=Path("corpus/findings"))
    args = parser.parse_args()
    chosen: dict[str, corpus.Entry] = {}
    for folder in args.folders:
        for entry in corpus.entries(folder):
            signature = entry.meta.get("signature")
            if signature and entry.meta.get("minimized") and signature not in chosen:
                chosen[signature] = entry
    affected: dict[str, list[str]] = {s: [] for s in chosen}
    for version in releases.releases_between(args.low, args.high):
        with Pool(releases.resolve(version), workers=1, case_timeout=30) as pool:
            target = RemoteTarget(pool)
            for signature, entry in chosen.items():
                found = run_case(target, entry.case, "cpu").verdict.finding
                if found is not None and found.signature == signature:
                    affected[signature].append(version)
        print(version, "done", flush=True)
    for signature, entry in chosen.items():
        meta = {**entry.meta, "affected_versions": affected[signature]}
        path = corpus.save_finding(args.out, entry.case, meta)
        print(json.dumps({"signature": signature, "file": str(path), "affected": affected[signature]}))


if __name__ == "__main__":
    main()
