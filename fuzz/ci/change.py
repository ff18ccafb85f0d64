"""The change under test in a `kvfuzz ci` run: printed when located, its reaching cases run on both sides,
and its diff coverage printed when the campaign is over (fuzz/ci/diff.py, direct.py, behaviour.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TextIO

from fuzz.campaign.pool import Pool, RemoteTarget
from fuzz.case import Case, from_dict
from fuzz.ci.behaviour import Compared
from fuzz.ci.diff import ChangedFunction, ranges_text
from fuzz.ci.direct import Direction
from fuzz.ci.model import CAMPAIGN, Checked, CiResult, DiffCoverage
from fuzz.corpus import store
from fuzz.targets.base import Target
from fuzz.targets.releases import TargetSource
from fuzz.verdict.findings import variants_of
from fuzz.verdict.runner import CaseResult, run_case

MAX_LISTED = 20  # changed functions printed one per line


def change_lines(functions: list[ChangedFunction]) -> str:
    if not functions:
        return "kvfuzz ci: the change: no changed line that runs in the KV-cache folders (vllm/v1, KV connectors, attention layers)"
    lines = [f"kvfuzz ci: the change: {sum(len(f.lines) for f in functions)} changed line(s) that run, in {len(functions)} function(s):"]
    for function in functions[:MAX_LISTED]:
        where = "import-time code" if function.import_time else function.qualname
        lines.append(f"  {where}: {ranges_text(function.path, function.lines)}")
    if len(functions) > MAX_LISTED:
        lines.append(f"  ... {len(functions) - MAX_LISTED} more in the summary")
    return "\n".join(lines)


def coverage_lines(coverage: DiffCoverage) -> str:
    if not coverage.functions:
        return "kvfuzz ci: diff coverage: nothing changed that a case can run"
    how = "directed" if coverage.directed else "undirected"
    lines = [f"kvfuzz ci: diff coverage: {coverage.executed} of {coverage.changed} changed line(s) executed; "
             f"{coverage.reached} of {coverage.cases} campaign case(s) reached a changed line ({how} draws)"]
    for row in coverage.functions:
        who = "at import" if row.cases is None else f"{row.cases} case(s)"
        lines.append(f"  {row.function.qualname}: {len(row.executed)}/{len(row.function.lines)} line(s), {who}")
    lines += [f"  kvfuzz did not exercise: {text}" for text in coverage.unexercised()]
    return "\n".join(lines)


def run_samples(target: Target, direction: Direction, device: str) -> list[tuple[Case, CaseResult]]:
    """The reaching cases the campaign kept, run once more on the branch (the campaign's own processes)."""
    ran = []
    for sample in direction.samples:
        case = from_dict(sample["case"])
        try:
            ran.append((case, run_case(target, case, device)))
        except Exception:  # noqa: BLE001 - kvfuzz could not run it again: it is not compared
            continue
    return ran


def compare(result: CiResult, branch: list[tuple[Case, CaseResult]], baseline: TargetSource, options: object,
            open_pool: Callable[[TargetSource], Pool], out: TextIO) -> list[Checked]:
    """Each reaching case on the baseline: behaviour-change notes into `result`; the branch's failures the baseline
    does not share (one case per signature) returned to be checked like any other failure. A signature the corpus
    gate already holds counts too: cases of it that fail on the baseline as well do not make this one pre-existing."""
    print(f"kvfuzz ci: running {len(branch)} case(s) that reached the change on the baseline {baseline.spec}", file=out, flush=True)
    compared = []
    with open_pool(baseline) as pool:
        target = RemoteTarget(pool)
        for case, mine in branch:
            try:
                compared.append(Compared(case, mine, run_case(target, case, getattr(options, "device", "cpu"))))
            except Exception:  # noqa: BLE001 - the baseline cannot run it: nothing to compare
                continue
    result.behaviour = [note for item in compared if (note := item.note()) is not None]
    known: set[str] = set()
    found = []
    for item in compared:
        finding = item.failure
        if finding is None or finding.signature in known:
            continue
        known.add(finding.signature)
        meta = {**finding.to_dict(), "variants": variants_of([finding]), "vllm_version": result.target["vllm_version"],
                "generation": result.target["generation"], "contract": result.target["contract"], "minimized": False,
                "target": result.target["spec"], "origin": "a case that reached a changed line, failing on the branch only"}
        path = store.save_finding(result.corpus / "findings", item.case, meta)
        found.append(Checked(CAMPAIGN, path, item.case, finding))
    return found
