"""Shrink a failing case while it keeps its signature.

Deterministic greedy passes, earliest and largest first: drop groups, drop layers, drop KV
sharing, then move each number toward its smallest value (blocks, heads, head sizes, block
size) and each option toward the simplest (layout LBNHC, no padding, default dtype). A pass
is kept only when the case still fails with the same signature; every candidate is re-planned
so its kernel block size stays the one vLLM would choose.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from fuzz.case import Case, CaseError, GroupCase, SpecCase, validate
from fuzz.strategies import choose_kernel_block_size
from fuzz.targets.base import TargetInfo

SIMPLE_LAYOUTS = ("LBNHC", "LBHNC", "BLNHC")


def minimize(case: Case, still_fails: Callable[[Case], bool], info: TargetInfo, max_steps: int = 400) -> Case:
    best = case
    steps = 0
    improved = True
    while improved and steps < max_steps:
        improved = False
        for candidate in _candidates(best, info):
            steps += 1
            if still_fails(candidate):
                best, improved = candidate, True
                break
            if steps >= max_steps:
                break
    return best


def _candidates(case: Case, info: TargetInfo) -> Iterator[Case]:
    for index in range(len(case.groups) - 1, -1, -1):
        if len(case.groups) > 1:
            kept = tuple(g for i, g in enumerate(case.groups) if i != index)
            yield from _valid(dataclasses.replace(case, groups=kept, kv_sharing=_sharing_within(case, kept)), info)
    for index, group in enumerate(case.groups):
        for cut in range(len(group.layers) - 1, 0, -1):
            yield from _with_group(case, index, dataclasses.replace(group, layers=group.layers[:cut]), info)
    if case.kv_sharing:
        yield from _valid(dataclasses.replace(case, kv_sharing=()), info)
    for blocks in range(1, case.num_blocks):
        yield from _valid(dataclasses.replace(case, num_blocks=blocks), info)
    for layout in SIMPLE_LAYOUTS:
        if layout != case.layout and SIMPLE_LAYOUTS.index(layout) < _rank(case.layout):
            yield from _valid(dataclasses.replace(case, layout=layout), info)
    for index, group in enumerate(case.groups):
        for spec in _simpler_specs(group.spec):
            yield from _with_group(case, index, dataclasses.replace(group, spec=spec), info)


def _rank(layout: str) -> int:
    return SIMPLE_LAYOUTS.index(layout) if layout in SIMPLE_LAYOUTS else len(SIMPLE_LAYOUTS)


def _simpler_specs(spec: SpecCase) -> Iterator[SpecCase]:
    changes: list[dict[str, object]] = []
    if spec.page_size_padded is not None:
        changes.append({"page_size_padded": None})
    if spec.alignment is not None:
        changes.append({"alignment": None})
    if spec.num_kv_heads > 1:
        changes += [{"num_kv_heads": 1}, {"num_kv_heads": spec.num_kv_heads - 1}]
    if spec.head_size_v is not None:
        changes.append({"head_size_v": None})
    for size in (16, 32, 64):
        if size < spec.head_size and not spec.is_mla:
            changes.append({"head_size": size})
    for size in (16, 32, 64, 128, 256):
        if size < spec.block_size and size % spec.compress_ratio == 0:
            changes.append({"block_size": size})
    if spec.cache_dtype != "auto" and spec.state_content_bytes is None:
        changes.append({"cache_dtype": "auto", "dtype": "bfloat16", "kv_quant_mode": "none"})
    for change in changes:
        yield dataclasses.replace(spec, **change)  # type: ignore[arg-type]


def _with_group(case: Case, index: int, group: GroupCase, info: TargetInfo) -> Iterator[Case]:
    groups = tuple(group if i == index else g for i, g in enumerate(case.groups))
    yield from _valid(dataclasses.replace(case, groups=groups, kv_sharing=_sharing_within(case, groups)), info)


def _sharing_within(case: Case, groups: tuple[GroupCase, ...]) -> tuple[tuple[str, str], ...]:
    names = {n for g in groups for n in g.layers}
    return tuple((s, t) for s, t in case.kv_sharing if t in names)


def _valid(case: Case, info: TargetInfo) -> Iterator[Case]:
    """The candidate with kernel block sizes re-chosen, if it is still a buildable case."""
    groups = []
    for group in case.groups:
        if group.synthetic_backend is not None:
            sizes = group.synthetic_backend.kernel_block_sizes
        elif group.backend is not None and info.backend(group.backend) is not None:
            sizes = info.backend(group.backend).kernel_block_sizes  # type: ignore[union-attr]
        else:
            sizes = (group.spec.block_size,)
        kernel = choose_kernel_block_size(group.spec.block_size, sizes)
        if kernel is None:
            return
        groups.append(dataclasses.replace(group, kernel_block_size=kernel))
    candidate = dataclasses.replace(case, groups=tuple(groups))
    try:
        validate(candidate)
    except CaseError:
        return
    yield candidate
