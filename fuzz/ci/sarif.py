"""SARIF 2.1.0 for code scanning: one result per bug (finding signature), at the vLLM source line it points to.

Rule id: the finding kind. Message: the signature, how many cases showed it under which variants, the
rows of `kvfuzz explain` that differ for its example case and the reproducer. Level: error for a bug the
change introduced (or a new one without a baseline), warning for a pre-existing one, note for a flaky
one; `baselineState` says new or unchanged. The location is the line the example's finding names (the
innermost vLLM frame of a crash; for a wrong view, the function that built it); every other place its
cases point to is a related location. Locations are relative to the repository root (`%SRCROOT%`), so
a vLLM checkout's code scanning shows them on its own files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fuzz.checks.registry import DESCRIPTIONS, KINDS
from fuzz.ci.diff import ranges
from fuzz.ci.model import FLAKY, INTRODUCED, NEW, PRE_EXISTING, Bug, CiResult, Location
from fuzz.ci.present import differing_rows, origins_text, variants_text

SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
INFORMATION_URI = "https://github.com/kvfuzz/kvfuzz"

RULES = DESCRIPTIONS
LEVELS = {INTRODUCED: "error", NEW: "error", PRE_EXISTING: "warning", FLAKY: "note"}
BASELINE_STATES = {INTRODUCED: "new", NEW: "new", PRE_EXISTING: "unchanged", FLAKY: "new"}
# Notes about the change itself rather than a bug: changed lines no case executed, and cases that behave differently on the baseline.
UNEXERCISED, BEHAVIOUR_CHANGE = "unexercised-change", "behaviour-change"
NOTE_RULES = {UNEXERCISED: "A changed line of the KV-cache code that no case of the campaign executed: a green run says nothing about it.",
              BEHAVIOUR_CHANGE: "A case that reached the change passes on both sides, and its views differ between them."}


def sarif_log(result: CiResult, version: str) -> dict[str, Any]:
    kinds = [kind for kind in KINDS if kind in RULES]
    rules = [{"id": kind, "name": kind.title().replace("-", ""), "shortDescription": {"text": RULES[kind]},
              "defaultConfiguration": {"level": "error"}} for kind in kinds]
    if result.coverage is not None:
        rules += [{"id": rule, "name": rule.title().replace("-", ""), "shortDescription": {"text": text},
                   "defaultConfiguration": {"level": "note"}} for rule, text in NOTE_RULES.items()]
    run: dict[str, Any] = {
        "tool": {"driver": {"name": "kvfuzz", "version": version, "informationUri": INFORMATION_URI, "rules": rules}},
        "invocations": [_invocation(result)],
        "results": [_result(bug, result, kinds.index(bug.kind)) for bug in result.bugs] + _notes(result, len(kinds)),
    }
    if result.coverage is not None:
        run["properties"] = {"diffCoverage": result.coverage.to_dict(), "behaviourChanges": [note.to_dict() for note in result.behaviour]}
    return {"$schema": SCHEMA, "version": "2.1.0", "runs": [run]}


def _notes(result: CiResult, first_rule: int) -> list[dict[str, Any]]:
    """A note per unexercised changed region (a run of lines of one function) and per behaviour change."""
    coverage = result.coverage
    if coverage is None:
        return []
    notes = []
    for row in coverage.functions:
        function = row.function
        for start, end in ranges(row.unexercised):
            where = Location(function.path, start, end, None if function.import_time else function.qualname)
            span = f"{start}-{end}" if end != start else str(start)
            notes.append({"ruleId": UNEXERCISED, "ruleIndex": first_rule, "level": "note",
                          "message": {"text": f"kvfuzz did not exercise: {function.path}:{span} ({function.qualname}); "
                                              f"no campaign case executed these changed lines"},
                          "locations": [_location(where)],
                          "properties": {"function": function.qualname, "lines": list(range(start, end + 1))}})
    for note in result.behaviour:
        moved = f"; layers {', '.join(note.layers)}, {note.bytes} byte(s) moved" if note.moves else ""
        notes.append({"ruleId": BEHAVIOUR_CHANGE, "ruleIndex": first_rule + 1, "level": "note",
                      "message": {"text": f"behaviour-change: {note.what}: {note.case.describe()}{moved}"},
                      "properties": note.to_dict()})
    return notes


def write_sarif(path: Path, result: CiResult, version: str) -> None:
    path.write_text(json.dumps(sarif_log(result, version), indent=1) + "\n")


def _invocation(result: CiResult) -> dict[str, Any]:
    """Unsuccessful when kvfuzz itself failed: its internal errors are tool notifications, not results about vLLM."""
    errors = result.internal_errors
    invocation: dict[str, Any] = {"executionSuccessful": not errors}
    if errors:
        invocation["toolExecutionNotifications"] = [
            {"level": "error", "message": {"text": f"kvfuzz internal error ({error.count}x): {error.message}"
                                           + (f"\n\n{error.traceback}" if error.traceback else "")}} for error in errors]
    return invocation


def _result(bug: Bug, result: CiResult, rule_index: int) -> dict[str, Any]:
    item = bug.example
    message = (f"{bug.status}: {bug.signature}\n{len(bug.items)} case(s) ({origins_text(bug.origins)}) under "
               f"{variants_text(bug.variants)}\n\n{differing_rows(item.explain)}\n\nReproduce: {result.reproducer(item)}")
    data: dict[str, Any] = {
        "ruleId": bug.kind,
        "ruleIndex": rule_index,
        "level": LEVELS[bug.status],
        "baselineState": BASELINE_STATES[bug.status],
        "message": {"text": message},
        "partialFingerprints": {"kvfuzzSignature/v1": item.finding.signature_id},
        "properties": {"signature": bug.signature, "status": bug.status, "cases": len(bug.items), "statuses": dict(bug.statuses),
                       "origins": dict(bug.origins), "variants": bug.variants, "caseFile": str(item.path),
                       "caseFiles": [str(case.path) for case in bug.items], "reruns": item.reruns, "onBaseline": item.baseline,
                       "latent": item.finding.latent},
    }
    locations = bug.locations
    if locations:
        data["locations"] = [_location(locations[0])]
        if len(locations) > 1:
            data["relatedLocations"] = [{"id": number, **_location(where)} for number, where in enumerate(locations[1:], 1)]
    return data


def _location(where: Location) -> dict[str, Any]:
    region: dict[str, Any] = {"startLine": where.start_line}
    if where.end_line is not None:
        region["endLine"] = where.end_line
    location: dict[str, Any] = {"physicalLocation": {"artifactLocation": {"uri": where.path, "uriBaseId": "%SRCROOT%"}, "region": region}}
    if where.function:
        location["logicalLocations"] = [{"name": where.function, "kind": "function"}]
    return location
