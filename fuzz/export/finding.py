"""A corpus finding file read for export and report: its case, and what kvfuzz recorded about it."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuzz.case import Case, from_dict
from fuzz.errors import CaseError


@dataclass(frozen=True)
class FindingFile:
    path: Path
    case: Case
    meta: dict[str, Any]

    @property
    def signature_id(self) -> str:
        return str(self.meta.get("signature_id") or self.path.stem.split("-")[0])

    @property
    def kind(self) -> str:
        return str(self.meta.get("kind", ""))

    @property
    def function(self) -> str:
        return str(self.meta.get("function", ""))

    @property
    def message(self) -> str:
        return str(self.meta.get("message", ""))

    @property
    def signature(self) -> str:
        return str(self.meta.get("signature", ""))

    @property
    def affected(self) -> list[str]:
        """The releases the finding affects, oldest first (the corpus file's `affected_versions`)."""
        versions = self.meta.get("affected_versions") or [self.meta.get("vllm_version")]
        return sorted((str(v) for v in versions if v), key=version_key)

    @property
    def newest_affected(self) -> str | None:
        return self.affected[-1] if self.affected else None

    @property
    def layout_placed(self) -> bool:
        """Found against a contract of vLLM 0.29+ (views placed by KVCacheLayout)."""
        return str(self.meta.get("contract", "")).startswith("placed")

    @property
    def module_name(self) -> str:
        return f"test_kvfuzz_{self.signature_id}_{self.case.content_hash()[:8]}"


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(number) for number in re.findall(r"\d+", version))


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
    try:
        text = path.read_text()
    except OSError as error:
        raise CaseError(f"{path}: cannot read ({error.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise CaseError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict) or "case" not in data or "kind" not in data:
        raise CaseError(f"{path}: not a corpus finding (a JSON object with 'kind' and 'case')")
    try:
        case = from_dict(data["case"])
    except CaseError as error:
        raise CaseError(f"{path}: {error}") from None
    return FindingFile(path, case, {k: v for k, v in data.items() if k != "case"})


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
