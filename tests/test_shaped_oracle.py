"""The backend-shaped oracle (vLLM 0.19-0.28) against layouts derived by hand, and its invariants."""

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend
from fuzz.strategies import cases
from oracles import expect
from oracles.contract import SHAPED_019, SHAPED_021, SHAPED_022, SHAPED_023, SHAPED_027
from tests.conftest import one_group, synthetic_info
from tests.test_oracle import assert_sound

KV_INNER = SyntheticBackend("inner", shape=("B", 2, "T", "H", "D"))
KV_FIRST = SyntheticBackend("first", shape=(2, "B", "T", "H", "D"))
LATENT = SyntheticBackend("latent", kernel_block_sizes=(2,), shape=("B", "T", "D"))
FULL = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64)  # 8192-byte pages


def test_deepseek_v4_indexer_1728_byte_page_on_023():
    # The brief's case: block 256, compress 128 -> 2 stored slots of 584 B = 1168 B, padded to 3 x 576.
    spec = SpecCase(kind="mla", block_size=256, head_size=584, dtype="uint8", alignment=576, compress_ratio=128,
                    model_version="deepseek_v4")
    e = expect(one_group(spec, layout="NHD", blocks=3, kernel=2, backend=LATENT), SHAPED_022)
    view = e.layers["l0"].views[0]
    assert view.shape == (3, 2, 584)
    assert view.byte_strides == (1728, 584, 1)
    assert e.buffers == (3 * 1728,)
    assert e.layers["l0"].pages.padding(0) == [(1168, 1728)]


def test_kv_inner_backend_is_dense_in_declared_order():
    view = expect(one_group(FULL, layout="NHD", backend=KV_INNER), SHAPED_022).layers["l0"].views[0]
    assert view.shape == (4, 2, 16, 2, 64)
    assert view.byte_strides == (8192, 4096, 256, 128, 2)


def test_stride_order_permutes_the_physical_layout():
    hnd = SyntheticBackend("hnd", shape=("B", 2, "T", "H", "D"), stride_order=(0, 1, 3, 2, 4))
    view = expect(one_group(FULL, layout="HND", backend=hnd), SHAPED_022).layers["l0"].views[0]
    assert view.shape == (4, 2, 16, 2, 64)
    assert view.byte_strides == (8192, 4096, 128, 2048, 2)


def test_kv_first_block_has_two_spans():
    e = expect(one_group(FULL, layout="NHD", backend=KV_FIRST), SHAPED_022)
    view = e.layers["l0"].views[0]
    assert view.byte_strides == (16384, 4096, 256, 128, 2)
    assert e.layers["l0"].pages.spans(1) == [(4096, 8192), (16384 + 4096, 16384 + 8192)]


def test_kernel_split_counts_kernel_blocks():
    spec = SpecCase(kind="full", block_size=64, num_kv_heads=2, head_size=64)
    view = expect(one_group(spec, layout="NHD", blocks=2, kernel=16, backend=KV_INNER), SHAPED_022).layers["l0"].views[0]
    assert view.shape == (8, 2, 16, 2, 64)
    assert view.byte_strides == (8192, 4096, 256, 128, 2)
    assert view.kernel_ratio == 4


def test_no_kernel_split_before_022():
    spec = SpecCase(kind="full", block_size=64, num_kv_heads=2, head_size=64)
    view = expect(one_group(spec, layout="NHD", blocks=2, kernel=16, backend=KV_INNER), SHAPED_021).layers["l0"].views[0]
    assert view.shape == (2, 2, 64, 2, 64)


def test_compressed_cache_keeps_its_stored_block_as_kernel_block():
    spec = SpecCase(kind="mla", block_size=512, head_size=64, dtype="uint8", compress_ratio=4)
    view = expect(one_group(spec, layout="NHD", blocks=2, kernel=256, backend=LATENT), SHAPED_022).layers["l0"].views[0]
    assert view.shape == (2, 128, 64)


def test_0_19_counts_tokens_not_slots():
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=1, head_size=64)
    view = expect(one_group(spec, layout="NHD", backend=KV_INNER), SHAPED_019).layers["l0"].views[0]
    assert view.shape == (4, 2, 16, 1, 64)


def hybrid(contract, backend=KV_FIRST):
    mamba = SpecCase(kind="mamba", block_size=16, mamba_shapes=((2, 8), (4,)), mamba_dtypes=("float32", "bfloat16"), page_size_padded=8192)
    case = Case(groups=(GroupCase(spec=FULL, layers=("a0",), synthetic_backend=backend, kernel_block_size=16),
                        GroupCase(spec=mamba, layers=("m0",), kernel_block_size=16)), num_blocks=3, layout="NHD")
    return expect(case, contract)


def test_kv_first_layer_sharing_a_pool_with_mamba_keeps_blocks_in_pages():
    e = hybrid(SHAPED_022)
    attention = e.layers["a0"].views[0]
    assert attention.byte_strides == (4096, 8192, 256, 128, 2)  # K of block b at b*page, V half a page later
    assert e.layers["a0"].pages.spans(2) == [(16384, 24576)]
    assert_sound(e)


