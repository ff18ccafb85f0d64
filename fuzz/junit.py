"""JUnit XML, the one writer behind `kvfuzz run --junit` (fuzz/campaign/junit.py) and `kvfuzz ci --junit` (fuzz/ci/junit.py).

A suite is a list of test cases; each case holds its parts in the order they are written (output, failure, error,
skipped). The suite's counts follow from the parts.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

OUTCOMES = ("failure", "error", "skipped")


@dataclass(frozen=True)
class Part:
    tag: str  # "system-out" or one of OUTCOMES
    text: str | None = None
    message: str | None = None
    type: str | None = None


@dataclass(frozen=True)
class JUnitCase:
    classname: str
    name: str
    parts: tuple[Part, ...] = ()
    time: str | None = None

    def has(self, tag: str) -> bool:
        return any(part.tag == tag for part in self.parts)


def write_junit(path: Path, suite_name: str, cases: Sequence[JUnitCase], time: str) -> None:
    counts = {f"{tag}s" if tag != "skipped" else tag: str(sum(case.has(tag) for case in cases)) for tag in OUTCOMES}
    suite = ET.Element("testsuite", name=suite_name, tests=str(len(cases)), failures=counts["failures"], errors=counts["errors"],
                       skipped=counts["skipped"], time=time)
    for case in cases:
        _case(suite, case)
    ET.ElementTree(suite).write(path, encoding="unicode", xml_declaration=True)


def _case(suite: ET.Element, case: JUnitCase) -> None:
    attributes = {"classname": case.classname, "name": case.name} | ({"time": case.time} if case.time is not None else {})
    element = ET.SubElement(suite, "testcase", attributes)
    for part in case.parts:
        named = {key: value for key, value in (("message", part.message), ("type", part.type)) if value is not None}
        child = ET.SubElement(element, part.tag, named)
        if part.text is not None:
            child.text = part.text
