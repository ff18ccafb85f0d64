"""The Markdown a reviewer reads (`$GITHUB_STEP_SUMMARY` or a review comment), and the end of the run on the terminal.

Both count bugs, not case files: one row per signature (fuzz/ci/model.py `Bug`) with the cases, variants and
origins that showed it. The verdict comes first (or, when kvfuzz itself failed, that the job failed because of
kvfuzz), then what was checked, the bugs the change introduced, the pre-existing and flaky ones collapsed, and
the first introduced bug explained inline: its minimal case in vLLM's terms, the rows of `kvfuzz explain` that
differ, and the command that reproduces it.
"""

from __future__ import annotations

import json

from fuzz.case import dumps
from fuzz.checks.registry import DESCRIPTIONS
from fuzz.ci.diff import ranges_text
from fuzz.ci.model import FLAKY, INTRODUCED, NEW, PRE_EXISTING, STATUSES, BehaviourChange, Bug, Checked, CiResult, DiffCoverage, InternalFailure
from fuzz.ci.present import differing_rows, export_command, origins_text, variants_text, vllm_terms

MAX_DETAILS = 20  # bugs shown in full (explain text, case); the tables list every one
REPORT_URL = "https://github.com/kvfuzz/kvfuzz/issues"
HEADINGS = {
    INTRODUCED: "Introduced by this change",
    NEW: "New (no baseline to compare with)",
    PRE_EXISTING: "Pre-existing (the baseline fails too)",
    FLAKY: "Flaky (did not fail the same way in both fresh processes)",
}
COLLAPSED = {PRE_EXISTING: "the baseline fails them too", FLAKY: "they did not fail the same way in both fresh processes"}
INTERNAL = "the job failed because of a kvfuzz internal error, not because of the change"


def markdown(result: CiResult) -> str:
    bugs = result.bugs
    failing = [bug for bug in bugs if bug.fails_job]
    lines = [f"## kvfuzz ci: {verdict(result, failing, bold=True)}", ""]
    errors = result.internal_errors
    if errors:
        lines += _internal_errors(errors)
    lines += _checked(result)
    if result.coverage is not None:
        lines += ["", *diff_coverage(result.coverage)]
    if result.behaviour:
        lines += ["", *behaviour_notes(result.behaviour)]
    if failing:
        lines += ["", f"### {HEADINGS[INTRODUCED] if result.baseline else HEADINGS[NEW]}", "", *_table(failing, with_status=False)]
    detailed = bugs[:MAX_DETAILS]  # in full: the first bugs, worst status first
    if failing:
        first = "First introduced bug" if result.baseline else "First new bug"
        lines += ["", f"### {first}: `{_code(failing[0].signature)}`", "", *_body(failing[0], result)]
    others = [bug for bug in failing[1:] if bug in detailed]
    if others:
        lines += ["", f"### The other {len(failing) - 1}", ""]
        for bug in others:
            lines += _folded(bug, result)
    for status in (PRE_EXISTING, FLAKY):
        lines += _collapsed(status, [bug for bug in bugs if bug.status == status], detailed, result)
    if len(bugs) > MAX_DETAILS:
        lines += ["", f"({len(bugs)} bugs in all; the first {MAX_DETAILS} are shown in full, the rest are in the tables, "
                      "the SARIF and the JUnit file)"]
    return "\n".join(lines) + "\n"


def verdict(result: CiResult, failing: list[Bug], bold: bool = False) -> str:
    """One line: what failed the job (the change, or kvfuzz itself), or that nothing did."""
    strong = (lambda text: f"**{text}**") if bold else (lambda text: text)
    if failing:
        cases = sum(item.fails_job for item in result.checked)
        what = "introduced by the change" if result.baseline else "new (no baseline to tell whether the change introduced them)"
        return strong(f"{len(failing)} bug(s) {what}") + f" ({cases} reproducible failing case(s))"
    if result.internal_errors:
        return strong(f"failed: {INTERNAL}")
    return strong("no new reproducible failure")


