"""A corpus finding file read for export and report: its case, and what kvfuzz recorded about it."""

from __future__ import annotations

from pathlib import Path

from fuzz.corpus.file import CorpusFile, read, version_key
from fuzz.errors import CaseError

FindingFile = CorpusFile  # a corpus file that records a finding
__all__ = ["RELEASE_CONTRACTS", "FindingFile", "contract_of", "finding_files", "read_finding", "version_key"]


# The contract each release's V2 runner follows, as kvfuzz's adapters probe it (README's adapter table): the entry of the
# newest release at or before it.
RELEASE_CONTRACTS = (("0.19.1", "shaped-0.19"), ("0.20.0", "shaped-0.20"), ("0.21.0", "shaped-0.21"), ("0.22.0", "shaped-0.22"),
                     ("0.23.0", "shaped-0.23"), ("0.24.0", "shaped-0.24"), ("0.27.0", "shaped-0.27"), ("0.29.0", "placed-0.29"),
                     ("0.32.0", "placed-0.32"))


def contract_of(release: str) -> str | None:
    names = [name for first, name in RELEASE_CONTRACTS if version_key(first) <= version_key(release)]
    return names[-1] if names else None


def read_finding(path: Path) -> FindingFile:
    """A corpus finding: CaseError (one line) when the file is missing, not JSON, or holds no finding."""
    found = read(path)
    if found.seed or not found.is_finding:
        raise CaseError(f"{path}: not a corpus finding (a JSON object with 'kind' and 'case')")
    return found


def finding_files(paths: list[Path]) -> list[Path]:
    """Files named, and every *.json under folders named (sorted)."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(path.rglob("*.json"))
        elif not path.exists():
            raise CaseError(f"{path}: no such file or folder")
        else:
            found.append(path)
    return found
