"""Campaign reports for CI systems: JUnit XML, one test case per new finding.

Flaky and unconfirmed process failures are skipped test cases (they never fail a job); a campaign
that ended with an error (a target kvfuzz cannot call, a corpus it cannot write) is an error.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def write_junit(path: Path, report: dict[str, Any]) -> None:
    findings, flaky, error = report["findings"], report.get("flaky", []), report.get("error")
    suite = ET.Element("testsuite", name="kvfuzz", tests=str(1 + len(findings) + len(flaky)), failures=str(len(findings)),
                       errors=str(int(bool(error))), skipped=str(len(flaky)), time=str(report["elapsed_s"]))
    target = report["target"]
    campaign = ET.SubElement(suite, "testcase", classname="kvfuzz.campaign", name=f"{target['label']} vLLM {target['vllm_version']}",
                             time=str(report["elapsed_s"]))
    ET.SubElement(campaign, "system-out").text = f"{report['cases']} cases, {report['cases_per_s']} cases/s, stopped by {report['stop_reason']}"
    if error:
        ET.SubElement(campaign, "error", message=error, type="kvfuzz")
    for finding in findings:
        case = ET.SubElement(suite, "testcase", classname=f"kvfuzz.{finding['kind']}", name=finding["signature"])
        failure = ET.SubElement(case, "failure", message=finding["message"], type=finding["kind"])
        where = finding["case_file"] or "not written (the JSON report holds the case)"
        failure.text = f"case file: {where}\nreproduce: kvfuzz replay {where} --vllm {target['spec']}"
    for entry in flaky:
        case = ET.SubElement(suite, "testcase", classname=f"kvfuzz.{entry['kind']}", name=entry["signature"])
        ET.SubElement(case, "skipped", message=f"{entry['status']}: {entry['rerun']}")
    ET.ElementTree(suite).write(path, encoding="unicode", xml_declaration=True)
