"""oracles.strided: hand cases, agreement with a brute-force reference, fallbacks, production sizes."""

from __future__ import annotations

import contextlib
import itertools
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oracles import strided
from oracles.strided import (
    Strided,
    Undecidable,
    byte_addresses,
    byte_span,
    describe,
    element_starts,
    inside,
    intervals,
    is_injective,
    overlaps,
    same_bytes,
    sub_layout,
    touches,
)

# --- brute-force reference, independent of the module --------------------------------------------


def ref_starts(layout: Strided) -> list[int]:
    indices = itertools.product(*map(range, layout.shape))
    return [layout.offset + sum(i * s for i, s in zip(index, layout.strides, strict=True)) for index in indices]


def ref_bytes(layout: Strided) -> set[int]:
    return {start + r for start in ref_starts(layout) for r in range(layout.item)}


def ref_injective(layout: Strided) -> bool:
    return len(ref_bytes(layout)) == layout.numel * layout.item


def ref_in_spans(addresses: set[int], spans) -> np.ndarray:
    values = np.array(sorted(addresses), dtype=np.int64)
    hit = np.zeros(len(values), dtype=bool)
    for lo, hi in spans:
        hit |= (values >= lo) & (values < hi)
    return hit


# --- hand cases ----------------------------------------------------------------------------------


def test_contiguous_bf16():
    layout = Strided((4, 2, 16, 128), (8192, 4096, 256, 2), 0, 2)
    assert layout.numel == 4 * 2 * 16 * 128
    assert byte_span(layout) == (0, 4 * 8192)
    assert is_injective(layout)
    assert inside(layout, [(0, 4 * 8192)])
    assert not inside(layout, [(0, 4 * 8192 - 1)])
    assert same_bytes(layout, Strided((4 * 8192,), (1,), 0, 1))
    assert layout.simplified() == Strided((4 * 2 * 16 * 128,), (2,), 0, 2)


def test_nhd_permuted_strides():
    layout = Strided((4, 2, 16, 128), (8192, 256, 512, 2), 0, 2)
    assert describe(layout) == "shape (4, 2, 16, 128) bytes-strides (8192, 256, 512, 2) offset 0 item 2"
    assert is_injective(layout)
    assert same_bytes(layout, Strided((4, 16, 2, 128), (8192, 512, 256, 2), 0, 2))
    assert layout.simplified() == Strided((4 * 2 * 16 * 128,), (2,), 0, 2)


def test_padded_page_gaps():
    # 584-byte pages in a 1728-byte block pitch: the bytes between pages are never addressed.
    layout = Strided((4, 584), (1728, 1), 0, 1)
    assert byte_span(layout) == (0, 3 * 1728 + 584)
    assert is_injective(layout)
    assert inside(layout, [(b * 1728, b * 1728 + 584) for b in range(4)])
    assert not inside(layout, [(b * 1728, b * 1728 + 584) for b in range(3)])
    assert not touches(layout, [(584, 1728), (1728 + 584, 2 * 1728)])
    assert touches(layout, [(583, 584)])
    assert not overlaps(layout, Strided((4, 584), (1728, 1), 584, 1))
    assert overlaps(layout, Strided((4, 584), (1728, 1), 583, 1))
    assert not same_bytes(layout, Strided((3 * 1728 + 584,), (1,), 0, 1))


def test_kv_first_layout():
    blocks, half = 6, 16 * 8 * 128 * 2
    kv = Strided((2, blocks, 16, 8, 128), (blocks * half, half, 8 * 128 * 2, 128 * 2, 2), 0, 2)
    assert is_injective(kv)
    assert same_bytes(kv, Strided((2 * blocks * half,), (1,), 0, 1))
    block = sub_layout(kv, 1, 3)
    assert same_bytes(block, Strided((2, half), (blocks * half, 1), 3 * half, 1))
    assert inside(block, [(3 * half, 4 * half), ((blocks + 3) * half, (blocks + 4) * half)])
    assert not inside(block, [(3 * half, 4 * half)])
    assert not touches(block, [(0, 3 * half), (4 * half, (blocks + 3) * half)])


