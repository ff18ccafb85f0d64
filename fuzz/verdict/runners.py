"""Both model runners on one case: they must lay every layer out alike.

Where a release has both the V2 runner and the V1 GPUModelRunner, a case they both build must get the
same layout from each: per layer and tensor, the same bytes for every manager block (ownership) and the
same element at every byte (element order), whatever shape each view has (one may address kernel
blocks, the other manager blocks). One refusing what the other builds is a disagreement too.

Each runner's views are first judged against the oracle (its own contract), so this comparison runs
only when both passed or both were refused. Elements are compared by what they mean, not by their view
index: (manager block, stored state within the block, head, content element), read off each view with
the axis meaning its expectation gives (the backend's declared shape before 0.29, [B, H, N, C] from
0.29). Buffers are matched by the first layer each holds.
"""

from __future__ import annotations

import math

import numpy as np

from fuzz.case import Case, parse_shape_entry
from fuzz.targets.base import Outcome, ViewRecord
from fuzz.verdict.compare import Verdict
from fuzz.verdict.findings import observed
from oracles.expectation import Expectation, ViewExpectation

FUNCTION = "GPUModelRunner.initialize_kv_cache_tensors"
# Blocks compared in full below this many view elements; beyond, the first two blocks and the last.
FULL_COMPARISON = 1 << 22


Judged = tuple[Verdict, "Expectation | None", Outcome]


def compare_runners(case: Case, v2: Judged, v1: Judged) -> Verdict | None:
    """A runner-mismatch verdict when two runners that each satisfied the oracle built different layouts, else None."""
    (v2_verdict, v2_expected, v2_outcome), (v1_verdict, v1_expected, v1_outcome) = v2, v1
    if v2_verdict.status != v1_verdict.status:
        refusing, building = ("V1", "V2") if v1_verdict.status == "rejected" else ("V2", "V1")
        outcome = v1_outcome if refusing == "V1" else v2_outcome
        message = f"the {refusing} runner refuses what the {building} runner builds ({outcome.error_type}: {outcome.error_message})"
        return _found(case, outcome.error_function or FUNCTION, message, outcome.error_layer)
    if v2_verdict.status != "pass" or v2_expected is None or v1_expected is None:
        return None
    for name in case.layer_names:
        want2, want1 = v2_expected.layers.get(name), v1_expected.layers.get(name)
        views2, views1 = v2_outcome.views.get(name, ()), v1_outcome.views.get(name, ())
        if want2 is None or want1 is None or len(views2) != len(views1):
            return _found(case, FUNCTION, "the runners give the layer different numbers of tensors", name)
        if want2.runner_arranged or want1.runner_arranged:
            continue  # each runner's arrangement of a mixed pool was judged against the oracle on its own
        group = case.groups[case.group_of(name)]
        pattern = group.declared_shape or (group.synthetic_backend.shape if group.synthetic_backend else None)
        for number, (view2, view1) in enumerate(zip(views2, views1, strict=True)):
            meaning2, meaning1 = want2.views[number], want1.views[number]
            difference = _difference(view2, meaning2, v2_outcome, view1, meaning1, v1_outcome, case.num_blocks,
                                     pattern if group.spec.is_attention else None, v2_expected.contract)
            if difference is not None:
                return _found(case, FUNCTION, difference, name)
    return None


def _found(case: Case, function: str, message: str, layer: str | None) -> Verdict:
    return Verdict("finding", observed(case, "runner-mismatch", function, message, layer))


def _difference(view2: ViewRecord, meaning2: ViewExpectation, outcome2: Outcome, view1: ViewRecord, meaning1: ViewExpectation,
                outcome1: Outcome, blocks: int, pattern: tuple[int | str, ...] | None, contract: str) -> str | None:
    if _buffer_name(view2, outcome2) != _buffer_name(view1, outcome1):
        return "the runners put the layer on different buffers"
    if view2.dtype != view1.dtype:
        return f"the V2 runner views the layer as {view2.dtype}, the V1 runner as {view1.dtype}"
    if view2 == view1 and meaning2 == meaning1:
        # Both sides below are the same function of these records: equal records cannot differ in bytes or order.
        return None
    elements = max(math.prod(view2.shape), math.prod(view1.shape))
    sample = range(blocks) if elements <= FULL_COMPARISON else sorted({0, min(1, blocks - 1), blocks - 1})
    order_differs: str | None = None
    for block in sample:
        mine = _meaningful(view2, meaning2, block, pattern, contract)
        theirs = _meaningful(view1, meaning1, block, pattern, contract)
        if mine.shape != theirs.shape:
            return f"block {block}: the V2 runner holds {mine.size} elements, the V1 runner {theirs.size}"
        if not np.array_equal(_bytes(mine, view2.element_size), _bytes(theirs, view1.element_size)):
            return f"block {block} owns other bytes under the V1 runner than under the V2 runner"
        if order_differs is None and not np.array_equal(mine, theirs):
            first = tuple(int(i) for i in np.argwhere(mine != theirs)[0])
            order_differs = (f"block {block} holds the same bytes under both runners, its elements in another order: element "
                             f"{_element_name(first, mine.ndim)} is at byte {mine[first]} under the V2 runner, "
                             f"{theirs[first]} under the V1 runner")
    return order_differs


def _element_name(index: tuple[int, ...], dims: int) -> str:
    if dims == 3:
        return f"(state {index[0]}, head {index[1]}, content {index[2]})"
    return str(index[0])


def _buffer_name(view: ViewRecord, outcome: Outcome) -> str | None:
    if view.buffer < 0 or view.buffer >= len(outcome.buffers):
        return None
    layers = outcome.buffers[view.buffer].layers
    return layers[0] if layers else None


def _bytes(offsets: np.ndarray, element_size: int) -> np.ndarray:
    return np.unique((offsets.reshape(-1)[:, None] + np.arange(element_size)[None, :]).reshape(-1))


def _meaningful(view: ViewRecord, meaning: ViewExpectation, block: int, pattern: tuple[int | str, ...] | None, contract: str) -> np.ndarray:
    """Byte offsets of manager block `block`'s elements, indexed (stored state, head, content element) for attention views
    and flat otherwise."""
    axis, ratio, stride = meaning.block_axis, meaning.kernel_ratio, meaning.kernel_stride
    shape = list(view.shape)
    shape[axis] = ratio
    offsets = np.full((), view.offset_bytes + block * stride * view.stride[axis] * view.element_size, dtype=np.int64)
    for size, step in zip(shape, view.byte_strides, strict=True):
        offsets = offsets[..., None] + np.arange(size, dtype=np.int64) * step
    if pattern is None and not contract.startswith("placed"):
        return offsets.reshape(-1)
    symbols = ["B", "H", "T", "C"] if contract.startswith("placed") else [parse_shape_entry(e)[1] or "C" for e in pattern]  # type: ignore[union-attr]
    if len(symbols) != offsets.ndim:
        return offsets.reshape(-1)
    states = [i for i, s in enumerate(symbols) if s == "T"]
    heads = [i for i, s in enumerate(symbols) if s == "H"]
    content = [i for i, s in enumerate(symbols) if s not in ("B", "T", "H")]
    arranged = np.transpose(offsets, [axis, *states, *heads, *content])
    head_count = math.prod(offsets.shape[i] for i in heads)
    state_count = ratio * math.prod(offsets.shape[i] for i in states)
    return arranged.reshape(state_count, head_count, -1)
