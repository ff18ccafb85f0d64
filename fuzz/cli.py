"""The kvfuzz command. Exit status: 0 clean, 1 new findings (or replay failures), 2 usage/setup error."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from fuzz.errors import KvfuzzError, UsageError


def _device(value: str) -> str:
    if value == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if value not in ("cpu", "cuda") and not value.startswith("cuda:"):
        raise argparse.ArgumentTypeError(f"{value!r} is not cpu, cuda or auto")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfuzz", description="Differential fuzzing of vLLM's KV-cache layout code.")
    sub = parser.add_subparsers(dest="command", required=True)

    def target_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--vllm", default="installed", help="vLLM to test: 'installed' (default)")
        p.add_argument("--device", type=_device, default="auto", help="cpu, cuda or auto (cuda when available)")

    run = sub.add_parser("run", help="run a fuzz campaign")
    target_options(run)
    run.add_argument("--max-time", type=float, default=60.0, help="seconds to fuzz (default 60)")
    run.add_argument("--max-cases", type=int, default=10**9, help="stop after this many cases")
    run.add_argument("--seed", type=int, default=0, help="campaign seed (default 0)")
    run.add_argument("--corpus", type=Path, default=Path("corpus/findings"), help="where findings go")
    run.add_argument("--report", type=Path, help="write the JSON report here")
    run.add_argument("--no-synthetic", action="store_true", help="draw only vLLM's own backends")

    replay = sub.add_parser("replay", help="re-run corpus files")
    target_options(replay)
    replay.add_argument("path", type=Path, help="a case file or a folder of them")

    explain = sub.add_parser("explain", help="expected and actual layout of one case")
    target_options(explain)
    explain.add_argument("case", type=Path)
    explain.add_argument("--json", action="store_true", help="print both layouts as JSON")
    return parser


def main(argv: list[str] | None = None, stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return 2 if exit_.code else 0
    try:
        return {"run": _run, "replay": _replay, "explain": _explain}[args.command](args, stdout)
    except KvfuzzError as error:
        print(f"kvfuzz: error: {error}", file=stderr)
        return 2
    except KeyboardInterrupt:
        print("kvfuzz: interrupted", file=stderr)
        return 130


def _run(args: argparse.Namespace, out: TextIO) -> int:
    from fuzz.campaign import run_campaign
    from fuzz.targets import load_target

    if args.max_time <= 0 or args.max_cases <= 0:
        raise UsageError("--max-time and --max-cases must be positive")
    target = load_target(args.vllm)
    info = target.info
    print(f"kvfuzz: vLLM {info.vllm_version} ({info.generation}, contract {info.contract.name}) on {args.device}", file=out)
    last = [time.monotonic()]

    def progress(report: Any) -> None:
        if time.monotonic() - last[0] >= 5:
            last[0] = time.monotonic()
            print(f"  {report.cases} cases, {len(report.findings)} new findings", file=out, flush=True)

    report = run_campaign(target, device=args.device, max_time=args.max_time, max_cases=args.max_cases,
                          seed_value=args.seed, corpus_dir=args.corpus, synthetic=not args.no_synthetic,
                          progress=progress)
    data = report.to_dict()
    print(f"kvfuzz: {data['cases']} cases in {data['elapsed_s']} s ({data['cases_per_s']} cases/s): "
          f"{dict(report.verdicts)}", file=out)
    for finding in data["findings"]:
        latent = " (latent: synthetic backend)" if finding["latent"] else ""
        print(f"  NEW {finding['kind']}{latent}: {finding['signature']}\n      {finding['case_file']}", file=out)
    if args.report:
        args.report.write_text(json.dumps(data, indent=1) + "\n")
    return 1 if data["findings"] else 0


def _replay(args: argparse.Namespace, out: TextIO) -> int:
    from fuzz.corpus import entries
    from fuzz.replay import replay_entry
    from fuzz.targets import load_target

    if not args.path.exists():
        raise UsageError(f"{args.path}: no such file or folder")
    target = load_target(args.vllm)
    failures = 0
    for entry in entries(args.path):
        outcome = replay_entry(target, entry, args.device)
        failures += outcome.status == "unexpected"
        print(f"{outcome.status:10} {entry.path}  {outcome.detail}", file=out)
    return 1 if failures else 0


def _explain(args: argparse.Namespace, out: TextIO) -> int:
    from fuzz.case import load
    from fuzz.explain import explain
    from fuzz.targets import load_target

    case = load(args.case)
    target = load_target(args.vllm)
    print(explain(target, case, args.device, as_json=args.json), file=out)
    return 0


def entry_point() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
