"""One corpus file (corpus/findings/*.json, corpus/seeds/*.json): reading it, updating its fields and writing it atomically.

A finding file is a JSON object: what kvfuzz recorded about the finding, and the case under "case". A seed file is a
case alone. Every reader and writer of the corpus goes through `CorpusFile`, and a file written back keeps the form it
was read in (key order, indentation, final newline), so reading and writing it again changes no byte.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzz.case import Case, from_dict, to_dict
from fuzz.errors import CaseError
from fuzz.verdict.findings import Finding, observed

INDENT = 1


@dataclass(frozen=True)
class CorpusFile:
    path: Path
    case: Case
    meta: dict[str, Any]  # every field but "case"; empty for a seed
    seed: bool = False  # a case alone, not wrapped in a finding's record
    # The case as the file holds it (a hand-written seed may spell defaults out), and the text as read: writing back keeps both.
    raw_case: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    text: str | None = field(default=None, repr=False, compare=False)

    @property
    def is_finding(self) -> bool:
        return "kind" in self.meta

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
        """The releases the finding affects, as the file records them (`affected_versions`, else the one it was found on)."""
        return list(self.meta.get("affected_versions") or [self.meta.get("vllm_version")])

    @property
    def affected(self) -> list[str]:
        """The releases the finding affects, oldest first."""
        return sorted((str(v) for v in self.affected_versions if v), key=version_key)

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

    def updated(self, **fields: Any) -> CorpusFile:
        """The file with these fields set, the rest as they were."""
        if self.seed:
            raise CaseError(f"{self.path}: a seed holds a case alone, it has no fields to set")
        return dataclasses.replace(self, meta={**self.meta, **fields})

    def to_json(self) -> dict[str, Any]:
        raw = self.raw_case if self.raw_case is not None and _same_case(self.raw_case, self.case) else to_dict(self.case)
        if self.seed:
            return raw
        return {**self.meta, "case": raw}

    def dumps(self) -> str:
        data = self.to_json()
        sort_keys, newline = _form(self.text)
        return json.dumps(data, indent=INDENT, sort_keys=sort_keys) + ("\n" if newline else "")

    def write(self, path: Path | None = None) -> CorpusFile:
        """Write the file atomically (to `path` when given, leaving the old one to the caller); returns it as written."""
        target = path or self.path
        text = self.dumps()
        write_text_atomic(target, text)
        return dataclasses.replace(self, path=target, text=text)


def new_finding(directory: Path, case: Case, meta: dict[str, Any]) -> CorpusFile:
    """A finding's file, not yet written: named `<signature id>-<case hash>.json`, with the command that replays it."""
    path = directory / f"{meta.get('signature_id', 'case')}-{case.content_hash()}.json"
    return CorpusFile(path, case, {**meta, "reproduce": f"kvfuzz replay {path} --vllm {meta.get('target', 'installed')}"})


def read(path: Path) -> CorpusFile:
    """One corpus file; CaseError (one line, naming the file) when it is missing, not JSON or not a case."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise CaseError(f"{path}: not a readable JSON case (cannot read: {error.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise CaseError(f"{path}: not a readable JSON case (not valid JSON: {error.msg} at line {error.lineno})") from None
    wrapped = isinstance(data, dict) and "case" in data
    raw = data["case"] if wrapped else data
    try:
        case = from_dict(raw)
    except CaseError as error:
        raise CaseError(f"{path}: {error}") from None
    meta = {k: v for k, v in data.items() if k != "case"} if wrapped else {}
    return CorpusFile(Path(path), case, meta, not wrapped, raw, text)


def read_all(root: Path) -> Iterator[CorpusFile]:
    """The file `root`, or every *.json under the folder `root` (sorted)."""
    for path in [root] if root.is_file() else sorted(root.rglob("*.json")):
        yield read(path)


def load(path: str | Path) -> Case:
    """The case a corpus file holds (a seed's, or a finding's)."""
    return read(Path(path)).case


def write_atomic(path: Path, data: Any) -> None:
    """JSON as the corpus writes it (sorted keys, one-space indent, final newline), atomically."""
    write_text_atomic(path, json.dumps(data, indent=INDENT, sort_keys=True) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not *.json: a writer killed before the rename leaves a file no corpus reader takes for a case.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".partial")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # a full or read-only disk leaves no partial file behind
        raise


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(number) for number in re.findall(r"\d+", version))


def _form(text: str | None) -> tuple[bool, bool]:
    """(sorted keys, final newline) of a file as read; a new file takes kvfuzz's form, sorted with a newline."""
    if text is None:
        return True, True
    body = text.rstrip("\n")
    return json.dumps(json.loads(body), indent=INDENT, sort_keys=True) == body, text.endswith("\n")


def _same_case(raw: dict[str, Any], case: Case) -> bool:
    try:
        return from_dict(raw) == case
    except CaseError:
        return False
