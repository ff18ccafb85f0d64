"""What a picture of a case shows, before anything is drawn: the panels and the grid of cells.

`panels` pairs the oracle's raw buffers with vLLM's, one row per pair, and gives each side a
panel: a byte map (`fuzz.explain.bytemap`) on a grid of cells, or text where there is no map (the oracle
rejects the case, or vLLM raised). A `Grid` cuts a buffer into pages (one per manager block),
each page into display rows of at most COLUMNS cells, and leaves pages out past MAX_PAGE_ROWS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fuzz.explain.bytemap import ByteMap, Tensor, actual_tensors, byte_map, expected_tensors, padding_mask, pair_buffers, view_tensor
from fuzz.explain.vllm_error import demand_lines, error_text, parse_storage_error
from fuzz.targets.base import ViewRecord
from fuzz.verdict.runner import CaseResult
from oracles.expectation import Expectation

COLUMNS = 192  # cells in one display row
MAX_WRAP = 4  # display rows one page may take before cells grow
MAX_PAGE_ROWS = 36  # display rows of one map before pages are left out
HEAD_PAGES, TAIL_PAGES = 4, 2  # pages shown before and after the ellipsis


# ---------------------------------------------------------------- the grid of cells


@dataclass(frozen=True)
class Grid:
    """How a buffer is cut into display rows: pages of `pitch` bytes, each `wraps` rows of `columns` cells."""

    pitch: int  # bytes per page
    cell: int  # bytes per cell
    columns: int  # cells per display row
    wraps: int  # display rows per page

    def pages_shown(self, size: int) -> list[int | None]:
        """Page numbers drawn, None for the ellipsis row."""
        pages = max(1, -(-size // self.pitch))
        if pages * self.wraps <= MAX_PAGE_ROWS:
            return list(range(pages))
        tail = min(TAIL_PAGES, max(1, MAX_PAGE_ROWS // (3 * self.wraps)))
        head = max(1, min(HEAD_PAGES, MAX_PAGE_ROWS // self.wraps - tail - 1))
        return [*range(head), None, *range(pages - tail, pages)]

    def rows(self, size: int) -> int:
        """Display rows a map of `size` bytes takes, the ellipsis row included."""
        return sum(1 if p is None else self.wraps for p in self.pages_shown(size))


def make_grid(pitch: int) -> Grid:
    """The grid for pages of `pitch` bytes: cells of a power of two bytes, at most MAX_WRAP rows a page."""
    pitch = max(1, pitch)
    cell = 1 << max(0, math.ceil(math.log2(max(1.0, pitch / (COLUMNS * MAX_WRAP)))))
    cells = -(-pitch // cell)
    columns = min(COLUMNS, cells)
    return Grid(pitch, cell, columns, -(-cells // columns))


def page_pitch(expectation: Expectation | None, buffer: int, tensors: list[Tensor], size: int, num_blocks: int) -> int:
    """Bytes per manager-block page of a buffer: the oracle's smallest block pitch on it, else the
    actual views' block stride, else the buffer split evenly."""
    if expectation is not None and expectation.accepted:
        pitches = [layer.pages.block_pitch for name, layer in expectation.layers.items()
                   if name not in expectation.kv_sharing and layer.views and layer.views[0].buffer == buffer and layer.pages.block_pitch > 0]
        if pitches:
            return min(pitches)
    for tensor in tensors:
        if tensor.buffer == buffer and (tensor.blocks == 0).any() and (tensor.blocks == 1).any():
            pitch = int(tensor.starts[tensor.blocks == 1].min() - tensor.starts[tensor.blocks == 0].min())
            if pitch > 0:
                return pitch
    return max(1, size // max(1, num_blocks))


# ---------------------------------------------------------------- the panels


@dataclass(frozen=True)
class MapPanel:
    """One side's byte map of one buffer."""

    title: str
    bmap: ByteMap
    grid: Grid
    notes: tuple[str, ...] = ()  # text above the map


@dataclass(frozen=True)
class TextPanel:
    """Words where a side has no map of a buffer."""

    title: str
    lines: tuple[str, ...]
    bar: tuple[int, int] | None = None  # (buffer bytes, bytes the demanded view reaches)


Panel = MapPanel | TextPanel


def panels(result: CaseResult) -> tuple[list[Panel], list[Panel], list[Tensor], list[Tensor]]:
    """The left (oracle) and right (vLLM) column of the picture, one row per buffer pair."""
    case, expectation, outcome = result.case, result.expectation, result.outcome
    expected = expected_tensors(case, expectation)
    has_views = outcome is not None and not outcome.raised
    actual = actual_tensors(case, expectation, outcome) if has_views else []
    accepted = expectation is not None and expectation.accepted
    exp_sizes = list(expectation.buffers) if accepted and expectation is not None else []
    act_sizes = [b.size for b in outcome.buffers] if has_views and outcome is not None else []
    left: list[Panel] = []
    right: list[Panel] = []
    for e, a in _buffer_rows(expected, actual, len(exp_sizes), len(act_sizes)):
        size = exp_sizes[e] if e is not None else act_sizes[a]  # type: ignore[index]
        pitch = page_pitch(expectation, e, expected, size, case.num_blocks) if e is not None else \
            page_pitch(None, a, actual, size, case.num_blocks)  # type: ignore[arg-type]
        grid = make_grid(pitch)
        if e is None:
            left.append(TextPanel(f"oracle: no buffer like vLLM's buffer {a}", ()))
        else:
            pad = padding_mask(expectation, e, size, case.num_blocks)
            left.append(MapPanel(f"oracle: buffer {e}, {size:,} B", byte_map([t for t in expected if t.buffer == e], size, pad), grid))
        if a is None:
            right.append(TextPanel(f"vLLM: no buffer for oracle buffer {e}", ()))
        else:
            pad = padding_mask(expectation, e, act_sizes[a], case.num_blocks) if e is not None else None
            right.append(MapPanel(f"vLLM: buffer {a}, {act_sizes[a]:,} B", byte_map([t for t in actual if t.buffer == a], act_sizes[a], pad),
                                  grid))
    if not accepted:
        left = [_oracle_text(result)]
    if not has_views:
        right = [_vllm_panel(result, expected)]
    return left, right, expected, actual


def _buffer_rows(expected: list[Tensor], actual: list[Tensor], exp_count: int, act_count: int) -> list[tuple[int | None, int | None]]:
    """(expected buffer, actual buffer) pairs, one per row of the picture."""
    pairs = pair_buffers(expected, actual)
    rows: list[tuple[int | None, int | None]] = [(e, next((a for a, x in pairs.items() if x == e), None)) for e in range(exp_count)]
    taken = {a for _, a in rows if a is not None}
    if act_count and exp_count and not pairs:
        rows = [(e, e if e < act_count else None) for e in range(exp_count)]  # nothing to pair by: by index
        taken = set(range(min(exp_count, act_count)))
    return rows + [(None, a) for a in range(act_count) if a not in taken]


def _oracle_text(result: CaseResult) -> TextPanel:
    """The oracle's side when it rejects the case: its reason, and the views vLLM built instead."""
    expectation, outcome = result.expectation, result.outcome
    reason = expectation.reject_reason if expectation is not None else result.verdict.reason
    layer = f" (layer {expectation.reject_layer})" if expectation is not None and expectation.reject_layer else ""
    lines = [f"{reason}{layer}"]
    if outcome is not None and outcome.views:
        lines += ["", "vLLM built instead:"]
        lines += [f"  {name}[{number}] shape {v.shape}, byte strides {v.byte_strides}, first byte {v.offset_bytes}, {v.dtype}"
                  for name, views in outcome.views.items() for number, v in enumerate(views)]
    return TextPanel("oracle: rejects the case", tuple(lines))


def _vllm_panel(result: CaseResult, expected: list[Tensor]) -> Panel:
    """What vLLM did instead of building views: its error, and when torch said which view it
    refused, that view's bytes against the buffer it had."""
    case, expectation, outcome = result.case, result.expectation, result.outcome
    if outcome is None:
        return TextPanel("vLLM: no outcome", (result.verdict.reason or result.verdict.status,))
    lines = [error_text(outcome)]
    demand = parse_storage_error(outcome.error_message)
    if demand is None:
        return TextPanel("vLLM raised", tuple(lines))
    lines += demand_lines(demand, expectation, outcome.error_layer)
    layer = outcome.error_layer or case.layer_names[0]
    mine = next((t for t in expected if t.layer == layer), None)
    buffer = mine.buffer if mine is not None else 0
    wanted = expectation.layers[layer].views[0] if expectation is not None and layer in expectation.layers else None
    view = ViewRecord(demand.sizes, demand.strides, demand.offset * demand.itemsize, "?", demand.itemsize, buffer)
    tensor = view_tensor(case, layer, 0, view, wanted)
    if tensor is None:
        return TextPanel("vLLM raised", tuple(lines), (demand.available, demand.needed))
    size = demand.available
    pitch = page_pitch(expectation if mine is not None else None, buffer, expected if mine is not None else [tensor], size, case.num_blocks)
    pad = padding_mask(expectation, buffer, size, case.num_blocks) if mine is not None else None
    return MapPanel(f"vLLM raised; the view it tried to build on a buffer of {size:,} B", byte_map([tensor], size, pad), make_grid(pitch),
                    tuple(lines))

