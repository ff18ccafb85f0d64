"""oracles/touch.py as intervals: the set arithmetic of Spans against Python sets, and the block byte sets of drawn cases
against the per-byte listing they replace (every element's bytes, from the views' full offset tables)."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzz.space import Rejected, draw_indexed
from oracles import expect, touch
from oracles.contract import SHAPED_022
from oracles.expectation import Expectation, ViewExpectation
from oracles.touch import Spans
from tests.conftest import synthetic_info

# --- Spans against Python sets -------------------------------------------------------------------

intervals = st.lists(st.tuples(st.integers(0, 120), st.integers(0, 12)).map(lambda t: (t[0], t[0] + t[1])), max_size=8)


def spans(pairs: list[tuple[int, int]]) -> Spans:
    return Spans.of([a for a, _ in pairs], [b for _, b in pairs])


def members(pairs: list[tuple[int, int]]) -> set[int]:
    return {x for a, b in pairs for x in range(a, b)}


def listed(found: Spans) -> list[int]:
    return np.asarray(found).tolist()


@settings(max_examples=500, deadline=None)
@given(a=intervals, b=intervals, points=st.lists(st.integers(-5, 140), max_size=10))
def test_spans_match_sets(a, b, points):
    left, right, set_a, set_b = spans(a), spans(b), members(a), members(b)
    assert listed(left) == sorted(set_a)
    assert (left.ends[:-1] < left.starts[1:]).all() and (left.starts < left.ends).all()  # canonical: apart and non-empty
    assert listed(left | right) == sorted(set_a | set_b)
    assert listed(left - right) == sorted(set_a - set_b)
    assert listed(left & right) == sorted(set_a & set_b)
    assert (left == right) == (set_a == set_b)
    assert left.count == len(set_a) and bool(left) == bool(set_a)
    assert left.within(right) == (set_a <= set_b)
    assert left.holds(np.array(points, dtype=np.int64)).tolist() == [p in set_a for p in points]
    if set_a:
        assert left.first == min(set_a)


def test_byte_set_helpers_leave_out_empty_buffers():
    a = {0: spans([(0, 10)]), 1: spans([(5, 6)])}
    b = {1: spans([(0, 8)]), 2: spans([(3, 4)])}
    assert touch.minus(a, b) == {0: spans([(0, 10)])}
    assert touch.union(a, b) == {0: spans([(0, 10)]), 1: spans([(0, 8)]), 2: spans([(3, 4)])}
    assert touch.count(a) == 11 and touch.meets(a, b) and not touch.meets(b, {0: spans([(0, 99)])})


# --- drawn cases against the per-byte listing ---------------------------------------------------


def reference_block_starts(view: ViewExpectation, block: int) -> np.ndarray:
    offsets = view.element_offsets(owned_only=False).reshape(view.shape)
    return np.take(offsets, touch.kernel_rows(view, block), axis=view.block_axis).reshape(-1)


def element_bytes(starts: np.ndarray, size: int) -> np.ndarray:
    return (starts[:, None] + np.arange(size, dtype=np.int64)[None, :]).reshape(-1)


def reference_owned(expected: Expectation, layers: list[str], block: int) -> dict[int, np.ndarray]:
    parts: dict[int, list[np.ndarray]] = {}
    for name in layers:
        for view in expected.layers[name].views:
            parts.setdefault(view.buffer, []).append(element_bytes(reference_block_starts(view, block), view.element_size))
    return {buffer: np.unique(np.concatenate(items)) for buffer, items in parts.items()}


def same_sets(got: touch.Bytes, want: dict[int, np.ndarray]) -> bool:
    want = {buffer: offsets for buffer, offsets in want.items() if offsets.size}
    return got.keys() == want.keys() and all(np.array_equal(got[buffer], want[buffer]) for buffer in want)


def drawn_expectations(count: int):
    shapes = {"A": ("B", 2, "T", "H", "D"), "M": ("B", "T", "D")}
    placed = synthetic_info()
    shaped = dataclasses.replace(synthetic_info(SHAPED_022, ("NHD", "HND")),
                                 spec_kinds=tuple(k for k in placed.spec_kinds if k != "encoder_only"))
    for index in range(count):
        info = (placed, shaped)[index % 2]
        try:
            case = draw_indexed(info, 33, index)
        except Rejected:
            continue
        if info is shaped:
            case = dataclasses.replace(case, groups=tuple(
                dataclasses.replace(g, declared_shape=shapes[g.backend]) if g.backend else g for g in case.groups))
        expected = expect(case, info.contract)
        if expected.accepted and sum(expected.buffers) <= 1 << 18:
            yield case, expected


def test_block_bytes_match_the_per_byte_listing():
    checked = 0
    for case, expected in drawn_expectations(160):
        layers = touch.cache_layers(expected)
        for block in sorted({0, min(1, case.num_blocks - 1), case.num_blocks - 1}):
            for chosen in [layers, layers[:1]]:
                assert same_sets(touch.owned(expected, chosen, block), reference_owned(expected, chosen, block))
            tile = touch.tile(case, expected, block)
            assert touch.minus(touch.owned(expected, layers, block), tile) == {}  # a block's elements lie in its tile
            dst = (block + 1) % case.num_blocks
            for buffer, (targets, sources) in touch.copy_map(expected, layers, block, dst).items():
                views = [v for name in layers for v in expected.layers[name].views if v.buffer == buffer]
                for got, which in ((targets, dst), (sources, block)):
                    want = [element_bytes(reference_block_starts(v, which), v.element_size) for v in views]
                    assert np.array_equal(got, np.concatenate(want))
        checked += 1
    assert checked > 40


def test_token_maps_match_the_per_byte_listing():
    checked = 0
    for case, expected in drawn_expectations(160):
        for layer in touch.cache_layers(expected):
            spec = case.groups[expected.layers[layer].group].spec
            if spec.kind == "mamba":
                continue  # no tokens: the cache writes the kernel probe drives are attention's
            try:
                got = touch.token_map(case, expected, layer, case.num_blocks - 1, 0, spec.is_mla)
            except IndexError:
                continue  # dims the token map reads past the view (compressed MLA), as numpy indexing the listed view did
            if got is None:
                continue
            view = expected.layers[layer].views[0]
            block = np.take(view.element_offsets(owned_only=False).reshape(view.shape),
                            touch.kernel_rows(view, case.num_blocks - 1), axis=view.block_axis)
            assert np.array_equal(got.block_bytes, np.unique(element_bytes(block.reshape(-1), view.element_size)))
            group = case.groups[expected.layers[layer].group]
            owner = dict(case.kv_sharing).get(layer, layer)
            group = group.of_layer(group.layers.index(owner))
            axes = touch._axes(group, len(view.shape))
            assert axes is not None
            for head, allowed in got.head_bytes.items():
                rows = block if "H" not in axes else np.take(block, [head], axis=axes.index("H"))
                assert np.array_equal(allowed, np.unique(element_bytes(rows.reshape(-1), view.element_size)))
            if got.offsets is not None:
                assert got.block_bytes.holds(got.offsets).all()
            full = view.element_offsets(owned_only=False).reshape(view.shape)
            sampled = np.unravel_index(np.linspace(0, full.size - 1, 50).astype(np.int64), view.shape)
            assert np.array_equal(touch._element_offsets(view, [axis.astype(np.int64) for axis in sampled]), full[sampled])
            checked += 1
    assert checked > 20
