"""The kvfuzz command. Exit status: 0 clean, 1 new findings (as severe as --fail-on) or replay failures, 2 usage or
setup error, a malformed or inconsistent case, or an internal kvfuzz error during a campaign; 130 / 143 stopped by
SIGINT / SIGTERM (a campaign writes its report first).

Every command is a function (args, out) -> int; errors derived from KvfuzzError become one line
on stderr and exit status 2; kvfuzz's own code raising (here or in a worker) prints its traceback,
then a line naming its innermost kvfuzz and vLLM frames, and exits 2 as well. SIGINT and SIGTERM
are a stop request every wait on the target's processes honours (fuzz.campaign.stop); a second one
exits at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from fuzz.errors import InternalError, KvfuzzError
from fuzz.tracebacks import describe

PROBES = ("metadata", "physical", "kernel")


def _device(value: str) -> str:
    if value == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if value not in ("cpu", "cuda") and not value.startswith("cuda:"):
        raise argparse.ArgumentTypeError(f"{value!r} is not cpu, cuda or auto")
    return value


def _positive(kind: type) -> object:
    def parse(value: str) -> object:
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
        if number <= 0:
            raise argparse.ArgumentTypeError(f"{value!r} must be positive")
        return number

    return parse


def _nonnegative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be 0 or more")
    return number


def _workers(value: str) -> int | str:
    if value == "auto":
        return value
    return _positive(int)(value)  # type: ignore[operator,no-any-return]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfuzz", description="Differential fuzzing of vLLM's KV-cache layout code.",
                                     epilog="exit status: 0 clean, 1 new findings (or an unexpected replay), 2 usage or setup error "
                                            "(one line on stderr), 130 / 143 stopped by SIGINT / SIGTERM")
    sub = parser.add_subparsers(dest="command", required=True)

    def target_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--vllm", default="installed", help="vLLM to test: 'installed' (default), a release (0.22.0) or a checkout folder")
        p.add_argument("--device", type=_device, default="auto", help="cpu, cuda or auto (cuda when available)")
        p.add_argument("--case-timeout", type=_positive(float), default=60.0, help="seconds one case may run before it counts as a hang")
        p.add_argument("--max-memory", type=_positive(int), default=4096, help="MiB a target process may grow by (default 4096)")

    run = sub.add_parser("run", help="run a fuzz campaign")
    target_options(run)
    run.add_argument("--max-time", type=_positive(float), default=60.0,
                     help="seconds of fuzzing, counted from when the target is ready: its start (start_s in the report) is not "
                          "counted (default 60); it ends within a few more")
    run.add_argument("--start-timeout", type=_positive(float), default=300.0,
                     help="seconds the target may take to start (import vLLM) before the run ends with an error (default 300)")
    run.add_argument("--max-cases", type=_positive(int), default=10**12, help="stop after this many cases")
    run.add_argument("--seed", type=int, default=0, help="campaign seed (default 0)")
    run.add_argument("--corpus", type=Path, default=Path("corpus/findings"), help="where findings go (default corpus/findings)")
    run.add_argument("--report", type=Path, help="write the JSON report here")
    run.add_argument("--junit", type=Path, help="write a JUnit XML summary here")
    run.add_argument("--workers", type=_workers, default=None,
                     help="worker processes, or 'auto' (one per core, or per GPU with cuda); "
                          "default auto, with --ray one per GPU (cuda) or CPU of the cluster")
    run.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                     help="run the workers on a Ray cluster: the one running here (else a new local one), "
                          "or the one at ADDRESS (pip install 'kvfuzz[ray]')")
    run.add_argument("--no-synthetic", action="store_true", help="draw only vLLM's own backends")
    run.add_argument("--probe", choices=PROBES, default="metadata",
                     help="compare view metadata; also write every view's bytes on the device (physical); or write tokens through "
                          "each backend's own cache write and check where they land (kernel)")
    run.add_argument("--probe-every", type=_positive(int), help="with --probe metadata, probe every K-th case physically")
    run.add_argument("--consumers-every", type=_nonnegative_int, default=None, metavar="K",
                     help="instead of the schedule (the deeper checks share half the time by what each finds), run the code that "
                          "addresses KV blocks by bytes (block zeroers, block copy, connector regions) on every K-th case and the "
                          "V1 runner and planner-fit on every case; 0: consumers never")
    run.add_argument("--scale", choices=("small", "production"), default="small",
                     help="small buffers, or production block counts and geometry (metadata on the meta device)")
    run.add_argument("--max-buffer-bytes", type=_positive(int), default=1 << 30, help="production scale with --probe physical: largest buffer")
    run.add_argument("--engine", choices=("default", "atheris"), default="default",
                     help="default: seeded draws in forked workers; atheris: coverage-guided (pip install 'kvfuzz[atheris]')")
    run.add_argument("--fail-on", choices=("error", "warning", "never"), default="error",
                     help="exit 1 for new findings of this severity or worse: error (default; crashes, wrong views, broken "
                          "declarations), warning (also refused-valid and assert-on-invalid), never")
    run.add_argument("--quiet", action="store_true", help="no progress output")

    replay = sub.add_parser("replay", help="re-run corpus files")
    target_options(replay)
    replay.add_argument("path", type=Path, nargs="?", help="a case file or a folder of them")
    replay.add_argument("--builtin-corpus", action="store_true", help="replay the corpus shipped with kvfuzz instead of PATH")
    replay.add_argument("--probe", choices=PROBES, default="metadata")
    replay.add_argument("--shrink-into", type=Path, help="minimize every unexpected finding and save it in this corpus folder")

    explain = sub.add_parser("explain", help="expected and actual layout of one case")
    target_options(explain)
    explain.add_argument("case", type=Path)
    explain.add_argument("--json", action="store_true", help="print both layouts as JSON")
    explain.add_argument("--probe", choices=PROBES, default="metadata")
    explain.add_argument("--png", type=Path, help="also draw the raw buffers as a byte map, expected beside actual")

    shrink = sub.add_parser("minimize", help="shrink a failing case while it keeps its signature")
    target_options(shrink)
    shrink.add_argument("case", type=Path)
    shrink.add_argument("--output", type=Path, help="write the small case here (default: print it)")

    bisect = sub.add_parser("bisect", help="replay one case on every release in a range")
    bisect.add_argument("case", type=Path)
    bisect.add_argument("--from", dest="low", help="first release (default 0.19.1)")
    bisect.add_argument("--to", dest="high", help="last release (default: the newest)")
    bisect.add_argument("--device", type=_device, default="cpu")
    bisect.add_argument("--case-timeout", type=_positive(float), default=60.0,
                        help="seconds the case may run on a release before it counts as a hang")
    bisect.add_argument("--jobs", type=_positive(int), default=max(1, min(4, os.cpu_count() or 1)), help="releases replayed at once")
    bisect.add_argument("--json", action="store_true", help="print the table as JSON")
    selftest = sub.add_parser("selftest", help="a short probed campaign on one device, as a table (the GPU check)")
    target_options(selftest)
    selftest.add_argument("--max-time", type=_positive(float), default=60.0, help="seconds to fuzz (default 60)")
    selftest.add_argument("--max-cases", type=_positive(int), default=10**12)
    selftest.add_argument("--seed", type=int, default=0)
    selftest.add_argument("--corpus", type=Path, help="keep new findings here (default: a temporary folder)")
    selftest.add_argument("--no-synthetic", action="store_true")
    selftest.add_argument("--probe", choices=("physical", "kernel"), default="physical",
                          help="write every view (physical, default), or tokens through each backend's cache write with the consumers on")

    mutate = sub.add_parser("mutate", help="would kvfuzz catch a bug here? single-edit mutants of vLLM's layout functions, each fuzzed")
    target_options(mutate)
    mutate.add_argument("--function", action="append", metavar="NAME",
                        help="mutate this function (bare or Class.method name; repeatable); default: the release's layout functions")
    mutate.add_argument("--budget", type=_positive(float), default=30.0, help="seconds of fuzzing per mutant (default 30)")
    mutate.add_argument("--jobs", type=_positive(int), default=max(1, os.cpu_count() or 1), help="mutants fuzzed at once")
    mutate.add_argument("--seed", type=int, default=0)
    mutate.add_argument("--session", type=Path, help="append each result to this JSONL file and resume from it")
    mutate.add_argument("--max-mutants", type=_positive(int), help="stop after this many mutants (in source order)")
    mutate.add_argument("--no-synthetic", action="store_true")
    mutate.add_argument("--json", action="store_true", help="print the report as JSON")

    bench = sub.add_parser("bench", help="measure pipeline speed against the bare vLLM calls and peer harnesses")
    target_options(bench)
    bench.add_argument("--cases", type=_positive(int), default=200, help="cases in the measured mix (default 200)")
    bench.add_argument("--scaling-cases", type=_positive(int), default=4000, help="cases per worker-scaling campaign")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", action="store_true", help="print the figures as JSON")
    surface = sub.add_parser("surface", help="the release's KV-cache functions, found from its source, and which of them kvfuzz drives")
    surface.add_argument("--vllm", default="installed", help="vLLM to map: 'installed' (default), a release (0.22.0) or a checkout folder")
    surface.add_argument("--max-time", type=_nonnegative_float, default=60.0,
                         help="seconds of cases traced to measure what is driven (default 60); 0: the static map only")
    surface.add_argument("--probe", choices=("metadata", "kernel"), default="metadata", help="the cases' probe (default metadata)")
    surface.add_argument("--seed", type=int, default=0)
    surface.add_argument("--json", action="store_true", help="print the map as JSON")
    standby = sub.add_parser("standby", help="the targets kept warm between campaigns (fuzz/campaign/standby.py): list or stop them")
    standby.add_argument("--stop", action="store_true", help="stop every standby")
    _ci_parser(sub, target_options)
    _export_parsers(sub)
    return parser


def _export_parsers(sub: Any) -> None:
    export = sub.add_parser("export", help="corpus findings as standalone pytest modules for vLLM's own tests (vllm and torch only)")
    export.add_argument("findings", nargs="+", metavar="FINDING",
                        help="corpus finding files or folders, or 'corpus' for every finding shipped with kvfuzz")
    export.add_argument("--out", type=Path, required=True, help="folder to write the test modules to")
    export.add_argument("--vllm", default=None,
                        help="ask this vLLM (a release, 'installed' or a checkout) which layouts backends declare, for each "
                             "finding's reach; default: not asked (undeclared assumed)")
    report = sub.add_parser("report", help="a corpus finding as a Markdown issue draft for vLLM")
    report.add_argument("finding", type=Path, metavar="FINDING", help="a corpus finding file")
    report.add_argument("--vllm", default=None, help="the vLLM to explain it on (default: the newest release it affects)")
    report.add_argument("--output", type=Path, help="write the draft here (default: print it)")
    report.add_argument("--case-timeout", type=_positive(float), default=60.0, help="seconds the case may run")
    report.add_argument("--no-test", action="store_true", help="do not run the exported test on that vLLM")


def _nonnegative_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be 0 or more")
    return number


def _ci_parser(sub: Any, target_options: Callable[[argparse.ArgumentParser], None]) -> None:
    from fuzz.ci import DEFAULT_BUDGET, DEFAULT_CORPUS

    ci = sub.add_parser("ci", help="guard a vLLM change: corpus gate, a time-boxed campaign, new findings checked against a baseline")
    target_options(ci)
    ci.add_argument("--budget", type=_positive(float), default=DEFAULT_BUDGET,
                    help=f"seconds of fuzzing, counted from when the target is ready: its start and the corpus gate are not "
                         f"counted (default {DEFAULT_BUDGET:g}: a pull request on 2 cores)")
    ci.add_argument("--baseline", metavar="SPEC",
                    help="the vLLM the change started from (a release, 'installed' or a checkout such as the merge base): "
                         "a failure it has too is pre-existing, not the change's")
    ci.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                    help=f"the CI corpus kept between runs: replayed with the built-in one, new findings go to its findings/ "
                         f"(default {DEFAULT_CORPUS})")
    ci.add_argument("--sarif", type=Path, help="write SARIF 2.1.0 here (code scanning)")
    ci.add_argument("--junit", type=Path, help="write JUnit XML here")
    ci.add_argument("--summary", type=Path, help="write the Markdown summary here (e.g. $GITHUB_STEP_SUMMARY)")
    ci.add_argument("--seed", type=int, default=0, help="campaign seed (default 0)")
    ci.add_argument("--workers", type=_workers, default="auto", help="campaign worker processes, or 'auto' (default: one per core)")
    ci.add_argument("--no-synthetic", action="store_true", help="draw only vLLM's own backends")
    ci.add_argument("--quiet", action="store_true", help="no campaign progress output")
    ci.add_argument("--report", type=Path, help="write the run as JSON here (verdict, bugs, diff coverage, behaviour changes)")
    ci.add_argument("--undirected", action="store_true",
                    help="with --baseline: trace the changed lines but draw cases as without a change (measures what direction adds)")


def main(argv: list[str] | None = None, stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr) -> int:
    started = time.monotonic()  # start_s counts from here, kvfuzz's own imports included
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return 2 if exit_.code else 0
    args.started = started
    from fuzz import commands
    from fuzz.campaign import stop
    from fuzz.export.command import export_command, report_command
    from fuzz.mutate.command import mutate as mutate_command
    from fuzz.surface.command import surface as surface_command

    handlers = {"run": commands.run, "replay": commands.replay, "explain": commands.explain, "minimize": commands.shrink,
                "bisect": commands.bisect, "bench": commands.bench, "selftest": commands.selftest, "ci": commands.ci, "mutate": mutate_command,
                "surface": surface_command, "export": export_command, "report": report_command, "standby": commands.standby}
    # The atheris engine handles Ctrl-C itself (its fuzzing child is no pool of ours).
    atheris = args.command == "run" and args.engine == "atheris"
    with contextlib.nullcontext() if atheris else stop.handling():
        try:
            status = handlers[args.command](args, stdout)
            signum = stop.requested()
            return status if signum is None else stop.exit_status(signum)  # a run has its report: it returns that already
        except KvfuzzError as error:
            print(_error_text(error), file=stderr)
            return 2
        except Exception as error:  # noqa: BLE001 - kvfuzz's own code raised in this process: a bug to report, shown whole
            described = describe(error)
            print(_error_text(InternalError(described.summary, described.traceback)), file=stderr)
            return 2
        except (stop.Stopped, KeyboardInterrupt):
            signum = stop.requested() or signal.SIGINT
            print(f"kvfuzz: stopped by {signal.Signals(signum).name}", file=stderr)
            return stop.exit_status(signum)


def _error_text(error: KvfuzzError) -> str:
    """One line; kvfuzz's own error comes after its traceback."""
    if isinstance(error, InternalError) and error.traceback:
        return f"{error.traceback.rstrip()}\nkvfuzz: error: kvfuzz internal error (please report): {error}"
    return f"kvfuzz: error: {error}"


def entry_point() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