def terminal(result: CiResult, limit: int = 10) -> str:
    """The end of the run on the terminal: bugs by status, the ones that fail the job, kvfuzz's own errors, the verdict."""
    bugs = result.bugs
    failing = [bug for bug in bugs if bug.fails_job]
    counts = ", ".join(f"{len(group)} {status} ({sum(len(bug.items) for bug in group)} case(s))"
                       for status in HEADINGS if (group := [bug for bug in bugs if bug.status == status]))
    lines = [f"kvfuzz ci: checked {len(result.checked)} failing case(s): {len(bugs)} bug(s): {counts}" if result.checked
             else "kvfuzz ci: nothing failed"]
    for bug in failing[:limit]:
        example = bug.example
        where = f"\n      at {bug.locations[0].path}:{bug.locations[0].start_line}" if bug.locations else ""
        lines.append(f"  {bug.status.upper()} {bug.signature}\n      {len(bug.items)} case(s) ({origins_text(bug.origins)}) "
                     f"under {variants_text(bug.variants)}\n      {result.reproducer(example)}{where}")
    if len(failing) > limit:
        lines.append(f"  ... {len(failing) - limit} more in the summary, the SARIF and the JUnit file")
    for error in result.internal_errors:
        kept = f"\n      case: {error.case_file}" if error.case_file else ""
        trace = "\n" + _indent(error.traceback.rstrip(), "      ") if error.traceback else ""
        lines.append(f"  KVFUZZ INTERNAL ERROR ({error.count}x, please report at {REPORT_URL}): {error.message}{kept}{trace}")
    if result.behaviour:
        lines.append(f"kvfuzz ci: {len(result.behaviour)} behaviour-change note(s): cases that reached the change differ on the baseline")
    lines.append(f"kvfuzz ci: {verdict(result, failing)}")
    if failing and result.internal_errors:
        lines.append(f"kvfuzz ci: kvfuzz also failed on {sum(e.count for e in result.internal_errors)} case(s) (an internal error, above)")
    return "\n".join(lines)


def _internal_errors(errors: list[InternalFailure]) -> list[str]:
    lines = [f"> **kvfuzz failed, not your change:** kvfuzz's own code raised "
             f"({sum(e.count for e in errors)} case(s), {len(errors)} distinct error(s)). No bug in the change is implied; "
             f"please report it at {REPORT_URL} with the traceback below.", ""]
    for error in errors:
        kept = f", first case kept in `{error.case_file}`" if error.case_file else ""
        lines += [f"- `{_code(error.message)}` ({error.count}x{kept})"]
        if error.traceback:
            lines += ["", "<details><summary>traceback</summary>", "", "```text", error.traceback.rstrip(), "```", "</details>", ""]
    return lines


def _checked(result: CiResult) -> list[str]:
    """What was checked: the target and baseline, the corpus gate, the campaign, the reruns."""
    target, campaign = result.target, result.campaign
    lines = [f"- target: `--vllm {target['spec']}` ({target['label']}, vLLM {target['vllm_version']}, contract {target['contract']})"]
    if result.baseline:
        version = f", vLLM {result.baseline['vllm_version']}" if "vllm_version" in result.baseline else ""
        lines.append(f"- baseline: `--vllm {result.baseline['spec']}`{version}")
    gate = ", ".join(f"{count} {status}" for status, count in sorted(result.gate.items())) or "nothing"
    lines.append(f"- corpus gate: {sum(result.gate.values())} cases replayed: {gate}")
    if campaign:
        lines.append(f"- campaign: {campaign['cases']:,} cases in {campaign['elapsed_s']:.0f} s ({campaign['cases_per_s']} cases/s), "
                     f"{len(campaign['findings'])} new signature(s); CI corpus `{result.corpus}`")
    if result.checked:
        baseline = " and once on the baseline" if result.baseline else ""
        lines.append(f"- {len(result.checked)} failing case(s) run again in two fresh processes{baseline}: "
                     f"{len(result.bugs)} bug(s) (one per signature)")
    return lines


def diff_coverage(coverage: DiffCoverage) -> list[str]:
    """One row per changed function: its changed lines executed, the cases that reached them, the lines no case executed."""
    how = "drawn towards the change" if coverage.directed else "undirected draws"
    lines = ["### Diff coverage", ""]
    if not coverage.functions:
        return [*lines, "The change has no line that runs in the KV-cache folders kvfuzz reads (vllm/v1, the KV connectors, "
                        "the attention layers)."]
    lines += [f"{coverage.executed} of {coverage.changed} changed line(s) executed; {coverage.reached:,} of {coverage.cases:,} "
              f"campaign case(s) reached a changed line ({how}); {coverage.compared} of them also ran on the baseline.", "",
              "| function | changed lines executed | cases that reached them | not exercised |", "|---|---|---|---|"]
    for row in coverage.functions:
        function = row.function
        name = "import-time code" if function.import_time else function.qualname
        cases = "at import" if row.cases is None else f"{row.cases:,}"
        missing = f"`{ranges_text(function.path, row.unexercised)}`" if row.unexercised else "-"
        lines.append(f"| `{function.path}` {_cell(name)} | {len(row.executed)}/{len(function.lines)} | {cases} | {missing} |")
    unexercised = coverage.unexercised()
    if unexercised:
        lines += ["", *[f"- kvfuzz did not exercise: `{text}`" for text in unexercised],
                  "", "A green run says nothing about these lines: no case kvfuzz drew executed them."]
    return lines


