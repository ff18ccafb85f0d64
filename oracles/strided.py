"""Exact arithmetic on strided byte layouts, with the enumeration it is tested against.

A layout addresses, for every index (i0..ik), the `item` bytes starting at
offset + sum(i_d * strides_d). Strides are in bytes and may be zero or negative (torch never
makes negative strides, but they are handled exactly: a dimension of size n and stride -s
addresses the same starts as one of stride s shifted down by (n-1)*s). The lowest addressed
byte must be >= 0.

How the set questions stay exact without enumerating:
- Every byte set is brought to a canonical "run form" base + G + [0, run), where
  G = {sum i_d * s_d : 0 <= i_d < n_d} is a set of starts (duplicates irrelevant). Dimensions whose
  stride is at most the run so far are absorbed into the run (their copies overlap or abut), and
  dimensions whose points interleave without gaps are merged (stride t = c*s with c <= n).
- `touches`, `inside` (via the gaps between the spans), `overlaps` (via the difference set
  G_a - G_b, itself a G after flipping) and `is_injective` (one query per leading non-zero
  coordinate of an index difference) all reduce to "is the point x in base + G + [0, run)".
- That point query descends the dimensions, largest stride first. For a nested run form (each
  stride >= the extent of everything inside it) exactly one block can hold x at every level, so
  it costs O(ndim). Otherwise it branches over the candidate blocks, with a memo of failures; two
  remaining dimensions are decided in O(log stride) by a Euclid-style search for the first
  multiple landing in a residue window. After SEARCH_BUDGET nodes it falls back to listing the
  points of G (at most ENUM_LIMIT) or a bitmap of the points below x (at most BITMAP_LIMIT bits).
- `same_bytes` of two nested run forms compares them directly: the nested run form of a byte set
  is unique (the first maximal interval fixes the run, the run fixes the starts, and the smallest
  start gap, the count of its multiples and every n-th start recover the dimensions level by
  level). Otherwise it checks containment in a nested side through that side's gaps (themselves
  nested run forms) and, if still open, compares maximal intervals listed from at most
  ENUM_LIMIT starts or a bitmap of at most BITMAP_LIMIT bytes.

`intervals` lists a layout's maximal byte intervals from its run form: the run starts of a nested form (already
ascending), else the sorted starts or, when those outnumber an eighth of the span, a bitmap of the span; never a byte list.

`Undecidable` is raised only past all of those limits: a point query on a non-nested run form
whose search exceeds SEARCH_BUDGET nodes while G has more than ENUM_LIMIT points and x lies
BITMAP_LIMIT or more steps of gcd(strides) above the base; or `same_bytes` where a side is not
nested, the containment checks did not settle it, and a side has more than ENUM_LIMIT starts and
spans more than BITMAP_LIMIT bytes. For nested layouts `is_injective` is immediate, `touches` and
`inside` visit at most 2**ndim search nodes per span, and `same_bytes` of two nested layouts is a
comparison, so none of them can raise. `overlaps` of two nested layouts searches G_a - G_b, which
is nested-like when their strides are related (shared block pitches, pages inside pitches) and
otherwise is a bounded-knapsack search that could, for huge unrelated layouts, hit the limits.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

SEARCH_BUDGET = 200_000  # search nodes one point query may visit before falling back
ENUM_LIMIT = 1 << 22  # starts a fallback may list
BITMAP_LIMIT = 1 << 25  # bits a fallback bitmap may hold
ENUMERATE_MAX = 1 << 28  # bytes element_starts / byte_addresses will materialise

Dim = tuple[int, int]  # (size, stride)


class Undecidable(ValueError):
    """An exact answer would cost more than the search budget and the listing and bitmap limits allow."""


class _OutOfBudget(Exception):
    pass


@dataclass(frozen=True)
class Strided:
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    item: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(operator.index(n) for n in self.shape))
        object.__setattr__(self, "strides", tuple(operator.index(s) for s in self.strides))
        object.__setattr__(self, "offset", operator.index(self.offset))
        object.__setattr__(self, "item", operator.index(self.item))
        if len(self.shape) != len(self.strides):
            raise ValueError(f"shape {self.shape} and strides {self.strides} differ in length")
        if any(n < 0 for n in self.shape):
            raise ValueError(f"negative size in shape {self.shape}")
        if self.item < 1:
            raise ValueError(f"item must be >= 1, got {self.item}")
        if self.offset < 0:
            raise ValueError(f"offset must be >= 0, got {self.offset}")
        if self.numel and byte_span(self)[0] < 0:
            raise ValueError(f"negative strides reach below byte 0: {describe(self)}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def simplified(self) -> Strided:
        """Equivalent layout (same starts as a multiset, so same bytes): no size-1 dims, strides >= 0, descending, merged.

        An empty layout becomes shape (0,) strides (0,) at the same offset.
        """
        if self.numel == 0:
            return Strided((0,), (0,), self.offset, self.item)
        base, dims = _flip(self.offset, zip(self.shape, self.strides, strict=True))
        dims.sort(key=lambda d: (-d[1], -d[0]))
        merged: list[Dim] = []
        for n, s in dims:
            if merged and merged[-1][1] == n * s:
                merged[-1] = (merged[-1][0] * n, s)
            else:
                merged.append((n, s))
        return Strided(tuple(n for n, _ in merged), tuple(s for _, s in merged), base, self.item)


def describe(layout: Strided) -> str:
    return f"shape {layout.shape} bytes-strides {layout.strides} offset {layout.offset} item {layout.item}"


def byte_span(layout: Strided) -> tuple[int, int]:
    """[lo, hi) of every addressed byte; (offset, offset) when the layout is empty."""
    if layout.numel == 0:
        return layout.offset, layout.offset
    reaches = [(n - 1) * s for n, s in zip(layout.shape, layout.strides, strict=True)]
    return layout.offset + sum(r for r in reaches if r < 0), layout.offset + sum(r for r in reaches if r > 0) + layout.item


def sub_layout(layout: Strided, axis: int, index: int) -> Strided:
    """The layout with `axis` fixed at `index` (0 <= index < size; axis may count from the end)."""
    if not -layout.ndim <= axis < layout.ndim:
        raise IndexError(f"axis {axis} out of range for {layout.ndim} dims")
    axis %= layout.ndim
    if not 0 <= index < layout.shape[axis]:
        raise IndexError(f"index {index} out of range for axis {axis} of size {layout.shape[axis]}")
    keep = [d for d in range(layout.ndim) if d != axis]
    return Strided(
        tuple(layout.shape[d] for d in keep),
        tuple(layout.strides[d] for d in keep),
        layout.offset + index * layout.strides[axis],
        layout.item,
    )


# --- reference enumeration -------------------------------------------------------------------


def element_starts(layout: Strided) -> np.ndarray:
    """First byte of every element, int64, in row-major index order."""
    _check_enumerable(layout)
    starts = np.full(1, layout.offset, dtype=np.int64)
    for n, s in zip(layout.shape, layout.strides, strict=True):
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * s).reshape(-1)
    return starts


def byte_addresses(layout: Strided) -> np.ndarray:
    """Every addressed byte, element by element in row-major order, each element's bytes ascending."""
    starts = element_starts(layout)
    return (starts[:, None] + np.arange(layout.item, dtype=np.int64)).reshape(-1)


