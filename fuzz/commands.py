"""The kvfuzz commands: each takes parsed arguments and an output stream and returns an exit status.

Every command runs vLLM in worker processes (fuzz/pool.py), so a release, a checkout or the
installed vLLM are all handled alike, and a case that kills its process is reported, not fatal.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from fuzz import SOURCE_ROOT
from fuzz.campaign import preload, stop
from fuzz.campaign.pool import START_TIMEOUT, Pool, RemoteTarget
from fuzz.case import Case
from fuzz.checks.registry import SEVERITY
from fuzz.errors import KvfuzzError, TargetError, UsageError
from fuzz.targets import releases
from fuzz.verdict.findings import SEVERITIES, Finding

MIB = 1 << 20


@contextmanager
def open_pool(args: argparse.Namespace, workers: int = 1, spec: str | None = None, start_timeout: float = START_TIMEOUT) -> Iterator[Pool]:
    source = releases.resolve(spec or args.vllm)
    pool = Pool(source, workers=workers, case_timeout=getattr(args, "case_timeout", 60.0),
                max_memory=getattr(args, "max_memory", 4096) * MIB, start_timeout=start_timeout)
    try:
        yield pool
    finally:
        pool.close()


def _worker_count(args: argparse.Namespace) -> int:
    """--workers as a number: 'auto' (the default) is one per core, or one per GPU on cuda."""
    if args.workers not in (None, "auto"):
        return int(args.workers)
    if args.device.startswith("cuda"):
        import torch

        return max(1, torch.cuda.device_count())
    return max(1, os.cpu_count() or 1)


@contextmanager
def open_campaign_pool(args: argparse.Namespace, start_timeout: float = START_TIMEOUT) -> Iterator[Any]:
    """The local pool, or with --ray a RayPool over the cluster's nodes."""
    if args.ray is None:
        with open_pool(args, workers=_worker_count(args), start_timeout=start_timeout) as pool:
            yield pool
        return
    from fuzz.cluster.pool import open_ray_pool

    workers = None if args.workers in (None, "auto") else int(args.workers)
    pool = open_ray_pool(releases.resolve(args.vllm), args.ray, device=args.device, workers=workers,
                         case_timeout=args.case_timeout, max_memory=args.max_memory * MIB)
    try:
        yield pool
    finally:
        pool.close()


