"""Hybrid Mamba models on the V1 runner of 0.19 - 0.20 (issue 46), which builds per-state Mamba views two releases before
the V2 runner does (GPUModelRunner._reshape_kv_cache_tensors, `elif isinstance(kv_cache_spec, MambaSpec)`).

Expected views are worked out by hand: a full-attention layer of 2 KV heads of 64 bf16 elements in 16-token blocks has an
8192-byte page; the Mamba layer's float32 state of 4 x 8 elements (128 bytes) and bf16 state of 16 elements (32 bytes)
share a page padded to those 8192 bytes, so each state's block stride is the page (2048 float32, 4096 bf16 elements) and
the second state starts 128 bytes into it."""

from __future__ import annotations

import dataclasses

import pytest

from fuzz.case import Case, GroupCase, SpecCase
from tests.conftest import release_target

pytestmark = [pytest.mark.slow, pytest.mark.releases]

ATTENTION = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
MAMBA = SpecCase(kind="mamba", block_size=16, mamba_shapes=((4, 8), (16,)), mamba_dtypes=("float32", "bfloat16"), page_size_padded=8192)


def hybrid(backend: str = "FLASH_ATTN", runner: str = "v1") -> Case:
    return Case(groups=(GroupCase(spec=ATTENTION, layers=("g0.l0", "g0.l1"), backend=backend, kernel_block_size=16),
                        GroupCase(spec=MAMBA, layers=("g1.l0", "g1.l1"), kernel_block_size=16)),
                num_blocks=3, layout="NHD", runner=runner)


@pytest.mark.parametrize("version", ["0.19.1", "0.20.0"])
def test_a_hybrid_mamba_model_runs_on_the_v1_runner(version):
    from fuzz.verdict.runner import run_case

    with release_target(version) as target:
        assert "mamba" in target.info.spec_kinds
        result = run_case(target, hybrid(), "cpu")
        assert result.verdict.status == "pass", result.verdict
        states = result.outcome.views["g1.l0"]
        assert [(v.shape, v.stride, v.offset_bytes, v.dtype) for v in states] == [
            ((3, 4, 8), (2048, 8, 1), 0, "float32"), ((3, 16), (4096, 1), 128, "bfloat16")]
        # FLASH_ATTN's K/V-first cache is restrided block-major beside Mamba: K/V stride one page half, blocks a page.
        [attention] = result.outcome.views["g0.l0"]
        assert attention.shape == (2, 3, 16, 2, 64) and attention.stride[:2] == (2048, 4096)
        # The V2 runner of these releases builds no Mamba views: kvfuzz skips the case for it, naming the runner that does.
        skipped = run_case(target, dataclasses.replace(hybrid(), runner="v2"), "cpu").verdict
        assert skipped.status == "skipped" and "V1 runner" in (skipped.reason or ""), skipped