def test_layer_interleaved_pages():
    # Two layers share each 2048-byte block pitch: layer 0 at byte 0, layer 1 at byte 1024.
    layer0 = Strided((8, 2, 512), (2048, 512, 1), 0, 1)
    layer1 = sub_layout(Strided((2, 8, 2, 512), (1024, 2048, 512, 1), 0, 1), 0, 1)
    assert not overlaps(layer0, layer1)
    assert overlaps(layer0, sub_layout(Strided((2, 8, 2, 512), (1023, 2048, 512, 1), 0, 1), 0, 1))
    assert same_bytes(layer0, Strided((8, 1024), (2048, 1), 0, 1))


def test_broadcast_is_not_injective():
    layout = Strided((3, 4), (0, 2), 0, 2)
    assert not is_injective(layout)
    assert same_bytes(layout, Strided((8,), (1,), 0, 1))
    assert is_injective(Strided((1, 4), (0, 2), 0, 2))


def test_size_zero_dim():
    layout = Strided((3, 0, 4), (64, 16, 2), 10, 2)
    assert layout.numel == 0
    assert byte_span(layout) == (10, 10)
    assert is_injective(layout)
    assert inside(layout, [])
    assert not touches(layout, [(0, 100)])
    assert not overlaps(layout, Strided((100,), (1,), 0, 1))
    assert same_bytes(layout, Strided((0,), (1,), 0, 1))
    assert not same_bytes(layout, Strided((1,), (1,), 0, 1))
    assert element_starts(layout).size == 0
    assert layout.simplified().numel == 0


def test_non_nested_strides():
    # Starts 0, 2, 3, 5: no stride ordering nests, yet the elements are distinct.
    layout = Strided((2, 2), (3, 2), 0, 1)
    assert sorted(element_starts(layout).tolist()) == [0, 2, 3, 5]
    assert is_injective(layout)
    assert not is_injective(Strided((2, 2), (3, 2), 0, 2))
    assert inside(layout, [(0, 1), (2, 4), (5, 6)])
    assert not inside(layout, [(0, 1), (2, 4)])
    assert not touches(layout, [(1, 2), (4, 5), (6, 100)])
    assert same_bytes(Strided((2, 2), (3, 2), 0, 2), Strided((7,), (1,), 0, 1))


def test_overlapping_items():
    assert not is_injective(Strided((4,), (1,), 0, 2))
    assert is_injective(Strided((4,), (2,), 0, 2))
    assert same_bytes(Strided((4,), (1,), 0, 2), Strided((5,), (1,), 0, 1))


def test_negative_strides():
    layout = Strided((3, 2), (-8, 1), 16, 1)
    assert element_starts(layout).tolist() == [16, 17, 8, 9, 0, 1]
    assert byte_span(layout) == (0, 18)
    assert layout.simplified() == Strided((3, 2), (8, 1), 0, 1)
    assert same_bytes(layout, Strided((3, 2), (8, 1), 0, 1))
    with pytest.raises(ValueError):
        Strided((3,), (-8,), 8, 1)


def test_validation():
    with pytest.raises(ValueError):
        Strided((2,), (1, 1), 0, 1)
    with pytest.raises(ValueError):
        Strided((2,), (1,), -1, 1)
    with pytest.raises(ValueError):
        Strided((2,), (1,), 0, 0)
    with pytest.raises(ValueError):
        Strided((-1,), (1,), 0, 1)
    with pytest.raises(ValueError):
        touches(Strided((2,), (1,), 0, 1), [(5, 4)])
    with pytest.raises(IndexError):
        sub_layout(Strided((2,), (1,), 0, 1), 0, 2)


def test_simplified_merges_and_sorts():
    layout = Strided((2, 1, 3, 4), (4, 99, 16, 1), 5, 1)
    assert layout.simplified() == Strided((3, 8), (16, 1), 5, 1)
    assert Strided((4, 5), (0, 0), 3, 2).simplified() == Strided((20,), (0,), 3, 2)
    assert Strided((1, 1), (7, 9), 3, 2).simplified() == Strided((), (), 3, 2)


