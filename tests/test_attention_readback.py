"""The attention read-back (fuzz/checks/attention.py) on the installed vLLM: drawn keys and values written through each
backend's own cache write into the views vLLM built, read back by the backend's own forward (decode, and prefill with
context in the cache), held against attention computed directly from them (oracles/attention.py); and the same check
failing when the forward reads the cache otherwise than the write stored it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fuzz.case import Case, GroupCase, SpecCase
from fuzz.checks import attention
from fuzz.checks.protocol import Judging
from oracles import attention as oracle
from tests.sweep import sampled

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


@pytest.fixture(autouse=True)
def flex_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests read FLEX_ATTENTION's compiled forward too (campaigns leave it out: fuzz/checks/attention.py)."""
    monkeypatch.setenv("KVFUZZ_READ_FLEX", "1")


def test_a_campaign_leaves_the_compiled_flex_forward_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFUZZ_READ_FLEX")
    assert attention.driven("CPU_ATTN") and attention.driven("TRITON_ATTN") and not attention.driven("FLEX_ATTENTION")
    assert attention.CHECK.unrealistic(case_for("FLEX_ATTENTION", "LBNHC", 32)) is not None


def case_for(backend: str, layout: str, block_size: int, dtype: str = "bfloat16", kind: str = "full", num_blocks: int = 5,
             kernel_block_size: int | None = None, heads: int = 2, head_size: int = 64, pad: int = 0) -> Case:
    """A group of two layers; `pad` bytes added to each block's page (as vLLM pads attention pages to a Mamba page)."""
    window = 40 if kind == "sliding_window" else None
    page = 2 * block_size * heads * head_size * torch.finfo(getattr(torch, dtype)).bits // 8
    spec = SpecCase(kind=kind, block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype, sliding_window=window,
                    page_size_padded=page + pad if pad else None)
    group = GroupCase(spec=spec, layers=LAYERS, backend=backend, kernel_block_size=kernel_block_size)
    return Case(groups=(group,), num_blocks=num_blocks, layout=layout)


def walked(target, case: Case):
    if not hasattr(target, "walk"):
        pytest.skip("the target runs in another process (--kvfuzz-vllm): no walk here")
    if case.groups[0].backend not in {b.name for b in target.info.backends}:
        pytest.skip(f"vLLM {target.info.vllm_version} has no {case.groups[0].backend}")
    return target.walk(case)


def read_back(target, case: Case):
    walk = walked(target, case)
    run = attention.CHECK.offer(target.probe)
    assert callable(run), run
    record = run(walk)
    layer = record["layers"][LAYERS[0]]
    assert "output" in layer, layer
    return walk, record, layer


def judged(walk, target, record):
    return attention.CHECK.judge(Judging(walk.case, target.info.contract, None, None, None), record)


def drawn_batch(walk) -> oracle.Batch:
    return attention.batch_for(walk.case, 0, attention.keyed(walk.case).content_hash())


# ---------------------------------------------------------------------------------------------- the oracle alone


def one_request(seq_len: int, queries: int, window: int | None = None, heads: int = 1, kv_heads: int = 1) -> oracle.Batch:
    return oracle.Batch((oracle.Request((1,), seq_len, queries),), heads, kv_heads, 4, 4, 16, "float32", window, 0)


def test_oracle_decode_of_equal_keys_is_the_mean_of_the_values():
    batch = one_request(3, 1)
    keys = torch.ones(3, 1, 4)
    values = torch.arange(12, dtype=torch.float32).reshape(3, 1, 4)
    out = oracle.expected(batch, oracle.Drawn([keys], [values], torch.ones(1, 1, 4)))
    np.testing.assert_allclose(out[0, 0], values.double().mean(dim=0)[0].numpy())