def run(args: argparse.Namespace, out: TextIO) -> int:
    """A campaign that fuzzes for --max-time seconds, counted from when the target is ready (its start, bounded by
    --start-timeout, is not counted), with its report written whatever happened: 0, 1 with new findings, 2 on an
    error, 130 / 143 when SIGINT / SIGTERM stopped it."""
    from fuzz.campaign.engine import Campaign, CampaignOptions, Report
    from fuzz.campaign.progress import Progress

    started = getattr(args, "started", time.monotonic())
    if args.ray is not None and args.engine == "atheris":
        raise UsageError("--ray goes with the default engine")
    if args.engine == "atheris":
        return _run_atheris(args, out)
    if args.probe_every and args.probe != "metadata":
        raise UsageError(f"--probe-every goes with --probe metadata (--probe {args.probe} probes every case already)")
    _check_writable(args.corpus)
    options = CampaignOptions(device=args.device, max_time=args.max_time, max_cases=args.max_cases, seed=args.seed,
                              corpus_dir=args.corpus, synthetic=not args.no_synthetic,
                              probe_every=1 if args.probe != "metadata" else (args.probe_every or 0),
                              probe_kind="kernel" if args.probe == "kernel" else "physical", consumers_every=args.consumers_every,
                              scale=args.scale, max_buffer_bytes=args.max_buffer_bytes)
    report = Report(target={"spec": args.vllm, "label": args.vllm, "vllm_version": "?", "generation": "?", "contract": "?"})
    with stop.handling():
        try:
            with open_campaign_pool(args, start_timeout=getattr(args, "start_timeout", START_TIMEOUT)) as pool:
                assert pool.info is not None
                label = pool.source.label
                start_s = time.monotonic() - started
                print(f"kvfuzz: {label}: vLLM {pool.info.vllm_version} ({pool.info.generation}, contract {pool.info.contract.name}), "
                      f"{len(pool.fuzzers())} worker(s) on {args.device}, seed {args.seed}", file=out, flush=True)
                warm = (", forked from a standby kept warm" if getattr(pool, "warm", False)
                        else ", dependencies preloaded" if getattr(pool, "preloaded", False) else "")
                print(f"kvfuzz: target ready in {start_s:.1f} s (start_s{warm}, not counted in --max-time {args.max_time:g})",
                      file=out, flush=True)
                for line in pool.info.checks_off:
                    print(f"kvfuzz: check off: {line}", file=out, flush=True)
                if pool.info.uncovered:
                    print(f"kvfuzz: not drawn (outside the case space): {', '.join(pool.info.uncovered)}", file=out, flush=True)
                progress = None if args.quiet else Progress(out, max_time=args.max_time, max_cases=args.max_cases)
                report = Campaign(pool, options, progress=progress).run()
                report.start_s = start_s
                if progress is not None:
                    progress.close(report)
                for node in getattr(pool, "nodes", list)():
                    print(f"  node {node['address']} ({node['node'][:12]}): {node['cases']} cases, {node['cases_per_s']}/s, "
                          f"{node['workers']} worker(s) alive, {node['restarts']} restarts", file=out)
        except stop.Stopped:  # while the target was starting
            report.stop_reason = signal.Signals(stop.requested() or signal.SIGINT).name
        except KvfuzzError as error:  # the target did not start: still a report saying so
            report.stop_reason, report.error = "error", str(error)
            report.start_s = time.monotonic() - started
            _write_reports(args, report.to_dict())
            raise
        signum = stop.requested()
        data = report.to_dict()
        _print_summary(report, data, out)
        status = _write_reports(args, data)
    if report.error:
        raise TargetError(report.error)
    return stop.exit_status(signum) if signum is not None else status


def _check_writable(corpus: Path) -> None:
    """A corpus folder findings cannot be written to is a one-line error before anything starts."""
    try:
        corpus.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=corpus, prefix=".kvfuzz-check-") as probe:
            probe.write(b"kvfuzz" * 512)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        raise UsageError(f"--corpus {corpus}: findings cannot be written there ({error.strerror or error})") from None


def _print_summary(report: Any, data: dict[str, Any], out: TextIO) -> None:
    started = "" if data["start_s"] is None else f" (the target's start, {data['start_s']} s, not counted)"
    print(f"kvfuzz: {data['cases']} cases in {data['fuzz_s']} s of fuzzing{started} ({data['cases_per_s']} cases/s), "
          f"stopped by {data['stop_reason']}: {dict(report.verdicts)}", file=out)
    from fuzz.campaign.progress import check_cell

    for row in data.get("checks", ()):
        print(f"  check {row['check']}: {row['offered']:,} cases asked, {check_cell(row)}", file=out)
    for finding in data["findings"]:
        latent = " (latent: synthetic backend)" if finding["latent"] else ""
        where = finding["case_file"] or f"NOT WRITTEN ({finding.get('note', '')}); the case: {json.dumps(finding.get('case'))}"
        shown = finding.get("variants") or {}
        under = " / ".join(", ".join(shown.get(key, ())) or "-" for key in ("spec_kinds", "backends", "layouts"))
        print(f"  NEW {finding['severity']} {finding['kind']}{latent}: {finding['signature']}\n      under {under}\n      {where}", file=out)
    kinds = Counter(f"{f['severity']} {f['kind']}" for f in data["findings"])
    if kinds:
        print("  findings by kind: " + ", ".join(f"{kind} {count}" for kind, count in sorted(kinds.items())), file=out)
    for flaky in data["flaky"]:
        kept = f"\n      {flaky['case_file']} (kept, marked unconfirmed)" if flaky["case_file"] else ""
        print(f"  {flaky['status'].upper()} {flaky['kind']}: {flaky['signature']}\n      {flaky['rerun']}{kept}", file=out)
    for message, count in data["internal_errors"].items():
        kept = data.get("internal_error_cases", {}).get(message)
        what = "case and traceback" if any(d["error"] == message and d["traceback"] for d in data.get("internal_error_details", ())) else "case"
        print(f"  kvfuzz internal error ({count}x, please report): {message}" + (f"\n      {what}: {kept}" if kept else ""), file=out)
    if data["stopped_workers"]:
        print(f"  {data['stopped_workers']} worker(s) busy at the end were stopped (their case in flight is not counted)", file=out)


