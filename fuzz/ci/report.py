"""`kvfuzz ci --report FILE`: the run as JSON, for scripts and dashboards: the verdict, the bugs by status, the
campaign, the change's diff coverage and behaviour-change notes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fuzz.ci.model import CiResult


def report(result: CiResult) -> dict[str, Any]:
    campaign = result.campaign
    return {
        "exit_status": result.exit_status,
        "target": result.target,
        "baseline": result.baseline,
        "corpus_gate": dict(result.gate),
        "campaign": {key: campaign.get(key) for key in ("cases", "elapsed_s", "cases_per_s", "stop_reason")} if campaign else None,
        "bugs": [{"signature": bug.signature, "kind": bug.kind, "status": bug.status, "cases": len(bug.items),
                  "case_files": [str(item.path) for item in bug.items]} for bug in result.bugs],
        "internal_errors": [{"error": error.message, "count": error.count} for error in result.internal_errors],
        "diff_coverage": result.coverage.to_dict() if result.coverage is not None else None,
        "behaviour_changes": [note.to_dict() for note in result.behaviour],
    }


def write_report(path: Path, result: CiResult) -> None:
    path.write_text(json.dumps(report(result), indent=1) + "\n")
