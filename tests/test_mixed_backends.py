"""Two attention backends in one model's pools (issue 46): ROCm encoder-decoders put cross-attention on another backend
than self-attention, and a drafter may take its own backend. Where the backends arrange blocks differently, a block id
must still name the same bytes in every layer of a pool (oracles/contract.py mixed_pool_arrangement).

The oracle tests enumerate each view's bytes block by block from its strides (brute force, no arithmetic of the
oracle's) and compare them with pages worked out by hand: three blocks of a 16-token page of 4 heads x 8 elements, K and
V, in bfloat16, so P = 16 * 4 * 8 * 2 * 2 = 2048 bytes and a half page 1024."""

from __future__ import annotations

import itertools

import pytest

from fuzz.case import Case, GroupCase, SpecCase, from_dict, to_dict
from fuzz.space import MIXED_BACKEND_PAIRS, Rejected, draw_indexed
from fuzz.verdict.runner import run_case
from oracles import CONTRACTS, expect
from oracles.expectation import ViewExpectation
from tests.conftest import release_target

BLOCKS, PAGE, HALF = 3, 2048, 1024
KV_FIRST = (2, "B", "T", 4, 8)
BLOCKS_FIRST = ("B", 2, "T", 4, 8)
FUSED = ("B", 4, "T", 16)  # K and V side by side in each head's content: no axis holds K apart from V
SHAPED = CONTRACTS["shaped-0.24"]


def group(kind: str, shape: tuple[int | str, ...], backend: str, index: int) -> GroupCase:
    spec = SpecCase(kind=kind, block_size=16, num_kv_heads=4, head_size=8, sliding_window=32 if kind == "sliding_window" else None)
    return GroupCase(spec=spec, layers=(f"g{index}.l0", f"g{index}.l1"), backend=backend, kernel_block_size=16,
                     declared_shape=shape, declared_stride_order=tuple(range(len(shape))))


def pool_of(first: tuple[int | str, ...], second: tuple[int | str, ...], layout: str = "NHD") -> Case:
    return Case(groups=(group("full", first, "ROCM_ATTN", 0), group("sliding_window", second, "TRITON_ATTN", 1)),
                num_blocks=BLOCKS, layout=layout)


def block_bytes(view: ViewExpectation, block: int) -> set[int]:
    """Every byte the view's elements of manager block `block` occupy, enumerated element by element."""
    axes = [range(n) for n in view.shape]
    axes[view.block_axis] = range(block * view.kernel_ratio, (block + 1) * view.kernel_ratio)
    found: set[int] = set()
    for index in itertools.product(*axes):
        start = view.byte_offset + sum(i * s for i, s in zip(index, view.byte_strides, strict=True))
        found.update(range(start, start + view.element_size))
    return found


def owners(case: Case, runner: str) -> dict[str, list[set[int]]]:
    expected = expect(case, SHAPED, runner)
    assert expected.accepted, expected.reject_reason
    return {name: [block_bytes(layer.views[0], b) for b in range(BLOCKS)] for name, layer in expected.layers.items()}


def test_the_v2_runner_keeps_k_and_v_apart_in_every_layer_of_a_mixed_pool():
    found = owners(pool_of(KV_FIRST, BLOCKS_FIRST), "v2")
    for b in range(BLOCKS):
        halves = set(range(b * HALF, (b + 1) * HALF)) | set(range((BLOCKS + b) * HALF, (BLOCKS + b + 1) * HALF))
        assert all(blocks[b] == halves for blocks in found.values())


def test_the_v1_runner_lays_every_layer_of_a_mixed_pool_page_by_page():
    found = owners(pool_of(KV_FIRST, BLOCKS_FIRST), "v1")
    for b in range(BLOCKS):
        assert all(blocks[b] == set(range(b * PAGE, (b + 1) * PAGE)) for blocks in found.values())


def test_a_fused_kv_layer_beside_a_kv_first_one_is_refused_by_the_v2_runner_and_paged_by_the_v1_runner():
    case = pool_of(KV_FIRST, FUSED)
    refused = expect(case, SHAPED, "v2")
    assert not refused.accepted and "K/V axis" in (refused.reject_reason or "")
    found = owners(case, "v1")
    assert all(blocks[1] == set(range(PAGE, 2 * PAGE)) for blocks in found.values())


def test_pools_of_one_arrangement_keep_each_backends_own_layout():
    one = owners(pool_of(BLOCKS_FIRST, BLOCKS_FIRST), "v2")
    assert all(blocks[2] == set(range(2 * PAGE, 3 * PAGE)) for blocks in one.values())
    expected = expect(pool_of(BLOCKS_FIRST, BLOCKS_FIRST), SHAPED, "v2")
    assert not any(layer.runner_arranged for layer in expected.layers.values())
    assert all(layer.runner_arranged for layer in expect(pool_of(KV_FIRST, BLOCKS_FIRST), SHAPED, "v2").layers.values())


def test_a_case_file_round_trips_its_two_backends():
    case = pool_of(KV_FIRST, BLOCKS_FIRST)
    assert from_dict(to_dict(case)) == case
    assert frozenset(g.backend for g in case.groups) in MIXED_BACKEND_PAIRS


@pytest.mark.releases
@pytest.mark.parametrize(("version", "layout", "status", "kind"), [
    ("0.24.0", "NHD", "finding", "page-escape"),  # FINDINGS #36: the blocks alias
    ("0.25.0", "NHD", "pass", None),  # vLLM PR #47685 restrides the blocks-first views
    ("0.32.0", "HND", "pass", None),  # one layout for the model: the backends no longer arrange blocks
])
def test_two_backends_in_one_pool_run_on_the_release(version, layout, status, kind):
    with release_target(version) as target:
        # The ROCm encoder-decoder pool, with the shapes the release's backends declare (the target asks them).
        case = pool_of(KV_FIRST, BLOCKS_FIRST, layout)
        undeclared = Case(groups=tuple(GroupCase(spec=g.spec, layers=g.layers, backend=g.backend, kernel_block_size=16)
                                       for g in case.groups), num_blocks=BLOCKS, layout=layout)
        result = run_case(target, undeclared, "cpu")
    assert result.verdict.status == status, result.verdict
    if kind is not None:
        assert result.verdict.finding is not None and result.verdict.finding.kind == kind


@pytest.mark.releases
@pytest.mark.parametrize("version", ["0.24.0", "0.32.0"])
def test_the_generator_draws_pools_of_two_backends_vllm_pairs(version):
    """Before 0.29 only the pairs vLLM builds (the backends arrange blocks there); from 0.29 any two."""
    with release_target(version) as target:
        info = target.info
    pairs = set()
    for index in range(1500):
        try:
            case = draw_indexed(info, 5, index)
        except Rejected:
            continue
        names = frozenset(g.backend for g in case.groups if g.spec.is_attention and g.backend)
        if len(names) > 1:
            pairs.add(names)
    assert pairs
    if not info.contract.layout_placed:  # from 0.29 a group's backend is drawn on its own: the layout is the model's
        assert all(any(pair <= names for pair in MIXED_BACKEND_PAIRS) for names in pairs), pairs