def _write_reports(args: argparse.Namespace, data: dict[str, Any]) -> int:
    """The JSON report and JUnit XML a campaign was asked for; the exit status: 2 when kvfuzz itself failed on a case,
    1 when a new finding is at least as severe as --fail-on (flaky and unconfirmed process failures never count), else 0."""
    from fuzz.campaign.junit import write_campaign_junit

    try:
        if args.report:
            args.report.write_text(json.dumps(data, indent=1) + "\n")
        if args.junit:
            write_campaign_junit(args.junit, data)
    except OSError as error:
        raise UsageError(f"cannot write the report: {error}") from None
    if data.get("internal_errors"):
        return 2
    return 1 if any(fails(f["kind"], args.fail_on) for f in data["findings"]) else 0


def fails(kind: str, fail_on: str) -> bool:
    """Whether a finding of this kind fails a campaign run with --fail-on error|warning|never."""
    if fail_on == "never":
        return False
    return SEVERITIES.index(SEVERITY.get(kind, "error")) >= SEVERITIES.index(fail_on)


def _run_atheris(args: argparse.Namespace, out: TextIO) -> int:
    from fuzz.engines.atheris_engine import run_atheris

    if args.workers not in (None, 1) or args.probe != "metadata" or args.probe_every or args.scale != "small":
        raise UsageError("--engine atheris runs one process with metadata checks at small scale "
                         "(no --workers, --probe physical, --probe-every or --scale production)")
    data = run_atheris(releases.resolve(args.vllm), device=args.device, max_time=args.max_time, seed=args.seed, corpus_dir=args.corpus,
                       synthetic=not args.no_synthetic, case_timeout=args.case_timeout, max_memory=args.max_memory,
                       max_cases=args.max_cases if args.max_cases < 10**12 else None, quiet=args.quiet, out=out)
    return _write_reports(args, data)


def replay(args: argparse.Namespace, out: TextIO) -> int:
    from fuzz.corpus.replay import replay_entry
    from fuzz.corpus.store import entries, expected_signatures

    found = list(entries(_replay_path(args)))
    failures = 0
    with open_pool(args) as pool:
        target = RemoteTarget(pool)
        known = expected_signatures(found, target.info.vllm_version)
        for entry in found:
            outcome = replay_entry(target, entry, args.device, probe=args.probe, known=known)
            failures += outcome.status == "unexpected"
            print(f"{outcome.status:10} {entry.path}  {outcome.detail}", file=out)
            if outcome.finding is not None and args.shrink_into:
                print(f"{'':10} shrunk into {_shrink_finding(target, entry.case, outcome.finding, args)}", file=out)
    return 1 if failures else 0


def _replay_path(args: argparse.Namespace) -> Path:
    """PATH, or with --builtin-corpus the corpus shipped with kvfuzz."""
    if args.builtin_corpus:
        if args.path is not None:
            raise UsageError("give PATH or --builtin-corpus, not both")
        from fuzz.corpus.builtin import builtin_corpus

        return builtin_corpus()
    if args.path is None:
        raise UsageError("replay needs PATH (a case file or a folder of them) or --builtin-corpus")
    if not args.path.exists():
        raise UsageError(f"{args.path}: no such file or folder")
    return args.path


