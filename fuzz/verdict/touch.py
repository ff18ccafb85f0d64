"""The comparator for code that addresses KV blocks by bytes: what consumers and cache writes touched,
against the bytes the oracle gives each block (oracles/touch.py).

Judged only after the views passed the metadata comparison, so every byte set below is the
oracle's and vLLM's alike. Findings, in the order they are looked for:
- a consumer or cache write raised on views vLLM built for a valid case: `crash-on-valid` (naming the
  consumer; `refused-valid` for a ValueError or NotImplementedError, vLLM's way of saying it does not
  support the case) or `kernel-crash`;
- zeroing block b changed a byte outside b's tile (`zero-escape`) or left a byte of b in a
  layer it zeroes uncleared (`zero-miss`);
- copying block src to dst changed a byte outside dst's tile (`copy-escape`) or left a byte of
  dst other than src's (`copy-wrong`);
- a connector's region for block b reaches outside b's tile or misses a byte of b in a layer it
  moves (`region-mismatch`);
- a token written through a backend's cache write put an element outside its block or head, or
  a byte on no element of the token (`kernel-escape`), did not write an element (`kernel-miss`),
  or put it elsewhere in its block than the contract's position (`kernel-order`; not for
  backends whose block interiors are their own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fuzz.case import Case
from fuzz.targets.base import Outcome, decode_bytes
from fuzz.targets.byte_runs import mask_runs, pattern_bytes, pattern_slice
from fuzz.verdict.compare import REFUSALS
from fuzz.verdict.findings import Finding, observed
from oracles import touch
from oracles.expectation import Expectation
from oracles.strided import Strided, element_starts

Found = Callable[..., Finding]

OUTSIDE_EVERY_BUFFER = "outside every KV-cache buffer"  # stores a kernel aimed past the case's buffers


def judge_consumer(case: Case, expected: Expectation, outcome: Outcome, record: dict[str, Any], **rules: Any) -> Finding | None:
    """The first thing a consumer did wrong on the blocks it was asked about, or None (`rules`, for a zeroer: whether it
    clears `full_attention_only` layers, and whether it `clears_words`)."""
    if "skipped" in record:
        return None
    buffers = _buffer_map(expected, outcome)
    where = record["where"]
    if "error" in record:
        if record["kind"] == "zeroing" and not touch.zeroer_serves(case, expected, **rules):
            return None  # a layout off the zeroer's word granule, which it refuses by design
        error = record["error"]
        # A consumer that refuses a case with vLLM's refusal errors says it does not support it: a warning, as in the views.
        kind = "refused-valid" if error["type"] in REFUSALS else "crash-on-valid"
        return observed(case, kind, error.get("function") or "?", f"{where}: {error['type']}: {error['message']}")
    found = _found(case)
    kind = record["kind"]
    if kind == "zeroing":
        return _zero(case, expected, buffers, rules["full_attention_only"], where, record, found)
    if kind == "copying":
        return _copy(case, expected, buffers, where, record, found)
    return _region(case, expected, buffers, where, record, found)


def judge_kernel(case: Case, expected: Expectation, outcome: Outcome, records: dict[str, Any]) -> Finding | None:
    """The first thing a backend's cache write did wrong on a layer's tokens, or None."""
    buffers = _buffer_map(expected, outcome)
    for layer, record in records.items():
        finding = _kernel(case, expected, buffers, layer, record, _found(case))
        if finding is not None:
            return finding
    return None


def _found(case: Case) -> Found:
    def found(kind: str, function: str, message: str, layer: str | None = None) -> Finding:
        return observed(case, kind, function, message, layer)

    return found


def _buffer_map(expected: Expectation, outcome: Outcome) -> dict[int, int]:
    """Outcome buffer -> expected buffer, matched by the layers each holds (the comparator already checked they match)."""
    mapping: dict[int, int] = {}
    for name in touch.cache_layers(expected):
        for view, wanted in zip(outcome.views.get(name, ()), expected.layers[name].views, strict=False):
            if view.buffer >= 0:
                mapping.setdefault(view.buffer, wanted.buffer)
    return mapping


def _bytes(intervals: list[list[int]], buffers: dict[int, int]) -> touch.Bytes:
    parts: dict[int, list[tuple[int, int]]] = {}
    for buffer, start, end in intervals:
        parts.setdefault(buffers.get(buffer, -1 - buffer), []).append((start, end))
    found = {buffer: touch.Spans.of([s for s, _ in items], [e for _, e in items]) for buffer, items in parts.items()}
    return {buffer: spans for buffer, spans in found.items() if spans}


def _describe(byte_set: touch.Bytes) -> str:
    buffer = min(byte_set)
    return f"{touch.count(byte_set)} bytes, the first at byte {byte_set[buffer].first} of buffer {buffer}"


def _layer_of(expected: Expectation, layers: list[str], byte_set: touch.Bytes, block: int) -> str | None:
    """The first of `layers` whose block `block` owns one of the bytes (for the finding's layer)."""
    return next((name for name in layers if touch.meets(byte_set, touch.owned(expected, [name], block))), None)


def _zero(case: Case, expected: Expectation, buffers: dict[int, int], full_attention_only: bool, where: str, record: dict[str, Any],
          found: Found) -> Finding | None:
    layers = touch.zeroed_layers(case, expected, full_attention_only)
    function = where.rsplit(".", 1)[-1]
    for entry in record["blocks"]:
        block = entry["block"]
        if "outside" in entry:  # stores the kernel aimed past every buffer of the cache (dropped: fuzz/targets/triton_interp.py)
            stray = entry["outside"]
            buffer, past = stray["first"]
            first = f"{past} bytes past the end of buffer {buffer}" if past >= 0 else f"{-past} bytes before buffer {buffer}"
            return found("zero-escape", function,
                         f"{where}: zeroing block {block} writes {stray['bytes']} bytes {OUTSIDE_EVERY_BUFFER}, the first {first}")
        zeroed = _bytes(entry["zeroed"], buffers)
        outside = touch.minus(touch.union(zeroed, _bytes(entry["dirtied"], buffers)), touch.tile(case, expected, block))
        if outside:
            return found("zero-escape", function, f"{where}: zeroing block {block} changed {_describe(outside)}, outside block {block}")
        missed = touch.minus(touch.owned(expected, layers, block), zeroed)
        if missed:
            layer = _layer_of(expected, layers, missed, block)
            # A zeroer that cleared none of the bytes only this layer owns in the block passed the layer over (another bug than
            # clearing the wrong bytes); bytes other layers own too may have been cleared through them.
            mine: touch.Bytes = touch.owned(expected, [layer], block) if layer is not None else {}
            private = touch.minus(mine, touch.owned(expected, [n for n in layers if n != layer], block))
            passed_over = touch.count(private) > 0 and touch.count(touch.minus(private, zeroed)) == touch.count(private)
            what = "cleared no byte at all, leaving" if passed_over else "left"
            return found("zero-miss", function, f"{where}: zeroing block {block} {what} {_describe(missed)} of it uncleared", layer)
    return None


def _copy(case: Case, expected: Expectation, buffers: dict[int, int], where: str, record: dict[str, Any], found: Found) -> Finding | None:
    layers = touch.cache_layers(expected)
    function = where.rsplit(".", 1)[-1]
    for entry in record["copies"]:
        src, dst = entry["src"], entry["dst"]
        changed = _bytes(entry["changed"], buffers)
        outside = touch.minus(changed, touch.tile(case, expected, dst))
        if outside:
            return found("copy-escape", function, f"{where}: copying block {src} to {dst} changed {_describe(outside)}, outside block {dst}")
        for buffer, parts in touch.copy_parts(expected, layers, src, dst).items():
            wrong = _not_copied(entry, buffers, buffer, parts)
            if wrong is not None:
                count, first, spans = wrong
                layer = _layer_of(expected, layers, {buffer: spans}, dst)
                return found("copy-wrong", function, f"{where}: after copying block {src} to {dst}, {count} bytes of block {dst} do not "
                                                     f"hold block {src}'s, the first at byte {first} of buffer {buffer}", layer)
    return None


def _not_copied(entry: dict[str, Any], buffers: dict[int, int], buffer: int, parts: list[touch.CopyPart]) -> tuple[int, int, touch.Spans] | None:
    """The bytes of dst in `buffer` that do not hold src's after the copy: how many (a byte of two views counts twice), the
    first in the views' element order, and which; None if every one does."""
    spans = [touch.layout_spans(part.target) for part in parts]
    mine = _outcome_buffer(buffers, buffer)
    now = _after(entry, buffers, buffer, pattern_bytes(mine, max((int(s.ends[-1]) for s in spans if s), default=0)).copy())
    count, first, wrong = 0, None, touch.EMPTY
    for part, targets in zip(parts, spans, strict=True):
        runs: list[tuple[int, int]] = []
        for start, end in zip(targets.starts.tolist(), targets.ends.tolist(), strict=True):
            differ = now[start:end] != pattern_slice(mine, start - part.shift, end - part.shift)
            runs += [(start + lo, start + hi) for lo, hi in mask_runs(differ)]
        if runs:
            here = touch.Spans.of([lo for lo, _ in runs], [hi for _, hi in runs])
            count += here.count
            first = _first_in_order(part.target, here) if first is None else first
            wrong = wrong | here
    return None if first is None else (count, first, wrong)


def _after(entry: dict[str, Any], buffers: dict[int, int], buffer: int, before: np.ndarray) -> np.ndarray:
    """The bytes 0..len(before)-1 of expected buffer `buffer` after the copy: `before` with the changed bytes' new values
    (scattered at once: a copy over a random pattern leaves its changed bytes in many short runs)."""
    runs = [(start, text) for (at, start, _), text in zip(entry["changed"], entry["values"], strict=True)
            if buffers.get(at, -1 - at) == buffer and start < before.size]
    if not runs:
        return before
    data = np.frombuffer(bytes.fromhex("".join(text for _, text in runs)), dtype=np.uint8)
    lengths = np.array([len(text) // 2 for _, text in runs])
    starts = np.array([start for start, _ in runs])
    positions = np.arange(data.size) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    kept = positions < before.size
    before[positions[kept]] = data[kept]
    return before


def _first_in_order(layout: Strided, spans: touch.Spans) -> int:
    """The first byte of `spans` in the layout's element order (row-major, each element's bytes ascending)."""
    starts = element_starts(layout)
    index = np.minimum(np.searchsorted(spans.ends, starts, side="right"), spans.starts.size - 1)
    hit = np.flatnonzero((spans.ends[index] > starts) & (spans.starts[index] < starts + layout.item))
    return max(int(starts[hit[0]]), int(spans.starts[index[hit[0]]]))


def _outcome_buffer(buffers: dict[int, int], expected_buffer: int) -> int:
    return next((mine for mine, theirs in buffers.items() if theirs == expected_buffer), expected_buffer)


def _region(case: Case, expected: Expectation, buffers: dict[int, int], where: str, record: dict[str, Any], found: Found) -> Finding | None:
    layers = [name for name in record["layers"] if name in expected.layers]
    function = where.rsplit(".", 1)[-1]
    for entry in record["blocks"]:
        block = entry["block"]
        region = _bytes(entry["region"], buffers)
        outside = touch.minus(region, touch.tile(case, expected, block))
        if outside:
            return found("region-mismatch", function, f"{where}: the region of block {block} holds {_describe(outside)} outside block {block}")
        missed = touch.minus(touch.owned(expected, layers, block), region)
        if missed:
            layer = _layer_of(expected, layers, missed, block)
            return found("region-mismatch", function, f"{where}: the region of block {block} misses {_describe(missed)} of it", layer)
    return None


def _kernel(case: Case, expected: Expectation, buffers: dict[int, int], layer: str, record: dict[str, Any], found: Found) -> Finding | None:
    if "skipped" in record:
        return None
    writer = record["writer"]
    function = writer.rsplit(".", 1)[-1]
    if "error" in record:
        error = record["error"]
        return found("kernel-crash", error.get("function") or function,
                     f"{writer}: {error['type']}: {error['message']} (token {error['position']} of block {error['block']})", layer)
    for token in record["tokens"]:
        block, position = token["block"], token["position"]
        where = f"{writer}: token {position} of block {block}"
        wanted = touch.token_map(case, expected, layer, block, position, bool(record.get("mla")))
        if wanted is None:
            continue
        landed = decode_bytes(token["landed"])
        assert landed is not None
        landed = landed.view(np.int64)
        stray = _bytes(token["stray"], buffers)
        if stray:
            inside = stray.keys() == {wanted.buffer} and stray[wanted.buffer].within(wanted.block_bytes)
            return found("kernel-escape", function, f"{where} changed {_describe(stray)} that hold no element of it"
                                                    + (" (inside its block)" if inside else ""), layer)
        missing = np.flatnonzero(landed < 0)
        if missing.size:
            return found("kernel-miss", function, f"{where}: {missing.size} of its {landed.size} elements were not written", layer)
        on = np.array([buffers.get(int(v) >> 40, -1) for v in landed], dtype=np.int64)
        at = landed & ((1 << 40) - 1)
        off_buffer = np.flatnonzero(on != wanted.buffer)
        outside = off_buffer if off_buffer.size else np.flatnonzero(~wanted.block_bytes.holds(at))
        if outside.size:
            return found("kernel-escape", function, f"{where}: {outside.size} of its elements landed outside its block, the first "
                                                    f"(element {int(outside[0])}) at byte {int(at[outside[0]])}", layer)
        for head, allowed in wanted.head_bytes.items():
            elements = np.flatnonzero(wanted.heads == head)
            astray = elements[~allowed.holds(at[elements])]
            if astray.size:
                return found("kernel-escape", function, f"{where}: {astray.size} elements of head {head} landed in another head's bytes",
                             layer)
        if wanted.offsets is not None:
            moved = np.flatnonzero(at != wanted.offsets)
            if moved.size:
                first = int(moved[0])
                return found("kernel-order", function, f"{where}: {moved.size} of its elements are not where the contract puts them, "
                                                       f"the first (element {first}) at byte {int(at[first])} instead of "
                                                       f"{int(wanted.offsets[first])}", layer)
    return None
