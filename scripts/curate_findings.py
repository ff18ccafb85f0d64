"""Fold campaign findings into corpus/findings: one file per signature, with the releases it affects.

Usage: python scripts/curate_findings.py CAMPAIGN_CORPUS_DIR... [--from 0.19.1] [--to 0.32.0] [--out corpus/findings]

Every finding file is replayed on every release of the range (one worker process per release, all
cases through it); a case's `affected_versions` are the releases where it fails with its own
signature. One signature text can come from different bugs in different releases (a page escape
in 0.21 and in 0.27 has other causes), so one case is kept per signature and campaign folder, and
cases are merged only when their signature and affected releases are the same. Cases that no
release reproduces (the oracle or generator changed since) are dropped. A kept finding names the
layer and numbers of the first release it fails on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fuzz.campaign.pool import Pool, RemoteTarget
from fuzz.corpus import store as corpus
from fuzz.targets import releases
from fuzz.verdict.findings import Finding
from fuzz.verdict.runner import run_case


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--from", dest="low", default="0.19.1")
    parser.add_argument("--to", dest="high", default=None)
    parser.add_argument("--out", type=Path, default=Path("corpus/findings"))
    args = parser.parse_args()
    chosen: dict[tuple[str, Path], corpus.Entry] = {}
    for folder in args.folders:
        for entry in corpus.entries(folder):
            signature = entry.meta.get("signature")
            if signature and entry.meta.get("minimized"):
                chosen.setdefault((signature, folder), entry)
    affected: dict[tuple[str, Path], list[str]] = {key: [] for key in chosen}
    first: dict[tuple[str, Path], Finding] = {}
    for version in releases.releases_between(args.low, args.high):
        with Pool(releases.resolve(version), workers=1, case_timeout=30) as pool:
            target = RemoteTarget(pool)
            for key, entry in chosen.items():
                found = run_case(target, entry.case, "cpu").verdict.finding
                if found is not None and found.signature == key[0]:
                    affected[key].append(version)
                    first.setdefault(key, found)
        print(version, "done", flush=True)
    written: set[tuple[str, tuple[str, ...]]] = set()
    for key, entry in chosen.items():
        group = (key[0], tuple(affected[key]))
        if not affected[key] or group in written:
            continue
        written.add(group)
        path = corpus.save_finding(args.out, entry.case, {**entry.meta, **first[key].to_dict(), "affected_versions": affected[key]})
        print(json.dumps({"signature": key[0], "file": str(path), "affected": affected[key]}))


if __name__ == "__main__":
    main()
