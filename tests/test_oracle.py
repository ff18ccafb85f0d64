"""The oracle against layouts derived by hand, and its own invariants on random cases."""

import numpy as np
from hypothesis import given

from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend
from fuzz.explain import byte_strides
from fuzz.strategies import cases
from fuzz.targets.base import BackendInfo, TargetInfo
from oracles import LAYOUT_PLACED_KERNEL_MAP, expect

ANY = SyntheticBackend("any")


def one_group(spec: SpecCase, layout: str = "LBNHC", blocks: int = 4, kernel: int | None = None, layers=("l0",)) -> Case:
    group = GroupCase(spec=spec, layers=layers, synthetic_backend=ANY, kernel_block_size=kernel or spec.block_size)
    return Case(groups=(group,), num_blocks=blocks, layout=layout)


def test_full_attention_nhd_by_hand():
    # 16 tokens x 2 heads x (64 K + 64 V) bf16 = 8192-byte pages; NHD puts heads inside tokens.
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64)
    e = expect(one_group(spec), LAYOUT_PLACED_KERNEL_MAP)
    layer = e.layers["l0"]
    assert e.buffer_bytes == 4 * 8192
    assert layer.shape == (4, 2, 16, 128)
    assert byte_strides(layer) == [8192, 256, 512, 2]


def test_full_attention_hnd_by_hand():
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64)
    layer = expect(one_group(spec, layout="LBHNC"), LAYOUT_PLACED_KERNEL_MAP).layers["l0"]
    assert byte_strides(layer) == [8192, 4096, 256, 2]


def test_deepseek_v4_compressed_padded_page():
    # 256-token blocks, 4 tokens per state: 64 states x 584 B = 37376, padded to 576 multiple 37440.
    spec = SpecCase(kind="mla", block_size=256, head_size=512, dtype="uint8", cache_dtype="fp8_ds_mla",
                    alignment=576, compress_ratio=4, state_content_bytes=584, model_version="deepseek_v4")
    e = expect(one_group(spec), LAYOUT_PLACED_KERNEL_MAP)
    layer = e.layers["l0"]
    assert layer.shape == (4, 1, 64, 584)
    assert e.buffer_bytes == 4 * 37440
    assert byte_strides(layer) == [37440, None, 584, 1]
    assert layer.padding[1] == [(37440 + 37376, 2 * 37440)]


def test_deepseek_v4_ratio_128_page_is_1728_bytes():
    spec = SpecCase(kind="mla", block_size=256, head_size=512, dtype="uint8", alignment=576,
                    compress_ratio=128, state_content_bytes=584, model_version="deepseek_v4")
    layer = expect(one_group(spec, blocks=2), LAYOUT_PLACED_KERNEL_MAP).layers["l0"]
    assert layer.shape == (2, 1, 2, 584)
    assert byte_strides(layer) == [1728, None, 584, 1]


def test_kernel_split_hnd_makes_each_kernel_block_a_sub_page():
    # 64-token block split into 16-token kernel blocks: kernel block j is the j-th quarter page.
    spec = SpecCase(kind="full", block_size=64, num_kv_heads=2, head_size=64)
    layer = expect(one_group(spec, layout="LBHNC", blocks=2, kernel=16), LAYOUT_PLACED_KERNEL_MAP).layers["l0"]
    assert layer.shape == (8, 2, 16, 128)
    assert byte_strides(layer) == [32768 // 4, 16 * 256, 256, 2]
    per_kernel_block = layer.blocks.reshape(8, -1)[:, 0]
    assert per_kernel_block.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_split_of_padded_page_is_rejected():
    spec = SpecCase(kind="full", block_size=64, num_kv_heads=1, head_size=64, page_size_padded=20000)
    e = expect(one_group(spec, kernel=16), LAYOUT_PLACED_KERNEL_MAP)
    assert not e.accepted and "split" in e.reject_reason


def test_kernel_smaller_than_a_state_is_rejected():
    spec = SpecCase(kind="mla", block_size=128, head_size=512, compress_ratio=128)
    assert not expect(one_group(spec, kernel=64), LAYOUT_PLACED_KERNEL_MAP).accepted


INFO = TargetInfo(
    vllm_version="synthetic", generation="G6", contract=LAYOUT_PLACED_KERNEL_MAP,
    spec_kinds=("full", "sliding_window", "mla", "sliding_window_mla", "mamba", "cross", "sink", "chunked_local", "encoder_only"),
    backends=(BackendInfo("A", False, ("x16",), None, ("bfloat16", "float16"), ("auto", "fp8")),
              BackendInfo("M", True, (64,), None, ("bfloat16",), ("auto", "fp8_ds_mla"), compresses=True)),
    layouts=("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"),
)


@given(cases(INFO))
def test_oracle_layouts_are_sound(case):
    """Expected views stay in the buffer, never share a byte, and keep blocks apart across groups."""
    e = expect(case, LAYOUT_PLACED_KERNEL_MAP)
    if not e.accepted:
        return
    owner: dict[int, tuple[int, str, int]] = {}
    for name, layer in e.layers.items():
        if name in e.kv_sharing:
            continue
        mask = layer.offsets >= 0
        starts = layer.offsets[mask]
        bytes_ = (starts[:, None] + np.arange(layer.element_size)).reshape(-1)
        blocks = np.repeat(layer.blocks[mask], layer.element_size)
        assert bytes_.min() >= 0 and bytes_.max() < e.buffer_bytes
        assert np.unique(bytes_).size == bytes_.size
        for address, block in zip(bytes_.tolist(), blocks.tolist(), strict=False):
            previous = owner.setdefault(address, (layer.group, name, block))
            if previous[1] != name:
                assert previous[0] != layer.group and previous[2] == block
            for start, end in layer.pages[block]:
                if start <= address < end:
                    break
            else:
                raise AssertionError(f"{name} block {block} leaves its page at byte {address}")
