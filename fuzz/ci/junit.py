"""JUnit XML of a `kvfuzz ci` run: the gate and the campaign as test cases, then one per bug (finding
signature) with the cases that showed it: a failure when it fails the job, skipped with the reason when
pre-existing or flaky. kvfuzz's own internal errors are one test case with an error, not a failure."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from fuzz.ci.model import Bug, CiResult
from fuzz.ci.present import differing_rows, origins_text, variants_text


def write_junit(path: Path, result: CiResult) -> None:
    bugs = result.bugs
    failing = [bug for bug in bugs if bug.fails_job]
    errors = result.internal_errors
    campaign = result.campaign
    elapsed = str(campaign.get("elapsed_s", 0))
    suite = ET.Element("testsuite", name="kvfuzz-ci", tests=str(2 + len(bugs) + bool(errors)), failures=str(len(failing)),
                       errors=str(int(bool(errors))), skipped=str(len(bugs) - len(failing)), time=elapsed)
    label = f"{result.target['label']} vLLM {result.target['vllm_version']}"
    gate = ET.SubElement(suite, "testcase", classname="kvfuzz.ci.gate", name=f"corpus replay on {label}")
    ET.SubElement(gate, "system-out").text = ", ".join(f"{n} {status}" for status, n in sorted(result.gate.items()))
    fuzz = ET.SubElement(suite, "testcase", classname="kvfuzz.ci.campaign", name=f"campaign on {label}", time=elapsed)
    ET.SubElement(fuzz, "system-out").text = (f"{campaign.get('cases', 0)} cases, {campaign.get('cases_per_s', 0)} cases/s, "
                                              f"stopped by {campaign.get('stop_reason', '-')}")
    if errors:
        internal = ET.SubElement(suite, "testcase", classname="kvfuzz.ci.internal", name="kvfuzz's own code")
        ET.SubElement(internal, "error", message="kvfuzz internal error: the job failed because of kvfuzz, not the change",
                      type="kvfuzz-internal-error").text = "\n\n".join(
            f"{error.message} ({error.count}x; case {error.case_file or '-'})\n{error.traceback or ''}".rstrip() for error in errors)
    for bug in bugs:
        case = ET.SubElement(suite, "testcase", classname=f"kvfuzz.ci.{bug.kind}", name=bug.signature)
        text = _text(bug, result)
        message = f"{bug.status}: {bug.example.finding.message} ({len(bug.items)} case(s))"
        if bug.fails_job:
            ET.SubElement(case, "failure", message=message, type=bug.kind).text = text
        else:
            ET.SubElement(case, "skipped", message=message)
            ET.SubElement(case, "system-out").text = text
    ET.ElementTree(suite).write(path, encoding="unicode", xml_declaration=True)


def _text(bug: Bug, result: CiResult) -> str:
    item = bug.example
    cases = "\n".join(f"  {case.status} ({case.origin}): {case.path}" for case in bug.items)
    return (f"{len(bug.items)} case(s) ({origins_text(bug.origins)}) under {variants_text(bug.variants)}\n"
            f"reproduce: {result.reproducer(item)}\nreruns: {item.reruns}\non the baseline: {item.baseline}\ncases:\n{cases}\n\n"
            f"{differing_rows(item.explain)}")
