"""`kvfuzz selftest`: a short campaign with a probe on every case on one device, as a table.

It checks the whole machinery where it runs: the target process imports vLLM, cases are drawn
and judged, and every case is written on the device and read back: through vLLM's views
(`--probe physical`, the default), or token by token through each backend's own cache write
(`--probe kernel`: compiled ops, Triton kernels compiled for the device or interpreted on the
CPU), with the byte-addressing consumers (block zeroers, block copy, connector regions) on every
case. The exit status is 0 when the campaign found nothing new, 1 otherwise. Findings already in
the project's corpus (corpus/findings) count as known, so known vLLM bugs do not fail it.

    python -m fuzz.campaign.selftest --device cuda --max-time 60 [--probe kernel]
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from fuzz import SOURCE_ROOT
from fuzz.campaign.engine import Campaign, CampaignOptions, Report
from fuzz.campaign.pool import Pool
from fuzz.errors import KvfuzzError
from fuzz.targets import releases

KNOWN_FINDINGS = SOURCE_ROOT / "corpus" / "findings"


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return f"{device} ({platform.processor() or platform.machine()})"


@contextmanager
def _corpus(keep: Path | None) -> Iterator[Path]:
    """Where the campaign writes findings, seeded with the known ones so that only new ones count."""
    folder = keep or Path(tempfile.mkdtemp(prefix="kvfuzz-selftest-"))
    folder.mkdir(parents=True, exist_ok=True)
    if KNOWN_FINDINGS.is_dir():
        for known in KNOWN_FINDINGS.glob("*.json"):
            if not (folder / known.name).exists():
                shutil.copy(known, folder / known.name)
    try:
        yield folder
    finally:
        if keep is None:
            shutil.rmtree(folder, ignore_errors=True)


def selftest(device: str, max_time: float, out: TextIO, vllm: str = "installed", corpus: Path | None = None, seed: int = 0,
             max_cases: int = 10**12, synthetic: bool = True, case_timeout: float = 60.0, max_memory: int = 4096 << 20,
             probe: str = "physical") -> int:
    """Run the campaign and print the table; 0 when nothing new was found, 1 otherwise."""
    import torch

    name = device_name(device)
    also = ", consumers on every case" if probe == "kernel" else ""
    print(f"kvfuzz selftest: {max_time:g} s on {name}, {probe} probe on every case{also}", file=out, flush=True)
    source = releases.resolve(vllm)
    with _corpus(corpus) as folder:
        pool = Pool(source, workers=1, case_timeout=case_timeout, max_memory=max_memory)
        try:
            assert pool.info is not None
            info = pool.info
            options = CampaignOptions(device=device, max_time=max_time, max_cases=max_cases, seed=seed, corpus_dir=folder,
                                      probe_every=1, probe_kind=probe, consumers_every=1 if probe == "kernel" else 0, synthetic=synthetic)
            report = Campaign(pool, options).run()
        finally:
            pool.close()
        target = f"{info.vllm_version} ({source.label}, {info.generation}, contract {info.contract.name})"
        rows = table_rows(report, name, torch.__version__, target, probe)
        print(format_table(rows), file=out)
        for record in report.findings:
            kept = f"\n      {record.path}" if corpus is not None else ""
            print(f"  NEW {record.finding.kind}: {record.finding.signature}{kept}", file=out)
    return 1 if report.findings else 0


KERNEL_KINDS = ("kernel-crash", "kernel-escape", "kernel-miss", "kernel-order")
CONSUMER_KINDS = ("zero-escape", "zero-miss", "copy-escape", "copy-wrong", "region-mismatch")


def table_rows(report: Report, device: str, torch_version: str, vllm: str, probe: str = "physical") -> list[tuple[str, str]]:
    kinds = report.findings_by_kind()
    if probe == "kernel":
        mismatches = [("kernel findings", str(sum(kinds.get(k, 0) for k in KERNEL_KINDS))),
                      ("consumer findings", str(sum(kinds.get(k, 0) for k in CONSUMER_KINDS)))]
    else:
        mismatches = [("probe mismatches", str(kinds.get("probe-mismatch", 0)))]
    verdicts = ", ".join(f"{k} {v:,}" for k, v in sorted(report.verdicts.items())) or "none"
    return [
        ("device", device),
        ("torch", torch_version),
        ("vLLM", vllm),
        ("cases", f"{report.cases:,} in {report.elapsed_s:.1f} s ({report.stop_reason})"),
        ("cases/s", f"{report.cases_per_s:.1f}"),
        ("verdicts", verdicts),
        ("findings by kind", ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "none"),
        *mismatches,
        ("known findings met", str(report.duplicates)),
        ("worker restarts", str(report.restarts)),
        ("result", "FAIL: new findings" if report.findings else "PASS"),
    ]


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(key) for key, _ in rows)
    rule = "-" * (width + 2 + max(len(value) for _, value in rows))
    return "\n".join([rule, *(f"{key:<{width}}  {value}" for key, value in rows), rule])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fuzz.campaign.selftest", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    parser.add_argument("--max-time", type=float, default=60.0, help="seconds to fuzz (default 60)")
    parser.add_argument("--vllm", default="installed", help="'installed' (default), a release like 0.32.0, or a checkout folder")
    parser.add_argument("--corpus", type=Path, help="keep the findings here (default: a temporary folder)")
    parser.add_argument("--max-cases", type=int, default=10**12, help="stop after this many cases")
    parser.add_argument("--seed", type=int, default=0, help="campaign seed (default 0)")
    parser.add_argument("--no-synthetic", action="store_true", help="draw only vLLM's own backends (no latent findings)")
    parser.add_argument("--probe", choices=("physical", "kernel"), default="physical",
                        help="write every view (physical, default) or tokens through each backend's cache write, consumers on (kernel)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        sys.exit(selftest(device, args.max_time, sys.stdout, vllm=args.vllm, corpus=args.corpus, seed=args.seed,
                          max_cases=args.max_cases, synthetic=not args.no_synthetic, probe=args.probe))
    except KvfuzzError as error:
        print(f"kvfuzz selftest: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