def test_byte_addresses_order():
    assert byte_addresses(Strided((2, 2), (10, 3), 1, 2)).tolist() == [1, 2, 4, 5, 11, 12, 14, 15]


# --- agreement with the reference ------------------------------------------------------------------


@st.composite
def layouts(draw) -> Strided:
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(0, 5)) for _ in range(ndim))
    item = draw(st.integers(1, 4))
    kind = draw(st.sampled_from(["random", "random", "nested", "negative"]))
    if kind == "nested":
        # Strides that nest in a random order, each with a little padding.
        strides = [0] * ndim
        extent = item
        for d in draw(st.permutations(range(ndim))):
            strides[d] = extent + draw(st.integers(0, 3))
            extent = strides[d] * max(shape[d] - 1, 0) + extent
    elif kind == "negative":
        strides = [draw(st.integers(-40, 40)) for _ in range(ndim)]
    else:
        strides = [draw(st.integers(0, 40)) for _ in range(ndim)]
    offset = draw(st.integers(0, 20))
    offset += sum((n - 1) * -s for n, s in zip(shape, strides, strict=True) if s < 0 and n > 0)
    return Strided(shape, tuple(strides), offset, item)


spans_strategy = st.lists(st.tuples(st.integers(0, 400), st.integers(0, 40)).map(lambda t: (t[0], t[0] + t[1])), max_size=4)


def equal_byte_variants(layout: Strided, data) -> list[Strided]:
    """Other descriptions of the same bytes: the item as a dim, permuted dims, a split dim, the simplified form."""
    variants = [Strided(layout.shape + (layout.item,), layout.strides + (1,), layout.offset, 1), layout.simplified()]
    order = data.draw(st.permutations(range(layout.ndim)))
    variants.append(Strided(tuple(layout.shape[d] for d in order), tuple(layout.strides[d] for d in order), layout.offset, layout.item))
    splittable = [d for d in range(layout.ndim) if layout.shape[d] in (4,)]
    if splittable:
        d = splittable[0]
        shape = layout.shape[:d] + (2, 2) + layout.shape[d + 1 :]
        strides = layout.strides[:d] + (2 * layout.strides[d], layout.strides[d]) + layout.strides[d + 1 :]
        variants.append(Strided(shape, strides, layout.offset, layout.item))
    return variants


def same_span_layouts(addresses: set[int]) -> list[Strided]:
    """Layouts over the same span as `addresses`: the hull, its two end bytes, and evenly spaced equal runs if the bytes form them."""
    lo, hi = min(addresses), max(addresses) + 1
    found = [Strided((hi - lo,), (1,), lo, 1)]
    if hi - lo > 1:
        found.append(Strided((2,), (hi - lo - 1,), lo, 1))
    values = sorted(addresses)
    breaks = [i for i in range(1, len(values)) if values[i] > values[i - 1] + 1]
    starts = [values[0]] + [values[i] for i in breaks]
    lengths = {b - a for a, b in zip([0] + breaks, breaks + [len(values)], strict=True)}
    pitches = {b - a for a, b in itertools.pairwise(starts)}
    if len(starts) > 1 and len(lengths) == 1 and len(pitches) == 1:
        found.append(Strided((len(starts), lengths.pop()), (pitches.pop(), 1), lo, 1))
    return found