def _check_enumerable(layout: Strided) -> None:
    if layout.numel * layout.item > ENUMERATE_MAX:
        raise ValueError(f"refusing to enumerate {layout.numel * layout.item} bytes of {describe(layout)}")
    if byte_span(layout)[1] >= 1 << 62:
        raise ValueError(f"addresses of {describe(layout)} overflow int64")


# --- maximal intervals ---------------------------------------------------------------------


def intervals(layout: Strided) -> tuple[np.ndarray, np.ndarray]:
    """The maximal intervals [starts, ends) of the addressed bytes, ascending (int64), without listing a byte.

    Memory grows with the runs of the layout's run form (its contiguous stretches of bytes), not with its bytes: a nested
    form lists its run starts, already ascending; a form whose runs overlap or interleave lists them and sorts them
    when they are few against its span, else marks them on a bitmap of its span (one byte per byte, transient).
    """
    runs = _runs_of(layout)
    if runs is None:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    if byte_span(layout)[1] >= 1 << 62:
        raise ValueError(f"addresses of {describe(layout)} overflow int64")
    size = runs.top + runs.run
    if runs.nested:
        return _joined(_all_points(runs.dims), runs.run, runs.base)
    if math.prod(n for n, _ in runs.dims) * 8 <= size:
        return _joined(np.unique(_all_points(runs.dims)), runs.run, runs.base)
    return _bitmap_intervals(runs, size)


