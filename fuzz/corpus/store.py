"""The corpus: findings and seed cases as readable JSON files, written atomically."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fuzz.case import Case
from fuzz.corpus.file import CorpusFile, new_finding, read_all, write_atomic

# A release's version as corpus files name it (0.32.0, 0.21.1.post1); development builds and checkouts have no release.
FINAL_RELEASE = re.compile(r"^\d+(\.\d+)+(\.post\d+)?$")

Entry = CorpusFile  # one corpus file, as the replay and the gate call it
entries = read_all
__all__ = ["Entry", "entries", "expected_signatures", "known_signatures", "save_finding", "write_atomic"]


def save_finding(directory: Path, case: Case, meta: dict[str, Any]) -> Path:
    return new_finding(directory, case, meta).write().path


def known_signatures(root: Path, release: str | None = None) -> set[str]:
    """The signatures of the findings under `root` that affect `release` (its `affected_versions`), so a corpus never
    hides a finding on a release where it was never a bug; with `release` None or no release's version (a checkout, a
    development build), every finding's. A process failure a campaign could not confirm (`"confirmed": false`) is not
    one, so the next campaign checks it again."""
    if not root.exists():
        return set()
    per_release = release is not None and FINAL_RELEASE.match(release) is not None
    return {signature for e in entries(root) if (signature := e.expected_signature) and e.meta.get("confirmed") is not False
            and (not per_release or release in e.affected_versions)}


def expected_signatures(found: Iterable[Entry], version: str) -> frozenset[str]:
    """The signatures that kept findings record as expected failures of one release."""
    return frozenset(e.expected_signature for e in found if e.expected_signature and version in e.affected_versions)
