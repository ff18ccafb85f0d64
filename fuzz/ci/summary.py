"""The Markdown a reviewer reads (`$GITHUB_STEP_SUMMARY` or a review comment): the verdict first,
then each failure with its location, reproducer, `kvfuzz explain` text and minimized case."""

from __future__ import annotations

import json

from fuzz.case import dumps
from fuzz.ci.model import FLAKY, INTRODUCED, NEW, PRE_EXISTING, Checked, CiResult

MAX_DETAILS = 20  # failures shown in full (explain text, case); the table lists every one
HEADINGS = {
    INTRODUCED: "Introduced by this change",
    NEW: "New (no baseline to compare with)",
    PRE_EXISTING: "Pre-existing (the baseline fails too)",
    FLAKY: "Flaky (did not fail the same way in both fresh processes)",
}


def markdown(result: CiResult) -> str:
    target, campaign = result.target, result.campaign
    failing = [item for item in result.checked if item.fails_job]
    verdict = (f"**{len(failing)} reproducible failure(s) introduced by the change**" if failing
               else "**no new reproducible failure**")
    lines = [f"## kvfuzz ci: {verdict}", "",
             f"- target: `--vllm {target['spec']}` ({target['label']}, vLLM {target['vllm_version']}, contract {target['contract']})"]
    if result.baseline:
        version = f", vLLM {result.baseline['vllm_version']}" if "vllm_version" in result.baseline else ""
        lines.append(f"- baseline: `--vllm {result.baseline['spec']}`{version}")
    gate = ", ".join(f"{count} {status}" for status, count in sorted(result.gate.items())) or "nothing"
    lines.append(f"- corpus gate: {sum(result.gate.values())} cases replayed: {gate}")
    if campaign:
        lines.append(f"- campaign: {campaign['cases']:,} cases in {campaign['elapsed_s']:.0f} s ({campaign['cases_per_s']} cases/s), "
                     f"{len(campaign['findings'])} new signature(s); CI corpus `{result.corpus}`")
        for message, count in campaign.get("internal_errors", {}).items():
            lines.append(f"- kvfuzz internal error ({count}x, please report): `{message}`")
    lines += ["", "| status | origin | kind | signature |", "|---|---|---|---|"]
    ordered = [item for status in HEADINGS for item in result.by_status(status)]
    lines += [f"| {item.status} | {item.origin} | {item.finding.kind} | `{_cell(item.finding.signature)}` |" for item in ordered]
    if not result.checked:
        lines.append("| - | - | - | nothing failed |")
    shown = 0
    for status, heading in HEADINGS.items():
        items = result.by_status(status)
        if items:
            lines += ["", f"### {heading}"]
        for item in items:
            if shown == MAX_DETAILS:
                lines += ["", f"({len(items)} in all; the first {MAX_DETAILS} failures of the run are shown in full, the rest are in the table, "
                              "the SARIF and the JUnit file)"]
                break
            lines += _details(item, result)
            shown += 1
    return "\n".join(lines) + "\n"


def terminal(result: CiResult, limit: int = 10) -> str:
    """The end of the run on the terminal: counts, then the failures that fail the job."""
    counts = ", ".join(f"{len(result.by_status(status))} {status}" for status in HEADINGS if result.by_status(status))
    failing = [item for item in result.checked if item.fails_job]
    lines = [f"kvfuzz ci: checked {len(result.checked)} failure(s): {counts}" if result.checked else "kvfuzz ci: nothing failed"]
    for item in failing[:limit]:
        where = f"\n      at {item.locations[0].path}:{item.locations[0].start_line}" if item.locations else ""
        lines.append(f"  {item.status.upper()} ({item.origin}) {item.finding.signature}\n      {result.reproducer(item)}{where}")
    if len(failing) > limit:
        lines.append(f"  ... {len(failing) - limit} more in the summary, the SARIF and the JUnit file")
    lines.append(f"kvfuzz ci: {len(failing)} reproducible failure(s) introduced by the change" if failing
                 else "kvfuzz ci: no new reproducible failure")
    return "\n".join(lines)


def _details(item: Checked, result: CiResult) -> list[str]:
    where = ", ".join(f"`{loc.path}:{loc.start_line}`" + (f" ({loc.function})" if loc.function else "") for loc in item.locations)
    lines = ["", f"#### `{item.finding.signature}`", "",
             f"- found by: {'the corpus gate' if item.origin == 'corpus' else 'the campaign'} (`{item.path}`)",
             f"- reruns in fresh processes: {_reruns(item)}"]
    if item.baseline is not None:
        lines.append(f"- on the baseline: `{_code(item.baseline)}`")
    if where:
        lines.append(f"- in vLLM: {where}")
    lines += ["- reproduce:", "", "```bash", result.reproducer(item), "```", "",
              "<details><summary>kvfuzz explain</summary>", "", "```text", item.explain.rstrip(), "```", "</details>", "",
              "<details><summary>minimized case</summary>", "", "```json", json.dumps(json.loads(dumps(item.case)), indent=1), "```",
              "</details>"]
    return lines


def _reruns(item: Checked) -> str:
    if item.reproduced:
        return f"the same signature in {len(item.reruns)} of {len(item.reruns)}"
    return ", ".join(f"`{_code(run)}`" for run in item.reruns) or "-"


def _code(text: str) -> str:
    return text.replace("`", "'")


def _cell(text: str) -> str:
    """Inline code in a table cell: GitHub splits cells at a bare `|` even there."""
    return _code(text).replace("|", "\\|")