def _joined(points: np.ndarray, run: int, base: int) -> tuple[np.ndarray, np.ndarray]:
    """Runs [p, p + run) from ascending unique starts, abutting or overlapping ones joined."""
    breaks = np.flatnonzero(np.diff(points) > run)
    starts = points[np.concatenate(([0], breaks + 1))]
    ends = points[np.concatenate((breaks, [len(points) - 1]))] + run
    return starts + base, ends + base


def _bitmap_intervals(runs: _Runs, size: int) -> tuple[np.ndarray, np.ndarray]:
    bits = _bitmap(list(runs.dims) + [(runs.run, 1)], size)
    edges = np.flatnonzero(bits[1:] != bits[:-1]) + 1
    cuts = np.concatenate(([0], edges, [size]))
    return cuts[:-1:2] + runs.base, cuts[1::2] + runs.base


def _all_points(dims: Sequence[Dim]) -> np.ndarray:
    """G's points in row-major order of `dims`, duplicates kept."""
    points = np.zeros(1, dtype=np.int64)
    for n, s in dims:
        points = (points[:, None] + np.arange(n, dtype=np.int64) * s).reshape(-1)
    return points


# --- the questions ---------------------------------------------------------------------------


def is_injective(layout: Strided) -> bool:
    """True iff no two distinct elements share a byte."""
    if layout.numel <= 1:
        return True
    lo, hi = byte_span(layout)
    if layout.numel * layout.item > hi - lo:
        return False
    simple = layout.simplified()
    dims = list(zip(simple.shape, simple.strides, strict=True))
    if any(s == 0 for _, s in dims):
        return False
    if _nested(reversed(dims), layout.item):
        return True
    # A collision is an index difference d != 0 with |sum d_j s_j| < item. Split on the first
    # non-zero d_k (taken > 0 by symmetry): d_k s_k ranges over s_k + {0..n_k-2} s_k, each later
    # d_j s_j over -(n_j-1) s_j + {0..2n_j-2} s_j, so each k is one window query on a set G.
    for k, (n, s) in enumerate(dims):
        later = dims[k + 1 :]
        shift = s - sum((m - 1) * t for m, t in later)
        query = [(n - 1, s)] + [(2 * m - 1, t) for m, t in later]
        if _hits(query, 1 - layout.item - shift, layout.item - shift):
            return False
    return True


def touches(layout: Strided, spans: Sequence[tuple[int, int]]) -> bool:
    """Some addressed byte lies in one of the half-open spans."""
    runs = _runs_of(layout)
    return runs is not None and any(_touches(runs, lo, hi) for lo, hi in _merge_spans(spans))


def inside(layout: Strided, spans: Sequence[tuple[int, int]]) -> bool:
    """Every addressed byte lies in the union of the half-open spans."""
    runs = _runs_of(layout)
    if runs is None:
        return True
    return not any(_touches(runs, lo, hi) for lo, hi in _gaps(runs.span, _merge_spans(spans)))


def overlaps(a: Strided, b: Strided) -> bool:
    """The two layouts share at least one byte."""
    ra, rb = _runs_of(a), _runs_of(b)
    return ra is not None and rb is not None and _overlap(ra, rb)


