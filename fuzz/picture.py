"""Pictures of a case: the raw KV-cache buffers as byte maps, the oracle's beside vLLM's.

Every byte of a raw buffer gets an owner (layer, tensor, K or V, manager block, kernel block)
from the views that address it. `draw` paints those owners into a PNG, one row per page
(wrapped into several display rows when a page is long), with padding hatched and clashes
(two elements on one byte, or elements of different blocks) in red; `text_diff` says the same
as a short table. Bytes are aggregated into cells with numpy; nothing loops over bytes.
"""

from __future__ import annotations

import colorsys
import math
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fuzz.case import Case, SpecCase
from fuzz.compare import element_offsets
from fuzz.runner import CaseResult
from fuzz.targets.base import Outcome, ViewRecord
from oracles.expectation import Expectation, ViewExpectation

COLUMNS = 192  # cells in one display row
MAX_WRAP = 4  # display rows one page may take before cells grow
MAX_PAGE_ROWS = 36  # display rows of one map before pages are left out
HEAD_PAGES, TAIL_PAGES = 4, 2  # pages shown before and after the ellipsis
ELEMENT_LIMIT = 1 << 24  # tensors beyond this many elements are left out of the maps
OVERFLOW_LIMIT = 1 << 22  # bytes past a buffer's end that a map still shows

# Owner codes pack (layer, tensor, kv, block, kernel block within its manager block) into an int64.
_FIELDS = (("layer", 12, 52), ("tensor", 4, 48), ("kv", 2, 46), ("block", 26, 20), ("sub", 20, 0))
_HUES = (0.60, 0.09, 0.33, 0.76, 0.50, 0.16, 0.88, 0.42, 0.68, 0.25)
CLASH = (0.86, 0.05, 0.05)
UNUSED = (0.90, 0.90, 0.90)
ABSENT = (1.0, 1.0, 1.0)
ELLIPSIS = (0.78, 0.78, 0.78)
KV_NAMES = {0: "", 1: "K", 2: "V"}

_SET_STORAGE = re.compile(
    r"sizes \[([^\]]*)\], strides \[([^\]]*)\], storage offset (\d+), and itemsize (\d+) "
    r"requiring a storage size of (\d+) are out of bounds for storage of size (\d+)")


# ---------------------------------------------------------------- who owns which byte


@dataclass(frozen=True)
class Tensor:
    """One tensor's owned elements on one raw buffer: first byte, row-major index and owner of each."""

    layer: str
    layer_index: int
    group: int
    tensor: int
    buffer: int
    shape: tuple[int, ...]
    byte_strides: tuple[int, ...]
    offset: int
    dtype: str
    element_size: int
    starts: np.ndarray
    index: np.ndarray
    blocks: np.ndarray
    kernel: np.ndarray
    kv: np.ndarray

    @property
    def codes(self) -> np.ndarray:
        sub = np.where(self.blocks >= 0, self.kernel, 0)
        return _pack(self.layer_index, self.tensor, self.kv, np.maximum(self.blocks, 0), sub)

    def byte_addresses(self) -> np.ndarray:
        return (self.starts[:, None] + np.arange(self.element_size, dtype=np.int64)[None, :]).reshape(-1)

    def describe(self, key: int) -> str:
        """The owner of byte `key % element_size` of element `key // element_size`, in words."""
        element, byte = divmod(int(key), self.element_size)
        at = int(np.searchsorted(self.index, element))
        where = tuple(int(i) for i in np.unravel_index(element, self.shape))
        kv = KV_NAMES[int(self.kv[at])]
        return (f"{self.layer}[{self.tensor}]{' ' + kv if kv else ''} element {where} byte {byte} "
                f"(block {int(self.blocks[at])}, its kernel block {int(self.kernel[at])})")


def _pack(layer: int, tensor: int, kv: np.ndarray, block: np.ndarray, sub: np.ndarray) -> np.ndarray:
    values = {"layer": layer, "tensor": tensor, "kv": kv, "block": block, "sub": sub}
    code = np.zeros(np.shape(kv), dtype=np.int64)
    for name, bits, shift in _FIELDS:
        code |= (np.asarray(values[name], dtype=np.int64) & ((1 << bits) - 1)) << shift
    return code


def _unpack(code: int) -> dict[str, int]:
    return {name: (int(code) >> shift) & ((1 << bits) - 1) for name, bits, shift in _FIELDS}


def _axis_index(shape: tuple[int, ...], axis: int) -> np.ndarray:
    """Each element's index along `axis`, row-major."""
    view = [1] * len(shape)
    view[axis] = -1
    return np.broadcast_to(np.arange(shape[axis], dtype=np.int64).reshape(view), shape).reshape(-1)


