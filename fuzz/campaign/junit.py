"""Campaign reports for CI systems: JUnit XML, one test case per new finding."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def write_junit(path: Path, report: dict[str, Any]) -> None:
    findings = report["findings"]
    suite = ET.Element("testsuite", name="kvfuzz", tests=str(1 + len(findings)), failures=str(len(findings)),
                       time=str(report["elapsed_s"]))
    target = report["target"]
    campaign = ET.SubElement(suite, "testcase", classname="kvfuzz.campaign", name=f"{target['label']} vLLM {target['vllm_version']}",
                             time=str(report["elapsed_s"]))
    ET.SubElement(campaign, "system-out").text = f"{report['cases']} cases, {report['cases_per_s']} cases/s, stopped by {report['stop_reason']}"
    for finding in findings:
        case = ET.SubElement(suite, "testcase", classname=f"kvfuzz.{finding['kind']}", name=finding["signature"])
        failure = ET.SubElement(case, "failure", message=finding["message"], type=finding["kind"])
        failure.text = f"case file: {finding['case_file']}\nreproduce: kvfuzz replay {finding['case_file']} --vllm {target['spec']}"
    ET.ElementTree(suite).write(path, encoding="unicode", xml_declaration=True)