def _shrink_finding(target: RemoteTarget, case: Case, finding: Finding, args: argparse.Namespace) -> Path:
    """A finding met outside a campaign goes through the same minimizer and into a corpus folder."""
    from fuzz.corpus import store as corpus
    from fuzz.corpus.minimize import shrink_finding
    from fuzz.verdict.runner import run_case

    def find(candidate: Case) -> Finding | None:
        return run_case(target, candidate, args.device).verdict.finding

    small, smallest, _ = shrink_finding(case, finding, find, target.info)
    meta = {**smallest.to_dict(), "vllm_version": target.info.vllm_version, "generation": target.info.generation,
            "contract": target.info.contract.name, "minimized": True, "target": args.vllm}
    return corpus.save_finding(args.shrink_into, small, meta)


def explain(args: argparse.Namespace, out: TextIO) -> int:
    from fuzz.corpus.file import load
    from fuzz.explain.render import describe, render
    from fuzz.verdict.runner import run_case

    case = load(args.case)
    with open_pool(args) as pool:
        target = RemoteTarget(pool)
        result = run_case(target, case, args.device, probe=args.probe)
    print(json.dumps(describe(result, target), indent=1) if args.json else render(result, target), file=out)
    if args.png:
        from fuzz.explain.picture import draw

        draw(result, args.png, vllm=target.info.vllm_version)
        print(f"kvfuzz: drew {args.png}", file=out)
    return 0


def selftest(args: argparse.Namespace, out: TextIO) -> int:
    from fuzz.campaign.selftest import selftest as run_selftest

    return run_selftest(args.device, args.max_time, out, vllm=args.vllm, corpus=args.corpus, seed=args.seed, max_cases=args.max_cases,
                        synthetic=not args.no_synthetic, case_timeout=args.case_timeout, max_memory=args.max_memory * MIB, probe=args.probe)


def shrink(args: argparse.Namespace, out: TextIO) -> int:
    from fuzz.case import dumps
    from fuzz.corpus.file import load
    from fuzz.corpus.minimize import shrink_finding
    from fuzz.verdict.runner import run_case

    case = load(args.case)
    with open_pool(args) as pool:
        target = RemoteTarget(pool)
        verdict = run_case(target, case, args.device).verdict
        if verdict.finding is None:
            raise UsageError(f"{args.case}: the case does not fail on {pool.source.label} ({verdict.status}); nothing to minimize")

        def find(candidate: Case) -> Finding | None:
            return run_case(target, candidate, args.device).verdict.finding

        small, smallest, steps = shrink_finding(case, verdict.finding, find, target.info)
    text = json.dumps(json.loads(dumps(small)), indent=1) + "\n"
    print(f"kvfuzz: {smallest.signature}\nkvfuzz: {steps} candidates run", file=out)
    if args.output:
        args.output.write_text(text)
        print(f"kvfuzz: wrote {args.output}", file=out)
    else:
        print(text, file=out, end="")
    return 0


def bisect(args: argparse.Namespace, out: TextIO) -> int:
    from fuzz.corpus.bisect import bisect_case, format_table
    from fuzz.corpus.file import load

    case = load(args.case)
    versions = releases.releases_between(args.low or "0.19.1", args.high)
    if not versions:
        raise UsageError(f"no vLLM releases between {args.low or '0.19.1'} and {args.high or 'the newest'}")
    rows = bisect_case(case, versions, device=args.device, jobs=args.jobs, case_timeout=args.case_timeout)
    print(json.dumps([row.to_dict() for row in rows], indent=1) if args.json else format_table(rows), file=out)
    return 0


