"""Pictures of a case: the raw KV-cache buffers as byte maps, the oracle's beside vLLM's.

`draw` paints the owner of every byte (`fuzz.explain.bytemap`) into a PNG, one row per page (wrapped into
several display rows when a page is long), with padding hatched and clashes (two elements on one
byte, or elements of different blocks) in red; `fuzz.explain.picture_layout` decides the panels and the
grid of cells, this module renders them. `text_diff` (`fuzz.explain.picture_text`) says the same as a
short table. Bytes are aggregated into cells with numpy; nothing loops over bytes.
"""

from __future__ import annotations

import colorsys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fuzz.explain.bytemap import KV_NAMES, ByteMap, actual_tensors, byte_map, pack_owner, unpack_owner
from fuzz.explain.picture_layout import Grid, MapPanel, Panel, TextPanel, panels
from fuzz.explain.picture_text import text_diff, title_lines
from fuzz.explain.vllm_error import parse_storage_error
from fuzz.verdict.runner import CaseResult

_HUES = (0.60, 0.09, 0.33, 0.76, 0.50, 0.16, 0.88, 0.42, 0.68, 0.25)
CLASH = (0.86, 0.05, 0.05)
UNUSED = (0.90, 0.90, 0.90)
ABSENT = (1.0, 1.0, 1.0)
ELLIPSIS = (0.78, 0.78, 0.78)


# ---------------------------------------------------------------- a byte map as cells of colour


def _cells(values: np.ndarray, start: int, length: int, cell: int, count: int, fill: object, reduce: str) -> np.ndarray:
    """`values[start:start+length]` cut into `count` cells of `cell` bytes, each reduced to one value."""
    padded = np.full(count * cell, fill, dtype=values.dtype)
    chunk = values[start:start + min(length, count * cell)]
    padded[:chunk.size] = chunk
    return getattr(padded.reshape(count, cell), reduce)(axis=1)


def owner_colour(code: int) -> tuple[float, float, float]:
    """Hue per layer (shifted per tensor and for V), saturation K vs V, lightness per manager block
    (four levels, repeating) and a lighter step for odd kernel blocks inside a block."""
    f = unpack_owner(code)
    hue = (_HUES[f["layer"] % len(_HUES)] + 0.035 * f["tensor"] + (0.03 if f["kv"] == 2 else 0.0)) % 1.0
    saturation = {0: 0.70, 1: 0.85, 2: 0.42}[f["kv"]]
    lightness = 0.34 + 0.11 * (f["block"] % 4) + (0.06 if f["sub"] % 2 else 0.0)
    return colorsys.hls_to_rgb(hue, lightness, saturation)


@dataclass(frozen=True)
class MapImage:
    """A byte map rendered onto its grid: colours, hatching masks and the rows' labels."""

    rgb: np.ndarray  # display rows x columns x 3
    padding: np.ndarray  # display rows x columns
    shared: np.ndarray
    labels: tuple[tuple[int, str, bool], ...]  # (display row, page label, page lies past the buffer's end)
    ellipses: tuple[tuple[int, int], ...]  # (display row, pages left out)
    owners: tuple[int, ...]  # owner codes on show


def render(bmap: ByteMap, grid: Grid) -> MapImage:
    """Each cell's colour: its owner's (two owners in stripes where groups share bytes), red for a clash
    or an element past the buffer's end, white where no byte lies, grey for the ellipsis row."""
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


# ---------------------------------------------------------------- the figure


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
        f = unpack_owner(code)
        key = (f["layer"], f["tensor"], f["kv"])
        if key in seen or len(seen) >= 12:
            continue
        seen.add(key)
        kv = KV_NAMES[f["kv"]]
        name = names.get(f["layer"], f"layer {f['layer']}")
        label = f"{name}[{f['tensor']}]{' ' + kv if kv else ''}"
        handles.append(Patch(color=owner_colour(int(pack_owner(f["layer"], f["tensor"], np.int64(f["kv"]), np.int64(0), np.int64(0)))),
                             label=label))
    if owners:
        hue = _HUES[unpack_owner(min(owners))["layer"] % len(_HUES)]
        handles += [Patch(color=colorsys.hls_to_rgb(hue, 0.34 + 0.11 * block, 0.7), label=f"block {block} (mod 4)") for block in range(4)]
        handles.append(Patch(color=colorsys.hls_to_rgb(hue, 0.40, 0.7), label="odd kernel block: +lighter"))
    handles += [Patch(facecolor="white", edgecolor="0.2", hatch="////", label="page padding"),
                Patch(facecolor="white", edgecolor="0.1", hatch="..", label="shared by two groups (both colours)"),
                Patch(color=CLASH, label="clash / outside the buffer"), Patch(facecolor=UNUSED, edgecolor="0.5", label="unused")]
    fig.legend(handles=handles, loc="lower center", ncol=min(9, len(handles)), fontsize=7, frameon=False)


# The public entry: `draw` and `text_diff`; tests also reach the byte-map and error parsing pieces through here.
__all__ = ["actual_tensors", "byte_map", "draw", "parse_storage_error", "text_diff"]