def check_against_reference(a: Strided, b: Strided, spans, data) -> None:
    starts_a, bytes_a, bytes_b = ref_starts(a), ref_bytes(a), ref_bytes(b)
    assert element_starts(a).tolist() == starts_a
    assert byte_addresses(a).tolist() == [start + r for start in starts_a for r in range(a.item)]
    assert byte_span(a) == ((min(bytes_a), max(bytes_a) + 1) if bytes_a else (a.offset, a.offset))
    assert is_injective(a) == ref_injective(a)
    assert overlaps(a, b) == bool(bytes_a & bytes_b)
    assert same_bytes(a, b) == (bytes_a == bytes_b)
    hit = ref_in_spans(bytes_a, spans)
    assert inside(a, spans) == bool(hit.all())
    assert touches(a, spans) == bool(hit.any())
    dropped = data.draw(st.integers(-1, len(starts_a) - 1))
    kept = [(s, s + a.item) for i, s in enumerate(starts_a) if i != dropped]
    assert inside(a, kept) == bool(ref_in_spans(bytes_a, kept).all())
    simple = a.simplified()
    assert sorted(ref_starts(simple)) == sorted(starts_a)
    assert all(n > 1 for n in simple.shape) or simple.numel <= 1
    assert list(simple.strides) == sorted(simple.strides, reverse=True)
    for variant in equal_byte_variants(a, data):
        assert same_bytes(a, variant) and same_bytes(variant, a)
        assert overlaps(a, variant) == bool(bytes_a)
    for other in same_span_layouts(bytes_a) if bytes_a else []:
        assert same_bytes(a, other) == same_bytes(other, a) == (bytes_a == ref_bytes(other))
    if a.numel:
        axis = data.draw(st.integers(-a.ndim, a.ndim - 1))
        if a.shape[axis]:
            index = data.draw(st.integers(0, a.shape[axis] - 1))
            part = sub_layout(a, axis, index)
            expected = [s for idx, s in zip(itertools.product(*map(range, a.shape)), starts_a, strict=True) if idx[axis] == index]
            assert ref_starts(part) == expected
            assert inside(part, [(s, s + a.item) for s in expected])
            assert overlaps(part, a)


@settings(max_examples=1200, deadline=None)
@given(a=layouts(), b=layouts(), spans=spans_strategy, data=st.data())
def test_matches_enumeration(a, b, spans, data):
    check_against_reference(a, b, spans, data)


@settings(max_examples=400, deadline=None)
@given(a=layouts(), b=layouts(), spans=spans_strategy, data=st.data())
def test_listing_fallback_matches_enumeration(a, b, spans, data):
    with mock.patch.object(strided, "SEARCH_BUDGET", 0):
        check_against_reference(a, b, spans, data)


@settings(max_examples=400, deadline=None)
@given(a=layouts(), b=layouts(), spans=spans_strategy, data=st.data())
def test_bitmap_fallback_matches_enumeration(a, b, spans, data):
    with mock.patch.object(strided, "SEARCH_BUDGET", 0), mock.patch.object(strided, "ENUM_LIMIT", 0):
        check_against_reference(a, b, spans, data)


def ref_intervals(layout: Strided) -> list[tuple[int, int]]:
    values = np.unique(byte_addresses(layout))
    breaks = np.flatnonzero(np.diff(values) != 1)
    return list(zip(np.concatenate((values[:1], values[breaks + 1])).tolist(), np.concatenate((values[breaks] + 1, values[-1:] + 1)).tolist(),
                    strict=True))


@settings(max_examples=2000, deadline=None)
@given(a=layouts())
def test_intervals_match_enumeration(a):
    want = ref_intervals(a)
    starts, ends = intervals(a)
    assert starts.dtype == ends.dtype == np.int64
    assert list(zip(starts.tolist(), ends.tolist(), strict=True)) == want
    runs = strided._runs_of(a)
    if runs is not None:  # the bitmap way, taken by forms whose runs are many against their span
        starts, ends = strided._bitmap_intervals(runs, runs.top + runs.run)
        assert list(zip(starts.tolist(), ends.tolist(), strict=True)) == want


def test_intervals_list_runs_not_bytes():
    # 512 MiB in 4 KiB pages 8 KiB apart (twice, 1 GiB apart): 131072 intervals, found without listing a byte.
    layout = Strided((2, 65536, 4096), (1 << 30, 8192, 1), 0, 1)
    starts, ends = intervals(layout)
    assert starts.size == 2 * 65536 and int(ends[-1]) == (1 << 30) + 65535 * 8192 + 4096
    assert intervals(Strided((1 << 40,), (2,), 0, 2))[1].tolist() == [1 << 41]
    assert [a.size for a in intervals(Strided((0, 3), (5, 1), 7, 2))] == [0, 0]


@settings(max_examples=1000, deadline=None)
@given(a=st.integers(0, 80), b=st.integers(0, 80), m=st.integers(1, 60), lo=st.integers(0, 59), width=st.integers(0, 59))
def test_first_mod_in_range(a, b, m, lo, width):
    lo %= m
    hi = min(m - 1, lo + width)
    expected = next((y for y in range(m + 1) if lo <= (a * y + b) % m <= hi), None)
    assert strided._first_mod_in(a, b, m, lo, hi) == expected


