"""The comparator: what vLLM did (an Outcome) against what the oracle expects.

Metadata first: a view whose dtype, shape, byte strides and offset equal the oracle's passes
without touching its bytes (the oracle's own layouts are proven sound by its tests). Otherwise
the difference is explained, in the order a reader wants to hear it:
1. the target process died, hung or ran out of memory (crash-signal, hang, oom);
2. a valid case is accepted, a case the contract cannot express is refused;
3. every addressed byte lies in the layer's raw buffer (out-of-bounds);
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
from fuzz.findings import Finding
from fuzz.targets.base import TARGET_CRASHED, TARGET_HUNG, TARGET_OUT_OF_MEMORY, Outcome, ViewRecord
from oracles.expectation import Expectation, LayerExpectation, ViewExpectation

# vLLM raises these on purpose to refuse a combination it does not support.
REFUSALS = ("ValueError", "NotImplementedError")
PROCESS_FAILURES = {TARGET_CRASHED: "crash-signal", TARGET_HUNG: "hang", TARGET_OUT_OF_MEMORY: "oom"}
# Beyond this many elements a mismatch is explained arithmetically instead of byte by byte.
ENUMERATION_LIMIT = 1 << 22


@dataclass(frozen=True)
class Verdict:
    status: str  # "pass", "rejected", "skipped" or "finding"
    finding: Finding | None = None
    reason: str | None = None


PASS = Verdict("pass")
Found = Callable[..., Verdict]


def compare(case: Case, expected: Expectation, outcome: Outcome) -> Verdict:
    latent = case.is_latent

    def found(kind: str, function: str, message: str, layer: str | None = None) -> Verdict:
        return Verdict("finding", Finding(kind, spec_kind_of(case, layer), function, message, layer, latent))

    if outcome.raised:
        return _judge_error(expected, outcome, found)
    if not expected.accepted:
        return found("accepted-invalid", "reshape", f"accepted a case the contract rejects: {expected.reject_reason}", expected.reject_layer)

    for index, size in outcome.kernel_block_sizes.items():
        want = expected.kernel_block_sizes.get(index)
        if want is not None and want != size:
            layer = case.groups[index].layers[0] if index < len(case.groups) else None
            return found("shape", "prepare_kernel_block_sizes", f"kernel block size {size} differs from the backend's choice {want}", layer)

    buffer_map = _map_buffers(expected, outcome)
    if isinstance(buffer_map, str):
        return found("block-partition", "allocate", buffer_map)

    for name, want in expected.layers.items():
        if name in expected.kv_sharing:
            continue
        views = outcome.views.get(name)
        if views is None:
            return found("shape", "reshape", "a layer got no view", name)
        if len(views) != len(want.views):
            return found("shape", "reshape", f"{len(views)} tensors instead of {len(want.views)}", name)
        for view, wanted in zip(views, want.views, strict=True):
            verdict = _compare_view(name, want, wanted, view, expected, outcome, buffer_map, found)
            if verdict is not PASS:
                return verdict

    for sharer, target in expected.kv_sharing.items():
        mine, theirs = outcome.views.get(sharer), outcome.views.get(target)
        if mine is None or theirs is None or [_geometry(v) for v in mine] != [_geometry(v) for v in theirs]:
            return found("share", "reshape", "a KV-sharing layer does not alias its target's view", sharer)
    return PASS


def _judge_error(expected: Expectation, outcome: Outcome, found: Found) -> Verdict:
    message = f"{outcome.error_type}: {outcome.error_message}"
    failure = PROCESS_FAILURES.get(outcome.error_type or "")
    if failure is None and (outcome.error_type == "MemoryError" or "can't allocate memory" in (outcome.error_message or "")):
        failure = "oom"
    if failure is not None:
        return found(failure, outcome.error_function or "?", outcome.error_message or "", outcome.error_layer)
    if not expected.accepted or outcome.error_type in REFUSALS:
        return Verdict("rejected", reason=message)
    return found("crash-on-valid", outcome.error_function or "?", message, outcome.error_layer)


def spec_kind_of(case: Case, layer: str | None) -> str:
    if layer is not None:
        owner = dict(case.kv_sharing).get(layer, layer)
        if owner in case.layer_names:
            return case.groups[case.group_of(owner)].spec.kind
    return "+".join(sorted({g.spec.kind for g in case.groups}))


def _geometry(view: ViewRecord) -> tuple[object, ...]:
    return (view.shape, view.stride, view.offset_bytes, view.dtype, view.buffer)


def _map_buffers(expected: Expectation, outcome: Outcome) -> dict[int, int] | str:
    """Actual buffer index -> expected buffer index, from the layers each holds."""
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


def _compare_view(name: str, layer: LayerExpectation, want: ViewExpectation, view: ViewRecord, expected: Expectation,
                  outcome: Outcome, buffer_map: dict[int, int], found: Found) -> Verdict:
    function = "reshape"
    if view.buffer < 0:
        return found("out-of-bounds", function, "the view is not on a raw buffer of the KV cache", name)
    size = outcome.buffers[view.buffer].size
    if _numel(view.shape) and (_low(view) < 0 or _high(view) > size):
        return found("out-of-bounds", function, "the view addresses bytes outside its raw buffer", name)
    if view.dtype != want.dtype:
        return found("dtype", function, f"dtype {view.dtype} instead of {want.dtype}", name)
    if view.shape == want.shape and view.offset_bytes == want.byte_offset and _strides_agree(view, want):
        return PASS
    if _numel(view.shape) > ENUMERATION_LIMIT:
        return found("shape" if view.shape != want.shape else "order", function, "the view's geometry differs from the contract's", name)
    actual = element_offsets(view)
    if np.unique(byte_addresses(actual, view.element_size)).size != actual.size * view.element_size:
        return found("alias", function, "distinct elements share bytes", name)
    if view.shape != want.shape:
        return found("shape", function, f"shape {list(view.shape)} instead of {list(want.shape)}", name)
    return _explain_placement(name, layer, want, actual, view.element_size, expected, buffer_map[view.buffer], found)


def _explain_placement(name: str, layer: LayerExpectation, want: ViewExpectation, actual: np.ndarray, element_size: int,
                       expected: Expectation, buffer: int, found: Found) -> Verdict:
    function = "reshape"
    wanted = want.element_offsets()
    owned = wanted >= 0
    actual, wanted = actual[owned], wanted[owned]
    blocks = want.element_blocks()[owned]
    conflict = _foreign_bytes(name, layer, actual, blocks, element_size, expected, buffer)
    if conflict is not None:
        return found("block-partition", function, conflict, name)
    for block in np.unique(blocks).tolist():
        mine = byte_addresses(actual[blocks == block], element_size)
        if not _inside(mine, layer.pages.spans(block)) or (not layer.addresses_padding and _inside_any(mine, layer.pages.padding(block))):
            return found("page-escape", function, "a block's bytes leave its page or touch its padding", name)
        if not np.array_equal(np.unique(mine), np.unique(byte_addresses(wanted[blocks == block], element_size))):
            return found("block-partition", function, "a block's kernel blocks do not cover exactly its page", name)
    return found("order", function, "elements inside a block are not in the declared order", name)


def _foreign_bytes(name: str, layer: LayerExpectation, actual: np.ndarray, blocks: np.ndarray, element_size: int,
                   expected: Expectation, buffer: int) -> str | None:
    """Whether this view's bytes land on bytes the oracle gives to another block or layer."""
    mine = byte_addresses(actual, element_size)
    my_blocks = np.repeat(blocks, element_size)
    for other_name, other in expected.layers.items():
        if other_name == name or other_name in expected.kv_sharing:
            continue
        for view in other.views:
            if view.buffer != buffer:
                continue
            offsets = view.element_offsets()
            mask = offsets >= 0
            other_bytes = byte_addresses(offsets[mask], view.element_size)
            other_blocks = np.repeat(view.element_blocks()[mask], view.element_size)
            common, mine_at, other_at = np.intersect1d(mine, other_bytes, return_indices=True)
            if common.size == 0:
                continue
            if other.group == layer.group:
                return f"its bytes overlap another layer of the same group ({other_name})"
            if np.any(my_blocks[mine_at] != other_blocks[other_at]):
                return f"block b overlaps a different block of layer {other_name} in another group"
    return None