def same_bytes(a: Strided, b: Strided) -> bool:
    """The two layouts address exactly the same set of bytes."""
    ra, rb = _runs_of(a), _runs_of(b)
    if ra is None or rb is None:
        return ra is None and rb is None
    if ra.span != rb.span:
        return False
    if ra.nested and rb.nested:
        return ra == rb
    for small, big in ((ra, rb), (rb, ra)):
        if big.nested and not _subset_of_nested(small, big):
            return False
        if small.nested and small.count > big.most:
            return False
    starts_a, ends_a = _intervals(ra)
    starts_b, ends_b = _intervals(rb)
    return np.array_equal(starts_a, starts_b) and np.array_equal(ends_a, ends_b)


# --- run form --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Runs:
    """The byte set base + G + [0, run), G = {sum i*s : 0 <= i < size} over `dims`.

    Canonical: strides descending, every size >= 2, every stride > run, and no two dims whose
    points interleave without gaps (see _merge_sets).
    """

    base: int
    dims: tuple[Dim, ...]
    run: int

    @property
    def top(self) -> int:
        return sum((n - 1) * s for n, s in self.dims)

    @property
    def span(self) -> tuple[int, int]:
        return self.base, self.base + self.top + self.run

    @property
    def nested(self) -> bool:
        return _nested(reversed(self.dims), self.run)

    @property
    def most(self) -> int:
        """Upper bound on the byte count (exact when nested)."""
        return math.prod(n for n, _ in self.dims) * self.run

    @property
    def count(self) -> int:
        assert self.nested
        return self.most


def _runs_of(layout: Strided) -> _Runs | None:
    if layout.numel == 0:
        return None
    return _canonical(layout.offset, zip(layout.shape, layout.strides, strict=True), layout.item)


def _flip(base: int, dims: Iterable[Dim]) -> tuple[int, list[Dim]]:
    """Drop size-1 dims and make strides non-negative, moving the base to the lowest start."""
    out = []
    for n, s in dims:
        if n == 1:
            continue
        if s < 0:
            base += (n - 1) * s
            s = -s
        out.append((n, s))
    return base, out


def _canonical(base: int, dims: Iterable[Dim], run: int) -> _Runs:
    base, rest = _flip(base, dims)
    rest.sort(key=lambda d: d[1])
    while rest and rest[0][1] <= run:  # copies of the run overlap or abut: still one run
        n, s = rest.pop(0)
        run += (n - 1) * s
    rest = _merge_sets(rest)
    return _Runs(base, tuple(sorted(rest, key=lambda d: -d[1])), run)


