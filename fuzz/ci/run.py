"""One `kvfuzz ci` run: the corpus gate, the campaign, then every failure checked (see fuzz/ci/__init__.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from fuzz.campaign.engine import Campaign, CampaignOptions, Report
from fuzz.campaign.pool import Pool, RemoteTarget
from fuzz.case import Case
from fuzz.ci import DEFAULT_BUDGET, DEFAULT_CORPUS
from fuzz.ci.change import change_lines, compare, coverage_lines, run_samples
from fuzz.ci.diff import locate_change
from fuzz.ci.direct import Direction
from fuzz.ci.gate import replay_gate
from fuzz.ci.locate import functions_under_test, locate, package_folder
from fuzz.ci.model import CAMPAIGN, FLAKY, Checked, CiResult, InternalFailure
from fuzz.ci.reproduce import describe, on_baseline, rerun, settle
from fuzz.corpus import file as corpus_file
from fuzz.corpus import store
from fuzz.corpus.builtin import builtin_corpus
from fuzz.corpus.store import Entry
from fuzz.errors import InternalError, KvfuzzError, TargetError
from fuzz.explain.render import render
from fuzz.targets import releases
from fuzz.targets.releases import TargetSource
from fuzz.tracebacks import describe as describe_error
from fuzz.verdict.runner import CaseResult


@dataclass(frozen=True)
class CiOptions:
    vllm: str
    baseline: str | None = None
    budget: float = DEFAULT_BUDGET
    corpus: Path = DEFAULT_CORPUS
    device: str = "cpu"
    seed: int = 0
    workers: int = 1
    synthetic: bool = True
    case_timeout: float = 60.0
    max_memory: int = 4 << 30  # bytes a target process may grow by
    quiet: bool = False
    undirected: bool = False  # with a baseline: trace the changed lines but draw cases as without one (to measure direction)


def run_ci(options: CiOptions, out: TextIO) -> CiResult:
    source = releases.resolve(options.vllm)
    baseline = _resolve_baseline(options.baseline) if options.baseline else None  # a bad spec stops the run before it starts
    shipped = list(store.entries(builtin_corpus()))
    findings = options.corpus / "findings"
    kept = list(store.entries(findings)) if findings.exists() else []
    results: list[CiResult] = []  # the result once the target runs: kvfuzz's own error after that is reported in it
    try:
        _run(options, source, baseline, shipped, kept, results, out)
    except Exception as error:  # noqa: BLE001 - only kvfuzz's own errors are kept, the rest raised again below
        if not results or (isinstance(error, KvfuzzError) and not isinstance(error, InternalError)):
            raise
        results[0].aborted = _failure(error)
        print(f"kvfuzz ci: stopped: kvfuzz internal error (please report): {results[0].aborted.message}", file=out, flush=True)
    return results[0]


def _run(options: CiOptions, source: TargetSource, baseline: TargetSource | None, shipped: list[Entry], kept: list[Entry],
         results: list[CiResult], out: TextIO) -> None:
    direction = _direction(options, source, baseline, out)
    began = time.monotonic()
    with _pool(options, source, options.workers) as pool:
        start_s = time.monotonic() - began
        result = CiResult(target=describe(pool), baseline={"spec": options.baseline} if options.baseline else None, corpus=options.corpus)
        results.append(result)
        target = result.target
        print(f"kvfuzz ci: {target['label']}: vLLM {target['vllm_version']} ({target['generation']}, contract {target['contract']}), "
              f"{len(pool.workers)} worker(s) on {options.device}", file=out, flush=True)
        result.gate, failing = replay_gate(RemoteTarget(pool), shipped + kept, options.device, with_baseline=baseline is not None)
        print(f"kvfuzz ci: corpus gate: {len(shipped) + len(kept)} cases: {_counts(result.gate)}", file=out, flush=True)
        # A signature the corpus holds is not news for the campaign: the gate has just replayed its case.
        report = _campaign(pool, options, frozenset(e.expected_signature for e in shipped if e.expected_signature), out, direction)
        report.start_s = start_s
        branch = run_samples(RemoteTarget(pool), direction, options.device) if direction is not None and baseline is not None else []
    result.campaign = report.to_dict()
    new = [Checked(CAMPAIGN, record.path, _case(record.path), record.finding) for record in report.findings]
    result.checked = failing + new
    if direction is not None:
        result.coverage = direction.coverage(len(branch))
        if baseline is not None and branch:
            result.checked += compare(result, branch, baseline, options, lambda s: _pool(options, s), out)
        print(coverage_lines(result.coverage), file=out, flush=True)
    if result.checked:
        _check(result, options, source, baseline, out)
        record_verdicts(result, options.corpus)


def _failure(error: Exception) -> InternalFailure:
    """kvfuzz's own error as the reports show it: raised in a worker (InternalError, with the worker's traceback) or here."""
    if isinstance(error, InternalError):
        return InternalFailure(str(error), 1, None, error.traceback or None)
    described = describe_error(error)
    return InternalFailure(described.summary, 1, None, described.traceback)


def _direction(options: CiOptions, source: TargetSource, baseline: TargetSource | None, out: TextIO) -> Direction | None:
    """With a baseline: the change located (fuzz/ci/diff.py), printed, and the campaign's direction towards it."""
    if baseline is None:
        return None
    trees = [package_folder(side) for side in (baseline, source)]
    if trees[0] is None or trees[1] is None:
        return None
    functions = locate_change(trees[0].parent, trees[1].parent)
    print(change_lines(functions), file=out, flush=True)
    return Direction(functions, directed=not options.undirected)