def bench(args: argparse.Namespace, out: TextIO) -> int:
    """Pipeline and peers in one process with the target's vLLM, then 1 and 2 worker campaigns."""
    import subprocess
    import sys
    import tempfile

    from fuzz.campaign.engine import Campaign, CampaignOptions

    source = releases.resolve(args.vllm)
    env = releases.worker_environment(source)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), str(SOURCE_ROOT)]))
    measured = subprocess.run([sys.executable, "-m", "fuzz.campaign.bench", "--seed", str(args.seed), "--cases", str(args.cases)],
                              env=env, capture_output=True, text=True, check=False)
    if measured.returncode != 0:
        raise UsageError(f"bench: the measuring process failed: {(measured.stderr.strip().splitlines() or ['?'])[-1]}")
    figures = json.loads(measured.stdout.strip().splitlines()[-1])
    figures.update(_start_times(args))
    # The starts leave a base standby importing vLLM's dependencies in the background: the campaigns wait for it, or the
    # one-worker campaign shares the cores with that import.
    preload.wait_for_base(env, str(source.python_path) if source.python_path is not None else None)
    for workers in (1, 2):
        with tempfile.TemporaryDirectory() as corpus, open_pool(args, workers=workers) as pool:
            # The default campaign: every deeper check on, where the schedule puts it (consumers_every None).
            options = CampaignOptions(device="cpu", max_time=600, max_cases=args.scaling_cases, seed=args.seed + 7, corpus_dir=Path(corpus),
                                      consumers_every=None)
            report = Campaign(pool, options).run()
            figures[f"campaign_{workers}_workers_per_s"] = report.cases_per_s
            if workers == 1:
                figures["campaign_checks"] = report.check_rows()
    figures["two_workers_speedup"] = figures["campaign_2_workers_per_s"] / figures["campaign_1_workers_per_s"]
    figures["ratios"] = bench_ratios(figures)
    if args.json:
        print(json.dumps(figures, indent=1), file=out)
    else:
        for key, value in figures.items():
            if key == "campaign_checks":
                from fuzz.campaign.progress import check_cell

                for row in value:
                    print(f"{'check ' + row['check']:32} {check_cell(row)}", file=out)
                continue
            if key == "ratios":
                _print_ratios(value, out)
                continue
            print(f"{key:32} {value:,.2f}" if isinstance(value, float) else f"{key:32} {value}", file=out)
    return 0


def bench_ratios(figures: dict[str, Any]) -> dict[str, Any]:
    """Speed as multiples of vLLM's own bare walk measured in the same run (1.0: as fast as vLLM's calls alone): the view
    path (kvfuzz's pipeline, metadata checked), the default campaign (one worker, every deeper check where the schedule
    puts it), and each deeper check's cost per key it checked, in bare walks (how many walks one key costs)."""
    walk = figures["bare_walk_per_s"]
    per_key = {row["check"]: row["seconds"] / row["keys_checked"] for row in figures.get("campaign_checks", ()) if row["keys_checked"]}
    return {"view_path_vs_bare_walk": figures["pipeline_per_s"] / walk,
            "campaign_vs_bare_walk": figures["campaign_1_workers_per_s"] / walk,
            "check_us_per_key": {name: seconds * 1e6 for name, seconds in per_key.items()},
            "check_per_key_in_bare_walks": {name: seconds * walk for name, seconds in per_key.items()}}


def _print_ratios(ratios: dict[str, Any], out: TextIO) -> None:
    print(f"{'view path / bare walk':32} {ratios['view_path_vs_bare_walk']:.2f}x", file=out)
    print(f"{'campaign (all checks) / bare walk':32} {ratios['campaign_vs_bare_walk']:.2f}x", file=out)
    for name, walks in ratios["check_per_key_in_bare_walks"].items():
        print(f"{'check ' + name + ' per key':32} {ratios['check_us_per_key'][name]:,.0f} us = {walks:,.1f} bare walks", file=out)