def test_oracle_prefill_is_causal_and_windowed():
    values = torch.tensor([[[1.0, 0, 0, 0]], [[0, 1.0, 0, 0]], [[0, 0, 1.0, 0]]])
    drawn = oracle.Drawn([torch.zeros(3, 1, 4)], [values], torch.zeros(2, 1, 4))  # zero scores: uniform over what is seen
    causal = oracle.expected(one_request(3, 2), drawn)
    np.testing.assert_allclose(causal[:, 0], [[0.5, 0.5, 0, 0], [1 / 3, 1 / 3, 1 / 3, 0]])
    windowed = oracle.expected(one_request(3, 2, window=1), drawn)  # a window of one: each query sees itself
    np.testing.assert_allclose(windowed[:, 0], [[0, 1, 0, 0], [0, 0, 1, 0]])


def test_oracle_query_heads_read_their_kv_head():
    values = torch.stack([torch.full((4,), 1.0), torch.full((4,), -1.0)])[None]  # one token, KV heads 0 and 1
    drawn = oracle.Drawn([torch.zeros(1, 2, 4)], [values], torch.zeros(1, 4, 4))
    out = oracle.expected(one_request(1, 1, heads=4, kv_heads=2), drawn)
    np.testing.assert_allclose(out[0, :, 0], [1, 1, -1, -1])


def test_draws_give_no_request_the_null_block_and_share_no_block():
    for seed in range(50):
        block_size = (16, 256)[seed % 2]
        batch = oracle.draw_batch(seed, 2 + seed % 7, block_size, 2, 64, None, "bfloat16", None)
        blocks = [b for r in batch.requests for b in r.blocks]
        assert all(len(r.blocks) <= (2 if block_size <= oracle.LARGE_BLOCK else 1) for r in batch.requests)
        assert 0 not in blocks and len(blocks) == len(set(blocks))
        # every block of a request holds a token, the last at most MAX_TOKENS_IN_LAST_BLOCK
        assert all(0 < r.seq_len - (len(r.blocks) - 1) * block_size <= min(block_size, oracle.MAX_TOKENS_IN_LAST_BLOCK)
                   for r in batch.requests)
        assert batch.requests[-1].queries >= 2 and batch.requests[-1].context >= 1  # a prefill with context
        if len(batch.requests) == 2:
            assert batch.requests[0].queries == 1  # a decode first


def test_oracle_holds_what_a_per_token_head_quantized_cache_can():
    """One scale per (token, head): absmax over the head / the element's largest value; int8 rounds half away from zero,
    float8 e4m3 to its nearest value (16 apart between 128 and 256)."""
    x = torch.tensor([[[1.0, -0.5, 0.25, 0.0]], [[2.0, 0.0, 0.0, 0.0]]])
    np.testing.assert_allclose(oracle.stored(x, "int8_per_token_head"), [[[1.0, -64 / 127, 32 / 127, 0]], [[2.0, 0, 0, 0]]])
    y = torch.tensor([[[1.0, 0.5, 0.3, -1.0]]])
    np.testing.assert_allclose(oracle.stored(y, "fp8_per_token_head"), [[[1.0, 0.5, 128 / 448, -1.0]]], rtol=1e-6)
    np.testing.assert_array_equal(oracle.stored(y, "auto"), y.double().numpy())


def test_first_mismatch_names_the_earliest_query_and_the_key_it_newly_saw():
    batch = one_request(10, 4)
    want = np.zeros((4, 1, 4))
    got = want.copy()
    got[2:, 0, 1] = 0.5  # queries at positions 8 and 9 are off, the one at 7 is right: key 8 was read wrong
    mismatch = oracle.first_mismatch(batch, got, want, 0.01)
    assert (mismatch.request, mismatch.query, mismatch.head, mismatch.suspect_position) == (0, 8, 0, 8)
    assert oracle.first_mismatch(batch, want + 0.005, want, 0.01) is None


# ---------------------------------------------------------------------------------------------- CPU_ATTN


