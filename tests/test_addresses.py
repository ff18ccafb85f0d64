"""The layout-placed oracle against byte addresses enumerated by brute force from the layout letters.

The enumeration knows nothing of strides: it walks the axes [L, B, H, N, C] in the layout's
physical order, outermost first, with one running byte counter that advances one byte per
content byte. Where the contract gives an axis a pitch (a padded page, a block pitch fixed by the
allocator; oracles/contract.py), each step of that axis ends at least that many bytes after it
began. Every element's first byte must be where the oracle's strides put it, on random small
cases of every layout, padded or not, split into kernel blocks or not, one group or several, and
one group whose layers differ in heads (walked with each layer's own extents, in the contract's
run order).
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from fuzz.case import KV_CACHE_LAYOUTS, Case, GroupCase, SpecCase, SyntheticBackend
from oracles import contract as rules
from oracles import expect, pages
from oracles.contract import LAYOUT_PLACED, LAYOUT_PLACED_KERNEL_MAP
from oracles.layout_placed import AXES

Address = tuple[int, int, int, int, int]
# Small cases enumerate in microseconds: more examples than the profile's default, never fewer.
EXAMPLES = settings(max_examples=max(400, settings.default.max_examples))


def enumerate_addresses(order: str, extents: dict[str, int], pitches: dict[str, int],
                        per_layer: list[tuple[dict[str, int], dict[str, int]]] | None = None) -> dict[Address, int]:
    """Byte address of every (layer, block, head, state, byte), by walking the axes in `order` with a running counter.

    `per_layer`: layers that differ in size, in the order they are laid out: each one's own extents and pitches (for the
    axes walked inside L)."""
    addresses: dict[Address, int] = {}
    index = dict.fromkeys(AXES, 0)
    counter = 0
    inside_layer = order[order.index("L") + 1:]

    def own(axis: str, table: str) -> dict[str, int]:
        if per_layer is None or axis not in inside_layer:
            return extents if table == "extents" else pitches
        layer_extents, layer_pitches = per_layer[index["L"]]
        return layer_extents if table == "extents" else layer_pitches

    def walk(depth: int) -> None:
        nonlocal counter
        axis = order[depth]
        for i in range(own(axis, "extents")[axis]):
            index[axis] = i
            start = counter
            if depth == len(order) - 1:
                addresses[(index["L"], index["B"], index["H"], index["N"], index["C"])] = counter
                counter += 1
            else:
                walk(depth + 1)
            pitch = own(axis, "pitches").get(axis)
            if pitch is not None:
                counter = start + max(counter - start, pitch)

    walk(0)
    return addresses


def contract_pitches(case: Case, spec: SpecCase) -> dict[str, int]:
    """The pitches the contract gives a layer of `spec`: a padded page's grid axis, and the block pitch of the layout family."""
    page = pages.page(spec)
    pitches: dict[str, int] = {}
    if page.padded:
        pitches[case.layout[rules.page_grid_end(case.layout)]] = page.page_bytes
    if case.layout[0] == "B":
        group_pages = [[pages.page(s) for s in g.layer_specs] for g in case.groups]
        pitches["B"] = rules.block_outermost_pitch([sum(p.page_bytes for p in ps) for ps in group_pages],
                                                   [p.block_stride_alignment for ps in group_pages for p in ps])
    elif rules.layer_outer_pitch(page.page_bytes, page.block_stride_alignment) != page.page_bytes:
        pitches["B"] = max(pitches.get("B", 0), rules.layer_outer_pitch(page.page_bytes, page.block_stride_alignment))
    return pitches


def extents_of(case: Case, spec: SpecCase, layers: int) -> dict[str, int]:
    page = pages.page(spec)
    return {"L": layers, "B": case.num_blocks, "H": page.heads, "N": page.states, "C": page.content_bytes}


def check_layers_that_differ(case: Case, expectation, index: int) -> int:
    """A group whose layers differ in heads: the L axis walks its layers in the contract's run order (rules.same_spec_runs),
    each layer with its own heads and pitches; every element of every layer must be where the oracle puts it."""
    group = case.groups[index]
    order = [i for run in rules.same_spec_runs(group.layer_specs) for i in run]
    specs = [group.layer_specs[i] for i in order]
    per_layer = [(extents_of(case, spec, len(order)), contract_pitches(case, spec)) for spec in specs]
    outer = {**per_layer[0][1]}
    if case.layout[0] == "L":  # a layer-outer block pitch belongs to the layer: walked inside L
        outer.pop("B", None)
    addresses = enumerate_addresses(case.layout, extents_of(case, specs[0], len(order)), outer, per_layer)
    checked = 0
    for slot, position in enumerate(order):
        view = expectation.layers[group.layers[position]].views[0]
        assert view.kernel_ratio == 1
        for b in range(view.shape[0]):
            for h in range(view.shape[1]):
                for n in range(view.shape[2]):
                    for e in range(view.shape[3]):
                        got = view.byte_offset + sum(i * s for i, s in zip((b, h, n, e), view.byte_strides, strict=True))
                        assert got == addresses[(slot, b, h, n, e * view.element_size)], (group.layers[position], (b, h, n, e), case)
                        checked += 1
    return checked


