"""Campaign reports for CI systems: JUnit XML, one test case per new finding.

Flaky and unconfirmed process failures are skipped test cases (they never fail a job); a campaign
that ended with an error (a target kvfuzz cannot call, a corpus it cannot write) is an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fuzz.junit import JUnitCase, Part, write_junit


def write_campaign_junit(path: Path, report: dict[str, Any]) -> None:
    write_junit(path, "kvfuzz", campaign_cases(report), str(report["elapsed_s"]))


def campaign_cases(report: dict[str, Any]) -> list[JUnitCase]:
    target, error = report["target"], report.get("error")
    summary = Part("system-out", f"{report['cases']} cases, {report['cases_per_s']} cases/s, stopped by {report['stop_reason']}")
    failed = (Part("error", message=error, type="kvfuzz"),) if error else ()
    cases = [JUnitCase("kvfuzz.campaign", f"{target['label']} vLLM {target['vllm_version']}", (summary, *failed), str(report["elapsed_s"]))]
    for finding in report["findings"]:
        where = finding["case_file"] or "not written (the JSON report holds the case)"
        text = f"case file: {where}\nreproduce: kvfuzz replay {where} --vllm {target['spec']}"
        failure = Part("failure", text, finding["message"], finding["kind"])
        cases.append(JUnitCase(f"kvfuzz.{finding['kind']}", finding["signature"], (failure,)))
    for entry in report.get("flaky", []):
        skipped = Part("skipped", message=f"{entry['status']}: {entry['rerun']}")
        cases.append(JUnitCase(f"kvfuzz.{entry['kind']}", entry["signature"], (skipped,)))
    return cases
