"""The comparator: what vLLM did (an Outcome) against what the oracle expects.

Checks, in the order a reader would want to hear about them:
1. a valid case is accepted; a case the contract cannot express is refused;
2. every addressed byte lies in the backing buffer (out-of-bounds);
3. distinct elements of one view never share a byte (alias);
4. shape and dtype are the declared ones (shape, dtype);
5. block b's bytes belong to no other block, layer or group and cover exactly block b
   (block-partition); they stay inside block b's page and never touch its padding (page-escape);
6. KV-sharing layers alias their target's view (share);
7. element order inside each block is the declared one (order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fuzz.case import Case
from fuzz.findings import Finding
from fuzz.targets.base import Outcome, ViewRecord
from oracles.expectation import Expectation, LayerExpectation

# vLLM raises these on purpose to refuse a combination it does not support.
REFUSALS = ("ValueError", "NotImplementedError")


@dataclass(frozen=True)
class Verdict:
    status: str  # "pass", "rejected" or "finding"
    finding: Finding | None = None
    reason: str | None = None


PASS = Verdict("pass")


def element_offsets(view: ViewRecord) -> np.ndarray:
    """Byte offset of every element's first byte, in row-major logical order."""
    offsets = np.full((), view.offset_bytes, dtype=np.int64)
    for size, stride in zip(view.shape, view.stride, strict=False):
        offsets = offsets[..., None] + np.arange(size, dtype=np.int64) * (stride * view.element_size)
    return offsets.reshape(-1)


def byte_addresses(starts: np.ndarray, element_size: int) -> np.ndarray:
    return (starts[:, None] + np.arange(element_size, dtype=np.int64)[None, :]).reshape(-1)


def compare(case: Case, expected: Expectation, outcome: Outcome) -> Verdict:
    spec_kind = "+".join(sorted({g.spec.kind for g in case.groups}))
    latent = case.is_latent

    def found(kind: str, function: str, message: str, layer: str | None = None) -> Verdict:
        kind_of_layer = case.groups[case.group_of(layer)].spec.kind if layer and layer in case.layer_names else spec_kind
        return Verdict("finding", Finding(kind, kind_of_layer, function, message, layer, latent))

    if outcome.raised:
        refusal = outcome.error_type in REFUSALS
        if not expected.accepted or refusal:
            return Verdict("rejected", reason=f"{outcome.error_type}: {outcome.error_message}")
        return found("crash-on-valid", outcome.error_function or "?", f"{outcome.error_type}: {outcome.error_message}")
    if not expected.accepted:
        return found("accepted-invalid", "allocate_kv_cache", f"accepted a case the contract rejects: {expected.reject_reason}")

    for index, size in outcome.kernel_block_sizes.items():
        want = expected.kernel_block_sizes.get(index)
        if want is not None and want != size:
            return found("shape", "prepare_kernel_block_sizes", f"kernel block size {size} differs from the backend's choice {want}")

    for name, want in expected.layers.items():
        if name in expected.kv_sharing:
            continue
        view = outcome.views.get(name)
        if view is None:
            return found("shape", "allocate_kv_cache", "a layer got no view", name)
        verdict = _compare_layer(name, want, view, expected, outcome.buffer_bytes, found)
        if verdict is not PASS:
            return verdict

    for sharer, target in expected.kv_sharing.items():
        mine, theirs = outcome.views.get(sharer), outcome.views.get(target)
        if mine is None or theirs is None or _geometry(mine) != _geometry(theirs):
            return found("share", "init_kv_cache", "a KV-sharing layer does not alias its target's view", sharer)
    return PASS


def _geometry(view: ViewRecord) -> tuple[object, ...]:
    return (view.shape, view.stride, view.offset_bytes, view.dtype)


def _compare_layer(name: str, want: LayerExpectation, view: ViewRecord, expected: Expectation, buffer_bytes: int, found) -> Verdict:  # type: ignore[no-untyped-def]
    function = "create_kv_cache_views"
    if not view.same_buffer:
        return found("out-of-bounds", function, "the view is not on the backing buffer", name)
    starts = element_offsets(view)
    if starts.size and (starts.min() < 0 or starts.max() + view.element_size > buffer_bytes):
        return found("out-of-bounds", function, "the view addresses bytes outside the backing buffer", name)
    if view.dtype != want.dtype:
        return found("dtype", function, f"dtype {view.dtype} instead of {want.dtype}", name)
    if view.shape != want.shape:
        if np.unique(byte_addresses(starts, view.element_size)).size != starts.size * view.element_size:
            return found("alias", function, "distinct elements share bytes", name)
        return found("shape", function, f"shape {list(view.shape)} instead of {list(want.shape)}", name)

    owned = want.offsets >= 0
    if np.array_equal(starts[owned], want.offsets[owned]):
        return PASS
    actual = starts[owned]
    actual_bytes = byte_addresses(actual, view.element_size)
    if np.unique(actual_bytes).size != actual_bytes.size:
        return found("alias", function, "distinct elements share bytes", name)
    blocks = want.blocks[owned]
    conflict = _foreign_bytes(name, want, actual, blocks, expected, view.element_size)
    if conflict is not None:
        return found("block-partition", function, conflict, name)
    for block in np.unique(blocks):
        mine = byte_addresses(actual[blocks == block], view.element_size)
        if not _inside(mine, want.pages[int(block)]) or _touches(mine, want.padding.get(int(block), [])):
            return found("page-escape", function, "a block's bytes leave its page or touch its padding", name)
        wanted = byte_addresses(want.offsets[owned][blocks == block], view.element_size)
        if not np.array_equal(np.unique(mine), np.unique(wanted)):
            return found("block-partition", function, "a block's kernel blocks do not cover exactly its page", name)
    return found("order", function, "elements inside a block are not in the declared order", name)


def _foreign_bytes(name: str, want: LayerExpectation, actual: np.ndarray, blocks: np.ndarray,
                   expected: Expectation, element_size: int) -> str | None:
    """Whether this layer's bytes land on bytes the oracle gives to another block or layer."""
    for other_name, other in expected.layers.items():
        if other_name == name or other_name in expected.kv_sharing:
            continue
        mask = other.offsets >= 0
        other_bytes = byte_addresses(other.offsets[mask], other.element_size)
        other_blocks = np.repeat(other.blocks[mask], other.element_size)
        mine = byte_addresses(actual, element_size)
        my_blocks = np.repeat(blocks, element_size)
        common, mine_at, other_at = np.intersect1d(mine, other_bytes, return_indices=True)
        if common.size == 0:
            continue
        if other.group == want.group:
            return f"its bytes overlap another layer of the same group ({other_name})"
        if np.any(my_blocks[mine_at] != other_blocks[other_at]):
            return f"block b overlaps a different block of layer {other_name} in another group"
    return None


def _inside(addresses: np.ndarray, spans: list[tuple[int, int]]) -> bool:
    inside = np.zeros(addresses.shape, dtype=bool)
    for start, end in spans:
        inside |= (addresses >= start) & (addresses < end)
    return bool(inside.all())


def _touches(addresses: np.ndarray, spans: list[tuple[int, int]]) -> bool:
    return any(bool(((addresses >= s) & (addresses < e)).any()) for s, e in spans)