@pytest.mark.parametrize(("block_size", "dtype", "kind", "heads", "head_size", "num_blocks", "pad"), [
    (64, "bfloat16", "full", 2, 64, 5, 0),
    (32, "float16", "sliding_window", 2, 64, 5, 0),  # a window of 40 tokens across 32-token blocks
    (128, "float32", "full", 2, 64, 5, 0),
    (32, "bfloat16", "full", 4, 128, 3, 0),  # one block each for the decode and the prefill request
    (96, "bfloat16", "full", 1, 80, 6, 0),  # a head size the vec16 kernel takes
    (32, "bfloat16", "full", 2, 64, 4, 256),  # padded pages: the block stride is not the block's size
])
def test_cpu_attention_reads_back_what_its_write_stored(kvfuzz_target, block_size, dtype, kind, heads, head_size, num_blocks, pad):
    case = case_for("CPU_ATTN", "LBHNC", block_size, dtype, kind, num_blocks=num_blocks, heads=heads, head_size=head_size, pad=pad)
    walk, record, layer = read_back(kvfuzz_target, case)
    assert judged(walk, kvfuzz_target, record) is None
    assert layer["forward"].endswith("CPUAttentionBackendImpl.forward")
    assert layer["builder"].endswith("CPUAttentionMetadataBuilder.build")
    assert layer["kernel_block_size"] == walk.kernel_block_sizes[0]
    batch = drawn_batch(walk)
    assert [r.queries == 1 for r in batch.requests] == [True, False]  # a decode and a prefill with context
    assert layer["shape"] == [batch.num_tokens, batch.num_heads, batch.head_size]


