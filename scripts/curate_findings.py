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
replayed on every release and keeps its own signature on the releases that still show it; a
signature a case now shows where no kept file expects it (a kind that changed, an AssertionError
refusal that became `assert-on-invalid`) is kept under a file of its own, so every replay of the
folder on any release is expected; files whose signature no release shows any more are removed. A
case vLLM derives differently from what it states (a case error) is reported.
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
    parser.add_argument("--cache", type=Path, help="with --refresh: keep (or reuse) every release's results in this JSON file")
    args = parser.parse_args()
    if args.refresh:
        refresh(args.folders[0], args.low, args.high, args.cache)
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
        # The signature the case shows now on the release it was found on (the verdicts may have named it anew since).
        now = seen[key].get(str(entry.meta.get("vllm_version")))
        signature = now.signature if isinstance(now, Finding) else json.loads(key)[0]
        affected = [v for v, f in seen[key].items() if isinstance(f, Finding) and f.signature == signature]
        group = (signature, tuple(affected))
        if not affected or group in written:
            continue
        written.add(group)
        first = seen[key][affected[0]]
        assert isinstance(first, Finding)
        path = corpus.save_finding(out, entry.case, {**entry.meta, **first.to_dict(), "affected_versions": affected})
        print(json.dumps({"signature": signature, "file": str(path), "affected": affected}))


def refresh(folder: Path, low: str, high: str | None, cache: Path | None = None) -> None:
    found = {str(entry.path): entry for entry in sorted(corpus.entries(folder), key=lambda e: str(e.path))}
    seen = _cached_replay(found, low, high, cache)
    # Each case keeps its own signature where it still shows it; a signature a case shows where no kept
    # file expects it (a kind that changed, an AssertionError now assert-on-invalid) gets a file of its own.
    covered: dict[str, set[str]] = {}
    keep: list[tuple[corpus.Entry, Finding, list[str]]] = []
    groups: set[tuple[str, tuple[str, ...]]] = set()  # (signature, releases) already kept: a second case adds nothing
    for own_only in (True, False):
        for key, entry in found.items():
            errors = {v: e for v, e in seen[key].items() if isinstance(e, str)}
            if errors and own_only:
                print(json.dumps({"case_error": key, "releases": errors}))
            shown: dict[str, list[str]] = {}
            for version, result in seen[key].items():
                if not isinstance(result, Finding) or (result.signature == entry.expected_signature) != own_only:
                    continue
                if own_only or result.signature not in covered.get(version, set()):
                    shown.setdefault(result.signature, []).append(version)
            for signature, affected in shown.items():
                if (signature, tuple(affected)) in groups:
                    continue
                groups.add((signature, tuple(affected)))
                first = seen[key][affected[0]]
                assert isinstance(first, Finding)
                keep.append((entry, first, affected))
                for version in affected:
                    covered.setdefault(version, set()).add(first.signature)
    written = set()
    for entry, first, affected in keep:
        meta = {**entry.meta, **first.to_dict(), **TARGETS[affected[0]], "affected_versions": affected, "vllm_version": affected[0],
                "target": affected[0]}
        path = corpus.save_finding(folder, entry.case, meta)
        written.add(path)
        if entry.expected_signature != first.signature or entry.meta.get("affected_versions") != affected:
            print(json.dumps({"file": str(path), "signature": first.signature, "affected": affected, "from": str(entry.path)}))
    for key in found:
        if Path(key) not in written:
            Path(key).unlink()
            print(json.dumps({"removed": key, "signature": found[key].meta.get("signature")}))


def _cached_replay(found: dict[str, corpus.Entry], low: str, high: str | None, cache: Path | None) -> dict[str, dict[str, Finding | str]]:
    """replay_everywhere, read from / written to `cache` (JSON) so a refresh can be re-derived without replaying."""
    if cache is not None and cache.exists():
        data = json.loads(cache.read_text())
        TARGETS.update(data["targets"])
        return {key: {v: r if isinstance(r, str) else Finding.from_dict(r) for v, r in per.items()} for key, per in data["seen"].items()}
    seen = replay_everywhere(found, low, high)
    if cache is not None:
        cache.write_text(json.dumps({"targets": TARGETS, "seen": {key: {v: r if isinstance(r, str) else r.to_dict() for v, r in per.items()}
                                                                  for key, per in seen.items()}}))
    return seen


if __name__ == "__main__":
    main()
