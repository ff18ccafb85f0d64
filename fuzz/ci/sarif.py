"""SARIF 2.1.0 for code scanning: one result per finding signature, at the vLLM source line it points to.

Rule id: the finding kind. Message: the `kvfuzz explain` text. Level: error for a failure the change
introduced (or a new one without a baseline), warning for a pre-existing one, note for a flaky one;
`baselineState` says new or unchanged. Locations are relative to the repository root (`%SRCROOT%`),
so a vLLM checkout's code scanning shows them on its own files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fuzz.ci.model import FLAKY, INTRODUCED, NEW, PRE_EXISTING, Checked, CiResult, Location
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
            "results": [_result(item, result, kinds.index(item.finding.kind)) for item in _one_per_signature(result.checked)],
        }],
    }


def write_sarif(path: Path, result: CiResult, version: str) -> None:
    path.write_text(json.dumps(sarif_log(result, version), indent=1) + "\n")


def _one_per_signature(checked: list[Checked]) -> list[Checked]:
    """The first failure of each signature, the one that fails the job first."""
    chosen: dict[str, Checked] = {}
    for item in sorted(checked, key=lambda c: (not c.fails_job, c.status == FLAKY)):
        chosen.setdefault(item.finding.signature, item)
    return list(chosen.values())


def _result(item: Checked, result: CiResult, rule_index: int) -> dict[str, Any]:
    data: dict[str, Any] = {
        "ruleId": item.finding.kind,
        "ruleIndex": rule_index,
        "level": LEVELS[item.status],
        "baselineState": BASELINE_STATES[item.status],
        "message": {"text": f"{item.status}: {item.finding.signature}\n\n{item.explain}\n\nReproduce: {result.reproducer(item)}"},
        "partialFingerprints": {"kvfuzzSignature/v1": item.finding.signature_id},
        "properties": {"signature": item.finding.signature, "status": item.status, "origin": item.origin, "caseFile": str(item.path),
                       "reruns": item.reruns, "onBaseline": item.baseline, "latent": item.finding.latent},
    }
    if item.locations:
        data["locations"] = [_location(item.locations[0])]
        if len(item.locations) > 1:
            data["relatedLocations"] = [{"id": number, **_location(where)} for number, where in enumerate(item.locations[1:], 1)]
    return data


def _location(where: Location) -> dict[str, Any]:
    region: dict[str, Any] = {"startLine": where.start_line}
    if where.end_line is not None:
        region["endLine"] = where.end_line
    location: dict[str, Any] = {"physicalLocation": {"artifactLocation": {"uri": where.path, "uriBaseId": "%SRCROOT%"}, "region": region}}
    if where.function:
        location["logicalLocations"] = [{"name": where.function, "kind": "function"}]
    return location