def stride_halved(forward):
    """The forward, reading the cache with half the block stride the write used (block b from b * stride / 2)."""

    def misread(self, layer, query, key, value, kv_cache, *rest, **kwargs):
        strides = (kv_cache.stride(0) // 2, *kv_cache.stride()[1:])
        return forward(self, layer, query, key, value, kv_cache.as_strided(kv_cache.shape, strides, kv_cache.storage_offset()),
                       *rest, **kwargs)

    return misread


def test_a_forward_reading_another_block_stride_is_a_mismatch(kvfuzz_target, monkeypatch):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", stride_halved(CPUAttentionBackendImpl.forward))
    walk, record, _ = read_back(kvfuzz_target, case_for("CPU_ATTN", "LBHNC", 32))
    finding = judged(walk, kvfuzz_target, record)
    assert finding is not None and finding.kind == attention.MISMATCH
    assert finding.function == "CPUAttentionBackendImpl.forward" and finding.layer == LAYERS[0]
    batch = drawn_batch(walk)
    assert f"request 0 (decode, blocks {list(batch.requests[0].blocks)}" in finding.message  # no block is block 0: all misread


def test_a_token_the_forward_reads_wrong_is_named(kvfuzz_target, monkeypatch):
    """Between the write and the read, one key and value of the prefill request change (rewritten through the backend's
    own write): the finding names the first query that sees it, and that token, its manager and kernel block."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    case = case_for("CPU_ATTN", "LBHNC", 32, kernel_block_size=None)
    walk = walked(kvfuzz_target, case)
    batch = drawn_batch(walk)
    prefill = batch.requests[-1]
    position = prefill.context + 1
    slot = int(batch.slots(prefill)[position])
    forward = CPUAttentionBackendImpl.forward

    def forward_after_overwrite(self, layer, query, key, value, kv_cache, *rest, **kwargs):
        other = torch.full((1, batch.num_kv_heads, batch.head_size), 2.0, dtype=query.dtype)
        self.do_kv_cache_update(layer, other, -other, kv_cache, torch.tensor([slot]))
        return forward(self, layer, query, key, value, kv_cache, *rest, **kwargs)

    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", forward_after_overwrite)
    record = attention.CHECK.offer(kvfuzz_target.probe)(walk)
    finding = judged(walk, kvfuzz_target, record)
    assert finding is not None and finding.kind == attention.MISMATCH
    block = prefill.blocks[position // 32]
    assert f"request {len(batch.requests) - 1} (prefill" in finding.message
    assert f"query token {position}," in finding.message
    assert f"first read wrong: token {position} (manager block {block}, kernel block {block}, offset {position % 32})" in finding.message


def test_cases_it_does_not_read_are_skipped_with_a_reason(kvfuzz_target):
    from fuzz.checks.protocol import Unusable

    walk = walked(kvfuzz_target, case_for("CPU_ATTN", "LBHNC", 32, num_blocks=1))
    with pytest.raises(Unusable, match="null block"):
        attention.CHECK.offer(kvfuzz_target.probe)(walk)


# ---------------------------------------------------------------------------------------------- FLEX_ATTENTION, TRITON_ATTN


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "block_size", "dtype", "kind", "pad"), [
    ("FLEX_ATTENTION", 32, "bfloat16", "full", 0),
    ("FLEX_ATTENTION", 16, "float32", "sliding_window", 0),
    ("TRITON_ATTN", 16, "float16", "full", 0),
    ("TRITON_ATTN", 32, "float32", "sliding_window", 0),
    ("TRITON_ATTN", 16, "float16", "full", 256),  # padded pages, read through the view's strides
])
def test_other_backends_read_back_what_their_write_stored(kvfuzz_target, backend, block_size, dtype, kind, pad):
    from fuzz.targets import triton_interp

    if not triton_interp.interpreting():
        pytest.skip("TRITON_INTERPRET=1 was not set before Triton was imported")
    walk, record, layer = read_back(kvfuzz_target, case_for(backend, "LBNHC", block_size, dtype, kind, pad=pad))
    assert judged(walk, kvfuzz_target, record) is None
    assert layer["backend"] == backend
    uncompiled = [s for s in layer["stand_ins"] if s.endswith("run uncompiled")]
    assert bool(uncompiled) == (backend == "FLEX_ATTENTION"), layer["stand_ins"]


def test_triton_forward_in_bfloat16_is_skipped_under_the_interpreter(kvfuzz_target):
    from fuzz.checks.protocol import Unusable
    from fuzz.targets import triton_interp

    if not triton_interp.interpreting():
        pytest.skip("Triton compiles natively here")
    walk = walked(kvfuzz_target, case_for("TRITON_ATTN", "LBNHC", 16, "bfloat16"))
    with pytest.raises(Unusable, match="interpreter"):
        attention.CHECK.offer(kvfuzz_target.probe)(walk)


@pytest.mark.slow
def test_triton_forward_reading_another_block_stride_is_a_mismatch(kvfuzz_target, monkeypatch):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from fuzz.targets import triton_interp

    if not triton_interp.interpreting():
        pytest.skip("TRITON_INTERPRET=1 was not set before Triton was imported")
    monkeypatch.setattr(TritonAttentionImpl, "forward", stride_halved(TritonAttentionImpl.forward))
    walk, record, _ = read_back(kvfuzz_target, case_for("TRITON_ATTN", "LBNHC", 16))
    finding = judged(walk, kvfuzz_target, record)
    assert finding is not None and finding.kind == attention.MISMATCH and finding.function == "TritonAttentionImpl.forward"


@pytest.mark.slow
def test_flex_attention_forward_cannot_read_a_padded_page(kvfuzz_target):
    """vLLM 0.32.0: FLEX_ATTENTION's write lands in a padded page (through the view's strides), and its forward then
    flattens the cache's blocks with `.view(-1, heads, head_size)`, which a block stride larger than the block refuses."""
    from fuzz.targets import triton_interp

    if not triton_interp.interpreting():
        pytest.skip("TRITON_INTERPRET=1 was not set before Triton was imported")
    walk = walked(kvfuzz_target, case_for("FLEX_ATTENTION", "LBNHC", 16, "float16", pad=256))
    record = attention.CHECK.offer(kvfuzz_target.probe)(walk)
    finding = judged(walk, kvfuzz_target, record)
    assert finding is not None and finding.kind == attention.ERROR, record
    assert finding.function == "forward" and "view size is not compatible" in finding.message
    assert record["layers"][LAYERS[0]]["error"]["file"] == "v1/attention/backends/flex_attention.py"


