"""Shrink a failing case while it keeps its signature.

Named passes, run in order and repeated until none makes progress (a fixed point):
1. groups   - delta debugging over KV-cache groups (drop halves, then single groups);
2. layers   - the same over each group's layers, and dropping KV sharing;
3. numbers  - every numeric field toward its smallest valid value: block count to 1, heads to 1,
              the smallest head and block sizes, no compression;
4. options  - toward the simplest layout, backend, dtype and options: no padding or alignment,
              a real backend instead of a synthetic one, the default cache dtype, one model
              runner (the V2 runner first), specs built from the case, alike layers, no packing, CUDA;
5. touches  - fewer consumers, blocks, copies and kernel-probe tokens, and lower block ids.
Rules, after Hypothesis' shrinker: every step is a strictly simpler case (by `size`, so progress
is deterministic and the loop ends), candidates are re-planned so their kernel block size is
the one vLLM would choose (a shrunk case must stay a case vLLM could build), and a candidate
is kept only when the target still fails with the same signature.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from fuzz.case import MLA_KINDS, RUNNERS, Case, CaseError, GroupCase, SpecCase, validate
from fuzz.space import LAYOUT_ORDER, choose_kernel_block_size, simpler_block_sizes, unrealistic
from fuzz.targets.base import TargetInfo
from fuzz.verdict.findings import PROCESS_KINDS, Finding
from oracles import pages

T = TypeVar("T")
MAX_STEPS = 600  # candidate runs; a case rarely needs more than a few dozen


@dataclasses.dataclass
class ShrinkPass:
    name: str
    generate: Callable[[Case, TargetInfo], Iterator[Case]]
    tried: int = 0
    kept: int = 0


def minimize(case: Case, still_fails: Callable[[Case], bool], info: TargetInfo, max_steps: int = MAX_STEPS,
             max_seconds: float | None = None) -> tuple[Case, int]:
    """The smallest case found that still fails, and the number of candidates run."""
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    passes = [ShrinkPass("groups", _drop_groups), ShrinkPass("layers", _drop_layers),
              ShrinkPass("numbers", _smaller_numbers), ShrinkPass("options", _simpler_options), ShrinkPass("touches", _fewer_touches)]
    best, steps, progress = case, 0, True
    while progress and steps < max_steps:
        progress = False
        for shrink in passes:
            for candidate in shrink.generate(best, info):
                candidate = _buildable(candidate, info)
                if candidate is None or size(candidate) >= size(best):
                    continue
                steps += 1
                shrink.tried += 1
                if still_fails(candidate):
                    best, progress = candidate, True
                    shrink.kept += 1
                    break
                if steps >= max_steps or (deadline is not None and time.monotonic() > deadline):
                    return best, steps
            if progress:
                break
    return best, steps


def shrink_finding(case: Case, finding: Finding, find: Callable[[Case], Finding | None], info: TargetInfo,
                   max_steps: int = MAX_STEPS, max_seconds: float | None = None) -> tuple[Case, Finding, int]:
    """Minimize a case while it fails as `finding` does: the small case, its finding, and the candidates run.

    A candidate fails the same way when `find` reports the same signature, or for a dead, hung or
    exhausted process the same kind (a signal's text varies; the record keeps its first text). The
    finding returned is the small case's own: the layer and numbers it names are in that case.
    """
    by_kind = finding.kind in PROCESS_KINDS
    smallest = finding

    def still_fails(candidate: Case) -> bool:
        nonlocal smallest
        found = find(candidate)
        if found is None or (found.kind != finding.kind if by_kind else found.signature != finding.signature):
            return False
        smallest = dataclasses.replace(finding, layer=found.layer) if by_kind else found
        return True

    small, steps = minimize(case, still_fails, info, max_steps, max_seconds)
    return small, dataclasses.replace(smallest, latent=small.is_latent), steps


def size(case: Case) -> tuple[int, ...]:
    """A total order on cases: fewer groups, layers and blocks first, then smaller numbers, then simpler options."""
    specs = [g.spec for g in case.groups]
    return (
        len(case.groups),
        sum(len(g.layers) for g in case.groups) + len(case.kv_sharing),
        case.num_blocks,
        sum(s.num_kv_heads + s.head_size + s.block_size + s.compress_ratio for s in specs)
        + sum(sum(g.layer_heads) + sum(g.layer_head_sizes) for g in case.groups),
        _layout_rank(case.layout),
        sum(_options(g) for g in case.groups) + RUNNERS.index(case.runner) + (case.spec_source != "case") + (case.packing != "none")
        + (case.platform != "cuda"),
        _touches_size(case),
    )


def _touches_size(case: Case) -> tuple[int, int]:
    touches = case.touches
    if touches is None:
        return (0, 0)
    ids = sum(touches.blocks) + sum(map(sum, touches.copies)) + sum(map(sum, touches.tokens))
    return (touches.size, ids)


def _options(group: GroupCase) -> int:
    spec = group.spec
    return ((group.synthetic_backend is not None) + bool(group.layer_heads) + bool(group.layer_head_sizes) + bool(group.layer_cache_dtypes)
            + (spec.page_size_padded is not None) + (spec.alignment is not None)
            + (spec.head_size_v is not None) + (spec.cache_dtype != "auto") + (spec.dtype != "bfloat16"))


def _layout_rank(layout: str) -> int:
    return LAYOUT_ORDER.index(layout) if layout in LAYOUT_ORDER else len(LAYOUT_ORDER)


def _without_chunks(items: tuple[T, ...]) -> Iterator[tuple[T, ...]]:
    """Delta debugging's candidates: the items without each half, then each quarter, ... each one."""
    chunk = len(items) // 2
    while chunk >= 1:
        for start in range(0, len(items), chunk):
            kept = items[:start] + items[start + chunk:]
            if kept:
                yield kept
        chunk //= 2


def _drop_groups(case: Case, info: TargetInfo) -> Iterator[Case]:
    for kept in _without_chunks(case.groups):
        yield _with_groups(case, kept)


def _drop_layers(case: Case, info: TargetInfo) -> Iterator[Case]:
    if case.kv_sharing:
        yield dataclasses.replace(case, kv_sharing=())
    for index, group in enumerate(case.groups):
        for kept in _without_chunks(tuple(range(len(group.layers)))):
            heads = tuple(group.layer_heads[i] for i in kept) if group.layer_heads else ()
            sizes = tuple(group.layer_head_sizes[i] for i in kept) if group.layer_head_sizes else ()
            dtypes = tuple(group.layer_cache_dtypes[i] for i in kept) if group.layer_cache_dtypes else ()
            yield _with_group(case, index, dataclasses.replace(group, layers=tuple(group.layers[i] for i in kept), layer_heads=heads,
                                                               layer_head_sizes=sizes, layer_cache_dtypes=dtypes))


def _smaller_numbers(case: Case, info: TargetInfo) -> Iterator[Case]:
    for blocks in range(1, case.num_blocks):
        yield dataclasses.replace(case, num_blocks=blocks)
    for index, group in enumerate(case.groups):
        for position, heads in enumerate(group.layer_heads):
            if heads > 1:
                fewer = group.layer_heads[:position] + (1,) + group.layer_heads[position + 1:]
                yield _with_group(case, index, dataclasses.replace(group, layer_heads=fewer))
        spec = group.spec
        changes: list[dict[str, object]] = []
        if spec.num_kv_heads > 1 and spec.kind not in MLA_KINDS:
            changes += [{"num_kv_heads": 1}, {"num_kv_heads": spec.num_kv_heads - 1}]
        if spec.kind not in MLA_KINDS and spec.kind != "mamba":
            changes += [{"head_size": h} for h in (16, 32, 64) if h < spec.head_size]
        changes += [{"block_size": b} for b in simpler_block_sizes(spec.block_size) if b % spec.compress_ratio == 0]
        if spec.compress_ratio > 1:
            changes.append({"compress_ratio": 1})
        yield from _spec_changes(case, index, group, changes)


def _simpler_options(case: Case, info: TargetInfo) -> Iterator[Case]:
    for runner in RUNNERS[: RUNNERS.index(case.runner)]:
        yield dataclasses.replace(case, runner=runner)
    if any(g.layer_heads for g in case.groups):
        yield dataclasses.replace(case, groups=tuple(dataclasses.replace(g, layer_heads=()) for g in case.groups))
    if any(g.layer_head_sizes for g in case.groups):
        yield dataclasses.replace(case, groups=tuple(dataclasses.replace(g, layer_head_sizes=()) for g in case.groups))
    if any(g.layer_cache_dtypes for g in case.groups):
        yield dataclasses.replace(case, groups=tuple(dataclasses.replace(g, layer_cache_dtypes=()) for g in case.groups))
    if case.packing != "none" and not any(g.differs_per_layer for g in case.groups):
        yield dataclasses.replace(case, packing="none")
    if case.platform != "cuda":
        yield dataclasses.replace(case, platform="cuda")
    if case.spec_source != "case":
        yield dataclasses.replace(case, spec_source="case")
    for layout in LAYOUT_ORDER:
        if layout in info.layouts and _layout_rank(layout) < _layout_rank(case.layout):
            yield dataclasses.replace(case, layout=layout)
    for index, group in enumerate(case.groups):
        spec = group.spec
        if group.synthetic_backend is not None:
            for backend in info.backends:  # the realism filter drops backends that cannot serve the spec
                yield _with_group(case, index, dataclasses.replace(group, synthetic_backend=None, backend=backend.name))
        changes: list[dict[str, object]] = []
        if spec.page_size_padded is not None and spec.kind != "mamba":
            changes.append({"page_size_padded": None})
        if spec.alignment is not None:
            changes.append({"alignment": None})
        if spec.head_size_v is not None:
            changes.append({"head_size_v": None})
        if spec.cache_dtype != "auto" and spec.state_content_bytes is None:
            changes.append({"cache_dtype": "auto", "dtype": "bfloat16", "kv_quant_mode": "none", "registered_cache_dtype": False,
                            "rope_dim": None})
        if spec.dtype != "bfloat16" and spec.cache_dtype == "auto" and spec.kind != "mamba":
            changes.append({"dtype": "bfloat16"})
        yield from _spec_changes(case, index, group, changes)


def _fewer_touches(case: Case, info: TargetInfo) -> Iterator[Case]:
    touches = case.touches
    if touches is None:
        return
    yield dataclasses.replace(case, touches=None)
    for field in ("consumers", "blocks", "copies", "tokens"):
        for kept in _without_chunks(getattr(touches, field)):
            yield dataclasses.replace(case, touches=dataclasses.replace(touches, **{field: kept}))
        if getattr(touches, field):
            yield dataclasses.replace(case, touches=dataclasses.replace(touches, **{field: ()}))
    lower = dataclasses.replace(touches, blocks=tuple(sorted({0, *touches.blocks[1:]})),
                                tokens=tuple(sorted({(block, 0) for block, _ in touches.tokens})))
    yield dataclasses.replace(case, touches=lower)


def _spec_changes(case: Case, index: int, group: GroupCase, changes: list[dict[str, object]]) -> Iterator[Case]:
    for change in changes:
        try:
            spec = dataclasses.replace(group.spec, **change)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        yield _with_group(case, index, dataclasses.replace(group, spec=spec))


def _with_groups(case: Case, groups: tuple[GroupCase, ...]) -> Case:
    names = {n for g in groups for n in g.layers}
    return dataclasses.replace(case, groups=groups, kv_sharing=tuple((s, t) for s, t in case.kv_sharing if t in names))


def _with_group(case: Case, index: int, group: GroupCase) -> Case:
    return _with_groups(case, tuple(group if i == index else g for i, g in enumerate(case.groups)))


def _buildable(case: Case, info: TargetInfo) -> Case | None:
    """The candidate with kernel block sizes re-chosen and backend declarations cleared, if it is
    still a case vLLM could build: a Mamba page stays padded to the attention page."""
    groups = []
    for group in case.groups:
        if group.synthetic_backend is not None:
            sizes = group.synthetic_backend.kernel_block_sizes
        elif group.backend is not None and info.backend(group.backend) is not None:
            sizes = info.backend(group.backend).kernel_block_sizes  # type: ignore[union-attr]
        else:
            sizes = (group.spec.block_size,)
        kernel = group.spec.block_size if group.spec.kind == "encoder_only" else choose_kernel_block_size(group.spec.block_size, sizes)
        if kernel is None:
            return None
        groups.append(dataclasses.replace(group, kernel_block_size=kernel, declared_shape=None, declared_stride_order=None))
    attention = next((g.spec for g in groups if g.spec.kind != "mamba"), None)
    if attention is not None:
        for i, group in enumerate(groups):
            if group.spec.kind == "mamba":
                spec = _mamba_matching(group.spec, attention)
                if spec is None:
                    return None
                groups[i] = dataclasses.replace(group, spec=spec, kernel_block_size=spec.block_size)
    touches = case.touches.within(case.num_blocks) if case.touches is not None else None
    candidate = dataclasses.replace(case, groups=tuple(groups), touches=touches if touches is not None and touches.size else None)
    try:
        validate(candidate)
    except CaseError:
        return None
    return None if unrealistic(candidate, info) else candidate


def _mamba_matching(spec: SpecCase, attention: SpecCase) -> SpecCase | None:
    """The Mamba spec re-padded to the attention page, as vLLM's hybrid allocator pads it."""
    bare = dataclasses.replace(spec, block_size=attention.block_size, page_size_padded=None)
    page, content = pages.page(attention).page_bytes, pages.page(bare).page_bytes
    if content > page:
        return None
    return dataclasses.replace(bare, page_size_padded=None if content == page else page)
