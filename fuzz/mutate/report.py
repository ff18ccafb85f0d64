"""The mutation report: per function killed / survived / unreached / stillborn / equivalent, the
score, and every survivor with its edit (where kvfuzz is blind)."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from fuzz.mutate.session import STATUSES, MutantResult, Session


def score(results: list[MutantResult]) -> float | None:
    """Killed over the mutants that count: neither stillborn (no tree) nor equivalent (no case can show them)."""
    counts = Counter(r.status for r in results)
    viable = counts["killed"] + counts["survived"] + counts["unreached"]
    return counts["killed"] / viable if viable else None


def by_function(session: Session) -> dict[str, list[MutantResult]]:
    grouped: dict[str, list[MutantResult]] = {f"{f.path}::{f.qualname}": [] for f in session.functions}
    for result in session.results:
        grouped.setdefault(f"{result.mutant.path}::{result.mutant.function}", []).append(result)
    return grouped


def timing(results: list[MutantResult]) -> dict[str, float | None]:
    """Medians over killed mutants: target start-up, and the time from the campaign's start to the finding that killed it."""
    killed = [r for r in results if r.status == "killed"]
    return {"killed_median_start_s": _median([r.start_s for r in killed]),
            "killed_median_first_finding_s": _median([r.campaign_s for r in killed])}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 2) if known else None


def to_dict(session: Session) -> dict[str, Any]:
    functions = []
    for name, results in by_function(session).items():
        counts = Counter(r.status for r in results)
        functions.append({"function": name, **{s: counts[s] for s in STATUSES}, "score": score(results)})
    return {
        "target": session.source.spec,
        "budget_s": session.options.budget,
        "seed": session.options.seed,
        "reach_cases": session.reach_cases,
        "baseline_signatures": session.baseline,
        "totals": {s: sum(1 for r in session.results if r.status == s) for s in STATUSES},
        "score": score(session.results),
        "timing": timing(session.results),
        "functions": functions,
        "mutants": [r.to_dict() for r in session.results],
    }


def render(session: Session) -> str:
    data = to_dict(session)
    width = max([len(f["function"]) for f in data["functions"]] + [8])
    lines = [f"kvfuzz mutate: {data['target']}, {data['budget_s']:g} s per mutant, seed {data['seed']}",
             f"{'function':{width}}  " + "  ".join(f"{s:>10}" for s in STATUSES) + "       score"]
    for row in data["functions"]:
        value = "-" if row["score"] is None else f"{100 * row['score']:.0f} %"
        lines.append(f"{row['function']:{width}}  " + "  ".join(f"{row[s]:>10}" for s in STATUSES) + f"  {value:>10}")
    total = data["score"]
    lines.append(f"{'all':{width}}  " + "  ".join(f"{data['totals'][s]:>10}" for s in STATUSES)
                 + f"  {'-' if total is None else f'{100 * total:.0f} %':>10}")
    times = data["timing"]
    if times["killed_median_first_finding_s"] is not None:
        start = times["killed_median_start_s"]
        lines.append(f"killed mutants, median: first finding {times['killed_median_first_finding_s']:g} s into the campaign"
                     + ("" if start is None else f", after a start-up of {start:g} s"))
    blind = [r for r in session.results if r.status in ("survived", "unreached")]
    if blind:
        lines += ["", "not killed (where kvfuzz is blind):"]
        lines += [f"  {r.status:9} {r.mutant.id}  {r.mutant.operator:13} {r.mutant.function}  {r.mutant.edit}" for r in blind]
    return "\n".join(lines)