def behaviour_notes(notes: list[BehaviourChange]) -> list[str]:
    """Cases that reached the change and behave differently on the baseline, without failing here: notes, not failures."""
    lines = [f"### Behaviour changes ({len(notes)} note(s), not failures)", ""]
    for note in notes:
        moved = f": {', '.join(note.layers)}, {note.bytes:,} byte(s) moved" if note.moves else ""
        lines += [f"<details><summary>behaviour-change: {_html(note.case.describe())}{_html(moved)}</summary>", "",
                  f"{note.what}; branch `{_code(note.branch)}`, baseline `{_code(note.baseline)}`.", "", "```text",
                  vllm_terms(note.case)]
        for move in note.moves:
            count = "?" if move.bytes is None else f"{move.bytes:,}"
            lines += [f"{move.layer}[{move.tensor}] branch   {move.branch}", f"{move.layer}[{move.tensor}] baseline {move.baseline}",
                      f"  -> {count} byte(s) moved"]
        lines += ["```", "</details>", ""]
    return lines


def _table(bugs: list[Bug], with_status: bool = True) -> list[str]:
    head = "| status " if with_status else ""
    lines = [f"{head}| kind | signature | cases | spec kinds / backends / layouts | found by | in vLLM |",
             "|---" * (6 + with_status) + "|"]
    for bug in bugs:
        where = f"`{bug.locations[0].path}:{bug.locations[0].start_line}`" if bug.locations else "-"
        status = f"| {bug.status} " if with_status else ""
        lines.append(f"{status}| {bug.kind} | `{_cell(bug.signature)}` | {_cases(bug)} | {_cell(variants_text(bug.variants))} | "
                     f"{origins_text(bug.origins)} | {where} |")
    return lines


def _collapsed(status: str, bugs: list[Bug], detailed: list[Bug], result: CiResult) -> list[str]:
    """One line with a count that opens on the table of those bugs and their details."""
    if not bugs:
        return []
    cases = sum(len(bug.items) for bug in bugs)
    lines = ["", f"<details><summary><b>{len(bugs)} {status} bug(s)</b> in {cases} case(s): {COLLAPSED[status]}</summary>", "",
             *_table(bugs, with_status=False), ""]
    for bug in bugs:
        if bug in detailed:
            lines += _folded(bug, result)
    return [*lines, "</details>"]


def _folded(bug: Bug, result: CiResult) -> list[str]:
    return [f"<details><summary>{bug.status}: <code>{_html(bug.signature)}</code></summary>", "", *_body(bug, result), "", "</details>", ""]


def _body(bug: Bug, result: CiResult) -> list[str]:
    """One bug in full: what it is, where, its minimal case in vLLM's terms, what differs, how to reproduce it."""
    example = bug.example
    where = ", ".join(f"`{loc.path}:{loc.start_line}`" + (f" ({loc.function})" if loc.function else "") for loc in bug.locations)
    lines = [f"{bug.kind}: {DESCRIPTIONS.get(bug.kind, '')}", "",
             f"- cases: {_cases(bug)}, found by {origins_text(bug.origins)}; under {variants_text(bug.variants)}",
             f"- reruns in fresh processes: {_reruns(example)}"]
    if example.baseline is not None:
        lines.append(f"- on the baseline: `{_code(example.baseline)}`")
    if where:
        lines.append(f"- in vLLM: {where}")
    lines += ["", f"Minimal case (`{example.path}`), as vLLM builds it:", "", "```text", vllm_terms(example.case), "```"]
    if example.explain:
        lines += ["", "Expected against actual (`kvfuzz explain`, the rows that differ):", "", "```text",
                  differing_rows(example.explain).rstrip(), "```"]
    lines += ["", "Reproduce:", "", "```bash", *_reproducers(example, result), "```", "",
              "<details><summary>full kvfuzz explain</summary>", "", "```text", example.explain.rstrip(), "```", "</details>", "",
              "<details><summary>minimized case</summary>", "", "```json", json.dumps(json.loads(dumps(example.case)), indent=1), "```",
              "</details>"]
    if len(bug.items) > 1:
        lines += ["", f"<details><summary>all {len(bug.items)} cases</summary>", "",
                  *[f"- {item.status}, {item.origin}: `{item.path}`" for item in bug.items], "", "</details>"]
    return lines


def _reproducers(item: Checked, result: CiResult) -> list[str]:
    export = export_command(item.path)
    return [result.reproducer(item), *([export] if export else [])]


def _cases(bug: Bug) -> str:
    statuses = bug.statuses
    if len(statuses) == 1:
        return str(len(bug.items))
    return f"{len(bug.items)} ({', '.join(f'{statuses[status]} {status}' for status in STATUSES if statuses[status])})"


def _reruns(item: Checked) -> str:
    if item.reproduced:
        return f"the same signature in {len(item.reruns)} of {len(item.reruns)}"
    return ", ".join(f"`{_code(run)}`" for run in item.reruns) or "-"


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def _code(text: str) -> str:
    return text.replace("`", "'")


def _cell(text: str) -> str:
    """Inline code in a table cell: GitHub splits cells at a bare `|` even there."""
    return _code(text).replace("|", "\\|")


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
