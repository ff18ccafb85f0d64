"""False alarms met while triaging docs/triage (2026-12-05), each pinned where kvfuzz went wrong: the case space drew a
configuration vLLM never builds (fuzz/space.py: NULL_BLOCK_RULE, CPU_RULE), or the oracle sized a case it rejects smaller
than vLLM allocates it, so a case too large to run was run (oracles/layout_placed.py `_sizing_alignment`)."""

from __future__ import annotations

import dataclasses

import pytest

from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend, Touches
from fuzz.checks.when import CPU_RULE, on_cpu
from fuzz.space import NULL_BLOCK_RULE, Rejected, draw_indexed, unrealistic
from oracles import LAYOUT_PLACED_KERNEL_MAP, buffer_bytes, expect

CPU_CONSUMERS = ("cpu-zero", "cpu-zeroer")


def attention(block_size: int = 16) -> GroupCase:
    spec = SpecCase(kind="full", block_size=block_size, num_kv_heads=2, head_size=64)
    return GroupCase(spec=spec, layers=("g0.l0",), backend="TRITON_ATTN", kernel_block_size=block_size)


def synthetic(name: str, layer: str, spec: SpecCase) -> GroupCase:
    backend = SyntheticBackend(name=name, kernel_block_sizes=(f"x{spec.block_size}",))
    return GroupCase(spec=spec, layers=(layer,), synthetic_backend=backend, kernel_block_size=spec.block_size)


@pytest.fixture
def info(kvfuzz_target):
    info = kvfuzz_target.info
    if not info.contract.layout_placed or info.backend("TRITON_ATTN") is None or "offload" not in info.consumers:
        pytest.skip("needs a layout-placed release with TRITON_ATTN and the offloading connector")
    return info


def test_a_pool_of_one_block_asks_its_consumers_about_no_block(info):
    """The 0.28.0 region-mismatch (047a3fda9528, FLASH_ATTN_DIFFKV in a cross_layers slab, one block): the connector took the
    size-1 block axis's stride for the slab's block stride; block 0 of a one-block pool is BlockPool's null block, never
    offloaded (the offloading scheduler skips block id 0), and with two blocks the same case passes."""
    one = Case(groups=(attention(),), num_blocks=1, layout="LBNHC", touches=Touches(consumers=("offload",), blocks=(0,)))
    assert unrealistic(one, info) == NULL_BLOCK_RULE
    assert unrealistic(dataclasses.replace(one, touches=Touches(consumers=("offload",))), info) is None, "set-up is still checked"
    assert unrealistic(dataclasses.replace(one, num_blocks=2), info) is None, "block 0 of a larger pool has real blocks' strides"
    drawn = 0
    for index in range(1500):
        try:
            case = draw_indexed(info, 1, index, touches=True)
        except Rejected:
            continue
        if case.num_blocks == 1 and case.touches is not None and case.touches.consumers:
            drawn += 1
            assert not case.touches.blocks, case
            assert unrealistic(case, info) is None, case
    assert drawn, "one-block cases still run their consumers' set-up"


def test_the_cpu_runner_zeroers_never_run_over_a_synthetic_backend(info):
    """The 0.32.0 zero-miss (0c4c97c48f4c): CPUModelRunner._zero_block_ids over two synthetic full-attention groups of
    different pages at one pool position (BLNHC). The CPU platform selects only its own backends, whose layers never make
    such groups; a synthetic backend is not one of them."""
    narrow = SpecCase(kind="full", block_size=1, num_kv_heads=1, head_size=16)
    wide = SpecCase(kind="full", block_size=739, num_kv_heads=1, head_size=4, cache_dtype="int4_per_token_head", dtype="uint8",
                    kv_quant_mode="int4_per_token_head")
    groups = (synthetic("beta", "g0.l0", narrow), synthetic("alpha", "g1.l0", wide))
    case = Case(groups=groups, num_blocks=1, layout="BLNHC", touches=Touches(consumers=("cpu-zero",)))
    assert not on_cpu(case)
    assert unrealistic(case, info) == CPU_RULE
    for index in range(1500):
        try:
            drawn = draw_indexed(info, 1, index, touches=True)
        except Rejected:
            continue
        if drawn.touches is not None and set(drawn.touches.consumers) & set(CPU_CONSUMERS):
            assert all(g.synthetic_backend is None for g in drawn.groups), drawn


def sliding_mla(layer: str, backend: str, kernel: int, **fields: object) -> GroupCase:
    spec = SpecCase(kind="sliding_window_mla", num_kv_heads=1, **fields)  # type: ignore[arg-type]
    return GroupCase(spec=spec, layers=(layer,), backend=backend, kernel_block_size=kernel)


def test_a_rejected_case_is_sized_as_vllm_allocates_it():
    """The 0.34.0 oom (26dbcdc650eb): three sliding-window MLA groups, BLHNC, one block, as 0.34.0's backends declare them
    (block stride alignments: whole 256-token kernel pages, or ROCM_AITER_MLA_SPARSE's rows). The compressed group's kernel
    block holds no state (compress_ratio 1024), which the contract refuses (#5); vLLM sizes that kernel page as the block's
    padded 4,096-byte page and asks for 16,145,633,280 bytes, the lcm of the alignments. kvfuzz skips a case whose buffer
    is over its limit, but sized that alignment as 1 (63,068,880 bytes), ran the case and met the allocation as an `oom`."""
    compressed = sliding_mla("g0.l2", "FLASHINFER_MLA_SPARSE_DSV4", 256, block_size=1024, compress_ratio=1024, head_size=3,
                             alignment=4096, sliding_window=64, block_stride_multiple_of=256)
    rows = sliding_mla("g1.l1", "ROCM_AITER_MLA_SPARSE", 1, block_size=1, head_size=930, sliding_window=65536,
                       block_stride_alignment=1860)
    records = sliding_mla("g2.l2", "DEEPSEEK_V4_FLASHMLA", 256, block_size=512, head_size=1024, cache_dtype="fp8_ds_mla",
                          dtype="uint8", kv_quant_mode="fp8_per_tensor", model_version="deepseek_v4", alignment=2768,
                          sliding_window=1, state_content_bytes=528, block_stride_multiple_of=256)
    case = Case(groups=(compressed, rows, records), num_blocks=1, layout="BLHNC")
    assert expect(case, LAYOUT_PLACED_KERNEL_MAP).reject_reason is not None
    assert buffer_bytes(case, LAYOUT_PLACED_KERNEL_MAP) == 16_145_633_280, "the bytes vLLM 0.34.0 tried to allocate"
    # With a kernel block that holds states (compress_ratio 4) the page was sized so before: the same pitch.
    fits = dataclasses.replace(compressed, spec=dataclasses.replace(compressed.spec, compress_ratio=4))
    assert buffer_bytes(dataclasses.replace(case, groups=(fits, rows, records)), LAYOUT_PLACED_KERNEL_MAP) == 16_145_633_280
