"""Packed per-block slabs (vLLM 0.24 - 0.28): placements derived by hand from the planner's stated design.

bucketed (0.24-0.26): one slot per (page size, layer index within a group), slots side by side, page sizes in
order of first appearance; per-group (0.27-0.28): each group densely from byte 0, the slab as wide as the
widest group. The numbers below are worked out on paper from those two sentences.
"""

import dataclasses

from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend
from oracles import contract as rules
from oracles import expect, packing
from oracles.contract import SHAPED_022, SHAPED_024, SHAPED_027

FULL = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64)  # K+V 256 B per token-head: 8192 B pages
HALF = SpecCase(kind="sliding_window", block_size=16, num_kv_heads=1, head_size=64, sliding_window=32)  # 4096 B pages
NHD = SyntheticBackend("nhd", kernel_block_sizes=(16,), shape=("B", 2, "T", "H", "D"))
KV_FIRST = SyntheticBackend("kvfirst", kernel_block_sizes=(16,), shape=(2, "B", "T", "H", "D"))


def two_groups(first=FULL, second=HALF, backend=NHD, packing_name="cross_layers", layers=(("l0", "l1"), ("s0",)), blocks=3) -> Case:
    groups = tuple(GroupCase(spec=spec, layers=names, synthetic_backend=backend, kernel_block_size=16)
                   for spec, names in zip((first, second), layers, strict=True))
    return Case(groups=groups, num_blocks=blocks, layout="NHD", packing=packing_name)


def test_bucketed_slots_follow_each_other_by_page_size():
    # Pages 8192 (l0, l1) and 4096 (s0): slots l0@0, l1@8192, s0@16384; the slab holds all three.
    assert rules.bucketed_slab([[("l0", 8192), ("l1", 8192)], [("s0", 4096)]]) == (20480, {"l0": 0, "l1": 8192, "s0": 16384})
    # Same page size in both groups: layer i of each group shares slot i.
    assert rules.bucketed_slab([[("l0", 8192), ("l1", 8192)], [("s0", 8192)]]) == (16384, {"l0": 0, "l1": 8192, "s0": 0})
    # DeepSeek-V4-like groups of different pages inside a group: a0 (4096), a1 (8192), b0 (2048) each a bucket of its own.
    assert rules.bucketed_slab([[("a0", 4096), ("a1", 8192)], [("b0", 2048)]]) == (14336, {"a0": 0, "a1": 4096, "b0": 12288})


def test_per_group_slabs_overlap_from_byte_zero():
    assert rules.per_group_slab([[("l0", 8192), ("l1", 8192)], [("s0", 4096)]]) == (16384, {"l0": 0, "l1": 8192, "s0": 0})
    assert rules.per_group_slab([[("a0", 4096), ("a1", 8192)], [("b0", 2048)]]) == (12288, {"a0": 0, "a1": 4096, "b0": 0})


def test_only_several_groups_asking_for_it_are_packed_and_only_from_0_24():
    assert packing.slab(two_groups(), SHAPED_022) is None
    assert packing.slab(two_groups(packing_name="none"), SHAPED_024) is None
    single = dataclasses.replace(two_groups(), groups=two_groups().groups[:1])
    assert packing.slab(single, SHAPED_027) is None
    assert packing.slab(two_groups(), SHAPED_024) == packing.Slab(20480, {"l0": 0, "l1": 8192, "s0": 16384})


def test_a_packed_layer_is_its_page_at_its_offset_in_every_slab():
    e = expect(two_groups(), SHAPED_024)
    assert e.accepted and e.buffers == (3 * 20480,)
    l1, s0 = e.layers["l1"].views[0], e.layers["s0"].views[0]
    # (B, 2, T, H, D) bf16: block pitch the slab, then K/V 4096 (T*H*D*2), token 256, head 128, element 2.
    assert (l1.byte_offset, l1.byte_strides) == (8192, (20480, 4096, 256, 128, 2))
    assert (s0.byte_offset, s0.byte_strides) == (16384, (20480, 2048, 128, 128, 2))
    assert e.layers["l1"].pages.spans(2) == [(2 * 20480 + 8192, 2 * 20480 + 8192 + 8192)]
    per_group = expect(two_groups(), SHAPED_027)
    assert per_group.buffers == (3 * 16384,) and per_group.layers["s0"].views[0].byte_offset == 0


def test_a_kv_first_layer_keeps_its_block_in_one_page_of_the_slab():
    view = expect(two_groups(backend=KV_FIRST), SHAPED_024).layers["l1"].views[0]
    # (2, B, T, H, D): the block axis hoisted outermost (slab pitch), K/V half a page apart inside the page.
    assert (view.byte_offset, view.byte_strides) == (8192, (4096, 20480, 256, 128, 2))


def test_a_slab_of_one_page_lays_out_unpacked():
    # One layer per group and one page size: every layer at byte 0 of a slab that is its page: K/V first stays K/V first.
    full_window = dataclasses.replace(FULL, kind="sliding_window", sliding_window=32)
    case = two_groups(second=full_window, backend=KV_FIRST, layers=(("l0",), ("s0",)))
    e = expect(case, SHAPED_027)
    assert e.accepted and e.buffers == (3 * 8192,)
    # K of all three blocks (4096 B each), then V: the unpacked K/V-first layout.
    assert e.layers["s0"].views[0].byte_strides == (3 * 4096, 4096, 256, 128, 2)


def test_a_packed_block_is_split_into_kernel_blocks_only_when_its_slab_is_its_page():
    split = SyntheticBackend("k8", kernel_block_sizes=(8,), shape=("B", 2, "T", "H", "D"))

    def with_kernel_8(case):
        return dataclasses.replace(case, groups=tuple(dataclasses.replace(g, synthetic_backend=split, kernel_block_size=8) for g in case.groups))

    e = expect(with_kernel_8(two_groups()), SHAPED_027)
    assert not e.accepted and "cannot be split" in (e.reject_reason or "")
    full_window = dataclasses.replace(FULL, kind="sliding_window", sliding_window=32)
    dense = with_kernel_8(two_groups(second=full_window, layers=(("l0",), ("s0",))))
    view = expect(dense, SHAPED_027).layers["l0"].views[0]
    # 3 blocks of 2 kernel blocks of 8 tokens: 4096 B apart, a page each.
    assert view.shape == (6, 2, 8, 2, 64) and view.byte_strides[0] == 4096


def test_packed_mamba_states_sit_at_their_offset_in_every_slab():
    mamba = SpecCase(kind="mamba", block_size=16, mamba_shapes=((2, 8),), mamba_dtypes=("float32",), page_size_padded=8192)
    case = Case(groups=(GroupCase(spec=FULL, layers=("a0", "a1"), synthetic_backend=NHD, kernel_block_size=16),
                        GroupCase(spec=mamba, layers=("m0", "m1"), kernel_block_size=16)), num_blocks=2, layout="NHD", packing="cross_layers")
    e = expect(case, SHAPED_024)  # one page size: slot i holds a_i and m_i
    m1 = e.layers["m1"].views[0]
    assert (m1.byte_offset, m1.byte_strides) == (8192, (16384, 32, 4))
    page_bytes = expect(case, SHAPED_027).layers["m1"].views[0]
    assert (page_bytes.shape, page_bytes.byte_offset, page_bytes.byte_strides[0]) == ((2, 1, 1, 8192), 8192, 16384)