def test_mamba_state_views_are_packed_in_the_page():
    per_state = hybrid(SHAPED_022).layers["m0"].views
    assert [(v.shape, v.byte_strides, v.byte_offset) for v in per_state] == [((3, 2, 8), (8192, 32, 4), 0), ((3, 4), (8192, 2), 64)]
    page_bytes = hybrid(SHAPED_027).layers["m0"]
    assert [(v.shape, v.byte_strides, v.dtype) for v in page_bytes.views] == [((3, 1, 1, 8192), (8192, 8192, 8192, 1), "int8")]
    assert page_bytes.addresses_padding


def test_declarations_that_break_the_contract_are_findings_of_their_own():
    # K only: half of the 8192-byte page.
    short = one_group(FULL, layout="NHD", backend=SyntheticBackend("short", shape=("B", "T", "H", "D")))
    assert expect(short, SHAPED_022).broken_declaration == (
        "get_kv_cache_shape", "synthetic:short declares cache shape [4, 16, 2, 64]: 4096 bytes per block for a page of 8192 bytes")
    declared = one_group(FULL, layout="NHD", backend=KV_INNER)
    group = declared.groups[0]

    def with_declaration(shape, order):
        return dataclasses.replace(declared, groups=(dataclasses.replace(group, declared_shape=shape, declared_stride_order=order),))

    cases = {
        "order is no permutation": with_declaration(("B", 2, "T", "H", "D"), (0, 1, 2, 3, 3)),
        "two block axes": with_declaration(("B", "B", "T", "H", "2*D"), None),
        "tokens outside the blocks": with_declaration(("B", 2, "T", "H", "D"), (2, 0, 1, 3, 4)),
    }
    for why, case in cases.items():
        e = expect(case, SHAPED_022)
        assert e.broken_declaration is not None and not e.accepted, why
    # K/V first (2, B, ...) keeps each block's K and V pages: a declaration the contract allows.
    assert expect(with_declaration((2, "B", "T", "H", "D"), None), SHAPED_022).accepted


def test_padded_kv_first_is_rejected():
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, page_size_padded=9000)
    e = expect(one_group(spec, layout="NHD", backend=KV_FIRST), SHAPED_022)
    assert not e.accepted and "outermost" in e.reject_reason


@given(st.data())
def test_shaped_oracle_layouts_are_sound(data):
    kinds = ("full", "sliding_window", "mla", "sliding_window_mla", "mamba", "cross", "sink", "chunked_local")
    info = synthetic_info(SHAPED_022, ("NHD", "HND"))
    info = type(info)(**{**info.__dict__, "spec_kinds": kinds})
    case = data.draw(cases(info))
    # What the test target's backends declare (a real target's declare step asks vLLM).
    shapes = {"A": ("B", 2, "T", "H", "D"), "M": ("B", "T", "D")}
    groups = tuple(dataclasses.replace(g, declared_shape=shapes[g.backend]) if g.backend else g for g in case.groups)
    e = expect(dataclasses.replace(case, groups=groups), SHAPED_022)
    if e.accepted:
        assert_sound(e)


def uniform_groups(*groups: tuple[SpecCase, tuple[str, ...]]) -> Case:
    return Case(groups=tuple(GroupCase(spec=spec, layers=layers, synthetic_backend=KV_INNER, kernel_block_size=spec.block_size)
                             for spec, layers in groups), num_blocks=3, layout="NHD", packing="uniform_type")


def test_several_uniform_type_groups_get_a_buffer_per_page_size_and_slot():
    # 0.23 (DeepSeek V4's planner): the i-th layer of each group with a page size shares that size's i-th buffer.
    small = dataclasses.replace(FULL, num_kv_heads=1)  # 4096-byte pages beside FULL's 8192
    case = uniform_groups((FULL, ("a0", "a1")), (small, ("b0", "b1")), (FULL, ("c0",)))
    e = expect(case, SHAPED_023)
    assert e.accepted
    assert e.buffers == (3 * 8192, 3 * 8192, 3 * 4096, 3 * 4096)
    buffer_of = {name: layer.views[0].buffer for name, layer in e.layers.items()}
    assert buffer_of == {"a0": 0, "c0": 0, "a1": 1, "b0": 2, "b1": 3}
    assert e.layers["b1"].views[0].byte_strides[0] == 4096  # its own page pitch, not the widest group's
    assert_sound(e)


def test_uniform_type_groups_of_one_page_size_share_pools_as_any_groups_do():
    case = uniform_groups((FULL, ("a0", "a1")), (FULL, ("b0",)))
    assert expect(case, SHAPED_023).buffers == expect(dataclasses.replace(case, packing="none"), SHAPED_023).buffers == (3 * 8192,) * 2


def test_groups_of_mixed_pages_are_refused_where_no_planner_buckets_them():
    small = dataclasses.replace(FULL, num_kv_heads=1)
    case = uniform_groups((FULL, ("a0",)), (small, ("b0",)))
    assert not expect(case, SHAPED_022).accepted  # 0.20 - 0.22 bucket only the first group's page sizes
    assert not expect(dataclasses.replace(case, packing="none"), SHAPED_023).accepted


def test_an_attention_free_model_plans_one_block_and_no_buffer():
    e = expect(Case(groups=(), num_blocks=5), SHAPED_023)
    assert e.accepted and e.buffers == () and e.exact_buffers and e.planned_blocks == 1