def check_group(case: Case, expectation, index: int) -> int:
    """Compare every element of every layer of group `index` with the enumeration; the number of elements checked."""
    group = case.groups[index]
    if group.differs_per_layer:
        return check_layers_that_differ(case, expectation, index)
    page = pages.page(group.spec)
    extents = extents_of(case, group.spec, len(group.layers))
    pitches = contract_pitches(case, group.spec)
    manager = enumerate_addresses(case.layout, extents, pitches)
    ratio = group.spec.block_size // group.kernel_block_size
    kernel_states = page.states // ratio
    pieces = None
    checked = 0
    for layer, name in enumerate(group.layers):
        view = expectation.layers[name].views[0]
        if ratio > 1 and view.kernel_stride == ratio and pieces is None:
            # Split in place: kernel block b * ratio + j is the j-th piece of a dense page, nested like a block of its own.
            pieces = enumerate_addresses(case.layout, {**extents, "B": case.num_blocks * ratio, "N": kernel_states},
                                         {"B": pitches.get("B", page.page_bytes) // ratio})
        for k in range(view.shape[0]):
            block, piece = divmod(k, view.kernel_stride)
            if piece >= ratio:
                continue  # a gap of a packed kernel-page view: never addressed
            for h in range(view.shape[1]):
                for n in range(view.shape[2]):
                    for e in range(view.shape[3]):
                        byte = e * view.element_size
                        if ratio == 1:
                            want = manager[(layer, block, h, n, byte)]
                        elif view.kernel_stride == ratio:
                            want = pieces[(layer, k, h, n, byte)]  # type: ignore[index]
                        else:
                            want = manager[(layer, block, h, piece * kernel_states + n, byte)]
                        got = view.byte_offset + sum(i * s for i, s in zip((k, h, n, e), view.byte_strides, strict=True))
                        assert got == want, (name, (k, h, n, e), got, want, case)
                        checked += 1
    return checked


ELEMENT = {"float32": 4, "bfloat16": 2, "uint8": 1}


@st.composite
def small_specs(draw: st.DrawFn, block_size: int) -> SpecCase:
    dtype = draw(st.sampled_from(sorted(ELEMENT)))
    ratio = draw(st.sampled_from([r for r in (1, 2, 4) if block_size % r == 0]))
    fields: dict[str, object] = {"kind": "mla" if ratio > 1 else "full", "block_size": block_size, "dtype": dtype,
                                 "num_kv_heads": 1 if ratio > 1 else draw(st.integers(1, 3)), "head_size": draw(st.integers(1, 3)),
                                 "compress_ratio": ratio}
    if draw(st.booleans()):
        fields["num_head_slots"] = draw(st.integers(1, 3)) if ratio == 1 else 1
    spec = SpecCase(**fields)  # type: ignore[arg-type]
    choice = draw(st.sampled_from(("none", "padded", "aligned")))
    if choice == "padded":
        spec = dataclasses.replace(spec, page_size_padded=pages.page(spec).page_bytes + ELEMENT[dtype] * draw(st.integers(0, 3)))
    elif choice == "aligned":
        spec = dataclasses.replace(spec, block_stride_alignment=ELEMENT[dtype] * draw(st.integers(1, 5)))
    return spec


@st.composite
def small_cases(draw: st.DrawFn) -> Case:
    layout = draw(st.sampled_from(KV_CACHE_LAYOUTS))
    block_size = draw(st.sampled_from((1, 2, 4)))
    groups = []
    for g in range(draw(st.integers(1, 2))):
        spec = draw(small_specs(block_size))
        kernel = draw(st.sampled_from([k for k in (1, 2, 4) if block_size % k == 0 and k % spec.compress_ratio == 0]))
        layers = tuple(f"g{g}.l{i}" for i in range(draw(st.integers(1, 3))))
        groups.append(GroupCase(spec=spec, layers=layers, synthetic_backend=SyntheticBackend("any"), kernel_block_size=kernel))
    return Case(groups=tuple(groups), num_blocks=draw(st.integers(1, 3)), layout=layout)


@st.composite
def differing_layer_cases(draw: st.DrawFn) -> Case:
    """One group whose layers differ in heads (a UniformTypeKVCacheSpecs group); fewer heads than the spec's still fit its
    padded page."""
    layout = draw(st.sampled_from(KV_CACHE_LAYOUTS))
    block_size = draw(st.sampled_from((1, 2, 4)))
    spec = dataclasses.replace(draw(small_specs(block_size)), kind="full", compress_ratio=1, num_head_slots=None,
                               num_kv_heads=draw(st.integers(1, 3)))
    if spec.page_size_padded is not None:
        unpadded = pages.page(dataclasses.replace(spec, page_size_padded=None)).page_bytes
        spec = dataclasses.replace(spec, page_size_padded=max(spec.page_size_padded, unpadded))
    most = spec.num_kv_heads if spec.page_size_padded is not None else 3
    count = draw(st.integers(2, 3))
    heads = tuple(draw(st.integers(1, most)) for _ in range(count))
    dtypes: tuple[str, ...] = ()
    if spec.page_size_padded is None and draw(st.booleans()):  # layers that skip an fp8 cache's quantization keep bf16
        spec = dataclasses.replace(spec, cache_dtype="fp8", dtype="float8_e4m3fn", kv_quant_mode="fp8_per_tensor", head_size_v=None)
        dtypes = tuple(draw(st.sampled_from(("fp8", "bfloat16"))) for _ in range(count))
        heads = heads if draw(st.booleans()) else ()
    group = GroupCase(spec=spec, layers=tuple(f"l{i}" for i in range(count)), synthetic_backend=SyntheticBackend("any"),
                      kernel_block_size=block_size, layer_heads=heads, layer_cache_dtypes=dtypes)
    return Case(groups=(group,), num_blocks=draw(st.integers(1, 3)), layout=layout, packing="uniform_type")


@EXAMPLES
@given(small_cases(), st.sampled_from((LAYOUT_PLACED, LAYOUT_PLACED_KERNEL_MAP)))
def test_oracle_strides_match_brute_force_addresses(case, contract):
    expectation = expect(case, contract)
    if not expectation.accepted:
        return
    assert sum(check_group(case, expectation, index) for index in range(len(case.groups))) > 0


@EXAMPLES
@given(differing_layer_cases(), st.sampled_from((LAYOUT_PLACED, LAYOUT_PLACED_KERNEL_MAP)))
def test_oracle_strides_match_brute_force_addresses_for_layers_that_differ(case, contract):
    expectation = expect(case, contract)
    if not expectation.accepted:
        return
    assert check_group(case, expectation, 0) > 0


def test_layers_that_differ_are_checked_in_both_layout_families():
    seen: set[str] = set()

    @EXAMPLES
    @given(differing_layer_cases())
    def collect(case):
        if expect(case, LAYOUT_PLACED_KERNEL_MAP).accepted and len(set(case.groups[0].layer_specs)) > 1:
            seen.add(case.layout[0] + ("-padded" if case.groups[0].spec.page_size_padded is not None else ""))
            if len({spec.dtype for spec in case.groups[0].layer_specs}) > 1:
                seen.add(case.layout[0] + "-precision")

    collect()
    assert seen >= {"B", "L", "B-padded", "L-padded", "B-precision", "L-precision"}


def test_every_layout_and_split_is_checked():
    """The strategy above reaches every layout, padded and unpadded, split in place and as packed kernel pages."""
    seen: set[tuple[str, str]] = set()

    @EXAMPLES
    @given(small_cases())
    def collect(case):
        expectation = expect(case, LAYOUT_PLACED_KERNEL_MAP)
        if not expectation.accepted:
            return
        for group in case.groups:
            view = expectation.layers[group.layers[0]].views[0]
            split = "none" if view.kernel_ratio == 1 else ("in-place" if view.kernel_stride == view.kernel_ratio else "kernel-pages")
            seen.add((case.layout, split))
            seen.add(("padded" if pages.page(group.spec).padded else "unpadded", split))

    collect()
    assert {layout for layout, _ in seen} >= set(KV_CACHE_LAYOUTS) | {"padded", "unpadded"}
    assert {split for _, split in seen} == {"none", "in-place", "kernel-pages"}


def test_enumeration_by_hand():
    # LBHNC, 2 layers, 2 blocks, 2 heads, 3 states, 2 bytes: head-major pages of 12 bytes, layers 24 bytes apart.
    addresses = enumerate_addresses("LBHNC", {"L": 2, "B": 2, "H": 2, "N": 3, "C": 2}, {})
    assert addresses[(0, 0, 1, 0, 0)] == 6 and addresses[(0, 1, 0, 0, 0)] == 12 and addresses[(1, 0, 0, 0, 0)] == 24
    # BLNHC with a 16-byte padded page: layer 1 of block 0 starts 16 bytes in, block 1 at 32.
    padded = enumerate_addresses("BLNHC", {"L": 2, "B": 2, "H": 2, "N": 3, "C": 2}, {"L": 16})
    assert padded[(1, 0, 0, 0, 0)] == 16 and padded[(0, 1, 0, 0, 0)] == 32 and padded[(0, 0, 0, 1, 0)] == 4
    # BLHNC, layer 0 with 1 head and layer 1 with 2 (pages of 6 and 12 bytes): layer 1 of block 0 starts at 6, block 1 at 18.
    ragged = enumerate_addresses("BLHNC", {"L": 2, "B": 2, "H": 1, "N": 3, "C": 2}, {},
                                 [({"H": 1, "N": 3, "C": 2}, {}), ({"H": 2, "N": 3, "C": 2}, {})])
    assert ragged[(1, 0, 0, 0, 0)] == 6 and ragged[(1, 0, 1, 0, 0)] == 12 and ragged[(0, 1, 0, 0, 0)] == 18