def test_flex_attention_builder_refuses_a_block_size_vllm_picked_for_it(kvfuzz_target):
    """vLLM 0.32.0: FLEX_ATTENTION declares kernel blocks of any multiple of 16, so a 48-token block is its kernel block,
    and its metadata builder then refuses it (`_get_block_sizes`: a power of 2 only)."""
    from fuzz.targets import triton_interp

    if not triton_interp.interpreting():
        pytest.skip("TRITON_INTERPRET=1 was not set before Triton was imported")
    walk = walked(kvfuzz_target, case_for("FLEX_ATTENTION", "LBNHC", 48, "float16"))
    assert walk.kernel_block_sizes == [48]
    record = attention.CHECK.offer(kvfuzz_target.probe)(walk)
    error = record["layers"][LAYERS[0]]["error"]
    assert error["stage"] == "metadata builder constructor" and error["function"] == "_get_block_sizes"
    finding = judged(walk, kvfuzz_target, record)
    assert finding is not None and finding.kind == attention.ERROR and "must be a power of 2" in finding.message


RELEASE_SCRIPT = """
import json
from fuzz.checks import attention
from fuzz.targets import triton_interp
from fuzz.targets.loader import load_local
from tests.test_attention_readback import LAYERS, case_for, judged, stride_halved
import vllm
target = load_local()
offered = attention.CHECK.offer(target.probe)
out = {"version": vllm.__version__, "off": getattr(offered, "reason", None), "interpreting": triton_interp.interpreting()}
layout = "LBNHC" if target.info.contract.layout_placed else "NHD"
cases = {"decode-and-prefill": case_for("TRITON_ATTN", layout, 16, "float16"),
         "kernel-blocks": case_for("TRITON_ATTN", layout, 32, "float32", kernel_block_size=16),
         "window": case_for("TRITON_ATTN", layout, 32, "float32", "sliding_window")}
if MISREAD:
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    TritonAttentionImpl.forward = stride_halved(TritonAttentionImpl.forward)
for name, case in cases.items() if callable(offered) else ():
    walk = target.walk(case)
    record = offered(walk)
    finding = judged(walk, target, record)
    layer = record["layers"][LAYERS[0]]
    out[name] = {"finding": None if finding is None else [finding.kind, finding.function], "read": "output" in layer,
                 "kernel_block_size": layer.get("kernel_block_size"), "walked": walk.kernel_block_sizes[0]}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.releases
@pytest.mark.parametrize("version", sampled(["0.19.1", "0.22.0", "0.28.0", "0.31.0"], ["0.31.0"]))
@pytest.mark.parametrize("misread", [False, True], ids=["as-written", "another-block-stride"])
def test_releases_before_0_32_read_back_through_the_runner_s_block_table(version, misread, tmp_path, monkeypatch):
    """Before 0.32 the runner maps kernel blocks in its BlockTable (`map_to_kernel_blocks`) and hands its builder the
    kernel-block table: the check does the same, and TRITON_ATTN's forward (Triton's interpreter) reads back decode and
    prefill tokens, through kernel blocks and a window; the forward made to read with half the block stride is found."""
    if misread and version == "0.19.1":
        # Wrapped by this test, 0.19.1's forward is one the check cannot tell interpretable (it skips the layer: "launches
        # a Triton kernel that is neither compiled nor interpretable here"); the misread is tested on the later releases.
        pytest.skip("0.19.1's forward, wrapped by the test, is skipped by the check's interpreter rule")
    from tests.processes import run_in_release

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = run_in_release(version, f"MISREAD = {misread}\n{RELEASE_SCRIPT}", tmp_path)
    assert out["version"] == version and out["off"] is None and out["interpreting"], out
    for name in ("decode-and-prefill", "kernel-blocks", "window"):
        if misread:  # read wrong, or refused by the kernel's own checks on the strides it was handed: reported either way
            assert out[name]["finding"] is not None and out[name]["finding"][0] in (attention.MISMATCH, attention.ERROR), (name, out[name])
        else:
            assert out[name]["read"] and out[name]["finding"] is None, (name, out[name])
    if not misread:
        assert out["kernel-blocks"]["kernel_block_size"] == out["kernel-blocks"]["walked"]  # the kernel blocks vLLM picked


def test_the_installed_release_offers_the_read_back():
    assert attention.CHECK.offer(None) is attention.run
