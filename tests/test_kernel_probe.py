"""`--probe kernel` on the installed vLLM: tokens written through the CPU backends' own cache writes
(`torch.ops._C.cpu_attn_reshape_and_cache` under CPU_ATTN, torch indexing under CPU_MLA, the AMX op
`concat_and_cache_mla_cpu` under AMX_MLA), each written element found in the raw buffer and held
against where the oracle (oracles/touch.py) puts token t of block b: inside its block and head, every
element once, and at the contract's position where the backend keeps no private block interior."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fuzz.case import Case, GroupCase, SpecCase, Touches
from fuzz.targets.base import decode_bytes
from fuzz.verdict.runner import judge
from oracles import touch

LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
TOKENS = ((0, 0), (1, 5), (2, 31))  # (manager block, position): first, middle and last slots of the blocks


def case_for(backend: str, kind: str, layout: str, block_size: int, kernel_block_size: int) -> Case:
    mla = kind == "mla"
    spec = SpecCase(kind=kind, block_size=block_size, num_kv_heads=1 if mla else 2, head_size=576 if mla else 64, dtype="bfloat16")
    group = GroupCase(spec=spec, layers=LAYERS, backend=backend, kernel_block_size=kernel_block_size)
    return Case(groups=(group,), num_blocks=3, layout=layout, touches=Touches(tokens=TOKENS))


def probed(target, case: Case):
    if case.groups[0].backend not in {b.name for b in target.info.backends}:
        pytest.skip(f"vLLM {target.info.vllm_version} has no {case.groups[0].backend}")
    execution = target.execute(case, "cpu", probe="kernel")
    result = judge(execution, target.info.contract)
    records = execution.outcome.checks["kernel-probe"]
    skipped = {r["skipped"] for r in records.values() if "skipped" in r}
    # Only a build without the backend's compiled op excuses a layer (a fact of the build, not of the probe): any other reason
    # to skip is the probe failing to drive the write, and fails here.
    if skipped and all("is not compiled into this build" in why for why in skipped):
        pytest.skip(f"not probed on vLLM {target.info.vllm_version}: {sorted(skipped)}")
    assert not skipped, skipped
    assert len(execution.outcome.buffers) == 1  # one raw buffer: outcome and oracle both call it 0
    return result, records


def landed_bytes(token: dict) -> np.ndarray:
    landed = decode_bytes(token["landed"]).view(np.int64)
    assert (landed >= 0).all(), "an element was not written"
    assert (landed >> 40 == 0).all()
    return landed & ((1 << 40) - 1)


@pytest.mark.parametrize(("backend", "kind", "layout", "block_size", "kernel"), [
    ("CPU_ATTN", "full", "LBHNC", 32, 32),  # the compiled cpu_attn_reshape_and_cache, the only layout CPU_ATTN lists
    ("CPU_ATTN", "full", "LBHNC", 64, 32),  # a manager block of two kernel blocks
    ("CPU_MLA", "mla", "LBNHC", 64, 16),
    ("AMX_MLA", "mla", "LBNHC", 64, 16),
])
def test_cpu_cache_writes_land_in_their_block_and_head(kvfuzz_target, backend, kind, layout, block_size, kernel):
    case = case_for(backend, kind, layout, block_size, kernel)
    result, records = probed(kvfuzz_target, case)
    assert result.verdict.status == "pass", result.verdict
    assert set(records) == set(LAYERS)
    for layer, record in records.items():
        assert [(t["block"], t["position"]) for t in record["tokens"]] == [(b, p % block_size) for b, p in TOKENS]
        for token in record["tokens"]:
            want = touch.token_map(case, result.expectation, layer, token["block"], token["position"], kind == "mla")
            at = landed_bytes(token)
            assert at.size == want.heads.size
            assert np.unique(at).size == at.size  # every element in a place of its own
            assert np.isin(at, want.block_bytes).all()
            for head, allowed in want.head_bytes.items():
                assert np.isin(at[want.heads == head], allowed).all()
            if want.offsets is not None:  # the backend keeps the contract's in-block order
                assert (at == want.offsets).all()
            assert not token["stray"]


def test_cpu_mla_writes_at_the_contract_positions(kvfuzz_target):
    # The MLA writers index the latent cache as [kernel block, slot, dims]: the oracle knows every element's byte.
    case = case_for("CPU_MLA", "mla", "LBNHC", 64, 16)
    result, records = probed(kvfuzz_target, case)
    token = records[LAYERS[1]]["tokens"][1]
    want = touch.token_map(case, result.expectation, LAYERS[1], 1, 5, True)
    assert want.offsets is not None
    layer_pages = 3 * 64 * 576 * 2  # layer 1 starts after layer 0's three blocks of 64 slots x 576 bf16
    assert int(want.offsets[0]) == layer_pages + (64 + 5) * 576 * 2
    assert (landed_bytes(token) == want.offsets).all()


# Each backend on a layout it accepts: CPU_ATTN takes LBHNC only; Triton's write (under the interpreter) any layout.
@pytest.mark.parametrize(("backend", "layout"), [("CPU_ATTN", "LBHNC"), ("TRITON_ATTN", "BLHNC")])
def test_layers_that_differ_in_heads_write_their_own_heads(kvfuzz_target, backend, layout):
    """A UniformTypeKVCacheSpecs group (0.29+): each layer's tokens carry that layer's KV heads, every one landing in its
    own head of its own layer's block."""
    if not kvfuzz_target.info.contract.layout_placed:
        pytest.skip("layers that differ in heads are drawn from vLLM 0.29")
    base = case_for(backend, "full", layout, 32, 32)
    group = dataclasses.replace(base.groups[0], layer_heads=(1, 3))
    case = dataclasses.replace(base, groups=(group,), packing="uniform_type")
    result, records = probed(kvfuzz_target, case)
    assert result.verdict.status == "pass", result.verdict
    for layer, heads in zip(LAYERS, (1, 3), strict=True):
        for token in records[layer]["tokens"]:
            want = touch.token_map(case, result.expectation, layer, token["block"], token["position"], False)
            at = landed_bytes(token)
            assert at.size == heads * 2 * 64  # K and V of every head of this layer, no more
            for head, allowed in want.head_bytes.items():
                assert np.isin(at[want.heads == head], allowed).all()
