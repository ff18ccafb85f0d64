"""Keeps in each corpus finding the cache shapes its releases' shipped backends declare (vLLM <= 0.28), so that
`kvfuzz export corpus` needs no release to write their tests: asks each release once per contract the finding affects.
Usage: .venv/bin/python scripts/record_declarations.py [CORPUS_FOLDER]   (default corpus/findings)"""

from __future__ import annotations

import sys
from pathlib import Path

from fuzz.export import declared
from fuzz.export.finding import finding_files, read_finding

folder = Path(sys.argv[1] if len(sys.argv) > 1 else "corpus/findings")
findings = [read_finding(path) for path in finding_files([folder])]
for finding in declared.ask(finding for finding in findings if declared.missing(finding)):
    if declared.DECLARED in finding.meta:
        declared.write_back(finding)
        print(f"{finding.path.name}: declared by {', '.join(finding.meta[declared.DECLARED])}")
    else:
        print(f"{finding.path.name}: no release could run it")
