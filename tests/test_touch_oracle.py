"""oracles/touch.py: the bytes block b owns, checked against byte ranges worked out by hand.

Every case here has K and V heads of 64 bfloat16 elements (a state is 256 bytes), 2 KV heads and
16-token blocks, so a page is 2 * 16 * 256 = 8192 bytes, and 3 blocks; the expected ranges below
are computed from those numbers, not by the oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

import oracles
from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend
from oracles import touch
from oracles.contract import LAYOUT_PLACED_KERNEL_MAP, SHAPED_022

PAGE = 8192
BLOCKS = 3


def span(*ranges: tuple[int, int]) -> np.ndarray:
    return np.concatenate([np.arange(a, b) for a, b in ranges])


def case(layout: str = "LBNHC", layers: int = 2, kind: str = "full", block: int = 16, kernel: int | None = None,
         backend: SyntheticBackend | None = None, name: str = "TRITON_ATTN", **spec: object) -> Case:
    fields = {"kind": kind, "block_size": block, "num_kv_heads": 2, "head_size": 64, **spec}
    group = GroupCase(spec=SpecCase(**fields), layers=tuple(f"l{i}" for i in range(layers)),  # type: ignore[arg-type]
                      backend=None if backend else name, synthetic_backend=backend, kernel_block_size=kernel or block)
    return Case(groups=(group,), num_blocks=BLOCKS, layout=layout)


def placed(c: Case) -> oracles.Expectation:
    expected = oracles.expect(c, LAYOUT_PLACED_KERNEL_MAP)
    assert expected.accepted, expected.reject_reason
    return expected


def test_layer_outer_block_owns_one_page_per_layer():
    c = case("LBNHC")
    expected = placed(c)
    # LBNHC: layer l's region is 3 pages; block 1 is its second page.
    want = span((PAGE, 2 * PAGE), (3 * PAGE + PAGE, 3 * PAGE + 2 * PAGE))
    assert np.array_equal(touch.owned(expected, ["l0", "l1"], 1)[0], want)
    assert np.array_equal(touch.tile(c, expected, 1)[0], want)


def test_head_outer_layout_gives_block_one_run_per_head():
    c = case("LHBNC")
    expected = placed(c)
    # LHBNC: a head's run of a block is 16 * 256 = 4096 bytes; a head steps 3 blocks (12288), a layer 2 heads (24576).
    want = span((4096, 8192), (12288 + 4096, 12288 + 8192), (24576 + 4096, 24576 + 8192), (24576 + 12288 + 4096, 24576 + 12288 + 8192))
    assert np.array_equal(touch.owned(expected, ["l0", "l1"], 1)[0], want)


@pytest.mark.parametrize("layout", ["BLNHC", "BHLNC"])
def test_block_outermost_block_owns_its_whole_row(layout):
    c = case(layout)
    expected = placed(c)
    # Block-outermost: block b's row holds both layers' pages, 2 * 8192 bytes from b * 16384.
    assert np.array_equal(touch.tile(c, expected, 1)[0], np.arange(16384, 32768))
    assert np.array_equal(touch.owned(expected, ["l0", "l1"], 1)[0], np.arange(16384, 32768))


def test_a_block_split_into_kernel_blocks_owns_all_of_them():
    c = case("LBNHC", layers=1, block=64, kernel=16, backend=SyntheticBackend("s16", (16,)))
    expected = placed(c)
    # A 64-token page is 32768 bytes: block 1 is [32768, 65536) whatever the kernel blocks inside.
    assert np.array_equal(touch.owned(expected, ["l0"], 1)[0], np.arange(32768, 65536))
    assert touch.kernel_rows(expected.layers["l0"].views[0], 1) == [4, 5, 6, 7]


def test_kv_first_declared_shape_owns_two_spans_per_block():
    backend = SyntheticBackend("kvfirst", (16,), shape=(2, "B", "T", "H", "D"))
    c = case("NHD", layers=1, backend=backend)
    expected = oracles.expect(c, SHAPED_022)
    assert expected.accepted, expected.reject_reason
    # (2, B, T, H, D): K of block b at b * 4096, V 3 * 4096 further.
    want = span((4096, 8192), (12288 + 4096, 12288 + 8192))
    assert np.array_equal(touch.owned(expected, ["l0"], 1)[0], want)
    assert np.array_equal(touch.tile(c, expected, 1)[0], want)


def test_zeroers_clear_the_kinds_they_state():
    c = Case(groups=(GroupCase(SpecCase(kind="full", block_size=16), ("f",), backend="A", kernel_block_size=16),
                     GroupCase(SpecCase(kind="sliding_window", block_size=16, sliding_window=8), ("w",), backend="A", kernel_block_size=16)),
             num_blocks=2, layout="LBNHC")
    expected = placed(c)
    assert touch.zeroed_layers(c, expected, full_attention_only=False) == ["f", "w"]
    assert touch.zeroed_layers(c, expected, full_attention_only=True) == ["f"]


def test_copy_map_pairs_each_destination_byte_with_the_same_byte_of_the_source():
    c = case("LBNHC")
    expected = placed(c)
    (targets, sources), = touch.copy_map(expected, ["l0", "l1"], 0, 2).values()
    assert np.array_equal(np.sort(targets), span((2 * PAGE, 3 * PAGE), (5 * PAGE, 6 * PAGE)))
    assert np.array_equal(targets - sources, np.full(targets.size, 2 * PAGE))


def test_token_map_places_k_then_v_of_each_head():
    c = case("LBNHC")
    expected = placed(c)
    tokens = touch.token_map(c, expected, "l0", 1, 3, mla=False)
    assert tokens is not None and tokens.offsets is not None
    # LBNHC over a layer: C 2 bytes per element, H 256 bytes, N 512 bytes, B 8192 bytes. Elements: K (2 heads x 64) then V.
    k_head1_dim5 = 1 * 64 + 5
    v_head0_dim0 = 2 * 64
    assert tokens.offsets[k_head1_dim5] == 8192 + 3 * 512 + 256 + 5 * 2
    assert tokens.offsets[v_head0_dim0] == 8192 + 3 * 512 + 64 * 2
    assert np.array_equal(tokens.head_bytes[1], np.sort(np.concatenate([np.arange(8192 + n * 512 + 256, 8192 + n * 512 + 512)
                                                                        for n in range(16)])))


def test_token_map_follows_a_declared_shape():
    backend = SyntheticBackend("nhd", (16,), shape=("B", 2, "T", "H", "D"))
    c = case("NHD", layers=1, backend=backend)
    expected = oracles.expect(c, SHAPED_022)
    tokens = touch.token_map(c, expected, "l0", 1, 3, mla=False)
    assert tokens is not None and tokens.offsets is not None
    # (B, 2, T, H, D) dense: D 2 bytes, H 128, T 256, K/V 4096, B 8192.
    assert tokens.offsets[1 * 64 + 5] == 8192 + 3 * 256 + 128 + 10
    assert tokens.offsets[2 * 64] == 8192 + 4096 + 3 * 256


def test_cpu_attention_interiors_are_its_own():
    c = case("LBHNC", block=32, name="CPU_ATTN")
    expected = placed(c)
    tokens = touch.token_map(c, expected, "l0", 0, 0, mla=False)
    assert tokens is not None and tokens.offsets is None
    # LBHNC: a head's run of a 32-token block is 32 * 256 = 8192 bytes.
    assert np.array_equal(tokens.head_bytes[1], np.arange(8192, 16384))


@pytest.mark.parametrize("shape", [("B", "T", 2, 2), ("B", 2, "T", "2*D")])
def test_token_map_refuses_a_shape_it_cannot_read_as_heads(shape):
    # Sizes that coincide (2 heads, K + V of 2 dims) leave two axes read as K/V; a 2-head cache with no head axis
    # cannot say where head 1 lives. Either way the oracle says nothing rather than guess.
    backend = SyntheticBackend("nhd", (16,), shape=shape)
    c = case("NHD", layers=1, backend=backend, head_size=1)
    expected = oracles.expect(c, SHAPED_022)
    assert expected.accepted and expected.layers["l0"].views  # a cache the views rules accept: only the token map abstains
    assert touch.token_map(c, expected, "l0", 0, 0, mla=False) is None


def padded_mla_beside_mamba(blocks: int) -> Case:
    """A sliding-window MLA page of 15 bfloat16 (30 bytes) padded to its 4096-byte alignment, its blocks kept whole 30-byte
    rows apart (XPU_MLA_SPARSE's customize_spec: align_blocks_to_rows), beside a Mamba group whose 80-byte state is padded to
    the same 4096-byte page, layer-outer: each group lays its blocks from byte 0 at its own stride."""
    mla = SpecCase(kind="sliding_window_mla", block_size=1, num_kv_heads=1, head_size=15, sliding_window=1, alignment=4096,
                   block_stride_alignment=30)
    mamba = SpecCase(kind="mamba", block_size=1, mamba_shapes=((2, 16), (2, 4, 1)), mamba_dtypes=("float16", "float16"),
                     page_size_padded=4096)
    return Case(groups=(GroupCase(mla, ("a",), backend="XPU_MLA_SPARSE", kernel_block_size=1), GroupCase(mamba, ("m",), kernel_block_size=1)),
                num_blocks=blocks, layout="LBNHC")


def test_the_last_block_owns_its_alignment_tail():
    # MLA blocks are round_up(4096, 30) = 4110 bytes apart, Mamba blocks 4096. One block: the buffer is 4110 bytes and no
    # other block places a page in [4096, 4110), so all of it is block 0's.
    c = padded_mla_beside_mamba(1)
    assert np.array_equal(touch.tile(c, placed(c), 0)[0], np.arange(4110))


def test_an_alignment_tail_ends_where_another_groups_next_block_begins():
    # Two blocks: Mamba block 1 starts at 4096, so MLA block 0's tail [4096, 4110) is block 1's; block 1 owns MLA [4110, 8220)
    # and Mamba [4096, 8192), the last block's tail included.
    c = padded_mla_beside_mamba(2)
    expected = placed(c)
    assert np.array_equal(touch.tile(c, expected, 0)[0], np.arange(4096))
    assert np.array_equal(touch.tile(c, expected, 1)[0], np.arange(4096, 8220))