def _start_times(args: argparse.Namespace) -> dict[str, float]:
    """Seconds until the target's one worker is ready: cold (a fresh machine: kvfuzz's and vLLM's cache folders empty, no
    standby), a fresh import with warm caches (no standby), preloaded (a fork of the base standby) and warm (a second
    campaign: forked from the standby the first left, fuzz/campaign/standby.py)."""
    import tempfile

    def start() -> float:
        began = time.monotonic()
        with open_pool(args, workers=1):
            return time.monotonic() - began

    # A fresh machine's first start: empty kvfuzz and vLLM cache folders, no standby of any kind.
    with tempfile.TemporaryDirectory() as empty, _environment(KVFUZZ_CACHE=empty, VLLM_CACHE_ROOT=f"{empty}/vllm-state",
                                                              KVFUZZ_STANDBY_DIR=f"{empty}/standby", KVFUZZ_KEEP_WARM="0"):
        cold = start()
    with _environment(KVFUZZ_KEEP_WARM="0"):
        imported = start()  # also warms the target's own state folder (fuzz/targets/releases.py vllm_state_folder)
    start()  # leaves a standby, where none was left before
    warm = start()
    return {"start_cold_s": cold, "start_fresh_import_s": imported, "start_preloaded_s": _preloaded_start(args), "start_warm_s": warm}


def _preloaded_start(args: argparse.Namespace) -> float:
    """Seconds until the target is ready when only the base standby is left (fuzz/campaign/preload.py): as another release
    or an edited tree starts once any target has started."""
    import tempfile

    from fuzz.campaign import standby

    with tempfile.TemporaryDirectory(prefix="kvs-") as folder, _environment(KVFUZZ_STANDBY_DIR=folder):
        try:
            with open_pool(args, workers=1) as pool:  # lists the dependencies and leaves the base beside its own standby
                key = pool.standby_key
            deadline = time.monotonic() + 120
            while len(standby.running()) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            standby.stop(key)
            began = time.monotonic()
            with open_pool(args, workers=1):
                return time.monotonic() - began
        finally:
            standby.stop_all()


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def standby(args: argparse.Namespace, out: TextIO) -> int:
    """The standbys of this user (their key and pid), or with --stop, stop them."""
    from fuzz.campaign import standby as standbys

    if args.stop:
        print(f"kvfuzz: stopped {standbys.stop_all()} standby(s)", file=out)
        return 0
    running = standbys.running()
    for key, pid in sorted(running.items()):
        print(f"{key}  pid {pid}  {standbys.label(key)}".rstrip(), file=out)
    print(f"kvfuzz: {len(running)} standby(s) in {standbys.folder()}, each kept {standbys.idle_seconds():g} s after its last use",
          file=out)
    return 0


def ci(args: argparse.Namespace, out: TextIO) -> int:
    """Guard a vLLM change: corpus gate, campaign, reruns in fresh processes, baseline (fuzz/ci)."""
    from fuzz import __version__
    from fuzz.ci.junit import write_ci_junit
    from fuzz.ci.run import CiOptions, run_ci
    from fuzz.ci.sarif import write_sarif
    from fuzz.ci.summary import markdown, terminal

    options = CiOptions(vllm=args.vllm, baseline=args.baseline, budget=args.budget, corpus=args.corpus, device=args.device, seed=args.seed,
                        workers=_worker_count(args), synthetic=not args.no_synthetic, case_timeout=args.case_timeout,
                        max_memory=args.max_memory * MIB, quiet=args.quiet, undirected=args.undirected)
    result = run_ci(options, out)
    if args.summary:
        args.summary.write_text(markdown(result))
    if args.sarif:
        write_sarif(args.sarif, result, __version__)
    if args.junit:
        write_ci_junit(args.junit, result)
    if args.report:
        from fuzz.ci.report import write_report

        write_report(args.report, result)
    print(terminal(result), file=out)
    return result.exit_status
