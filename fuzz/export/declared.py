"""What a shipped backend declares for a case, which an exported test's expectation needs and only a release can tell.

Before vLLM 0.29 a backend declares its cache shape and stride order (`get_kv_cache_shape`,
`get_kv_cache_stride_order`) and `_reshape_kv_cache` views the pages through them; kvfuzz's oracle lays the views out
from that declaration (it holds the declaration itself to the contract: oracles/declarations.py). From 0.29 a backend
publishes, in `customize_spec`, how far apart its blocks lie (`block_stride_alignment`: sparse MLA backends keep whole
rows). A corpus case keeps neither (the minimizer drops them, so that each release is asked its own), so the exporter
asks the release the finding affects, once per contract, and a corpus file keeps the answer under `declared`:
{release: [[shape, stride order] (before 0.29), {field: value} (0.29+) or null, one per KV-cache group]}.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fuzz.case import Case, GroupCase
from fuzz.corpus.file import read
from fuzz.errors import InternalError, TargetError
from fuzz.export.finding import RELEASE_CONTRACTS, FindingFile, contract_of, version_key

DECLARED = "declared"
Declarations = list[Any]  # per group: [shape, stride order], {field: value}, or None where nothing was declared
# The spec fields a 0.29+ backend publishes that place blocks (fuzz/targets/layout_placed.py declare_group).
PUBLISHED_PLACEMENT = ("block_stride_alignment", "block_stride_multiple_of")


def needs_declarations(finding: FindingFile) -> bool:
    """A finding with an attention group on a shipped backend whose declaration the case does not hold."""
    return any(_asks(group) for group in finding.case.groups)


def _asks(group: GroupCase) -> bool:
    if not group.spec.is_attention or group.backend is None or group.synthetic_backend is not None:
        return False
    return group.declared_shape is None and all(getattr(group.spec, name) is None for name in PUBLISHED_PLACEMENT)


def releases_to_ask(finding: FindingFile) -> list[str]:
    """The newest release of each contract the finding affects, and the first release of the next contract of the same
    family (where a fix would show): one answer per contract its test checks."""
    newest: dict[str | None, str] = {}
    for release in finding.affected:
        newest[contract_of(release)] = release
    following = next_contract(finding)
    if following is not None:
        newest[following] = next(first for first, name in RELEASE_CONTRACTS if name == following)
    return sorted(newest.values(), key=version_key)


def next_contract(finding: FindingFile) -> str | None:
    """The contract after the last one the finding affects, where it is of the same family (shaped-*, placed-*)."""
    names = [name for _, name in RELEASE_CONTRACTS]
    last = contract_of(finding.affected[-1]) if finding.affected else None
    if last is None or names.index(last) + 1 == len(names):
        return None
    following = names[names.index(last) + 1]
    return following if following.split("-")[0] == last.split("-")[0] else None


def declared_for(finding: FindingFile, contract: str) -> bool:
    """Whether the oracle can lay the finding's views out under `contract`: it needs no declaration, or one of a release
    of that contract is recorded."""
    recorded = finding.meta.get(DECLARED) or {}
    return not needs_declarations(finding) or any(contract_of(release) == contract for release in recorded)


def missing(finding: FindingFile) -> list[str]:
    if not needs_declarations(finding):
        return []
    recorded = finding.meta.get(DECLARED) or {}
    return [release for release in releases_to_ask(finding) if release not in recorded]


def declared_case(finding: FindingFile, contract: str) -> Case:
    """The finding's case with the declarations of its release under `contract` (else of the nearest older contract's,
    else of the oldest recorded): the oracle's input for the test's expectation under that contract."""
    recorded: dict[str, Declarations] = finding.meta.get(DECLARED) or {}
    if not recorded or not needs_declarations(finding):
        return finding.case
    rank = {name: index for index, (_, name) in enumerate(RELEASE_CONTRACTS)}
    ordered = sorted(recorded, key=version_key)
    at_or_before = [release for release in ordered if rank.get(contract_of(release) or "", -1) <= rank[contract]]
    return with_declarations(finding.case, recorded[at_or_before[-1] if at_or_before else ordered[0]])


def with_declarations(case: Case, answer: Declarations) -> Case:
    groups = []
    for group, declared in zip(case.groups, answer, strict=True):
        if isinstance(declared, dict) and _asks(group):
            group = dataclasses.replace(group, spec=dataclasses.replace(group.spec, **declared))
        elif declared is not None and _asks(group):
            shape, order = declared
            group = dataclasses.replace(group, declared_shape=tuple(shape), declared_stride_order=None if order is None else tuple(order))
        groups.append(group)
    return dataclasses.replace(case, groups=tuple(groups))


def ask(findings: Iterable[FindingFile]) -> list[FindingFile]:
    """The findings with every declaration they miss asked of its release (one target per release); a release that
    cannot run a case leaves that finding without it, and its exporter says why."""
    from fuzz.campaign.pool import Pool
    from fuzz.targets import releases

    findings = list(findings)
    wanted: dict[str, list[int]] = {}
    for index, finding in enumerate(findings):
        for release in missing(finding):
            wanted.setdefault(release, []).append(index)
    answers: dict[int, dict[str, Declarations]] = {}
    for release, indices in sorted(wanted.items(), key=lambda item: version_key(item[0])):
        with Pool(releases.resolve(release), workers=1) as pool:
            for index in indices:
                try:
                    execution = pool.execute(findings[index].case, "cpu")
                except InternalError:
                    raise  # kvfuzz's own code failed: never a finding left unexported quietly
                except TargetError:
                    continue
                answers.setdefault(index, {})[release] = declarations_of(execution.case)
    return [_recorded(finding, answers[index]) if index in answers else finding for index, finding in enumerate(findings)]


def declarations_of(case: Case) -> Declarations:
    return [_declaration(group) for group in case.groups]


def _declaration(group: GroupCase) -> Any:
    if group.declared_shape is not None:
        order = group.declared_stride_order
        return [list(group.declared_shape), None if order is None else list(order)]
    published = {name: getattr(group.spec, name) for name in PUBLISHED_PLACEMENT if getattr(group.spec, name) is not None}
    return published or None


def _recorded(finding: FindingFile, answers: dict[str, Declarations]) -> FindingFile:
    declared = {**(finding.meta.get(DECLARED) or {}), **answers}
    return dataclasses.replace(finding, meta={**finding.meta, DECLARED: dict(sorted(declared.items(), key=lambda item: version_key(item[0])))})


def write_back(finding: FindingFile) -> None:
    """Keeps the finding's declarations in its corpus file (the other fields as they were)."""
    stored = read(Path(finding.path))
    if stored.meta.get(DECLARED) != finding.meta.get(DECLARED):
        stored.updated(**{DECLARED: finding.meta[DECLARED]}).write()