def _spec_of(case: Case, layer: str) -> SpecCase | None:
    owner = dict(case.kv_sharing).get(layer, layer)
    try:
        return case.groups[case.group_of(owner)].spec
    except KeyError:
        return None


def _kv_labels(case: Case, layer: str, shape: tuple[int, ...], block_axis: int) -> np.ndarray:
    """1 for K and 2 for V along a size-2 K/V axis (one of the two outermost), else 0."""
    spec = _spec_of(case, layer)
    if spec is not None and spec.is_attention and not spec.is_mla:
        for axis in (0, 1):
            if axis < len(shape) and axis != block_axis and shape[axis] == 2:
                return _axis_index(shape, axis) + 1
    return np.zeros(math.prod(shape), dtype=np.int64)


def _group_index(case: Case, layer: str) -> int:
    try:
        return case.group_of(dict(case.kv_sharing).get(layer, layer))
    except KeyError:
        return -1


def expected_tensors(case: Case, expectation: Expectation | None) -> list[Tensor]:
    if expectation is None or not expectation.accepted:
        return []
    tensors = []
    names = case.layer_names
    for name, layer in expectation.layers.items():
        if name in expectation.kv_sharing:
            continue
        for number, view in enumerate(layer.views):
            if math.prod(view.shape) > ELEMENT_LIMIT:
                continue
            offsets = view.element_offsets()
            owned = offsets >= 0
            tensors.append(Tensor(
                name, names.index(name) if name in names else len(names), layer.group, number, view.buffer, view.shape,
                view.byte_strides, view.byte_offset, view.dtype, view.element_size, offsets[owned], np.flatnonzero(owned),
                view.element_blocks()[owned], _axis_index(view.shape, view.block_axis)[owned] % view.kernel_stride,
                _kv_labels(case, name, view.shape, view.block_axis)[owned]))
    return tensors


