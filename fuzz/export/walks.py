"""The model runner's walk up to the views, in the generation the finding's allocation belongs to: vLLM 0.29+'s
(runner_steps, KVCacheLayout) or 0.19 - 0.28's (shaped_steps, `_reshape_kv_cache`). Templates that check what code
does with the views (block copy, connector regions) write either."""

from __future__ import annotations

import dataclasses

from fuzz.case import GroupCase
from fuzz.export import runner_steps, shaped_steps
from fuzz.export.code import CONFIG_FIXTURE, Module
from fuzz.export.finding import FindingFile, contract_of, version_key
from fuzz.export.placed_views import PROBE as PLACED_PROBE
from fuzz.export.reach import Reach

PLACED_FROM = "0.29.0"  # the first release that allocates by KVCacheLayout (allocate_kv_cache)


def by_generation(finding: FindingFile) -> list[tuple[str, FindingFile]]:
    """The finding as one finding per allocation generation its affected releases lie in, each named and holding that
    generation's releases and contract: one walk each (a module writes one)."""
    parts: dict[str, list[str]] = {}
    for release in finding.affected:
        placed = version_key(release) >= version_key(PLACED_FROM)
        parts.setdefault("from_0_29" if placed else "before_0_29", []).append(release)
    if len(parts) < 2:
        return [("", finding)]
    return [(name, dataclasses.replace(finding, meta={**finding.meta, "affected_versions": releases,
                                                      "contract": contract_of(releases[-1])}))
            for name, releases in parts.items()]


def checked_groups(finding: FindingFile) -> list[GroupCase] | None:
    """The case's groups for a 0.29+ walk, None for a walk before 0.29; NoTemplate where neither writes the case."""
    if finding.layout_placed:
        return runner_steps.check_groups(finding)
    shaped_steps.check_case(finding)
    return None


def constants(finding: FindingFile, groups: list[GroupCase] | None) -> str:
    return shaped_steps.constants(finding) if groups is None else runner_steps.constants(finding, groups)


def steps(finding: FindingFile, reach: Reach | None, module: Module, groups: list[GroupCase] | None) -> tuple[str, str]:
    """The walk's helpers and fixture added to `module`; returns the test body up to `kv_caches` (the views the runner
    keeps: the manager views from 0.29) and the release probe of its generation."""
    if groups is None:
        return shaped_steps.walk(finding, module), shaped_steps.PROBE
    module.add(CONFIG_FIXTURE, "VllmConfig", "set_current_vllm_config", "current_platform")
    return runner_steps.steps(finding, reach, module), PLACED_PROBE
