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

from fuzz.ci.model import FLAKY, INTRODUCED, NEW, PRE_EXISTING, Bug, CiResult, Location
from fuzz.ci.present import differing_rows, origins_text, variants_text
from fuzz.verdict.findings import DESCRIPTIONS, KINDS

SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
INFORMATION_URI = "https://github.com/kvfuzz/kvfuzz"

RULES = DESCRIPTIONS
LEVELS = {INTRODUCED: "error", NEW: "error", PRE_EXISTING: "warning", FLAKY: "note"}
BASELINE_STATES = {INTRODUCED: "new", NEW: "new", PRE_EXISTING: "unchanged", FLAKY: "new"}


def sarif_log(result: CiResult, version: str) -> dict[str, Any]:
    kinds = [kind for kind in KINDS if kind in RULES]
    return {
        "$schema": SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {
                "name": "kvfuzz",
                "version": version,
                "informationUri": INFORMATION_URI,
                "rules": [{"id": kind, "name": kind.title().replace("-", ""), "shortDescription": {"text": RULES[kind]},
                           "defaultConfiguration": {"level": "error"}} for kind in kinds],
            }},
            "invocations": [_invocation(result)],
            "results": [_result(bug, result, kinds.index(bug.kind)) for bug in result.bugs],
        }],
    }


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