def _block_geometry(case: Case, view: ViewRecord, want: ViewExpectation | None) -> tuple[int, int, int]:
    """(block axis, kernel ratio, kernel stride) of an actual view: the expected view's when the
    shapes agree, else a guess that spreads the block axis evenly over the manager blocks."""
    if want is not None and want.shape == view.shape:
        return want.block_axis, want.kernel_ratio, want.kernel_stride
    blocks = case.num_blocks
    if want is not None and len(want.shape) == len(view.shape):
        axis = want.block_axis
    else:
        fits = [a for a, size in enumerate(view.shape) if size >= blocks and size % blocks == 0]
        axis = max(fits, key=lambda a: abs(view.stride[a])) if fits else 0
    per = max(1, view.shape[axis] // blocks) if view.shape else 1
    return axis, per, per


def actual_tensors(case: Case, expectation: Expectation | None, outcome: Outcome | None) -> list[Tensor]:
    if outcome is None:
        return []
    sharers = set(dict(case.kv_sharing)) | set(outcome.aliases)
    layers = expectation.layers if expectation is not None and expectation.accepted else {}
    tensors = []
    for name, views in outcome.views.items():
        if name in sharers:
            continue
        wanted = layers[name].views if name in layers else ()
        for number, view in enumerate(views):
            tensor = view_tensor(case, name, number, view, wanted[number] if number < len(wanted) else None)
            if tensor is not None:
                tensors.append(tensor)
    return tensors


def view_tensor(case: Case, name: str, number: int, view: ViewRecord, want: ViewExpectation | None) -> Tensor | None:
    """The owned elements of one view vLLM built (or tried to), None when they cannot be enumerated."""
    if view.buffer < 0 or not view.shape or math.prod(view.shape) > ELEMENT_LIMIT:
        return None
    names = case.layer_names
    axis, ratio, stride = _block_geometry(case, view, want)
    kernel = _axis_index(view.shape, axis)
    owned = kernel % stride < ratio
    return Tensor(name, names.index(name) if name in names else len(names), _group_index(case, name), number, view.buffer,
                  view.shape, view.byte_strides, view.offset_bytes, view.dtype, view.element_size, element_offsets(view)[owned],
                  np.flatnonzero(owned), (kernel // stride)[owned], (kernel % stride)[owned], _kv_labels(case, name, view.shape, axis)[owned])


@dataclass(frozen=True)
class ByteMap:
    """Owners of every byte of one raw buffer, as one side (oracle or vLLM) sees them. The arrays
    run past the buffer's end when a view reaches further (up to OVERFLOW_LIMIT bytes)."""

    end: int  # the buffer's size
    owner: np.ndarray  # packed owner code, -1 where no element lies
    under: np.ndarray  # the other owner of a byte that layers of different groups share, else -1
    clash: np.ndarray  # two elements, elements of different blocks, or two layers of one group
    shared: np.ndarray  # layers of different groups, block for block (hybrid pages share bytes)
    padding: np.ndarray  # page padding that no expected element uses
    outside: tuple[tuple[str, int, int], ...]  # (layer, lowest, highest + 1) of bytes off the buffer

    @property
    def size(self) -> int:
        """Bytes mapped: the buffer and what views address past its end."""
        return int(self.owner.size)


def byte_map(tensors: list[Tensor], end: int, padding: np.ndarray | None = None) -> ByteMap:
    reach = max([end] + [int(t.starts.max()) + t.element_size for t in tensors if t.starts.size])
    size = min(reach, end + OVERFLOW_LIMIT)
    owner = np.full(size, -1, dtype=np.int64)
    under = np.full(size, -1, dtype=np.int64)
    block = np.full(size, -1, dtype=np.int32)
    group = np.full(size, -1, dtype=np.int32)
    clash = np.zeros(size, dtype=bool)
    shared = np.zeros(size, dtype=bool)
    outside = []
    for tensor in tensors:
        addresses = tensor.byte_addresses()
        codes = np.repeat(tensor.codes, tensor.element_size)
        blocks = np.repeat(tensor.blocks, tensor.element_size).astype(np.int32)
        off = addresses[(addresses < 0) | (addresses >= end)]
        if off.size:
            outside.append((tensor.layer, int(off.min()), int(off.max()) + 1))
        inside = (addresses >= 0) & (addresses < size)
        if not inside.all():
            addresses, codes, blocks = addresses[inside], codes[inside], blocks[inside]
        clash |= np.bincount(addresses, minlength=size)[:size] > 1
        before_block, before_group = block[addresses], group[addresses]
        taken = owner[addresses] >= 0
        clash[addresses[taken & ((before_block != blocks) | (before_group == tensor.group))]] = True
        hybrid = addresses[taken & (before_group != tensor.group) & (before_block == blocks)]
        shared[hybrid] = True
        under[hybrid] = owner[hybrid]
        owner[addresses] = codes
        block[addresses] = blocks
        group[addresses] = tensor.group
    pad = np.zeros(size, dtype=bool)
    if padding is not None:
        pad[:min(size, padding.size)] = padding[:size]
        pad &= owner < 0
    return ByteMap(end, owner, under, clash, shared, pad, tuple(outside))


def padding_mask(expectation: Expectation | None, buffer: int, size: int, num_blocks: int) -> np.ndarray:
    """Bytes that some layer's page rule calls padding, on one expected buffer."""
    edges = np.zeros(size + 1, dtype=np.int64)
    if expectation is None or not expectation.accepted:
        return np.zeros(size, dtype=bool)
    for name, layer in expectation.layers.items():
        rule = layer.pages
        if name in expectation.kv_sharing or not layer.views or layer.views[0].buffer != buffer or rule.pad_start >= rule.span_len:
            continue
        bases = rule.origin + np.arange(num_blocks, dtype=np.int64) * rule.block_pitch
        starts = (bases[:, None] + np.asarray(rule.span_starts, dtype=np.int64)[None, :] + rule.pad_start).reshape(-1)
        ends = starts + (rule.span_len - rule.pad_start)
        np.add.at(edges, np.clip(starts, 0, size), 1)
        np.add.at(edges, np.clip(ends, 0, size), -1)
    return np.cumsum(edges[:-1]) > 0


def pair_buffers(expected: list[Tensor], actual: list[Tensor]) -> dict[int, int]:
    """Actual buffer index -> expected buffer index, through the layers each holds."""
    where = {(t.layer, t.tensor): t.buffer for t in expected}
    pairs: dict[int, int] = {}
    for tensor in actual:
        if (tensor.layer, tensor.tensor) in where:
            pairs.setdefault(tensor.buffer, where[(tensor.layer, tensor.tensor)])
    return pairs


# ---------------------------------------------------------------- what vLLM raised


@dataclass(frozen=True)
class StorageDemand:
    """A torch setStorage refusal: the view vLLM tried to build and the storage it had."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    itemsize: int
    needed: int
    available: int


def parse_storage_error(message: str | None) -> StorageDemand | None:
    match = _SET_STORAGE.search(message or "")
    if match is None:
        return None
    numbers = [tuple(int(x) for x in part.split(",") if x.strip()) for part in match.group(1, 2)]
    return StorageDemand(numbers[0], numbers[1], *(int(match.group(i)) for i in range(3, 7)))


def _demand_lines(demand: StorageDemand, expectation: Expectation | None, layer: str | None) -> list[str]:
    lines = [f"vLLM asked for a view of sizes {list(demand.sizes)}, byte strides {[s * demand.itemsize for s in demand.strides]}",
             f"it needs {demand.needed:,} B; the buffer has {demand.available:,} B: "
             f"{demand.needed - demand.available:,} B past its end ({demand.needed / max(demand.available, 1):.1f}x the buffer)"]
    if expectation is None or not expectation.accepted:
        return lines
    candidates = [expectation.layers[layer]] if layer in expectation.layers else list(expectation.layers.values())
    for candidate in candidates:
        for view in candidate.views:
            if len(view.shape) == len(demand.sizes):
                axes = [f"axis {a}: {got} instead of {want}" for a, (got, want) in enumerate(zip(demand.sizes, view.shape, strict=True))
                        if got != want]
                if axes:
                    lines.append(f"against the oracle's {candidate.name} view {view.shape}: " + ", ".join(axes))
                return lines
    return lines


def error_text(outcome: Outcome) -> str:
    where = f" in {outcome.error_function}" if outcome.error_function else ""
    layer = f" (layer {outcome.error_layer})" if outcome.error_layer else ""
    return f"{outcome.error_type}{where}{layer}: {outcome.error_message}"


# ---------------------------------------------------------------- the grid of cells


@dataclass(frozen=True)
class Grid:
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
        return sum(1 if p is None else self.wraps for p in self.pages_shown(size))


def make_grid(pitch: int) -> Grid:
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


def _cells(values: np.ndarray, start: int, length: int, cell: int, count: int, fill: object, reduce: str) -> np.ndarray:
    """`values[start:start+length]` cut into `count` cells of `cell` bytes, each reduced to one value."""
    padded = np.full(count * cell, fill, dtype=values.dtype)
    chunk = values[start:start + min(length, count * cell)]
    padded[:chunk.size] = chunk
    return getattr(padded.reshape(count, cell), reduce)(axis=1)


def owner_colour(code: int) -> tuple[float, float, float]:
    """Hue per layer (shifted per tensor and for V), saturation K vs V, lightness per manager block
    (four levels, repeating) and a lighter step for odd kernel blocks inside a block."""
    f = _unpack(code)
    hue = (_HUES[f["layer"] % len(_HUES)] + 0.035 * f["tensor"] + (0.03 if f["kv"] == 2 else 0.0)) % 1.0
    saturation = {0: 0.70, 1: 0.85, 2: 0.42}[f["kv"]]
    lightness = 0.34 + 0.11 * (f["block"] % 4) + (0.06 if f["sub"] % 2 else 0.0)
    return colorsys.hls_to_rgb(hue, lightness, saturation)


@dataclass(frozen=True)
class MapImage:
    rgb: np.ndarray  # display rows x columns x 3
    padding: np.ndarray  # display rows x columns
    shared: np.ndarray
    labels: tuple[tuple[int, str, bool], ...]  # (display row, page label, page lies past the buffer's end)
    ellipses: tuple[tuple[int, int], ...]  # (display row, pages left out)
    owners: tuple[int, ...]  # owner codes on show


def render(bmap: ByteMap, grid: Grid) -> MapImage:
    pages = grid.pages_shown(bmap.size)
    count = grid.wraps * grid.columns
    owner_rows, under_rows, clash_rows, shared_rows, pad_rows, valid_rows, beyond_rows = [], [], [], [], [], [], []
    labels, ellipses = [], []
    row = 0
    for position, page in enumerate(pages):
        if page is None:
            ellipses.append((row, pages[position + 1] - pages[position - 1] - 1))
            owner_rows.append(np.full(grid.columns, -1, dtype=np.int64))
            under_rows.append(np.full(grid.columns, -1, dtype=np.int64))
            for rows in (clash_rows, shared_rows, pad_rows, valid_rows, beyond_rows):
                rows.append(np.zeros(grid.columns, dtype=bool))
            row += 1
            continue
        start = page * grid.pitch
        length = max(0, min(grid.pitch, bmap.size - start))
        owner_rows.append(_cells(bmap.owner, start, length, grid.cell, count, -1, "max"))
        under_rows.append(_cells(bmap.under, start, length, grid.cell, count, -1, "max"))
        clash_rows.append(_cells(bmap.clash, start, length, grid.cell, count, False, "any"))
        shared_rows.append(_cells(bmap.shared, start, length, grid.cell, count, False, "any"))
        pad_rows.append(_cells(bmap.padding.astype(np.float32), start, length, grid.cell, count, 0.0, "mean") >= 0.5)
        valid_rows.append(np.arange(count) * grid.cell < length)
        labels.append((row, f"p{page} @{start:,}", start >= bmap.end))
        beyond_rows.append(start + np.arange(count) * grid.cell >= bmap.end)
        row += grid.wraps
    owner = np.concatenate(owner_rows).reshape(row, grid.columns)
    under = np.concatenate(under_rows).reshape(row, grid.columns)
    clash, shared, pad, valid, beyond = (np.concatenate(rows).reshape(row, grid.columns)
                                         for rows in (clash_rows, shared_rows, pad_rows, valid_rows, beyond_rows))
    codes, inverse = np.unique(np.concatenate([owner.ravel(), under.ravel()]), return_inverse=True)
    palette = np.array([owner_colour(c) if c >= 0 else UNUSED for c in codes.tolist()], dtype=np.float32).reshape(-1, 3)
    rgb = palette[inverse[:owner.size].reshape(owner.shape)]
    # Bytes two groups share show both owners, in interleaved stripes two cells wide.
    stripes = (np.arange(grid.columns)[None, :] // 2 + np.arange(row)[:, None]) % 2 == 1
    second = shared & (under >= 0) & stripes
    rgb[second] = palette[inverse[owner.size:].reshape(owner.shape)][second]
    rgb[~valid | (beyond & (owner < 0))] = ABSENT
    rgb[clash | (beyond & (owner >= 0))] = CLASH
    for at, _ in ellipses:
        rgb[at] = ELLIPSIS
    return MapImage(rgb, pad & valid, shared, tuple(labels), tuple(ellipses), tuple(int(c) for c in codes if c >= 0))


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of True in a 1-d mask."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


# ---------------------------------------------------------------- panels and the figure


@dataclass(frozen=True)
class MapPanel:
    title: str
    bmap: ByteMap
    grid: Grid
    notes: tuple[str, ...] = ()  # text above the map


@dataclass(frozen=True)
class TextPanel:
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
    lines += _demand_lines(demand, expectation, outcome.error_layer)
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


def title_lines(result: CaseResult, vllm: str | None) -> list[str]:
    case, verdict = result.case, result.verdict
    where = f"vLLM {vllm}" if vllm else (f"contract {result.expectation.contract}" if result.expectation else "")
    head = f"{case.describe()}  ·  {case.num_blocks} blocks  ·  {where}"
    if verdict.finding is not None:
        status = f"{verdict.status}: {verdict.finding.signature}"
    else:
        status = verdict.status + (f" ({verdict.reason})" if verdict.reason else "")
    return [head, *textwrap.wrap(status, 150)[:3]]


def draw(result: CaseResult, path: Path, *, vllm: str | None = None) -> None:
    """Write a PNG of the case: the oracle's byte map of each raw buffer beside vLLM's."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    left, right, expected, actual = panels(result)
    names = {t.layer_index: t.layer for t in expected + actual}
    rows = max(len(left), len(right), 1)
    spanning = [len(side) == 1 and rows > 1 for side in (left, right)]
    heights = [max([sum(h for _, h in _parts(side[r])) for side, span in zip((left, right), spanning, strict=True)
                    if r < len(side) and not span] + [0.5]) for r in range(rows)]
    for side, span in zip((left, right), spanning, strict=True):
        if span:  # one panel beside several rows: the rows grow when it needs more room than they have
            heights[-1] += max(0.0, sum(h for _, h in _parts(side[0])) - sum(heights))
    title = title_lines(result, vllm)
    head, foot = 0.3 + 0.2 * len(title), 0.9
    total = sum(heights) + head + foot
    fig = Figure(figsize=(16, total), dpi=90)
    FigureCanvasAgg(fig)
    fig.suptitle("\n".join(title), fontsize=10, family="monospace", y=1 - 0.1 / total, va="top")
    outer = fig.add_gridspec(rows, 2, height_ratios=heights, top=1 - head / total, bottom=foot / total, left=0.07, right=0.99,
                             hspace=0.0, wspace=0.16)
    owners: set[int] = set()
    for column, side in enumerate((left, right)):
        for r, panel in enumerate(side):
            slot = outer[:, column] if spanning[column] else outer[r, column]
            room = sum(heights) if spanning[column] else heights[r]
            owners.update(_draw_panel(fig, slot, panel, room))
    _legend(fig, owners, names)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


# Heights in inches of the parts of a panel, top to bottom; names without an axes are gaps.
TITLE_GAP, ROW_HEIGHT, AXIS_GAP, STRIP = 0.3, 0.17, 0.5, 0.3


def _parts(panel: Panel) -> list[tuple[str, float]]:
    if isinstance(panel, MapPanel):
        parts = [("gap", TITLE_GAP)] + [("notes", _text_height(panel.notes))] * bool(panel.notes)
        parts += [("map", max(0.5, ROW_HEIGHT * panel.grid.rows(panel.bmap.size))), ("gap", AXIS_GAP)]
        return parts + [("gap", TITLE_GAP), ("strip", STRIP), ("gap", AXIS_GAP)] * bool(panel.bmap.outside)
    parts = [("gap", TITLE_GAP), ("text", _text_height(panel.lines) + 0.1)]
    return parts + [("gap", TITLE_GAP), ("bar", STRIP), ("gap", AXIS_GAP)] * (panel.bar is not None)


def _wrapped(lines: tuple[str, ...]) -> list[str]:
    return [part for line in lines for part in (textwrap.wrap(line, 95) or [""])]


def _text_height(lines: tuple[str, ...]) -> float:
    return 0.15 * len(_wrapped(lines)) + (0.1 if lines else 0.0)


def _draw_panel(fig, slot, panel: Panel, room: float) -> tuple[int, ...]:  # noqa: ANN001 - matplotlib objects
    """Draw one panel at the top of its slot; returns the owner codes it shows."""
    parts = _parts(panel)
    spare = room - sum(h for _, h in parts)
    inner = slot.subgridspec(len(parts) + 1, 1, height_ratios=[h for _, h in parts] + [max(spare, 0.001)], hspace=0.0)
    axes = {name: fig.add_subplot(inner[i]) for i, (name, _) in enumerate(parts) if name != "gap"}
    if isinstance(panel, TextPanel):
        _write(axes["text"], panel.title, panel.lines)
        if panel.bar is not None:
            size, needed = panel.bar
            _reach_bar(axes["bar"], size, 0, max(size, needed))
            axes["bar"].set_title(f"the demanded view reaches byte {needed:,}: {needed - size:,} B past the buffer", fontsize=8,
                                  loc="left", color=CLASH)
        return ()
    if panel.notes:
        _write(axes["notes"], panel.title, panel.notes)
    else:
        axes["map"].set_title(panel.title, fontsize=9, loc="left")
    if "strip" in axes:
        _outside_strip(axes["strip"], panel.bmap)
    return _draw_map(axes["map"], panel)


def _draw_map(ax, panel: MapPanel) -> tuple[int, ...]:  # noqa: ANN001
    from matplotlib.patches import Rectangle

    bmap, grid = panel.bmap, panel.grid
    image = render(bmap, grid)
    rows, columns = image.rgb.shape[:2]
    ax.imshow(image.rgb, aspect="auto", interpolation="nearest", extent=(0, columns, rows, 0))
    for mask, hatch, colour in ((image.padding, "////", (0.2, 0.2, 0.2)), (image.shared, "..", (0.25, 0.25, 0.25))):
        for r in range(rows):
            for start, end in _runs(mask[r]):
                ax.add_patch(Rectangle((start, r), end - start, 1, fill=False, hatch=hatch, edgecolor=colour, linewidth=0))
    for at, left_out in image.ellipses:
        ax.text(columns / 2, at + 0.5, f"⋯  {left_out:,} pages not shown  ⋯", ha="center", va="center", fontsize=8)
    if grid.wraps > 1:
        for at, _, _ in image.labels[1:]:
            ax.axhline(at, color="black", linewidth=0.8)
    ax.set_yticks([at + 0.5 for at, _, _ in image.labels], [label for _, label, _ in image.labels], fontsize=7)
    for label, (_, _, past) in zip(ax.get_yticklabels(), image.labels, strict=True):
        if past:
            label.set_color(CLASH)
    ticks = np.linspace(0, columns, 5).round().astype(int)
    ax.set_xticks(ticks, [f"{int(t) * grid.cell:,}" for t in ticks], fontsize=7)
    ax.set_xlim(0, columns)
    ax.set_ylim(rows, 0)
    ax.set_xlabel(f"byte in page (page {grid.pitch:,} B, {grid.wraps} row(s) of {grid.columns * grid.cell:,} B, cell {grid.cell} B)",
                  fontsize=7)
    return image.owners


def _outside_strip(ax, bmap: ByteMap) -> None:  # noqa: ANN001
    low = min(0, *(lo for _, lo, _ in bmap.outside))
    high = max(bmap.end, *(hi for _, _, hi in bmap.outside))
    _reach_bar(ax, bmap.end, low, high)
    words = "; ".join(f"{layer} reaches bytes {lo:,}..{hi:,}" for layer, lo, hi in bmap.outside[:3])
    ax.set_title(f"outside the buffer: {words}", fontsize=8, loc="left", color=CLASH)


def _reach_bar(ax, size: int, low: int, high: int) -> None:  # noqa: ANN001
    from matplotlib.ticker import FuncFormatter

    ax.barh(0, size, left=0, height=0.8, color=UNUSED, edgecolor="black", linewidth=0.6)
    if high > size:
        ax.barh(0, high - size, left=size, height=0.8, color=CLASH)
    if low < 0:
        ax.barh(0, -low, left=low, height=0.8, color=CLASH)
    ax.axvline(size, color="black", linewidth=1.2)
    right = size - low > 0.6 * (high - low)  # near the right edge: write the label to the left of the line
    ax.text(size, 0.55, f" buffer end: {size:,} B " if right else f" buffer end: {size:,} B", fontsize=7, va="bottom",
            ha="right" if right else "left")
    ax.set_xlim(low, high)
    ax.set_ylim(-0.5, 1.3)
    ax.set_yticks([])
    ax.tick_params(axis="x", labelsize=7)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{int(x):,}"))


def _write(ax, title: str, lines: tuple[str, ...]) -> None:  # noqa: ANN001
    ax.axis("off")
    ax.set_title(title, fontsize=9, loc="left")
    ax.text(0.0, 1.0, "\n".join(_wrapped(lines)), va="top", ha="left", fontsize=8, family="monospace", transform=ax.transAxes)


def _legend(fig, owners: set[int], names: dict[int, str]) -> None:  # noqa: ANN001
    from matplotlib.patches import Patch

    handles, seen = [], set()
    for code in sorted(owners):
        f = _unpack(code)
        key = (f["layer"], f["tensor"], f["kv"])
        if key in seen or len(seen) >= 12:
            continue
        seen.add(key)
        kv = KV_NAMES[f["kv"]]
        name = names.get(f["layer"], f"layer {f['layer']}")
        label = f"{name}[{f['tensor']}]{' ' + kv if kv else ''}"
        handles.append(Patch(color=owner_colour(int(_pack(f["layer"], f["tensor"], np.int64(f["kv"]), np.int64(0), np.int64(0)))),
                             label=label))
    if owners:
        hue = _HUES[_unpack(min(owners))["layer"] % len(_HUES)]
        handles += [Patch(color=colorsys.hls_to_rgb(hue, 0.34 + 0.11 * block, 0.7), label=f"block {block} (mod 4)") for block in range(4)]
        handles.append(Patch(color=colorsys.hls_to_rgb(hue, 0.40, 0.7), label="odd kernel block: +lighter"))
    handles += [Patch(facecolor="white", edgecolor="0.2", hatch="////", label="page padding"),
                Patch(facecolor="white", edgecolor="0.1", hatch="..", label="shared by two groups (both colours)"),
                Patch(color=CLASH, label="clash / outside the buffer"), Patch(facecolor=UNUSED, edgecolor="0.5", label="unused")]
    fig.legend(handles=handles, loc="lower center", ncol=min(9, len(handles)), fontsize=7, frameon=False)


# ---------------------------------------------------------------- the same, as text


def text_diff(result: CaseResult, *, vllm: str | None = None) -> str:
    """Expected against actual, per layer and tensor: shape, byte strides, first byte, and which
    bytes differ (with the first differing byte's owner on each side)."""
    case, expectation, outcome = result.case, result.expectation, result.outcome
    lines = title_lines(result, vllm)
    if expectation is not None and not expectation.accepted:
        layer = f" (layer {expectation.reject_layer})" if expectation.reject_layer else ""
        lines.append(f"oracle rejects the case: {expectation.reject_reason}{layer}")
    if outcome is not None and outcome.raised:
        lines.append(f"vLLM raised {error_text(outcome)}")
        demand = parse_storage_error(outcome.error_message)
        if demand is not None:
            lines += ["  " + line for line in _demand_lines(demand, expectation, outcome.error_layer)]
    accepted = expectation is not None and expectation.accepted
    exp_sizes = list(expectation.buffers) if accepted and expectation is not None else None
    act_sizes = [b.size for b in outcome.buffers] if outcome is not None and not outcome.raised else None
    lines.append(f"buffer bytes: expected {exp_sizes if exp_sizes is not None else '-'}  actual {act_sizes if act_sizes is not None else '-'}")
    expected = expected_tensors(case, expectation)
    actual = actual_tensors(case, expectation, outcome) if act_sizes is not None else []
    lines.append(f"{'layer':12} {'tensor':6} {'side':8} {'shape':22} {'dtype':13} {'byte strides':28} {'first byte':>10} buffer")
    for name in case.layer_names:
        lines += _layer_rows(name, result, expected, actual, exp_sizes or [], act_sizes or [])
    for sharer, target in case.kv_sharing:
        mine = outcome.views.get(sharer) if outcome is not None else None
        theirs = outcome.views.get(target) if outcome is not None else None
        same = mine is not None and theirs is not None and [_geometry(v) for v in mine] == [_geometry(v) for v in theirs]
        lines.append(f"{sharer:12} shares {target}'s cache: vLLM's views {'alias it' if same else 'do NOT alias it'}")
    return "\n".join(lines)


def _geometry(view: ViewRecord) -> tuple[object, ...]:
    return (view.shape, view.stride, view.offset_bytes, view.dtype, view.buffer)


def _layer_rows(name: str, result: CaseResult, expected: list[Tensor], actual: list[Tensor], exp_sizes: list[int],
                act_sizes: list[int]) -> list[str]:
    expectation, outcome = result.expectation, result.outcome
    wanted = expectation.layers[name].views if expectation is not None and name in expectation.layers else ()
    got = outcome.views.get(name, ()) if outcome is not None else ()
    rows = []
    for number in range(max(len(wanted), len(got), 1)):
        want = wanted[number] if number < len(wanted) else None
        view = got[number] if number < len(got) else None
        rows.append(_row(name, number, "expected", want and (want.shape, want.dtype, want.byte_strides, want.byte_offset, want.buffer)))
        rows.append(_row(name, number, "actual", view and (view.shape, view.dtype, view.byte_strides, view.offset_bytes, view.buffer)))
        mine = next((t for t in expected if t.layer == name and t.tensor == number), None)
        theirs = next((t for t in actual if t.layer == name and t.tensor == number), None)
        if mine is not None or theirs is not None:
            rows.append(" " * 20 + "-> " + byte_difference(mine, theirs, exp_sizes, act_sizes))
    return rows


def _row(name: str, number: int, side: str, data: tuple | None) -> str:
    if not data:
        return f"{name:12} {number:<6} {side:8} -"
    shape, dtype, strides, first, buffer = data
    return f"{name:12} {number:<6} {side:8} {str(tuple(shape)):22} {dtype:13} {str(tuple(strides)):28} {first:>10} {buffer}"


def _keys(tensor: Tensor, size: int) -> tuple[np.ndarray, int, int]:
    """(per-byte element key over `size` bytes, bytes outside the buffer, highest byte reached)."""
    keys = np.full(size, -1, dtype=np.int64)
    addresses = tensor.byte_addresses()
    values = (tensor.index[:, None] * tensor.element_size + np.arange(tensor.element_size)[None, :]).reshape(-1)
    inside = (addresses >= 0) & (addresses < size)
    keys[addresses[inside]] = values[inside]
    return keys, int((~inside).sum()), int(addresses.max()) + 1 if addresses.size else 0


def byte_difference(mine: Tensor | None, theirs: Tensor | None, exp_sizes: list[int], act_sizes: list[int]) -> str:
    """How many buffer bytes hold a different element byte on the two sides, and the first of them."""
    exp_size = exp_sizes[mine.buffer] if mine is not None and mine.buffer < len(exp_sizes) else 0
    act_size = act_sizes[theirs.buffer] if theirs is not None and theirs.buffer < len(act_sizes) else 0
    size = max(exp_size, act_size)
    want, _, _ = _keys(mine, size) if mine is not None else (np.full(size, -1, dtype=np.int64), 0, 0)
    got, outside, reach = _keys(theirs, size) if theirs is not None else (np.full(size, -1, dtype=np.int64), 0, 0)
    differ = np.flatnonzero(want != got)
    used = int(((want >= 0) | (got >= 0)).sum())
    words = [f"{differ.size:,} of {used:,} bytes differ" if differ.size else f"same {used:,} bytes"]
    if differ.size:
        first = int(differ[0])
        expected_owner = mine.describe(want[first]) if mine is not None and want[first] >= 0 else "nothing"
        actual_owner = theirs.describe(got[first]) if theirs is not None and got[first] >= 0 else "nothing"
        words.append(f"first at byte {first:,}: expected {expected_owner}, actual {actual_owner}")
    if outside:
        words.append(f"{outside:,} B outside the buffer (up to byte {reach:,} of {act_size:,})")
    return "; ".join(words)
