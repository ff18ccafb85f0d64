"""The layout-placed oracle (vLLM 0.29+) against layouts derived by hand, and its own invariants."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fuzz.case import SpecCase
from fuzz.strategies import cases
from oracles import LAYOUT_PLACED, LAYOUT_PLACED_KERNEL_MAP, expect
from tests.conftest import one_group, synthetic_info


def view_of(expectation, name="l0"):
    return expectation.layers[name].views[0]


def test_full_attention_nhd_by_hand():
    # 16 tokens x 2 heads x (64 K + 64 V) bf16 = 8192-byte pages; NHD puts heads inside tokens.
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64)
    e = expect(one_group(spec), LAYOUT_PLACED_KERNEL_MAP)
    view = view_of(e)
    assert e.buffers == (4 * 8192,)
    assert view.shape == (4, 2, 16, 128)
    assert view.byte_strides == (8192, 256, 512, 2)


def test_full_attention_hnd_by_hand():
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64)
    assert view_of(expect(one_group(spec, layout="LBHNC"), LAYOUT_PLACED_KERNEL_MAP)).byte_strides == (8192, 4096, 256, 2)


def test_deepseek_v4_compressed_padded_page():
    # 256-token blocks, 4 tokens per state: 64 states x 584 B = 37376, padded to a 576 multiple: 37440.
    spec = SpecCase(kind="mla", block_size=256, head_size=512, dtype="uint8", cache_dtype="fp8_ds_mla",
                    alignment=576, compress_ratio=4, state_content_bytes=584, model_version="deepseek_v4")
    e = expect(one_group(spec), LAYOUT_PLACED_KERNEL_MAP)
    view = view_of(e)
    assert view.shape == (4, 1, 64, 584)
    assert e.buffers == (4 * 37440,)
    assert view.byte_strides[0] == 37440 and view.byte_strides[2:] == (584, 1)
    assert e.layers["l0"].pages.padding(1) == [(37440 + 37376, 2 * 37440)]


def test_deepseek_v4_ratio_128_page_is_1728_bytes():
    spec = SpecCase(kind="mla", block_size=256, head_size=512, dtype="uint8", alignment=576,
                    compress_ratio=128, state_content_bytes=584, model_version="deepseek_v4")
    view = view_of(expect(one_group(spec, blocks=2), LAYOUT_PLACED_KERNEL_MAP))
    assert view.shape == (2, 1, 2, 584)
    assert (view.byte_strides[0], view.byte_strides[2], view.byte_strides[3]) == (1728, 584, 1)


def test_kernel_split_hnd_makes_each_kernel_block_a_sub_page():
    # 64-token block split into 16-token kernel blocks: kernel block j is the j-th quarter page.
    spec = SpecCase(kind="full", block_size=64, num_kv_heads=2, head_size=64)
    view = view_of(expect(one_group(spec, layout="LBHNC", blocks=2, kernel=16), LAYOUT_PLACED_KERNEL_MAP))
    assert view.shape == (8, 2, 16, 128)
    assert view.byte_strides == (32768 // 4, 16 * 256, 256, 2)
    assert view.element_blocks().reshape(8, -1)[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_split_of_one_dense_page_with_heads_outside_the_page_tail():
    # BHLNC with one layer: a block is one dense page, head 0's states then head 1's. Kernel block
    # 2b + j is the j-th half of that page, nested like a block of its own (0.29-0.31 built strides
    # past the buffer for it; 0.32 keeps the manager block and refuses to map it).
    spec = SpecCase(kind="full", block_size=32, num_kv_heads=2, head_size=16)  # 2 x 32 states x 64 B = 4096 B
    for contract in (LAYOUT_PLACED, LAYOUT_PLACED_KERNEL_MAP):
        view = view_of(expect(one_group(spec, layout="BHLNC", blocks=2, kernel=16), contract))
        assert view.shape == (4, 2, 16, 32)
        assert view.byte_strides == (2048, 1024, 64, 2)


def test_split_with_other_pages_between_blocks_is_rejected():
    spec = SpecCase(kind="full", block_size=32, num_kv_heads=2, head_size=16)
    for layout, layers in (("BHLNC", ("l0", "l1")), ("BLNHC", ("l0", "l1")), ("LHBNC", ("l0",))):
        e = expect(one_group(spec, layout=layout, blocks=1, kernel=16, layers=layers), LAYOUT_PLACED_KERNEL_MAP)
        assert not e.accepted and "dense page" in e.reject_reason, layout


def test_split_of_padded_page_is_rejected():
    spec = SpecCase(kind="full", block_size=64, num_kv_heads=1, head_size=64, page_size_padded=20000)
    e = expect(one_group(spec, kernel=16), LAYOUT_PLACED_KERNEL_MAP)
    assert not e.accepted and "split" in e.reject_reason


def test_kernel_smaller_than_a_state_is_rejected():
    spec = SpecCase(kind="mla", block_size=128, head_size=512, compress_ratio=128)
    e = expect(one_group(spec, kernel=64), LAYOUT_PLACED_KERNEL_MAP)
    assert not e.accepted and e.reject_layer == "l0"


def assert_sound(e):
    """Expected views stay in their buffer, never share a byte, keep blocks in their pages and
    apart across groups that share a buffer (vectorized: one row per addressed byte)."""
    rows = []
    for number, (name, layer) in enumerate(e.layers.items()):
        if name in e.kv_sharing:
            continue
        for view in layer.views:
            offsets = view.element_offsets()
            mask = offsets >= 0
            addresses = (offsets[mask][:, None] + np.arange(view.element_size)).reshape(-1)
            blocks = np.repeat(view.element_blocks()[mask], view.element_size)
            assert addresses.min() >= 0 and addresses.max() < e.buffers[view.buffer], name
            rule = layer.pages
            base = rule.origin + blocks * rule.block_pitch
            starts = base[:, None] + np.asarray(rule.span_starts)[None, :]
            within = (addresses[:, None] >= starts) & (addresses[:, None] < starts + rule.span_len)
            assert within.any(axis=1).all(), f"{name} leaves its page"
            if not layer.addresses_padding:
                padding = (addresses[:, None] >= starts + rule.pad_start) & (addresses[:, None] < starts + rule.span_len)
                assert not padding.any(), f"{name} touches padding"
            rows.append(np.stack([np.full_like(addresses, view.buffer), addresses, np.full_like(addresses, number),
                                  np.full_like(addresses, layer.group), blocks], axis=1))
    table = np.concatenate(rows)
    table = table[np.lexsort((table[:, 2], table[:, 1], table[:, 0]))]
    same = (table[1:, 0] == table[:-1, 0]) & (table[1:, 1] == table[:-1, 1])
    first, second = table[:-1][same], table[1:][same]
    assert (first[:, 2] != second[:, 2]).all(), "one layer addresses a byte twice"
    assert (first[:, 3] != second[:, 3]).all(), "two layers of one group share a byte"
    assert (first[:, 4] == second[:, 4]).all(), "different blocks share a byte"


@given(st.data())
def test_oracle_layouts_are_sound(data):
    case = data.draw(cases(synthetic_info()))
    e = expect(case, LAYOUT_PLACED_KERNEL_MAP)
    if e.accepted:
        assert_sound(e)


def test_oracle_is_sound_on_many_fast_path_cases():
    """Hypothesis explores; this sweeps: many more cases of the campaign's own draw, both contract families."""
    import dataclasses

    from fuzz.space import Rejected, draw_indexed
    from oracles.contract import SHAPED_022

    shapes = {"A": ("B", 2, "T", "H", "D"), "M": ("B", "T", "D")}
    placed = synthetic_info()
    shaped = dataclasses.replace(synthetic_info(SHAPED_022, ("NHD", "HND")),
                                 spec_kinds=tuple(k for k in placed.spec_kinds if k != "encoder_only"))
    checked = 0
    for index in range(1600):
        info = (placed, shaped)[index % 2]
        try:
            case = draw_indexed(info, 21, index)
        except Rejected:
            continue
        if info is shaped:
            case = dataclasses.replace(case, groups=tuple(
                dataclasses.replace(g, declared_shape=shapes[g.backend]) if g.backend else g for g in case.groups))
        e = expect(case, info.contract)
        # The check costs per byte: buffers up to 256 KiB keep the sweep to seconds (the Hypothesis test above and the
        # campaigns' own oracle runs see the larger ones).
        if e.accepted and sum(e.buffers) <= 1 << 18:
            assert_sound(e)
            checked += 1
    assert checked > 900
