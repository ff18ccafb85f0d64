#!/usr/bin/env python3
"""Compare the default engine (fuzz.campaign.pool.Pool + fuzz.campaign.engine.Campaign) with the atheris engine.

Both run on the same target and fuzzing budget, one after the other, each into a fresh corpus
folder, with one fuzzing process each. Printed per engine and target: cases, cases/s, distinct
finding signatures, time and cases to the first vLLM #38831-style finding (compressed MLA with
storage_block_size < block_size and kernel-block splitting, a crash-on-valid in the 0.22
reshape), atheris' coverage, and startup time (vLLM import, plus instrumentation for atheris),
which the budget does not count for either engine.

The default engine shrinks each new finding inside its budget, on its only worker; atheris
shrinks after its budget, so here atheris runs with --minimize-time 0 (the fuzzing phases compare
like for like, except that the default engine also spends part of its budget shrinking).

    KVFUZZ_WHEELHOUSE=/tmp/whl .venv/bin/python scripts/bench_engines.py --vllm 0.22.0 installed --budget 60
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fuzz.corpus.file import load  # noqa: E402
from fuzz.targets.releases import TargetSource, resolve  # noqa: E402


def is_38831(finding: dict[str, Any]) -> bool:
    """A crash-on-valid of compressed MLA in the backend-shaped reshape, on a case with compression
    and a kernel block smaller than the manager block."""
    if finding["kind"] != "crash-on-valid" or "mla" not in finding["spec_kind"] or finding["function"] != "_reshape_kv_cache":
        return False
    try:
        case = load(finding["case_file"])
    except Exception:  # noqa: BLE001 - a case file replaced while shrinking: judge by the signature alone
        return True
    return any(g.spec.compress_ratio > 1 and (g.kernel_block_size or g.spec.block_size) < g.spec.block_size for g in case.groups)


def run_default(source: TargetSource, budget: float, seed: int, device: str, corpus_dir: Path) -> dict[str, Any]:
    from fuzz.campaign.engine import Campaign, CampaignOptions
    from fuzz.campaign.pool import Pool

    began = time.monotonic()
    with Pool(source, workers=1) as pool:
        startup = time.monotonic() - began
        options = CampaignOptions(device=device, max_time=budget, seed=seed, corpus_dir=corpus_dir)
        report = Campaign(pool, options).run().to_dict()
    report["startup_s"] = round(startup, 3)
    return report


def run_atheris(source: TargetSource, budget: float, seed: int, device: str, corpus_dir: Path, flags: list[str]) -> dict[str, Any]:
    from fuzz.engines.atheris_engine import run_atheris as run

    return run(source, device=device, max_time=budget, seed=seed, corpus_dir=corpus_dir, out=io.StringIO(), minimize_time=0,
               quiet=True, extra_flags=flags)


def summarize(engine: str, report: dict[str, Any]) -> dict[str, Any]:
    first = [f for f in report["findings"] if is_38831(f)]
    first.sort(key=lambda f: f["seconds_until_found"])
    coverage = report.get("coverage") or {}
    return {
        "engine": engine,
        "target": f"{report['target']['spec']} ({report['target']['vllm_version']})",
        "cases": report["cases"],
        "cases_per_s": report["cases_per_s"],
        "elapsed_s": report["elapsed_s"],
        "signatures": len({f["signature"] for f in report["findings"]}),
        "kinds": sorted({f["kind"] for f in report["findings"]}),
        "first_38831_s": first[0]["seconds_until_found"] if first else None,
        "first_38831_cases": first[0]["cases_until_found"] if first else None,
        "edges": coverage.get("edges"),
        "features": coverage.get("features"),
        "restarts": report.get("restarts", 0),
        "startup_s": report.get("startup_s"),
    }


def table(rows: list[dict[str, Any]]) -> str:
    columns = ("engine", "target", "cases", "cases_per_s", "signatures", "first_38831_s", "first_38831_cases", "edges", "features",
               "restarts", "startup_s")
    text = [list(columns)] + [["-" if row[c] is None else str(row[c]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in text) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", nargs="+", default=["0.22.0", "installed"], help="targets (default: 0.22.0 installed)")
    parser.add_argument("--budget", type=float, default=60.0, help="fuzzing seconds per engine and target (default 60)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="campaign seeds (default 0)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engines", nargs="+", default=["default", "atheris"], choices=["default", "atheris"])
    parser.add_argument("--atheris-flag", action="append", default=[], help="extra libFuzzer flag for atheris, e.g. -use_value_profile=1")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    for spec in args.vllm:
        source = resolve(spec)
        for seed in args.seeds:
            for engine in args.engines:
                corpus_dir = Path(tempfile.mkdtemp(prefix=f"kvfuzz-bench-{engine}-"))
                if engine == "default":
                    report = run_default(source, args.budget, seed, args.device, corpus_dir)
                else:
                    report = run_atheris(source, args.budget, seed, args.device, corpus_dir, args.atheris_flag)
                row = {**summarize(engine, report), "seed": seed}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
