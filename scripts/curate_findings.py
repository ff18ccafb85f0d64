"""Fold campaign findings into corpus/findings: one file per signature, with the releases it affects.

Usage:
  python scripts/curate_findings.py CAMPAIGN_CORPUS_DIR... [--from 0.19.1] [--to 0.32.0] [--out corpus/findings]
  python scripts/curate_findings.py --refresh corpus/findings [--from 0.19.1] [--to 0.32.0]

Every finding file is replayed on every release of the range (one worker process per release, all
cases through it); a case's `affected_versions` are the releases where it fails with its own
signature. One signature text can come from different bugs in different releases (a page escape
in 0.21 and in 0.27 has other causes), so one case is kept per signature and campaign folder, and
cases are merged only when their signature and affected releases are the same. Cases that no
release reproduces (the oracle or generator changed since) are dropped. A kept finding names the
layer and numbers of the first release it fails on.

--refresh re-derives a corpus folder after the oracle or the verdicts changed: each kept case is
replayed on every release, and it is kept under every signature it now shows (a case whose
AssertionError refusal became `assert-on-invalid` on one release and that crashes on another is
kept once per signature, each with the releases that show it); files whose signature no release
shows any more are removed. A case vLLM derives differently from what it states (a case error) is
reported and left alone.
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
    parser.add_argument("--refresh", action="store_true", help="re-derive the signatures and releases of the one folder given")
    args = parser.parse_args()
    if args.refresh:
        refresh(args.folders[0], args.low, args.high)
    else:
        curate(args.folders, args.low, args.high, args.out)


TARGETS: dict[str, dict[str, str]] = {}  # release -> the generation and contract its adapter reported


def replay_everywhere(cases: dict[str, corpus.Entry], low: str, high: str | None) -> dict[str, dict[str, Finding | str]]:
    """For every case key, what each release of the range says: its finding, or a case error (str)."""
    seen: dict[str, dict[str, Finding | str]] = {key: {} for key in cases}
    for version in releases.releases_between(low, high):
        with Pool(releases.resolve(version), workers=1, case_timeout=30) as pool:
            target = RemoteTarget(pool)
            TARGETS[version] = {"generation": target.info.generation, "contract": target.info.contract.name}
            for key, entry in cases.items():
                verdict = run_case(target, entry.case, "cpu").verdict
                if verdict.status == "case-error":
                    seen[key][version] = verdict.reason or "case error"
                elif verdict.finding is not None:
                    seen[key][version] = verdict.finding
        print(version, "done", flush=True)
    return seen


def curate(folders: list[Path], low: str, high: str | None, out: Path) -> None:
    chosen: dict[str, corpus.Entry] = {}
    for folder in folders:
        for entry in corpus.entries(folder):
            signature = entry.meta.get("signature")
            if signature and entry.meta.get("minimized"):
                chosen.setdefault(json.dumps([signature, str(folder)]), entry)
    seen = replay_everywhere(chosen, low, high)
    written: set[tuple[str, tuple[str, ...]]] = set()
    for key, entry in chosen.items():
        signature = json.loads(key)[0]
        affected = [v for v, f in seen[key].items() if isinstance(f, Finding) and f.signature == signature]
        group = (signature, tuple(affected))
        if not affected or group in written:
            continue
        written.add(group)
        first = seen[key][affected[0]]
        assert isinstance(first, Finding)
        path = corpus.save_finding(out, entry.case, {**entry.meta, **first.to_dict(), "affected_versions": affected})
        print(json.dumps({"signature": signature, "file": str(path), "affected": affected}))


def refresh(folder: Path, low: str, high: str | None) -> None:
    found = {str(entry.path): entry for entry in corpus.entries(folder)}
    seen = replay_everywhere(found, low, high)
    keep: dict[Path, tuple[corpus.Entry, Finding, list[str]]] = {}
    for key, entry in found.items():
        errors = {v: e for v, e in seen[key].items() if isinstance(e, str)}
        if errors:
            print(json.dumps({"case_error": key, "releases": errors}))
        by_signature: dict[str, list[str]] = {}
        for version, result in seen[key].items():
            if isinstance(result, Finding):
                by_signature.setdefault(result.signature, []).append(version)
        for affected in by_signature.values():
            first = seen[key][affected[0]]
            assert isinstance(first, Finding)
            path = folder / f"{first.signature_id}-{entry.case.content_hash()}.json"
            keep.setdefault(path, (entry, first, affected))
    written = set()
    for path, (entry, first, affected) in keep.items():
        meta = {**entry.meta, **first.to_dict(), **TARGETS[affected[0]], "affected_versions": affected, "vllm_version": affected[0],
                "target": affected[0]}
        written.add(corpus.save_finding(folder, entry.case, meta))
        if str(path) not in found or found[str(path)].meta.get("signature") != first.signature:
            print(json.dumps({"new": str(path), "signature": first.signature, "affected": affected}))
    for key in found:
        if Path(key) not in written:
            Path(key).unlink()
            print(json.dumps({"removed": key}))


if __name__ == "__main__":
    main()