def test_undecidable_past_every_limit():
    layout = Strided((1000, 1000, 1000), (1_000_003, 1001, 1000), 0, 1)
    other = Strided((1000, 1000), (999_999, 997), 17, 1)
    no_limits = (mock.patch.object(strided, name, 0) for name in ("SEARCH_BUDGET", "ENUM_LIMIT", "BITMAP_LIMIT"))
    with contextlib.ExitStack() as stack:
        for patch in no_limits:
            stack.enter_context(patch)
        with pytest.raises(Undecidable):
            overlaps(layout, other)
        with pytest.raises(Undecidable):
            same_bytes(Strided((10**6, 10**6), (3, 2), 0, 1), Strided((5 * 10**6 - 4,), (1,), 0, 1))
        assert is_injective(Strided((30819, 2, 16, 8, 128), (65536, 32768, 2048, 256, 2), 0, 2))
        # Still decided: the odd bytes of 3i + 2j fall in the one-byte gaps of the even bytes.
        assert not same_bytes(Strided((10**6 + 1, 10**6 + 1), (3, 2), 0, 1), Strided((2_500_001,), (2,), 0, 1))


def test_large_non_nested_is_exact():
    # 3i + 2j covers every integer from 2 to the top, but not 1 (and not top - 1).
    layout = Strided((10**6, 10**6), (3, 2), 0, 1)
    assert not is_injective(layout)
    assert touches(layout, [(2, 3)]) and not touches(layout, [(1, 2)])
    assert not same_bytes(layout, Strided((5 * 10**6 - 4,), (1,), 0, 1))
    assert not is_injective(Strided((1000, 1000, 1000), (1_000_003, 1001, 1000), 0, 1))
    assert is_injective(Strided((1000, 1000), (1001, 1000), 0, 1))


# --- production sizes (must simply return; nothing is enumerated) ------------------------------


@pytest.mark.parametrize("kv_stride, in_bounds", [(584, True), (600, False)])
def test_production_page_sized_layout(kv_stride, in_bounds):
    blocks, pitch, page = 30819, 1728, 1168
    layout = Strided((blocks, 1, 2, 584), (pitch, pitch, kv_stride, 1), 0, 1)
    assert byte_span(layout) == (0, (blocks - 1) * pitch + kv_stride + 584)
    assert is_injective(layout)
    pages = [(b * pitch, b * pitch + page) for b in range(blocks)]
    for block in (0, blocks - 1):
        part = sub_layout(layout, 0, block)
        assert inside(part, [pages[block]]) == in_bounds
        assert inside(part, [pages[0], pages[-1]]) == in_bounds
        assert touches(part, [pages[block]])
        assert not touches(part, [pages[block - 1]] if block else [pages[1]])
    assert inside(layout, pages) == in_bounds
    gap = kv_stride - 584
    assert not overlaps(layout, Strided((blocks, pitch - page - gap), (pitch, 1), page + gap, 1))


def test_production_huge_element_counts():
    blocks = 30819
    layout = Strided((blocks, 2, 16, 8, 128), (2 * 16 * 8 * 128 * 2, 16 * 8 * 128 * 2, 8 * 128 * 2, 128 * 2, 2), 0, 2)
    assert is_injective(layout)
    assert same_bytes(layout, Strided((blocks * 65536,), (1,), 0, 1))
    kv_first = Strided((2, blocks, 16, 8, 128), (blocks * 32768, 32768, 2048, 256, 2), 0, 2)
    assert same_bytes(layout, kv_first)
    assert not overlaps(sub_layout(kv_first, 1, 5), sub_layout(kv_first, 1, 6))
    huge = Strided((10**6, 10**5, 584), (10**9, 1728, 1), 0, 1)
    assert is_injective(huge)
    assert inside(huge, [(0, (10**6 - 1) * 10**9 + (10**5 - 1) * 1728 + 584)])
    assert not touches(huge, [(584, 1728)])