def _merge_sets(dims: list[Dim]) -> list[Dim]:
    """Merge dims (n, s), (m, c*s) with c <= n: their points are the multiples 0..(n-1)+(m-1)c of s."""
    dims = sorted(dims, key=lambda d: d[1])
    merged = True
    while merged:
        merged = False
        for i in range(len(dims)):
            n, s = dims[i]
            j = next((j for j in range(i + 1, len(dims)) if dims[j][1] % s == 0 and dims[j][1] // s <= n), None)
            if j is not None:
                m, t = dims.pop(j)
                dims[i] = (n + (m - 1) * (t // s), s)
                merged = True
                break
    return dims


def _nested(ascending: Iterable[Dim], extent: int) -> bool:
    for n, s in ascending:
        if s < extent:
            return False
        extent += (n - 1) * s
    return True


# --- set questions on run forms --------------------------------------------------------------


def _merge_spans(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted((operator.index(lo), operator.index(hi)) for lo, hi in spans):
        if hi < lo:
            raise ValueError(f"span ({lo}, {hi}) ends before it starts")
        if lo == hi:
            continue
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _gaps(span: tuple[int, int], merged: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `span` outside the merged spans."""
    gaps, cursor = [], span[0]
    for lo, hi in merged:
        if lo > cursor:
            gaps.append((cursor, min(lo, span[1])))
        cursor = max(cursor, hi)
    if cursor < span[1]:
        gaps.append((cursor, span[1]))
    return [(lo, hi) for lo, hi in gaps if lo < hi]


def _touches(runs: _Runs, lo: int, hi: int) -> bool:
    # A run starting at p meets [lo, hi) iff lo - run < p < hi.
    return _hits(runs.dims, lo - runs.run + 1 - runs.base, hi - runs.base)


def _overlap(a: _Runs, b: _Runs) -> bool:
    # g - h must land in (c - run_a, c + run_b), c = base_b - base_a; -h = h' - top_b with h' in G_b.
    if a.span[1] <= b.span[0] or b.span[1] <= a.span[0]:
        return False
    c = b.base - a.base
    return _hits(a.dims + b.dims, c - a.run + 1 + b.top, c + b.run + b.top)


def _subset_of_nested(small: _Runs, big: _Runs) -> bool:
    """small is inside nested big: within its span and clear of its gaps (each gap family is a nested run form)."""
    if small.span[0] < big.span[0] or small.span[1] > big.span[1]:
        return False
    ascending = list(reversed(big.dims))
    extent = big.run
    for k, (n, s) in enumerate(ascending):
        if s > extent:
            gap = _canonical(big.base + extent, [(n - 1, s)] + ascending[k + 1 :], s - extent)
            if _overlap(small, gap):
                return False
        extent += (n - 1) * s
    return True


def _hits(dims: Sequence[Dim], lo: int, hi: int) -> bool:
    """Does G = {sum i*s} (strides >= 0) have a point in [lo, hi)? Same as: hi - 1 in G + [0, hi - lo)."""
    if hi <= lo:
        return False
    return _contains(_canonical(0, dims, hi - lo), hi - 1)


def _contains(runs: _Runs, x: int) -> bool:
    x -= runs.base
    if x < 0 or x >= runs.top + runs.run:
        return False
    try:
        return _Search(runs.dims, runs.run).find(0, x)
    except _OutOfBudget:
        return _contains_by_listing(runs.dims, runs.run, x)


class _Search:
    """Is x in G + [0, run)? Dims are canonical (strides descending, all > run)."""

    def __init__(self, dims: tuple[Dim, ...], run: int) -> None:
        self.dims = dims
        self.run = run
        reach = [run]
        for n, s in reversed(dims):
            reach.append(reach[-1] + (n - 1) * s)
        self.reach = reach[::-1]  # reach[k]: extent of dims[k:] plus the run
        self.failed: set[tuple[int, int]] = set()
        self.nodes = 0

    def find(self, k: int, x: int) -> bool:
        if x < 0 or x >= self.reach[k]:
            return False
        left = len(self.dims) - k
        if left == 0:
            return True
        if left == 1:
            n, s = self.dims[k]
            return x - min(x // s, n - 1) * s < self.run
        if left == 2:
            return _two_dims(*self.dims[k], *self.dims[k + 1], self.run, x)
        if (k, x) in self.failed:
            return False
        n, s = self.dims[k]
        # Block i can hold x only if i*s <= x < i*s + reach[k+1]: one block when nested.
        for i in range(min(n - 1, x // s), max(0, _ceil_div(x - self.reach[k + 1] + 1, s)) - 1, -1):
            self.nodes += 1
            if self.nodes > SEARCH_BUDGET:
                raise _OutOfBudget
            if self.find(k + 1, x - i * s):
                return True
        self.failed.add((k, x))
        return False


def _two_dims(n: int, s: int, m: int, t: int, w: int, x: int) -> bool:
    """Is there i < n, j < m with 0 <= x - i*s - j*t < w (s, t, w > 0)?"""
    top = (m - 1) * t
    # Where x - i*s >= top the best j is m - 1.
    i = max(0, _ceil_div(x - top - w + 1, s))
    if i < n and i * s <= x - top:
        return True
    # Where 0 <= x - i*s < top the best j leaves (x - i*s) mod t, which must be < w.
    first, last = max(0, _ceil_div(x - top + 1, s)), min(n - 1, x // s)
    if first > last:
        return False
    if w >= t:
        return True
    y = _first_mod_in((-s) % t, (x - first * s) % t, t, 0, w - 1)
    return y is not None and y <= last - first


def _first_mod_in(a: int, b: int, m: int, lo: int, hi: int) -> int | None:
    """Smallest y >= 0 with lo <= (a*y + b) mod m <= hi (0 <= lo <= hi < m), or None."""
    a, b = a % m, b % m
    lo, hi = (lo - b) % m, (hi - b) % m
    if lo > hi:  # the window wraps through 0, which y = 0 reaches
        return 0
    return _first_multiple_in(a, m, lo, hi)


def _first_multiple_in(a: int, m: int, lo: int, hi: int) -> int | None:
    """Smallest y >= 0 with lo <= (a*y) mod m <= hi, for 0 <= a < m and 0 <= lo <= hi < m, or None."""
    if lo == 0:
        return 0
    if a == 0:
        return None
    y = _ceil_div(lo, a)
    if a * y <= hi:
        return y
    # No multiple of a in [lo, hi]: a*y = k*m + v with v in [lo, hi] and k >= 1, which needs
    # (k*m) mod a in [a - hi mod a, a - lo mod a]. The smallest such k gives the smallest y.
    k = _first_multiple_in(m % a, a, a - hi % a, a - lo % a)
    return None if k is None else _ceil_div(k * m + lo, a)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- fallbacks -------------------------------------------------------------------------------


def _contains_by_listing(dims: tuple[Dim, ...], run: int, x: int) -> bool:
    """x in G + [0, run) by listing G's points, or by a bitmap of its points up to x."""
    points = _points(dims)
    if points is not None:
        return bool(np.any((points <= x) & (points > x - run)))
    g = math.gcd(*(s for _, s in dims))
    if x // g < BITMAP_LIMIT:
        reached = _bitmap([(n, s // g) for n, s in dims], x // g + 1)
        return bool(reached[max(0, (x - run) // g + 1) :].any())
    raise Undecidable(f"point {x} in a non-nested set of {math.prod(n for n, _ in dims)} starts with dims {dims} and run {run}")


def _intervals(runs: _Runs) -> tuple[np.ndarray, np.ndarray]:
    """Maximal byte intervals [starts, ends) of a run form, by listing its starts or by a bitmap."""
    points = _points(runs.dims)
    if points is not None:
        return _joined(np.unique(points), runs.run, runs.base)
    size = runs.top + runs.run
    if size <= BITMAP_LIMIT:
        return _bitmap_intervals(runs, size)
    raise Undecidable(f"comparing a non-nested byte set of {math.prod(n for n, _ in runs.dims)} runs over {size} bytes")


def _points(dims: Sequence[Dim]) -> np.ndarray | None:
    if math.prod(n for n, _ in dims) > ENUM_LIMIT or sum((n - 1) * s for n, s in dims) >= 1 << 62:
        return None
    return _all_points(dims)


def _bitmap(dims: Sequence[Dim], length: int) -> np.ndarray:
    """Which of 0..length-1 are points of G."""
    bits = np.zeros(length, dtype=bool)
    bits[0] = True
    for n, s in dims:
        if s:
            bits = _spread(bits, min(n, (length - 1) // s + 1), s)
    return bits


def _spread(bits: np.ndarray, n: int, s: int) -> np.ndarray:
    """OR of bits shifted by 0, s, ..., (n-1)*s, by doubling."""
    out = np.zeros_like(bits)
    block, width, done = bits.copy(), 1, 0  # block = OR of shifts 0 .. width-1 (times s)
    while n:
        if n & 1:
            _or_shifted(out, block, done * s)
            done += width
        n >>= 1
        if n:
            _or_shifted(block, block.copy(), width * s)
            width *= 2
    return out


def _or_shifted(dst: np.ndarray, src: np.ndarray, shift: int) -> None:
    if shift < len(dst):
        dst[shift:] |= src[: len(dst) - shift]
