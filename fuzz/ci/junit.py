"""JUnit XML of a `kvfuzz ci` run: the gate and the campaign as test cases, then one per checked failure
(a failure when it fails the job, skipped with the reason when pre-existing or flaky)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from fuzz.ci.model import CiResult


def write_junit(path: Path, result: CiResult) -> None:
    failing = [item for item in result.checked if item.fails_job]
    campaign = result.campaign
    elapsed = str(campaign.get("elapsed_s", 0))
    suite = ET.Element("testsuite", name="kvfuzz-ci", tests=str(2 + len(result.checked)), failures=str(len(failing)),
                       skipped=str(len(result.checked) - len(failing)), time=elapsed)
    label = f"{result.target['label']} vLLM {result.target['vllm_version']}"
    gate = ET.SubElement(suite, "testcase", classname="kvfuzz.ci.gate", name=f"corpus replay on {label}")
    ET.SubElement(gate, "system-out").text = ", ".join(f"{n} {status}" for status, n in sorted(result.gate.items()))
    fuzz = ET.SubElement(suite, "testcase", classname="kvfuzz.ci.campaign", name=f"campaign on {label}", time=elapsed)
    ET.SubElement(fuzz, "system-out").text = (f"{campaign.get('cases', 0)} cases, {campaign.get('cases_per_s', 0)} cases/s, "
                                              f"stopped by {campaign.get('stop_reason', '-')}")
    for item in result.checked:
        case = ET.SubElement(suite, "testcase", classname=f"kvfuzz.ci.{item.origin}.{item.finding.kind}", name=item.finding.signature)
        text = (f"case file: {item.path}\nreproduce: {result.reproducer(item)}\nreruns: {item.reruns}\n"
                f"on the baseline: {item.baseline}\n\n{item.explain}")
        if item.fails_job:
            ET.SubElement(case, "failure", message=f"{item.status}: {item.finding.message}", type=item.finding.kind).text = text
        else:
            ET.SubElement(case, "skipped", message=f"{item.status}: {item.finding.message}")
            ET.SubElement(case, "system-out").text = text
    ET.ElementTree(suite).write(path, encoding="unicode", xml_declaration=True)
