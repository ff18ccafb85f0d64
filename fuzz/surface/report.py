"""`kvfuzz surface` output: counts first, then every function (text), or the same as JSON."""

from __future__ import annotations

from typing import Any

from fuzz.surface.reasons import KINDS
from fuzz.surface.survey import Entry, Survey


def counts(survey: Survey) -> dict[str, Any]:
    executed, lines = survey.line_coverage()
    result: dict[str, Any] = {"found": len(survey.entries)}
    if survey.measured:
        result.update(driven=len(survey.driven()), not_driven=len(survey.not_driven()), not_driven_by_kind=survey.by_kind(),
                      unexplained=len(survey.unexplained()), lines_executed=executed, lines_of_driven=lines,
                      line_coverage=round(executed / lines, 4) if lines else None)
    return result


def headline(survey: Survey) -> str:
    """One line of counts, e.g. for a campaign's first lines."""
    found = f"{len(survey.entries)} KV-cache functions found"
    if not survey.measured:
        return found
    executed, lines = survey.line_coverage()
    share = f", {executed / lines:.0%} of their lines" if lines else ""
    kinds = ", ".join(f"{kind} {n}" for kind, n in survey.by_kind().items())
    unexplained = f", {len(survey.unexplained())} unexplained" if survey.unexplained() else ""
    return (f"{found}, {len(survey.driven())} driven{share} by {survey.cases} cases; {len(survey.not_driven())} not driven "
            f"({kinds}){unexplained}")


def render(survey: Survey) -> str:
    lines = [f"kvfuzz surface: vLLM {survey.version} (--vllm {survey.vllm}) at {survey.root}"]
    if survey.measured:
        crashed = f"; {len(survey.crashed)} skipped, the tracing process died or hung on them: {survey.crashed}" if survey.crashed else ""
        lines.append(f"campaign: at most {survey.seconds:g} s, {survey.cases} cases ({survey.probe} probe, every consumer a case names, "
                     f"seed {survey.seed}), traced{crashed}" + (f"; {survey.error}" if survey.error else ""))
    else:
        lines.append("static map only (--max-time 0): nothing was run")
    lines += [headline(survey), ""]
    if survey.measured:
        lines.append(f"driven ({len(survey.driven())}): lines run / lines, calls")
        lines += [f"  {e.function.name:96} {e.executed:4}/{e.lines:<4} {_share(e):>5}  {e.calls}" for e in survey.driven()]
        lines.append("")
        for kind, text in KINDS.items():
            entries = [e for e in survey.not_driven() if e.reason is not None and e.reason.kind == kind]
            if entries:
                lines.append(f"not driven: {kind}, {text} ({len(entries)})")
                lines += [f"  {e.function.name:96} {e.reason.text if e.reason else ''}" for e in entries]
                lines.append("")
        if survey.unexplained():
            lines.append(f"unexplained ({len(survey.unexplained())}): not driven, and no rule in fuzz/surface/reasons.py says why")
            lines += [f"  {e.function.name:96} {', '.join(e.function.verbs)}" for e in survey.unexplained()]
    else:
        lines.append("found: what it does to a KV cache; the reason it would have if not driven")
        lines += [f"  {e.function.name:96} {', '.join(e.function.verbs):24} {e.reason.kind if e.reason else '-'}" for e in survey.entries]
    return "\n".join(lines).rstrip()


def _share(entry: Entry) -> str:
    return f"{(entry.executed or 0) / entry.lines:.0%}" if entry.lines else "-"


def to_dict(survey: Survey) -> dict[str, Any]:
    return {"vllm": survey.vllm, "version": survey.version, "root": survey.root,
            "campaign": {"seconds": survey.seconds, "cases": survey.cases, "probe": survey.probe, "seed": survey.seed,
                         "crashed_cases": survey.crashed, "error": survey.error},
            "counts": counts(survey), "functions": [_function(e) for e in survey.entries]}


def _function(entry: Entry) -> dict[str, Any]:
    f = entry.function
    data: dict[str, Any] = {"name": f.name, "path": f.path, "qualname": f.qualname, "lines": [f.start, f.end], "does": list(f.verbs),
                            "status": entry.status, "executable_lines": entry.lines}
    if f.calls:
        data["passes_to"] = list(f.calls)
    if entry.driven:
        data.update(calls=entry.calls, executed_lines=entry.executed, first_case=entry.first)
    if entry.reason is not None and not entry.driven:
        data["reason"] = {"kind": entry.reason.kind, "text": entry.reason.text}
    return data
