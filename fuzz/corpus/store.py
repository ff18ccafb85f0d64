"""The corpus: findings and seed cases as readable JSON files, written atomically."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuzz.case import Case, CaseError, from_dict, to_dict
from fuzz.verdict.findings import Finding, observed

# A release's version as corpus files name it (0.32.0, 0.21.1.post1); development builds and checkouts have no release.
FINAL_RELEASE = re.compile(r"^\d+(\.\d+)+(\.post\d+)?$")


@dataclass(frozen=True)
class Entry:
    path: Path
    case: Case
    meta: dict[str, Any]

    @property
    def expected_signature(self) -> str | None:
        """A finding kept as an expected failure of the releases it names: its signature, derived from
        the finding it records (so a file written before a change of the signature's form still counts)."""
        if not {"kind", "function", "message"} <= self.meta.keys():
            return self.meta.get("signature")
        if "backend" not in self.meta:  # kept before findings named their variant: the case names it
            return observed(self.case, self.meta["kind"], self.meta["function"], self.meta["message"], self.meta.get("layer")).signature
        return Finding.from_dict({"spec_kind": "", **self.meta}).signature

    @property
    def affected_versions(self) -> list[str]:
        return list(self.meta.get("affected_versions") or [self.meta.get("vllm_version")])


def write_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not *.json: a writer killed before the rename leaves a file no corpus reader takes for a case.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".partial")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # a full or read-only disk leaves no partial file behind
        raise


def save_finding(directory: Path, case: Case, meta: dict[str, Any]) -> Path:
    path = directory / f"{meta.get('signature_id', 'case')}-{case.content_hash()}.json"
    write_atomic(path, {**meta, "reproduce": f"kvfuzz replay {path} --vllm {meta.get('target', 'installed')}", "case": to_dict(case)})
    return path


def entries(root: Path) -> Iterator[Entry]:
    files = [root] if root.is_file() else sorted(root.rglob("*.json"))
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise CaseError(f"{path}: not a readable JSON case ({error})") from None
        raw = data.get("case", data) if isinstance(data, dict) else data
        try:
            case = from_dict(raw)
        except CaseError as error:
            raise CaseError(f"{path}: {error}") from None
        meta = {k: v for k, v in data.items() if k != "case"} if "case" in data else {}
        yield Entry(path, case, meta)


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
