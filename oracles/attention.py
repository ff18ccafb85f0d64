"""Attention read back from the KV cache, computed directly from the keys, values and queries that were written.

The attention check (fuzz/checks/attention.py) writes drawn keys and values into vLLM's views through a backend's own
cache write and runs the backend's own forward on drawn queries. This module draws that batch from the case alone (so
the judge redraws exactly what the run wrote, and never needs vLLM) and computes what the forward must return:
softmax(q k^T * scale) v per request and query head, in float64, on the values as the cache's dtype holds them, with
grouped-query heads (query head h reads KV head h // (heads / KV heads)), causal masking of every query against the
keys after its own position, and the spec's sliding window (a query at position i sees keys i - window + 1 .. i).

Never imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Requests read at most this many manager blocks each (one where blocks are larger than LARGE_BLOCK tokens: a request of
# two such blocks reads a whole block first, which costs minutes under Triton's interpreter), and prefill queries at most
# MAX_PREFILL_QUERIES tokens: one forward stays cheap and still crosses a block boundary wherever a request has two blocks.
MAX_BLOCKS_PER_REQUEST = 2
LARGE_BLOCK = 128
MAX_PREFILL_QUERIES = 12
# A request's last block holds at most this many tokens (the kernels read whole blocks; a boundary needs only a few).
MAX_TOKENS_IN_LAST_BLOCK = 48
# Queries are drawn larger than keys so softmax concentrates on a few keys: a key read from the wrong place then moves
# the output far beyond rounding.
QUERY_GAIN = 3.0
# Unit roundoff of each dtype's significand; the forward rounds its inputs' products, the softmax weights and its output
# at most a few times in that dtype, accumulating in float32.
ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}
FLOAT32_ACCUMULATE = 2.0 ** -24
# Per-token-head quantized caches: each (token, head) of K and of V stored as round(x / scale) in the cache's element,
# scale = max(absmax / largest element, SMALLEST_SCALE) kept in float32 beside it. int8 rounds half away from zero;
# float8 (e4m3) rounds to nearest even on the cast.
QUANTIZED = {"int8_per_token_head": (127.0, -128.0), "fp8_per_token_head": (448.0, -448.0)}
SMALLEST_SCALE = 1e-6


@dataclass(frozen=True)
class Request:
    blocks: tuple[int, ...]  # manager blocks holding tokens 0, block_size, 2 * block_size, ... of the request
    seq_len: int  # tokens in the cache once this step's are written (context + queries)
    queries: int  # this step's tokens: the last `queries` positions (1: a decode)

    @property
    def context(self) -> int:
        return self.seq_len - self.queries


@dataclass(frozen=True)
class Batch:
    """One forward's inputs, drawn from the case: requests in the order the batch lists them (decodes first)."""

    requests: tuple[Request, ...]
    num_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    block_size: int  # the manager's
    dtype: str
    sliding_window: int | None
    seed: int
    cache_dtype: str = "auto"  # a per-token-head quantized cache (QUANTIZED) holds keys and values as its format can

    @property
    def scale(self) -> float:
        return self.head_size ** -0.5

    @property
    def num_tokens(self) -> int:
        return sum(r.queries for r in self.requests)

    def slots(self, request: Request) -> np.ndarray:
        """Each of the request's tokens' slot: manager block * block_size + position in the block (kernel blocks split a
        manager block in place, so the slot is the same counted in either)."""
        positions = np.arange(request.seq_len)
        return np.asarray(request.blocks)[positions // self.block_size] * self.block_size + positions % self.block_size


@dataclass(frozen=True)
class Drawn:
    """The batch's tensors in its dtype: per request keys (seq_len, KV heads, head size) and values; queries of all
    requests' new tokens, concatenated (tokens, heads, head size)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    queries: torch.Tensor


def seed_of(case_hash: str, group: int) -> int:
    return (int(case_hash, 16) + 7919 * group) % (2 ** 63)


def draw_batch(seed: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, head_size_v: int | None,
               dtype: str, sliding_window: int | None, cache_dtype: str = "auto") -> Batch:
    """A decode request and a prefill request with context already in the cache, on distinct manager blocks drawn from
    the case's pool, block 0 excepted (vLLM's block pool keeps it as the null block no request is given); with a single
    block to give, the prefill request alone."""
    rng = np.random.default_rng(seed)
    order = [int(b) for b in rng.permutation(np.arange(1, num_blocks))]
    if not order:
        raise ValueError("a pool of one block holds only the null block")
    most = MAX_BLOCKS_PER_REQUEST if block_size <= LARGE_BLOCK else 1
    if len(order) > 1:
        decode_blocks = min(most, len(order) - 1)
        shares = [(True, order[:decode_blocks]), (False, order[decode_blocks:decode_blocks + most])]
    else:
        shares = [(False, order)]
    requests: list[Request] = []
    for decode, blocks in shares:
        full = (len(blocks) - 1) * block_size
        room = full + min(block_size, MAX_TOKENS_IN_LAST_BLOCK)
        seq_len = int(rng.integers(min(max(full + 1, 3), room), room + 1))
        queries = 1 if decode else int(rng.integers(2, max(min(seq_len - 1, MAX_PREFILL_QUERIES), 2) + 1))
        requests.append(Request(tuple(blocks), seq_len, queries))
    group_size = int(rng.choice([1, 2]))
    return Batch(tuple(requests), num_kv_heads * group_size, num_kv_heads, head_size, head_size_v or head_size, block_size, dtype,
                 sliding_window, seed, cache_dtype)


def tensors(batch: Batch) -> Drawn:
    """Keys and queries normal, values uniform in [-1, 1), drawn in float32 (cheap to round) and rounded to the dtype."""
    rng = np.random.default_rng(batch.seed + 1)
    dtype = getattr(torch, batch.dtype)

    def normal(*shape: int, gain: float = 1.0) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * np.float32(gain)).to(dtype)

    def uniform(*shape: int) -> torch.Tensor:
        return torch.from_numpy(rng.random(shape, dtype=np.float32) * 2 - 1).to(dtype)

    keys = [normal(r.seq_len, batch.num_kv_heads, batch.head_size) for r in batch.requests]
    values = [uniform(r.seq_len, batch.num_kv_heads, batch.head_size_v) for r in batch.requests]
    queries = normal(batch.num_tokens, batch.num_heads, batch.head_size, gain=QUERY_GAIN)
    return Drawn(keys, values, queries)


def expected(batch: Batch, drawn: Drawn) -> np.ndarray:
    """The forward's output (tokens, heads, V head size), float64."""
    out = np.zeros((batch.num_tokens, batch.num_heads, batch.head_size_v))
    group = batch.num_heads // batch.num_kv_heads
    start = 0
    for request, keys, values in zip(batch.requests, drawn.keys, drawn.values, strict=True):
        q = drawn.queries[start:start + request.queries].double().numpy()  # (queries, heads, size)
        k = stored(keys, batch.cache_dtype)[:, np.arange(batch.num_heads) // group]  # (seq, heads, size)
        v = stored(values, batch.cache_dtype)[:, np.arange(batch.num_heads) // group]
        scores = np.einsum("qhd,khd->hqk", q, k) * batch.scale
        scores = np.where(visible(batch, request)[None], scores, -np.inf)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[start:start + request.queries] = np.einsum("hqk,khd->qhd", weights, v)
        start += request.queries
    return out


def stored(x: torch.Tensor, cache_dtype: str) -> np.ndarray:
    """The values a cache of `cache_dtype` holds for x (tokens, heads, size), float64: x itself in a plain cache, else
    each (token, head) quantized with its own scale and multiplied back."""
    if cache_dtype not in QUANTIZED:
        return x.double().numpy()
    largest, smallest = QUANTIZED[cache_dtype]
    wide = x.float()
    scale = (wide.abs().amax(dim=-1, keepdim=True) / largest).clamp_min(SMALLEST_SCALE)
    ratio = wide * (1.0 / scale)
    if cache_dtype.startswith("int8"):
        held = torch.trunc(torch.where(ratio >= 0, ratio + 0.5, ratio - 0.5)).clamp(smallest, largest)
    else:
        held = ratio.clamp(smallest, largest).to(torch.float8_e4m3fn).float()
    return (held.double() * scale.double()).numpy()


def visible(batch: Batch, request: Request) -> np.ndarray:
    """(queries, seq_len): whether each query sees each key (causal, and inside the sliding window)."""
    query_positions = np.arange(request.context, request.seq_len)[:, None]
    key_positions = np.arange(request.seq_len)[None, :]
    seen = key_positions <= query_positions
    if batch.sliding_window is not None:
        seen &= key_positions > query_positions - batch.sliding_window
    return seen


def tolerance(dtype: str) -> float:
    """Absolute error allowed on an output element (values lie in [-1, 1]): the dtype's roundoff a handful of times (its
    inputs, the softmax weights cast back to it, the output), plus float32 accumulation over a request's keys."""
    return 8 * ROUNDOFF[dtype] + 1024 * FLOAT32_ACCUMULATE


@dataclass(frozen=True)
class Mismatch:
    request: int
    query: int  # position of the query token in its request
    head: int
    got: float
    want: float
    error: float
    suspect_position: int | None  # the key token the forward read wrong, where the earlier queries narrow it to one
    bad_elements: int

    def token_place(self, batch: Batch, kernel_block_size: int) -> str:
        if self.suspect_position is None:
            return ""
        request = batch.requests[self.request]
        block = request.blocks[self.suspect_position // batch.block_size]
        offset = self.suspect_position % batch.block_size
        kernel = block * (batch.block_size // kernel_block_size) + offset // kernel_block_size
        return (f"; first read wrong: token {self.suspect_position} (manager block {block}, kernel block {kernel}, "
                f"offset {offset % kernel_block_size})")


def first_mismatch(batch: Batch, got: np.ndarray, want: np.ndarray, atol: float) -> Mismatch | None:
    """The mismatching output element of the earliest query (by request, then position), and where the queries before
    it narrow the wrong read to one key token: a causal query at position p sees exactly one key more than the query
    at p - 1, so if that one matched, the key at p (or, under a sliding window, a key the window just let in) is the
    first read wrong."""
    error = np.abs(got - want)
    bad = ~(error <= atol)  # NaN counts as bad
    if not bad.any():
        return None
    start = 0
    for index, request in enumerate(batch.requests):
        rows = bad[start:start + request.queries]
        if rows.any():
            query = int(np.flatnonzero(rows.any(axis=(1, 2)))[0])
            head = int(np.flatnonzero(rows[query].any(axis=1))[0])
            element = int(np.flatnonzero(rows[query, head])[0])
            position = request.context + query
            suspect = position if query > 0 and batch.sliding_window is None else None
            at = (start + query, head, element)
            return Mismatch(index, position, head, float(got[at]), float(want[at]), float(error[at]), suspect, int(bad.sum()))
        start += request.queries
    raise AssertionError("unreachable: a bad element lies in some request")