def _strides_agree(view: ViewRecord, want: ViewExpectation) -> bool:
    return all(size < 2 or s * view.element_size == w for size, s, w in zip(view.shape, view.stride, want.byte_strides, strict=True))


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _low(view: ViewRecord) -> int:
    return view.offset_bytes + sum((n - 1) * s for n, s in zip(view.shape, view.byte_strides, strict=True) if s < 0)


def _high(view: ViewRecord) -> int:
    return view.offset_bytes + sum((n - 1) * s for n, s in zip(view.shape, view.byte_strides, strict=True) if s > 0) + view.element_size


def element_offsets(view: ViewRecord) -> np.ndarray:
    """Byte offset of every element's first byte, in row-major logical order."""
    offsets = np.full((), view.offset_bytes, dtype=np.int64)
    for size, stride in zip(view.shape, view.byte_strides, strict=True):
        offsets = offsets[..., None] + np.arange(size, dtype=np.int64) * stride
    return offsets.reshape(-1)


def byte_addresses(starts: np.ndarray, element_size: int) -> np.ndarray:
    return (starts[:, None] + np.arange(element_size, dtype=np.int64)[None, :]).reshape(-1)


def _inside(addresses: np.ndarray, spans: list[tuple[int, int]]) -> bool:
    inside = np.zeros(addresses.shape, dtype=bool)
    for start, end in spans:
        inside |= (addresses >= start) & (addresses < end)
    return bool(inside.all())


def _inside_any(addresses: np.ndarray, spans: list[tuple[int, int]]) -> bool:
    return any(bool(((addresses >= s) & (addresses < e)).any()) for s, e in spans)
