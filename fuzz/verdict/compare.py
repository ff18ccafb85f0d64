"""The comparator: what vLLM did (an Outcome) against what the oracle expects.

Metadata first: a view whose dtype, shape, byte strides and offset equal the oracle's passes
without touching its bytes (the oracle's own layouts are proven sound by its tests). Otherwise
the difference is explained arithmetically on the strided layouts (oracles/strided.py: exact, and
as fast for a 30,000-block production cache as for a toy one), in the order a reader wants:
1. the target process died, hung or ran out of memory (crash-signal, hang, oom);
2. a valid case is accepted (a low-level error on it is crash-on-valid, a deliberate refusal
   refused-valid), a case the contract cannot express is refused with the ValueError /
   NotImplementedError vLLM promises (an assertion is assert-on-invalid, a low-level error from
   deep inside crash-on-invalid, success accepted-invalid);
3. layers sit on raw buffers as the contract pools them (block-partition), each of the size the
   contract gives it where vLLM allocates exactly that (buffer-size); every addressed byte lies in
   the layer's raw buffer (out-of-bounds);
4. distinct elements of one view never share a byte (alias);
5. shape and dtype are the declared ones (shape, dtype);
6. block b's bytes belong to no other block, layer or group, and cover exactly block b
   (block-partition); they stay inside block b's page and never touch its padding (page-escape);
7. KV-sharing layers alias their target's view (share);
8. element order inside each block is the declared one (order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fuzz.case import Case
from fuzz.targets.base import TARGET_CRASHED, TARGET_HUNG, TARGET_OUT_OF_MEMORY, Outcome, ViewRecord
from fuzz.verdict.findings import Finding, observed
from oracles.expectation import Expectation, LayerExpectation, ViewExpectation
from oracles.strided import Strided, Undecidable, inside, is_injective, same_bytes, touches

PLANNER = "get_kv_cache_config_from_groups"  # the planner, named where its plan is wrong
# vLLM raises these on purpose to refuse a combination it does not support, with a message.
REFUSALS = ("ValueError", "NotImplementedError")
# An assertion is a check, but not the refusal vLLM promises (assertions vanish under python -O).
# Any other error means nothing checked the case and it failed deep inside torch or arithmetic, as
# vLLM #54877 did (as_strided out of bounds).
ASSERTION = "AssertionError"
PROCESS_FAILURES = {TARGET_CRASHED: "crash-signal", TARGET_HUNG: "hang", TARGET_OUT_OF_MEMORY: "oom"}


@dataclass(frozen=True)
class Verdict:
    status: str  # "pass", "rejected", "skipped", "case-error" (the case contradicts what vLLM derives) or "finding"
    finding: Finding | None = None
    reason: str | None = None


PASS = Verdict("pass")
Found = Callable[..., Verdict]


def compare(case: Case, expected: Expectation, outcome: Outcome) -> Verdict:
    def found(kind: str, function: str, message: str, layer: str | None = None) -> Verdict:
        return Verdict("finding", observed(case, kind, function, message, layer))

    if expected.broken_declaration is not None:
        function, message = expected.broken_declaration
        return found("declaration", function, message, expected.reject_layer)
    if outcome.raised:
        return _judge_error(expected, outcome, found)
    if not expected.accepted:
        return found("accepted-invalid", "reshape", f"accepted a case the contract rejects: {expected.reject_reason}", expected.reject_layer)

    if expected.planned_blocks is not None and outcome.planned_blocks is not None and outcome.planned_blocks != expected.planned_blocks:
        return found("planner-fit", PLANNER, f"the plan gives {outcome.planned_blocks} blocks instead of {expected.planned_blocks}")
    mapping = _buffer_mapping(expected, outcome)
    if isinstance(mapping, str):
        return found("block-partition", "allocate", mapping)
    if expected.exact_buffers:
        for actual, wanted in sorted(mapping.items()):
            if outcome.buffers[actual].size != expected.buffers[wanted]:
                return found("buffer-size", "allocate", f"the backing buffer holds {outcome.buffers[actual].size} bytes, "
                             f"not the {expected.buffers[wanted]} its layout gives it")

    for name, want in expected.layers.items():
        if name in expected.kv_sharing:
            continue
        views = outcome.views.get(name)
        if views is None:
            return found("shape", "reshape", "a layer got no view", name)
        if len(views) != len(want.views):
            return found("shape", "reshape", f"{len(views)} tensors instead of {len(want.views)}", name)
        for view, wanted in zip(views, want.views, strict=True):
            verdict = _compare_view(name, want, wanted, view, outcome, found)
            if verdict is not PASS:
                return verdict

    for sharer, target in expected.kv_sharing.items():
        mine, theirs = outcome.views.get(sharer), outcome.views.get(target)
        if mine is None or theirs is None or [_geometry(v) for v in mine] != [_geometry(v) for v in theirs]:
            return found("share", "reshape", "a KV-sharing layer does not alias its target's view", sharer)
    return PASS


def _judge_error(expected: Expectation, outcome: Outcome, found: Found) -> Verdict:
    message = f"{outcome.error_type}: {outcome.error_message}"
    function = outcome.error_function or "?"
    failure = PROCESS_FAILURES.get(outcome.error_type or "")
    if failure is None and (outcome.error_type == "MemoryError" or "can't allocate memory" in (outcome.error_message or "")):
        failure = "oom"
    if failure is not None:
        return found(failure, function, outcome.error_message or "", outcome.error_layer)
    if expected.accepted:
        kind = "refused-valid" if outcome.error_type in REFUSALS else "crash-on-valid"
        return found(kind, function, message, outcome.error_layer)
    if outcome.error_type in REFUSALS:
        return Verdict("rejected", reason=f"{expected.reject_reason} (vLLM: {message})")
    kind = "assert-on-invalid" if outcome.error_type == ASSERTION else "crash-on-invalid"
    return found(kind, function, message, outcome.error_layer or expected.reject_layer)


def _geometry(view: ViewRecord) -> tuple[object, ...]:
    return (view.shape, view.stride, view.offset_bytes, view.dtype, view.buffer)


def _buffer_mapping(expected: Expectation, outcome: Outcome) -> dict[int, int] | str:
    """Which expected buffer each raw buffer is (matched by the layers each holds), or why layers do not sit on raw buffers
    as the contract pools them."""
    mapping: dict[int, int] = {}
    for name, want in expected.layers.items():
        if name in expected.kv_sharing:
            continue
        for view, wanted in zip(outcome.views.get(name, ()), want.views, strict=False):
            if view.buffer < 0:
                continue
            previous = mapping.setdefault(view.buffer, wanted.buffer)
            if previous != wanted.buffer:
                return "layers that must not share a raw buffer were put on one"
    if len(set(mapping.values())) != len(mapping):
        return "layers that must share a raw buffer were put on different ones"
    return mapping


def _compare_view(name: str, layer: LayerExpectation, want: ViewExpectation, view: ViewRecord, outcome: Outcome, found: Found) -> Verdict:
    function = "reshape"
    if view.buffer < 0:
        return found("out-of-bounds", function, "the view is not on a raw buffer of the KV cache", name)
    low, high = _byte_span(view)
    if low < 0 or high > outcome.buffers[view.buffer].size:
        return found("out-of-bounds", function, "the view addresses bytes outside its raw buffer", name)
    if view.dtype != want.dtype:
        return found("dtype", function, f"dtype {view.dtype} instead of {want.dtype}", name)
    if view.shape == want.shape and view.offset_bytes == want.byte_offset and _strides_agree(view, want):
        return PASS
    kind, message = classify(layer, want, actual_layout(view))
    return found(kind, function, message, name)


def actual_layout(view: ViewRecord) -> Strided:
    return Strided(view.shape, view.byte_strides, view.offset_bytes, view.element_size)


def expected_layout(want: ViewExpectation) -> Strided:
    return Strided(want.shape, want.byte_strides, want.byte_offset, want.element_size)


def block_layout(layout: Strided, want: ViewExpectation, block: int) -> Strided:
    """The part of a view that holds manager block `block`: its kernel blocks along the block axis."""
    axis = want.block_axis
    first = block * want.kernel_stride
    count = max(0, min(want.kernel_ratio, layout.shape[axis] - first))
    shape = layout.shape[:axis] + (count,) + layout.shape[axis + 1:]
    return Strided(shape, layout.strides, layout.offset + first * layout.strides[axis], layout.item)


def classify(layer: LayerExpectation, want: ViewExpectation, actual: Strided) -> tuple[str, str]:
    """What is wrong with a view whose geometry differs from the contract's, decided arithmetically
    on the strided layouts (exact at any size; tests/test_compare.py checks it against enumeration)."""
    try:
        if not is_injective(actual):
            return "alias", "distinct elements share bytes"
        if actual.shape != want.shape:
            return "shape", f"shape {list(actual.shape)} instead of {list(want.shape)}"
        expected = expected_layout(want)
        blocks = -(-want.shape[want.block_axis] // want.kernel_stride)
        for block in range(blocks):
            mine = block_layout(actual, want, block)
            if not inside(mine, layer.pages.spans(block)) or (not layer.addresses_padding and touches(mine, layer.pages.padding(block))):
                return "page-escape", "a block's bytes leave its page or touch its padding"
            if not same_bytes(mine, block_layout(expected, want, block)):
                return "block-partition", "a block's kernel blocks do not cover exactly its page"
    except Undecidable:
        return "order", "the view's geometry differs from the contract's (too irregular to classify exactly)"
    return "order", "elements inside a block are not in the declared order"


def _byte_span(view: ViewRecord) -> tuple[int, int]:
    """[lo, hi) of the bytes a view addresses: the hot path's bounds check, without building a layout."""
    low = high = view.offset_bytes
    for size, stride in zip(view.shape, view.stride, strict=True):
        if size == 0:
            return view.offset_bytes, view.offset_bytes
        reach = (size - 1) * stride * view.element_size
        if reach < 0:
            low += reach
        else:
            high += reach
    return low, high + view.element_size


def _strides_agree(view: ViewRecord, want: ViewExpectation) -> bool:
    return all(size < 2 or s * view.element_size == w for size, s, w in zip(view.shape, view.stride, want.byte_strides, strict=True))


def element_offsets(view: ViewRecord) -> np.ndarray:
    """Byte offset of every element's first byte, in row-major logical order."""
    offsets = np.full((), view.offset_bytes, dtype=np.int64)
    for size, stride in zip(view.shape, view.byte_strides, strict=True):
        offsets = offsets[..., None] + np.arange(size, dtype=np.int64) * stride
    return offsets.reshape(-1)


def byte_addresses(starts: np.ndarray, element_size: int) -> np.ndarray:
    return (starts[:, None] + np.arange(element_size, dtype=np.int64)[None, :]).reshape(-1)