def _campaign(pool: Pool, options: CiOptions, known: frozenset[str], out: TextIO, direction: Direction | None = None) -> Report:
    from fuzz.campaign.progress import Progress

    campaign_options = CampaignOptions(device=options.device, max_time=options.budget, seed=options.seed, corpus_dir=options.corpus / "findings",
                                       synthetic=options.synthetic, known=known)
    progress = None if options.quiet else Progress(out, max_time=options.budget, max_cases=campaign_options.max_cases)
    report = Campaign(pool, campaign_options, progress=progress, direction=direction).run()
    if progress is not None:
        progress.close(report)
    print(f"kvfuzz ci: campaign: {report.cases} cases in {report.elapsed_s:.0f} s of fuzzing (seed {options.seed}), "
          f"{len(report.findings)} new finding(s)", file=out, flush=True)
    return report


def _check(result: CiResult, options: CiOptions, source: TargetSource, baseline: TargetSource | None, out: TextIO) -> None:
    """Reruns in fresh processes, then the baseline; each failure gets its status, explain text and location."""
    print(f"kvfuzz ci: checking {len(result.checked)} failure(s) in fresh processes", file=out, flush=True)
    under_test = functions_under_test(package_folder(source))

    def first(item: Checked, case_result: CaseResult, target: RemoteTarget) -> None:
        item.explain = render(case_result, target)
        item.locations = locate(case_result.outcome, under_test)

    rerun(source, result.checked, options.device, lambda s: _pool(options, s), first)
    reproduced = [item for item in result.checked if item.reproduced]
    if baseline is not None and reproduced:
        print(f"kvfuzz ci: running {len(reproduced)} reproducible failure(s) on the baseline {baseline.spec}", file=out, flush=True)
        result.baseline = on_baseline(baseline, reproduced, options.device, lambda s: _pool(options, s))
    for item in result.checked:
        item.status = settle(item, with_baseline=baseline is not None)


def record_verdicts(result: CiResult, corpus: Path) -> None:
    """The CI corpus records how each new finding was judged; flaky ones go to flaky/, which the gate does not replay."""
    for item in result.checked:
        if item.origin != CAMPAIGN:
            continue
        ci = {"status": item.status, "reruns": item.reruns, "baseline": (result.baseline or {}).get("spec"), "on_baseline": item.baseline}
        path = corpus / "flaky" / item.path.name if item.status == FLAKY else item.path
        corpus_file.read(item.path).updated(ci=ci).write(path)
        if path != item.path:
            item.path.unlink(missing_ok=True)
            item.path = path


def _resolve_baseline(spec: str) -> TargetSource:
    try:
        return releases.resolve(spec)
    except TargetError as error:  # the message names the option as --vllm
        raise TargetError(str(error).replace("--vllm ", "--baseline ", 1)) from None


def _pool(options: CiOptions, source: TargetSource, workers: int = 1) -> Pool:
    return Pool(source, workers=workers, case_timeout=options.case_timeout, max_memory=options.max_memory)


def _case(path: Path) -> Case:
    return corpus_file.load(path)


def _counts(tally: dict[str, int]) -> str:
    return ", ".join(f"{count} {status}" for status, count in sorted(tally.items())) or "none"
