"""The space of cases, defined once and drawn from any source of choices.

`draw_case(source, info)` builds a Case a real vLLM configuration could build, from the target's
own declarations (TargetInfo: its spec kinds, backends, kernel block sizes, layouts, dtypes):
- the kernel block size is the one vLLM's rule picks for the group's backends;
- layouts are ones every backend of the case accepts;
- hybrid groups get pages the hybrid allocator can pool (one page size on backend-shaped
  releases; a Mamba page is padded to the attention page), and a Mamba group has a layer in
  every pool;
- cache dtypes, compression, alignment and head_size_v appear only where the target's spec
  classes and backends express them.
Choices are biased toward compression, padding, kernel splitting and hybrid groups. Every
option list starts with its simplest entry and integers shrink toward their lower bound, so a
shrinking source (Hypothesis) moves toward one group, one layer, one block and default dtypes.

Sources: `RandomSource` (the campaign's fast path), `fuzz.strategies.HypothesisSource`
(shrinking, pytest) and `fuzz.engines.provider.ProviderSource` (coverage-guided).
"""

from __future__ import annotations

import bisect
import functools
import random
from collections.abc import Sequence
from typing import NoReturn, Protocol, TypeVar

import oracles
from fuzz.case import (
    DTYPE_SIZES,
    LAYOUT_EQUIVALENTS,
    MLA_KINDS,
    MODEL_DTYPES,
    PACKINGS,
    RUNNERS,
    WINDOWED_KINDS,
    Case,
    GroupCase,
    SpecCase,
    SyntheticBackend,
    Touches,
    layout_as,
    replace,
)
from fuzz.checks import registry
from fuzz.targets.base import BackendInfo, TargetInfo
from oracles import contract, dtypes, pages

T = TypeVar("T")

# Numbers are drawn from ranges, biased toward their edges (the low end, 2, powers of two, primes,
# the high end), never from the numbers of known bugs; integers shrink toward the low end.
MAX_BLOCK_SIZE = 1024
MAX_HEAD_SIZE = 1024
MAX_HEADS = 8
MAMBA_DTYPES = ("float32", "bfloat16", "float16")
# DeepSeek records a release builds only from a version on: V4.1's MXFP8 record, 528 bytes a token, from vLLM 0.30.0
# (vllm/models/deepseek_v41, "V4.1 (528 B)"; 0.28 - 0.29 size fp8_ds_mla caches at 584 or 656 bytes only).
RECORDS_SINCE = {528: (0, 30)}
ALL_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8", "int8")
# Declared cache shapes of synthetic backends on backend-shaped releases, with the stride
# orders such a backend may declare; each covers heads x (K + V) or one MLA latent per slot.
SYNTHETIC_SHAPES: dict[bool, tuple[tuple[tuple[int | str, ...], tuple[tuple[int, ...], ...]], ...]] = {
    False: (
        (("B", 2, "T", "H", "D"), ((0, 1, 2, 3, 4), (0, 1, 3, 2, 4))),
        ((2, "B", "T", "H", "D"), ((0, 1, 2, 3, 4), (0, 1, 3, 2, 4))),
        (("B", "H", "T", "2*D"), ((0, 1, 2, 3), (0, 2, 1, 3))),
        (("B", "T", "H", "2*D"), ((0, 1, 2, 3), (0, 2, 1, 3))),
    ),
    True: ((("B", "T", "D"), ((0, 1, 2),)),),
}

# Cache dtypes, quant modes and their storage come from the target (TargetInfo.cache_dtypes,
# quant_modes: the release's own tables); what a dtype's page holds comes from its definition
# (oracles/dtypes.py). Storage dtypes kvfuzz's own registered cache dtypes may declare:
REGISTERED_STORAGE = ("uint8", "int8", "float8_e4m3fn", "bfloat16", "float16")
KIND_ORDER = ("full", "sliding_window", "mla", "sliding_window_mla", "chunked_local", "sink", "cross", "encoder_only", "mamba")
LAYOUT_ORDER = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC", "NHD", "HND")
MAX_BUFFER_BYTES = 1 << 20
# Production scale: block counts and geometry of real deployments, up to a million blocks and a TiB
# of buffer. Such buffers are described, not allocated: the target runs on the meta device.
MAX_PRODUCTION_BLOCKS = 1 << 20
MAX_PRODUCTION_BYTES = 1 << 40
MAX_PRODUCTION_HEADS = 64
# A case the contract rejects is kept this often (percent); the others are redrawn, so most cases
# test layouts vLLM must build while refusals stay covered.
KEEP_REJECTED = 30
# Groups of mixed page sizes in a layer-outer layout vLLM's layout resolution would not pick (percent of such cases).
FORCED_LAYOUT = 5
# Models with no KV cache at all (attention-free: the planner's early return), percent of cases.
ATTENTION_FREE = 2
# Models of Mamba layers only (Mamba, Mamba2 and their kin: one group of states, no attention page), percent of cases.
MAMBA_ONLY = 3
# A later attention group on another backend than the first's, sharing its pools (percent of such groups on releases
# whose backends shape the cache): encoder-decoder cross-attention, a drafter on its own backend.
MIXED_BACKENDS = 25
# The pairs of attention backends vLLM puts in one model's shared pools (vLLM pull requests): ROCm encoder-decoders run
# self-attention on ROCM_ATTN and cross-attention on a blocks-first backend (#38450, #43945, #47035, #47685), and
# speculative decoding lets a drafter take its own backend (#39930; DFlash's FLEX_ATTENTION beside TRITON_ATTN, #41657;
# a ROCM_ATTN drafter beside TRITON_ATTN, #50237).
MIXED_BACKEND_PAIRS = frozenset({
    frozenset({"ROCM_ATTN", "TRITON_ATTN"}),
    frozenset({"ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN"}),
    frozenset({"TRITON_ATTN", "FLEX_ATTENTION"}),
    frozenset({"FLASH_ATTN", "FLEX_ATTENTION"}),
})


class Source(Protocol):
    """Where the choices come from."""

    def integer(self, low: int, high: int) -> int: ...

    def choice(self, options: Sequence[T]) -> T: ...

    def chance(self, percent: int) -> bool:
        """True with about this probability; shrinks toward False."""
        ...

    def reject(self) -> NoReturn:
        """These choices make no valid case."""
        ...


class Rejected(Exception):
    pass


class RandomSource:
    """Choices from a seeded random.Random: fast, and replayable from (seed, index)."""

    def __init__(self, rng: random.Random) -> None:
        self.random = rng.random  # one float per choice: the fastest uniform draw random offers

    def integer(self, low: int, high: int) -> int:
        return low + int(self.random() * (high - low + 1))

    def choice(self, options: Sequence[T]) -> T:
        return options[int(self.random() * len(options))]

    def chance(self, percent: int) -> bool:
        return self.random() * 100 < percent

    def reject(self) -> NoReturn:
        raise Rejected


PRIMES = tuple(n for n in range(2, 4097) if all(n % d for d in range(2, int(n**0.5) + 1)))


PRIME_SET = frozenset(PRIMES)


def _primes(low: int, high: int) -> tuple[int, ...]:
    return PRIMES[bisect.bisect_left(PRIMES, low):bisect.bisect_right(PRIMES, high)]


def edge_int(source: Source, low: int, high: int) -> int:
    """An integer in [low, high], biased toward its edges: low, low + 1, a power of two, a prime, high, or any (drawn
    log-uniformly, so small and large magnitudes are equally likely)."""
    if high <= low:
        return low
    kind = source.integer(0, 5)
    if kind == 0:
        return low
    if kind == 1:
        return low + 1
    if kind == 2:
        powers = [1 << k for k in range(max(0, (low - 1).bit_length()), high.bit_length()) if low <= 1 << k <= high]
        if powers:
            return source.choice(powers)
    elif kind == 3:
        primes = _primes(low, min(high, PRIMES[-1]))
        if primes:
            return source.choice(primes)
    elif kind == 4:
        return high
    bits = source.integer(max(1, low.bit_length()), high.bit_length())
    return source.integer(max(low, 1 << (bits - 1)), min(high, (1 << bits) - 1))


def edge_divisor(source: Source, number: int) -> int:
    """A divisor of `number`, biased toward 1, 2, powers of two, primes and `number` itself."""
    divisors = _divisors(number)
    if len(divisors) == 1:
        return divisors[0]
    kind = source.integer(0, 4)
    if kind == 0:
        return 1
    if kind == 1 and number % 2 == 0:
        return 2
    if kind == 2:
        return number
    picked = [d for d in divisors if (kind == 3 and d & (d - 1) == 0) or (kind == 4 and d in PRIME_SET)]
    return source.choice(picked or divisors)


@functools.lru_cache(maxsize=1024)
def _divisors(number: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, number + 1) if number % d == 0)


def simpler_block_sizes(block_size: int) -> list[int]:
    """Smaller block sizes a minimizer may try: powers of two and divisors below `block_size`, simplest first."""
    powers = [1 << k for k in range(block_size.bit_length()) if 1 << k < block_size]
    return sorted(set(powers) | {d for d in _divisors(block_size) if d < block_size})


def case_seed(campaign_seed: int, index: int) -> int:
    """The seed of case `index` of a campaign: any worker can redraw any case alone."""
    return (campaign_seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)


def draw_indexed(info: TargetInfo, campaign_seed: int, index: int, synthetic: bool = True, attempts: int = 50,
                 scale: str = "small", touches: bool = False) -> Case:
    """Case `index` of a campaign: deterministic for a given target, seed and index."""
    rng = random.Random(case_seed(campaign_seed, index))
    source = RandomSource(rng)
    for _ in range(attempts):
        try:
            return draw_case(source, info, synthetic=synthetic, scale=scale, touches=touches)
        except Rejected:
            continue
    raise Rejected(f"no valid case in {attempts} attempts for index {index}")


def ordered(items: Sequence[str], order: Sequence[str]) -> list[str]:
    return list(_ordered(tuple(items), tuple(order)))


@functools.lru_cache(maxsize=1024)
def _ordered(items: tuple[str, ...], order: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(items, key=lambda x: order.index(x) if x in order else len(order)))


def draw_case(source: Source, info: TargetInfo, synthetic: bool = True, max_groups: int = 3, scale: str = "small",
              touches: bool = False) -> Case:
    """A case; with `touches`, also what the consumers and the kernel probe are asked on it (drawn last)."""
    shaped = not info.contract.layout_placed
    production = scale == "production"
    kinds = ordered([k for k in info.spec_kinds if k != "mamba"], KIND_ORDER)
    first_kind = source.choice(kinds)
    group_kinds = [first_kind]
    if first_kind != "encoder_only":
        family = [k for k in kinds if (k in MLA_KINDS) == (first_kind in MLA_KINDS) and k != "encoder_only"]
        extras = family + (["mamba"] if "mamba" in info.spec_kinds else [])
        for _ in range(source.integer(0, max_groups - 1)):
            group_kinds.append(source.choice(extras))
    cache_dtype: str | None = None  # backend-shaped releases take one cache dtype per model
    groups: list[GroupCase] = []
    layouts = set(info.layouts)
    for kind in group_kinds:
        if kind == "mamba":
            continue
        layer_count = source.integer(1, 3)
        group = _attention_group(source, info, kind, len(groups), layer_count, synthetic, shaped, cache_dtype, groups[0] if groups else None,
                                 production)
        if shaped:
            cache_dtype = group.spec.cache_dtype
        allowed = accepted_layouts(group, info)
        if allowed is not None:
            layouts &= set(allowed)
        groups.append(group)
    if len({g.backend for g in groups if g.backend}) > 2:
        # A model's pools take a second backend for one reason (encoder-decoder cross-attention, a drafter:
        # MIXED_BACKEND_PAIRS), never a third.
        source.reject()
    mamba_groups = group_kinds.count("mamba")
    if mamba_groups:
        attention_page = pages.page(groups[0].spec).page_bytes
        depth = max(len(g.layers) for g in groups)
        for _ in range(mamba_groups):
            spec = _mamba_spec(source, groups[0].spec.block_size, attention_page, info)
            names = tuple(f"g{len(groups)}.l{j}" for j in range(depth + source.integer(0, 1)))
            groups.append(GroupCase(spec=spec, layers=names, kernel_block_size=spec.block_size))
    group_pages = [pages.page(g.spec) for g in groups]
    if len({p.page_bytes for p in group_pages}) > 1:
        if shaped:
            source.reject()
        # Now and then a layer-outer layout a user forces (VLLM_KV_CACHE_LAYOUT) on several groups: vLLM must refuse it.
        forced = len(groups) > 1 and source.chance(FORCED_LAYOUT)
        layouts = {name for name in layouts if set(name[:2]) == {"L", "B"} and (len(groups) == 1 or name[0] == "B" or forced)}
    if len({(p.heads, p.states, p.page_bytes) for p in group_pages}) > 1:
        # vLLM's layout resolution keeps block-compact layouts only for mixed page shapes.
        layouts = {name for name in layouts if _block_compact(name)}
    if not layouts:
        source.reject()
    layout = source.choice(ordered(sorted(layouts), LAYOUT_ORDER))
    sharing: tuple[tuple[str, str], ...] = ()
    if info.kv_sharing and source.chance(15):
        sharing = (("g0.shared", groups[0].layers[-1]),)
    case = Case(groups=tuple(groups), num_blocks=1, layout=layout, kv_sharing=sharing)
    # Bytes per block as the contract lays the case out (alignments of several groups can multiply them).
    per_block = max(buffer_bytes(case), oracles.buffer_bytes(case, info.contract))
    cap = MAX_PRODUCTION_BYTES if production else MAX_BUFFER_BYTES
    if per_block > cap:
        source.reject()
    # As many blocks as the buffer cap allows at most; few, some or many, biased toward the edges.
    most = min(cap // per_block, MAX_PRODUCTION_BLOCKS if production else 4)
    case = Case(groups=case.groups, num_blocks=edge_int(source, 1, most), layout=layout, kv_sharing=sharing)
    if not source.chance(KEEP_REJECTED) and not oracles.expect(case, info.contract).accepted:
        source.reject()
    # Drawn last, so the rest of a case depends on (seed, index) as it did before these options existed.
    case = _with_options(source, info, case)
    if info.attention_free and source.chance(ATTENTION_FREE):
        return Case(groups=(), num_blocks=case.num_blocks, layout=case.layout)
    if "mamba" in info.spec_kinds and source.chance(MAMBA_ONLY):
        case = _mamba_only(source, info, case)
    if not touches:
        return case
    # Drawn after them, so the layout a seed draws does not depend on them (campaigns keep them on some cases only: for_run).
    return replace(case, touches=_touches(source, info, case))


def _with_options(source: Source, info: TargetInfo, case: Case) -> Case:
    """The case with the model runner(s) that build its views, how the planner packs it, whether vLLM builds its specs
    from layers and the platform its allocation runs as, each drawn where the target has it (simplest option first)."""
    runner = source.choice(RUNNERS if "v1" in info.runners else RUNNERS[:1])
    if v1_only_mamba(case, info):
        runner = "v1"
    packing = "none"
    if len(info.packings) > 1 and source.chance(30):
        offered = [p for p in PACKINGS[1:] if p in info.packings and packing_reason(case, info, p) is None]
        packing = source.choice(offered) if offered else "none"
    if packing == "uniform_type" and info.contract.layout_placed:
        # From 0.29 vLLM's planner sees a UniformTypeKVCacheSpecs group only for layers that differ in size.
        case = replace(case, groups=tuple(_differing_layers(source, info, g) for g in case.groups))
    elif packing == "uniform_type" and info.contract.page_buckets and len(case.groups) > 1:
        # DeepSeek V4's planner (0.23) buffers such groups by page size: let later groups' pages differ.
        case = replace(case, groups=case.groups[:1] + tuple(_fewer_heads(source, g) for g in case.groups[1:]))
    spec_source = "case"
    if info.layer_kinds and layer_reason(replace(case, spec_source="vllm"), info) is None and source.chance(50):
        spec_source = "vllm"
    # ROCm's answers change only the backing allocation, so a few cases are enough.
    platform = source.choice(info.platforms[1:]) if len(info.platforms) > 1 and source.chance(15) else info.platforms[0]
    options = replace(case, runner=runner, packing=packing, spec_source=spec_source, platform=platform)
    if packing != "none" and not source.chance(KEEP_REJECTED) and not oracles.expect(options, info.contract).accepted:
        source.reject()
    return options


def v1_only_mamba(case: Case, info: TargetInfo) -> bool:
    """Whether the case has Mamba layers that only the V1 runner builds views for (0.19 - 0.20, whose V2 runner's reshape
    has no Mamba branch: contract mamba_views "none")."""
    shaped = not info.contract.layout_placed
    return shaped and info.contract.mamba_views == "none" and any(g.spec.kind == "mamba" for g in case.groups)


def _differing_layers(source: Source, info: TargetInfo, group: GroupCase) -> GroupCase:
    """The group's layers made to differ in size: in KV heads, in head size, in precision, or in several, as far as the
    group can (an MLA group only in its latent's size)."""
    heads, precision = _can_differ_in_heads(group), bool(_skipped_dtypes(group, info))
    head_sizes = _can_differ_in_head_sizes(group)
    if head_sizes and (not (heads or precision) or source.chance(30)):
        group = _differing_head_sizes(source, group)
        if source.chance(70):
            return group
    both = heads and precision and source.chance(30)
    if heads and (both or not precision or source.chance(60)):
        group = _differing_heads(source, group)
    if precision and (both or not group.layer_heads):
        group = _differing_precision(source, info, group)
    return group


# MLA latents that differ between layers are drawn as 64 elements times a power of two, unpadded: the flat-row sparse MLA
# backends align a layer's block stride (64 KiB on FLASHINFER_MLA_SPARSE) and assert it is a whole number of the layer's
# rows (0.32 MLAAttention.bind_kv_cache), which rows of other sizes do not divide (a 1025- or 320-element latent).
MLA_LATENT_MULTIPLE = 64
MLA_LATENTS = tuple(MLA_LATENT_MULTIPLE << shift for shift in range(6))  # 64 ... 2048


def _can_differ_in_head_sizes(group: GroupCase) -> bool:
    """Whether the group's layers can take head sizes of their own: attention layers (MLA's latent too) whose spec states
    nothing else that follows the head size (a value head, rotary dims, a record format, head slots, a padded page)."""
    spec = group.spec
    mla_row = not spec.is_mla or spec.alignment is None
    return (len(group.layers) > 1 and spec.is_attention and spec.head_size_v is None and spec.rope_dim is None
            and spec.state_content_bytes is None and spec.num_head_slots is None and spec.page_size_padded is None and mla_row)


def _differing_head_sizes(source: Source, group: GroupCase) -> GroupCase:
    """The group's layers with head sizes of their own, the group's own among them, in whole groups of the cache format's
    elements; each at most the group's own size times two, so the pages still fit the buffer cap the spec was drawn under."""
    spec = group.spec
    if spec.is_mla:  # every layer's latent one of MLA_LATENTS, at most about twice the drawn one (the buffer cap)
        latents = [size for size in MLA_LATENTS if size <= max(2 * spec.head_size, 2 * MLA_LATENT_MULTIPLE)]
        sizes = [source.choice(latents) for _ in group.layers]
        if len(set(sizes)) == 1:
            sizes[-1] = next(size for size in latents if size != sizes[-1])
        return replace(group, layer_head_sizes=tuple(sizes))
    multiple = definition.head_multiple if (definition := dtypes.definition(spec.cache_dtype)) is not None else 1
    most = max(1, 2 * spec.head_size // multiple)
    sizes = [spec.head_size if source.chance(40) else multiple * edge_int(source, 1, most) for _ in group.layers]
    if len(set(sizes)) == 1:
        sizes[-1] = multiple * (sizes[-1] // multiple % most + 1)
    return replace(group, layer_head_sizes=tuple(sizes))


def _differing_precision(source: Source, info: TargetInfo, group: GroupCase) -> GroupCase:
    """Some of the group's layers skip its cache dtype's quantization (vLLM's `--kv-cache-dtype-skip-layers`): they keep the
    model dtype, one for the whole model, so the group holds layers of two page sizes. At least one layer skips and one
    does not."""
    model = source.choice(_skipped_dtypes(group, info))
    skipped = [source.chance(40) for _ in group.layers]
    if all(skipped) or not any(skipped):
        skipped[-1] = not skipped[-1]
    return replace(group, layer_cache_dtypes=tuple(model if skip else group.spec.cache_dtype for skip in skipped))


def _skipped_dtypes(group: GroupCase, info: TargetInfo) -> list[str]:
    """The model dtypes a layer of the group that skips the cache's quantization may keep (none: no layer can skip): the
    group's cache dtype is a quantized one of the release's, its backend also stores plain caches of that model dtype, and
    nothing else about the page depends on the precision (published fields, padding, rotary dims)."""
    spec = group.spec
    definition = dtypes.definition(spec.cache_dtype)
    quantized = definition is not None and definition.quant_modes != ("none",) and not spec.registered_cache_dtype
    plain = spec.is_attention and not spec.is_mla and quantized
    if len(group.layers) < 2 or not plain or spec.rope_dim is not None or spec.page_size_padded is not None \
            or (spec.num_head_slots, spec.state_content_bytes) != (None, None):
        return []
    if group.synthetic_backend is not None:
        return list(MODEL_DTYPES)
    backend = next((b for b in info.backends if b.name == group.backend), None)
    if backend is None or "auto" not in backend.cache_dtypes:
        return []
    return [dtype for dtype in ordered(backend.model_dtypes, MODEL_DTYPES) if dtype in MODEL_DTYPES]


def _differing_heads(source: Source, group: GroupCase) -> GroupCase:
    """The group's layers with KV heads of their own (one type, different sizes: vLLM's UniformTypeKVCacheSpecs), where
    its layers have heads: 1 to MAX_HEADS each (at most the group's own count under a padded page, which then still holds
    every layer's page), the group's own count among them."""
    spec = group.spec
    most = spec.num_kv_heads if spec.page_size_padded is not None else MAX_HEADS
    heads = [spec.num_kv_heads if source.chance(40) else edge_int(source, 1, most) for _ in group.layers]
    if len(set(heads)) == 1:
        heads[-1] = heads[-1] % most + 1
    return replace(group, layer_heads=tuple(heads))


def _fewer_heads(source: Source, group: GroupCase) -> GroupCase:
    """Now and then the group with fewer KV heads (a smaller page, so the case still fits the buffer cap), where the heads
    alone size its page: a real backend's unpadded, unpublished attention page."""
    spec = group.spec
    plain = spec.is_attention and not spec.is_mla and spec.page_size_padded is None and spec.num_head_slots is None
    if not plain or group.synthetic_backend is not None or spec.num_kv_heads < 2 or not source.chance(50):
        return group
    return replace(group, spec=replace(spec, num_kv_heads=edge_int(source, 1, spec.num_kv_heads - 1)))


def _can_differ_in_heads(group: GroupCase) -> bool:
    spec = group.spec
    most = spec.num_kv_heads if spec.page_size_padded is not None else MAX_HEADS
    return len(group.layers) > 1 and spec.is_attention and not spec.is_mla and spec.num_head_slots is None and most > 1


def packing_reason(case: Case, info: TargetInfo, packing: str) -> str | None:
    """Why vLLM's planner never sees these groups with this packing (None: it can): cross-layer blocks need several groups;
    UniformTypeKVCacheSpecs hold attention layers only, one group of them ("all layers have the same type of KV cache but
    with different hidden sizes"), or several (DeepSeek V4) where the release packs slabs."""
    if packing == "none":
        return None
    if packing not in info.packings:
        return f"this vLLM packs no {packing} slabs"
    if packing == "cross_layers" and len(case.groups) < 2:
        return "cross-layer blocks pack several KV-cache groups"
    if packing == "uniform_type":
        if not all(g.spec.is_attention for g in case.groups):
            return "UniformTypeKVCacheSpecs hold attention layers only"
        if len(case.groups) > 1 and info.contract.packing == "none" and not info.contract.page_buckets:
            return "this vLLM plans one group of UniformTypeKVCacheSpecs only"
        if info.contract.layout_placed and not all(_can_differ_in_heads(g) or _can_differ_in_head_sizes(g) or _skipped_dtypes(g, info)
                                                   for g in case.groups):
            return "from 0.29 a UniformTypeKVCacheSpecs group holds layers that differ in KV heads, head size or precision"
        if info.contract.layout_placed and not _block_compact(case.layout):
            return MIXED_SHAPES_RULE
    return None


# vLLM 0.29+ resolves the layout once per model, before any view (v1/attention/backends/utils.py resolve_kv_cache_layout:
# "If not block-compact, each spec must agree on HNC to alias the same page"; an explicit VLLM_KV_CACHE_LAYOUT outside the
# candidates left "does not satisfy every supported set"). kvfuzz hands the allocation the case's layout directly, so a
# case of mixed page shapes in another layout is one no deployment reaches.
MIXED_SHAPES_RULE = "vLLM's layout resolution keeps block-compact layouts only (L and B outermost) for pages of mixed shapes"


def _block_compact(layout: str) -> bool:
    return set(LAYOUT_EQUIVALENTS.get(layout, layout)[:2]) == {"L", "B"}


def mixed_shapes(case: Case) -> bool:
    """Whether the model's layers have pages of more than one (heads, states, bytes) shape, as the resolution compares them."""
    return len({(p.heads, p.states, p.page_bytes) for p in (pages.page(s) for g in case.groups for s in g.layer_specs)}) > 1


def layer_reason(case: Case, info: TargetInfo) -> str | None:
    """Why vLLM cannot build this case's specs from layers here (None: it can): the layers kvfuzz builds are Attention
    (full, sliding window) and MLAAttention on real backends whose layers build here, with what a layer carries
    (head sizes, heads, window, cache dtype, model dtype); padding, alignment, compression and published fields come
    from elsewhere in vLLM (page unification, DeepSeek V4's layers, backend hooks) and are not built from layers."""
    for group in case.groups:
        spec = group.spec
        if spec.kind not in info.layer_kinds:
            return f"field spec_source: kvfuzz builds no {spec.kind} layer for vLLM {info.vllm_version}"
        if group.differs_per_layer:
            return "field spec_source: kvfuzz builds layers of one size per group"
        if group.backend is None or group.backend not in info.layer_backends:
            return f"field spec_source: no {group.backend_name} layer builds here"
        if spec.cache_dtype == "auto" and spec.dtype not in MODEL_DTYPES:
            return f"field spec_source: {spec.dtype} is no model dtype"
        if spec.head_size_v is not None and "head_size_v" not in info.layer_fields:
            return "field spec_source: this vLLM's Attention takes no head_size_v"
        if spec.registered_cache_dtype or spec.page_size_padded is not None or spec.alignment is not None or spec.compress_ratio != 1 \
                or spec.model_version is not None or spec.rope_dim is not None or spec.topk_buffer_width is not None or spec.is_draft:
            return "field spec_source: the layer kvfuzz builds states no padding, alignment, compression or model-specific fields"
    return None


def accepted_layouts(group: GroupCase, info: TargetInfo) -> tuple[str, ...] | None:
    """The layouts the group's backend (real or synthetic) declares its kernels consume; None: any."""
    if group.synthetic_backend is not None:
        return group.synthetic_backend.layouts
    backend = info.backend(group.backend) if group.backend else None
    return backend.layouts if backend is not None else None


def layout_reason(case: Case, info: TargetInfo) -> str | None:
    """Why vLLM never runs this case's backends on its layout (None: every backend takes it). Each backend declares the
    layouts it takes, and vLLM builds a model only in one every backend declares: from 0.29 its layout resolution keeps
    "Layouts every one of the worker's backends supports" (v1/attention/backends/utils.py get_supported_kv_cache_layouts)
    and "An explicit VLLM_KV_CACHE_LAYOUT must be one of the candidates or resolution fails" (resolve_kv_cache_layout),
    before any view exists; before 0.29 the attention selector sets the layout a backend requires
    (get_required_kv_cache_layout, "Adjust kv cache layout if the selected backend requires a specific one")."""
    for group in case.groups:
        accepted = accepted_layouts(group, info)
        if accepted is not None and layout_as(case.layout, accepted) is None:
            return f"field layout: {group.backend_name} takes {', '.join(accepted)} only; vLLM never builds it a {case.layout} cache"
    return None


# BlockPool's block 0 is its null block (get_kv_cache_config_from_groups: "BlockPool always needs a null_block"; block_pool.py
# `self.null_block = self.free_block_queue.popleft()`), which no request owns: the scheduler hands the zeroers none of it,
# copy-on-write copies never name it, and the offloading scheduler skips it (offloading/scheduler.py `if block_id == 0:
# continue`, 0.28 - 0.34). In a pool of several blocks block 0 is laid out by the same strides as every other block, so
# asking a consumer about it checks what real blocks get; a pool of one block has no other block, and its block axis has
# size 1, whose stride torch leaves to the view, so whatever a consumer derives from that stride (the offloading connector's
# packed block stride, 0.28 offloading/worker.py) addresses no block a request can own. Consumers are still built on such a
# pool (their set-up runs at start-up and is checked), but asked about no block.
NULL_BLOCK_RULE = "a pool of one block holds only BlockPool's null block, which vLLM never zeroes, copies or offloads"


def _page_buckets(info: TargetInfo, case: Case) -> bool:
    """Whether the planner buffers the case's groups by page size (several UniformTypeKVCacheSpecs groups, 0.23)."""
    return info.contract.page_buckets and case.packing == "uniform_type" and len(case.groups) > 1


def _touches(source: Source, info: TargetInfo, case: Case) -> Touches:
    """The consumers the case runs (each the target has and vLLM runs on it, at least one), the blocks they zero and map,
    one block copy, and one to three tokens for the kernel probe, positions biased to a block's first and last token."""
    drawable = tuple(name for name in info.consumers if registry.BY_NAME[name].unrealistic(case) is None)
    consumers = tuple(name for name in drawable if source.chance(50))
    if drawable and not consumers:
        consumers = (source.choice(drawable),)
    last = case.num_blocks - 1
    blocks = tuple(sorted({source.integer(0, last) for _ in range(source.integer(1, 2))}))
    if not last:
        blocks = ()  # NULL_BLOCK_RULE (drawn all the same, so the rest of the case draws as before)
    copies: tuple[tuple[int, int], ...] = ()
    if last > 0:
        src = source.integer(0, last)
        copies = ((src, (src + source.integer(1, last)) % case.num_blocks),)
    size = case.groups[0].spec.block_size
    tokens = tuple(sorted({(source.integer(0, last), source.choice((0, size - 1, source.integer(0, size - 1))))
                           for _ in range(source.integer(1, 3))}))
    return Touches(consumers=consumers, blocks=blocks, copies=copies, tokens=tokens)


def for_run(case: Case, consumers: bool, kernel: bool) -> Case:
    """The case as a campaign runs it: its consumers only on the cases that run them, its tokens only with the kernel probe."""
    touches = case.touches
    if touches is None:
        return case
    kept = replace(touches, consumers=touches.consumers if consumers else (), tokens=touches.tokens if kernel else ())
    if not kept.consumers:
        kept = replace(kept, blocks=(), copies=())
    return replace(case, touches=kept if kept.size else None)


def _attention_group(source: Source, info: TargetInfo, kind: str, index: int, layer_count: int, synthetic: bool, shaped: bool,
                     cache_dtype: str | None, first: GroupCase | None, production: bool = False) -> GroupCase:
    mla = kind in MLA_KINDS
    if shaped and first is not None:
        # Pools shared by groups hold one page size, so a later attention group keeps the first one's geometry; its
        # backend may differ (encoder-decoder cross-attention, a drafter), and then the pool's block arrangement is
        # the oracle's to say (contract.mixed_pool_arrangement).
        backend = info.backend(first.backend) if first.backend else None
        fake = first.synthetic_backend
        cleared = {"sliding_window": None, "attention_chunk_size": None, "sink_len": None}
        spec = SpecCase(**{**first.spec.__dict__, **cleared, "kind": kind, **_kind_fields(source, kind)})
        if kind == "sliding_window_mla" and (spec.cache_dtype == "fp8_ds_mla") != (spec.model_version == "deepseek_v4"):
            source.reject()
        if backend is not None and source.chance(MIXED_BACKENDS):
            backend = _another_backend(source, info, backend, spec)
    else:
        candidates = [b for b in info.backends if b.is_mla == mla and (cache_dtype is None or cache_dtype in b.cache_dtypes)]
        # A synthetic backend declares one latent per slot, which DeepSeek's MLA records are not, and
        # on backend-shaped releases plain elements only.
        fits_synthetic = cache_dtype is None or (cache_dtype not in dtypes.DS_MLA_RECORDS
                                                 and not (shaped and (_unalike(cache_dtype) or (mla and _scaled(cache_dtype)))))
        use_synthetic = synthetic and fits_synthetic and (not candidates or source.chance(20))
        if not use_synthetic and not candidates:
            source.reject()
        backend = None if use_synthetic else source.choice(candidates)
        block_size = _block_size(source, kind, backend.kernel_block_sizes if backend else ())
        fake = _synthetic_backend(source, info, mla, shaped, block_size) if use_synthetic else None
        spec = _attention_spec(source, info, kind, backend, shaped, cache_dtype, production, block_size)
    sizes = fake.kernel_block_sizes if fake else backend.kernel_block_sizes  # type: ignore[union-attr]
    # vLLM picks no kernel block size for encoder-only groups: they keep the manager block.
    kernel = spec.block_size if kind == "encoder_only" else choose_kernel_block_size(spec.block_size, sizes)
    if kernel is None:
        source.reject()
    layers = tuple(f"g{index}.l{j}" for j in range(layer_count))
    return GroupCase(spec=spec, layers=layers, backend=None if backend is None else backend.name, synthetic_backend=fake,
                     kernel_block_size=kernel)


def _another_backend(source: Source, info: TargetInfo, backend: BackendInfo, spec: SpecCase) -> BackendInfo:
    """A backend vLLM pairs with `backend` in one model (MIXED_BACKEND_PAIRS) that serves the same spec (its cache dtype,
    a kernel block size for its block size), or `backend` where the release has none."""
    others = [b for b in info.backends
              if frozenset({b.name, backend.name}) in MIXED_BACKEND_PAIRS and b.is_mla == backend.is_mla and b.compresses == backend.compresses
              and spec.cache_dtype in b.cache_dtypes and (spec.cache_dtype != "auto" or spec.dtype in b.model_dtypes)
              and (spec.head_size_v is None or (b.asymmetric_kv and b.sets_value_heads == backend.sets_value_heads))
              and choose_kernel_block_size(spec.block_size, b.kernel_block_sizes) is not None]
    return source.choice(others) if others else backend


def record_reason(spec: SpecCase, info: TargetInfo) -> str | None:
    """Why the release builds no cache of the spec's DeepSeek record size (RECORDS_SINCE), or None."""
    if spec.cache_dtype not in dtypes.DS_MLA_RECORDS or builds_record(info, spec.state_content_bytes):
        return None
    since = ".".join(map(str, RECORDS_SINCE[spec.state_content_bytes or 0]))
    return (f"field state_content_bytes: vLLM {info.vllm_version} builds no {spec.cache_dtype} cache of "
            f"{spec.state_content_bytes}-byte records (from {since})")


def builds_record(info: TargetInfo, record: int | None) -> bool:
    """Whether the target's release builds DeepSeek records of this size (a version kvfuzz cannot read: any)."""
    since = RECORDS_SINCE.get(record or 0)
    release = release_of(info)
    return since is None or not release or release >= since


def release_of(info: TargetInfo) -> tuple[int, ...]:
    """The target's release as numbers (a checkout's dev version counts as the release it precedes); () if unreadable."""
    numbers = []
    for part in info.vllm_version.split("+")[0].split(".")[:3]:
        if not part.isdigit():
            break
        numbers.append(int(part))
    return tuple(numbers)


def _block_size(source: Source, kind: str, kernel_sizes: Sequence[int | str]) -> int:
    """A block size: a multiple of a kernel block size the backend declares (so vLLM's rule can split it), or for a
    backend declaring none (a synthetic one, drawn after) any size."""
    bases = sorted({int(s[1:]) if isinstance(s, str) else s for s in kernel_sizes})
    if not bases:
        return edge_int(source, 1, MAX_BLOCK_SIZE)
    base = source.choice(bases)
    return base * edge_int(source, 1, max(1, MAX_BLOCK_SIZE // base))


def _attention_spec(source: Source, info: TargetInfo, kind: str, backend: BackendInfo | None, shaped: bool,
                    cache_dtype: str | None, production: bool, block_size: int) -> SpecCase:
    mla = kind in MLA_KINDS
    model_dtype = source.choice(ordered(backend.model_dtypes, ALL_DTYPES) or ["bfloat16"]) if backend else source.choice(ALL_DTYPES)
    fields: dict[str, object] = {"kind": kind, "block_size": block_size, **_cache_dtype_fields(source, info, kind, backend, shaped, cache_dtype,
                                                                                                 model_dtype)}
    cache = str(fields["cache_dtype"])
    element = DTYPE_SIZES[str(fields["dtype"])]
    # Head sizes up to the largest one whose page still fits the buffer cap (the high edge of the range).
    cap = MAX_PRODUCTION_BYTES // 64 if production else MAX_BUFFER_BYTES

    def largest_head(heads: int, vectors: int) -> int:
        return max(1, min(MAX_HEAD_SIZE, cap // (block_size * heads * vectors * element)))

    if mla:
        fields["num_kv_heads"] = 1
        fields["head_size"] = edge_int(source, 1, largest_head(1, 1))
        compresses = (backend is None or backend.compresses) and info.can(kind, "compress_ratio")
        ratio = edge_divisor(source, block_size) if compresses and source.chance(70) else 1
        fields["compress_ratio"] = ratio
        if cache in dtypes.DS_MLA_RECORDS:
            # DeepSeek's record formats: V3.2's and V4's (the latter on V4's own, compressing
            # backends); sliding-window MLA exists only in V4.
            v4 = backend is not None and backend.compresses
            records = dtypes.DS_MLA_RECORDS[cache].get("deepseek_v4" if v4 else None)
            if backend is None or not records or (kind == "sliding_window_mla" and not v4):
                source.reject()
            if not info.can(kind, "state_content_bytes"):
                records = records[:1]  # before 0.28 the model version alone names the record
            records = tuple(r for r in records if builds_record(info, r))
            version = "deepseek_v4" if v4 else None
            if version is not None or info.can(kind, "model_version"):
                fields["model_version"] = version
            fields["state_content_bytes"] = source.choice(records)
        elif kind == "mla" and ratio > 1 and info.can(kind, "model_version"):
            fields["model_version"] = "deepseek_v4"
        if info.can(kind, "alignment") and source.chance(50):
            fields["alignment"] = 16 * edge_int(source, 1, 256)  # bytes, at the granularity of device memory alignment
        if info.can(kind, "topk_buffer_width") and source.chance(10):
            fields["topk_buffer_width"] = edge_int(source, 1, 1 << 14)
    else:
        heads = fields["num_kv_heads"] = edge_int(source, 1, MAX_PRODUCTION_HEADS if production else MAX_HEADS)
        fields["head_size"] = edge_int(source, 1, largest_head(heads, 2))
        # A synthetic backend-shaped cache declares K and V apart, in one head dim: equal heads only.
        if backend is None:
            takes_value_heads = not shaped
        else:
            takes_value_heads = backend.sets_value_heads if shaped else backend.asymmetric_kv
        if takes_value_heads and info.can(kind, "head_size_v") and source.chance(30):
            fields["head_size_v"] = edge_int(source, 1, largest_head(heads, 2))
        group = definition.head_multiple if (definition := dtypes.definition(cache)) is not None else 1
        if group > 1:
            # Formats that group a head's elements (scale groups, rotation blocks) take whole groups.
            fields["head_size"] = group * edge_int(source, 1, max(1, largest_head(heads, 2) // group))
            if int(fields.get("head_size_v") or 0) % group:  # type: ignore[call-overload]
                fields["head_size_v"] = None
        if cache.startswith("octave_"):
            fields["rope_dim"] = source.choice(range(64, int(fields["head_size"]) + 1, 64) or [64])  # type: ignore[call-overload]
    if info.can(kind, "is_draft") and source.chance(5):
        fields["is_draft"] = True
    fields.update(_kind_fields(source, kind))
    spec = SpecCase(**fields)  # type: ignore[arg-type]
    if not mla and not shaped and source.chance(25):
        # Padding up to a larger page, as vLLM's page-size unification pads to another group's page (16-byte granular).
        padded = pages.round_up(pages.page(spec).page_bytes + edge_int(source, 1, 2048), 16)
        spec = SpecCase(**{**fields, "page_size_padded": padded})  # type: ignore[arg-type]
    return spec


def _cache_dtype_fields(source: Source, info: TargetInfo, kind: str, backend: BackendInfo | None, shaped: bool, cache_dtype: str | None,
                        model_dtype: str) -> dict[str, object]:
    """The cache dtype of a group, with the storage dtype the release gives it and the quant mode
    its definition means (as this release names it): from the backend's list for a real backend,
    from every dtype the release accepts for a synthetic one, or one kvfuzz registers itself."""
    mla = kind in MLA_KINDS
    if cache_dtype is not None:
        choices = [cache_dtype]
    elif backend is not None:
        choices = [c for c in backend.cache_dtypes if c in info.cache_dtypes] or ["auto"]
    else:
        if info.registers_dtypes and source.chance(15):
            return _registered_dtype(source, info, kind)
        # A synthetic backend declares a head's K and V apart on backend-shaped releases (formats storing them
        # alike) and there a plain latent (those releases' MLA specs quantize only the formats their own MLA
        # backends write), and one latent per slot (which DeepSeek's MLA records are not).
        choices = [c for c in info.cache_dtypes if c not in dtypes.DS_MLA_RECORDS and not (shaped and (_unalike(c) or (mla and _scaled(c))))]
        choices = choices or ["auto"]
    choices = [c for c in choices if _applies(c, mla)] or ["auto"]
    cache = source.choice(ordered(choices, tuple(info.cache_dtypes)))
    definition = dtypes.definition(cache)
    quant = "none"
    if info.can(kind, "kv_quant_mode") and definition is not None:
        quant = dtypes.quant_mode_in(definition, info.quant_modes) or definition.quant_modes[0]
    storage = info.cache_dtypes.get(cache)
    return {"cache_dtype": cache, "dtype": storage or model_dtype, "kv_quant_mode": quant}


def _registered_dtype(source: Source, info: TargetInfo, kind: str) -> dict[str, object]:
    storage = source.choice(REGISTERED_STORAGE)
    quant = source.choice(info.quant_modes) if info.can(kind, "kv_quant_mode") else "none"
    return {"cache_dtype": f"kvfuzz_{storage}_{quant}", "dtype": storage, "kv_quant_mode": quant, "registered_cache_dtype": True}


@functools.lru_cache(maxsize=256)
def _scaled(cache: str) -> bool:
    definition = dtypes.definition(cache)
    return definition is not None and not definition.plain


@functools.lru_cache(maxsize=256)
def _unalike(cache: str) -> bool:
    """A format that stores a head's K and V other than as two alike halves (a synthetic backend's shape cannot say it)."""
    definition = dtypes.definition(cache)
    return definition is not None and not definition.kv_alike


@functools.lru_cache(maxsize=512)
def _applies(cache: str, mla: bool) -> bool:
    """False only for a dtype whose definition says it is no format of this kind of cache (NVFP4 and
    the K+V slot formats of attention heads, the record formats of MLA); an unknown dtype is drawn,
    and its cases are skipped with that reason."""
    definition = dtypes.definition(cache)
    if definition is None:
        return True
    probe = dtypes.Geometry(head_size=128, head_size_v=0 if mla else 128, element=1, mla=mla, rope_dim=64,
                            record=next(iter(dtypes.DS_MLA_RECORDS.get(cache, {None: (None,)}).values()))[0])
    return definition.content_bytes(probe) is not None


def _kind_fields(source: Source, kind: str) -> dict[str, object]:
    if kind in WINDOWED_KINDS:
        return {"sliding_window": edge_int(source, 1, 1 << 16)}
    if kind == "chunked_local":
        return {"attention_chunk_size": edge_int(source, 1, 1 << 16)}
    if kind == "sink":
        return {"sink_len": edge_int(source, 1, 64)}
    return {}


def _synthetic_backend(source: Source, info: TargetInfo, mla: bool, shaped: bool, block_size: int) -> SyntheticBackend:
    layouts = None
    if not shaped and source.chance(50):
        picked = {source.choice(info.layouts) for _ in range(source.integer(1, 3))}
        layouts = tuple(sorted(picked))
    shape = order = None
    if shaped:
        shape, orders = source.choice(SYNTHETIC_SHAPES[mla])
        order = source.choice(orders)
    return SyntheticBackend(name=source.choice(("alpha", "beta")), kernel_block_sizes=_synthetic_kernel_sizes(source, block_size),
                            layouts=layouts, shape=shape, stride_order=order)


def _synthetic_kernel_sizes(source: Source, block_size: int) -> tuple[int | str, ...]:
    """What a synthetic backend declares: any multiple of a divisor of the block size, or one or two exact sizes, each a
    divisor of the block size or (less often) a size that does not divide it, which vLLM's rule must pass over."""
    if source.chance(40):
        return (f"x{edge_divisor(source, block_size)}",)
    sizes: list[int | str] = []
    for _ in range(source.integer(1, 2)):
        size = edge_divisor(source, block_size) if source.chance(75) else edge_int(source, 1, 2 * block_size)
        if size not in sizes:
            sizes.append(size)
    return tuple(sizes)


def _mamba_only(source: Source, info: TargetInfo, case: Case) -> Case:
    """A model of Mamba layers only, in place of the drawn one (its runner and platform kept): one group, as vLLM groups
    layers of one spec, whose page is the states' own bytes (no attention page to pad to). vLLM's block size for such a
    model is the Mamba block size (max_model_len without prefix caching): it sizes no page, so any is drawn."""
    spec = _mamba_spec(source, edge_int(source, 1, MAX_BLOCK_SIZE), None, info)
    group = GroupCase(spec=spec, layers=tuple(f"g0.l{j}" for j in range(source.integer(1, 4))), kernel_block_size=spec.block_size)
    layout = source.choice(ordered(sorted(info.layouts), LAYOUT_ORDER))
    per_block = pages.page(spec).page_bytes * len(group.layers)
    most = max(1, min(MAX_BUFFER_BYTES // per_block, 4))
    mamba = replace(case, groups=(group,), num_blocks=edge_int(source, 1, most), layout=layout, kv_sharing=(), packing="none",
                    spec_source="case")
    if v1_only_mamba(mamba, info):
        mamba = replace(mamba, runner="v1")
    if not source.chance(KEEP_REJECTED) and not oracles.expect(mamba, info.contract).accepted:
        source.reject()
    return mamba


def _mamba_spec(source: Source, block_size: int, attention_page: int | None, info: TargetInfo | None = None) -> SpecCase:
    shapes = tuple(tuple(edge_int(source, 1, 16) for _ in range(source.integer(1, 3))) for _ in range(source.integer(1, 2)))
    state_dtypes = tuple(source.choice(MAMBA_DTYPES) for _ in shapes)
    fields: dict[str, object] = {"kind": "mamba", "block_size": block_size, "mamba_shapes": shapes, "mamba_dtypes": state_dtypes}
    if info is not None and info.can("mamba", "state_alignment") and source.chance(30):
        # 0.34+ aligns each state (and the block stride) as the Mamba layer asks; a page padded to the
        # attention page must stay a multiple of it, so only alignments dividing that page are drawn.
        alignment = source.choice([1 << k for k in range(1, 13) if attention_page is None or attention_page % (1 << k) == 0] or [1])
        fields.update(state_alignment=alignment, block_stride_alignment=alignment if alignment > 1 else None)
    spec = SpecCase(**fields)  # type: ignore[arg-type]
    if attention_page is None:
        return spec
    content = pages.page(spec).page_bytes
    if content > attention_page:
        source.reject()
    if content != attention_page:
        spec = SpecCase(**{**fields, "page_size_padded": attention_page})  # type: ignore[arg-type]
    return spec


def unrealistic(case: Case, info: TargetInfo) -> str | None:
    """Why no vLLM configuration builds this case (None: one could). The generator only draws
    realistic cases; the minimizer keeps only realistic candidates; tests hold both to it."""
    shaped = not info.contract.layout_placed
    attention = [g for g in case.groups if g.spec.kind != "mamba"]
    if case.runner not in RUNNERS[:1] and "v1" not in info.runners:
        return "this vLLM has no V1 model runner"
    if case.runner != "v1" and v1_only_mamba(case, info):
        return "this vLLM's V2 runner builds no Mamba views (its reshape has a Mamba branch from 0.21; the V1 runner's from 0.19)"
    if (why := packing_reason(case, info, case.packing)) is not None:
        return why
    if case.packing == "uniform_type" and not shaped and any(len(set(g.layer_specs)) < 2 for g in case.groups):
        return "from 0.29 vLLM makes a UniformTypeKVCacheSpecs group only of layers that differ in size"
    if shaped and any(g.differs_per_layer for g in case.groups):
        return "kvfuzz draws layers that differ in size from 0.29 only"
    if case.spec_source == "vllm" and (why := layer_reason(case, info)) is not None:
        return why
    if (why := layout_reason(case, info)) is not None:
        return why
    if not shaped and mixed_shapes(case) and not _block_compact(case.layout):
        return MIXED_SHAPES_RULE
    for group in attention:
        spec = group.spec
        backend = info.backend(group.backend) if group.backend else None
        if backend is None and group.synthetic_backend is None:
            return "an attention group without a backend"
        if backend is not None:
            if backend.is_mla != (spec.kind in MLA_KINDS):
                return f"{backend.name} does not serve {spec.kind} layers"
            if spec.compress_ratio > 1 and not backend.compresses:
                return f"{backend.name} serves no compressed cache"
            if spec.cache_dtype not in backend.cache_dtypes:
                return f"{backend.name} takes no {spec.cache_dtype} cache"
        elif spec.cache_dtype in dtypes.DS_MLA_RECORDS:
            return f"the {spec.cache_dtype} format needs its own backend"
        sizes = group.synthetic_backend.kernel_block_sizes if group.synthetic_backend else backend.kernel_block_sizes  # type: ignore[union-attr]
        want = spec.block_size if spec.kind == "encoder_only" else choose_kernel_block_size(spec.block_size, sizes)
        if group.kernel_block_size != want:
            return "the kernel block size is not the one vLLM picks"
        if spec.kind == "sliding_window_mla" and (spec.cache_dtype == "fp8_ds_mla") != (spec.model_version == "deepseek_v4"):
            return "sliding-window MLA is DeepSeek V4's, in fp8_ds_mla"
    if shaped and len({(g.backend, g.synthetic_backend) for g in attention}) > 1:
        return "one attention backend per model before 0.29"
    page_sizes = {pages.page(g.spec).page_bytes for g in case.groups}
    if shaped and len(page_sizes) > 1 and not _page_buckets(info, case):
        return "pools hold one page size before 0.29"
    for name in case.touches.consumers if case.touches is not None else ():
        check = registry.BY_NAME.get(name)
        if check is not None and (why := check.unrealistic(case)) is not None:
            return why
    if case.touches is not None and case.touches.consumers and case.num_blocks == 1 and case.touches.blocks:
        return NULL_BLOCK_RULE
    if attention and any(g.spec.kind == "mamba" and len(g.layers) < max(len(a.layers) for a in attention) for g in case.groups):
        return "a Mamba group has a layer in every pool"
    return None


# A backend's kernel block sizes and the one vLLM picks are the contract's (oracles/contract.py).
accepts = contract.declares
choose_kernel_block_size = contract.kernel_block_size


def buffer_bytes(case: Case) -> int:
    return case.num_blocks * sum(pages.page(spec).page_bytes for g in case.groups for spec in g.layer_specs)


__all__ = ["DTYPE_SIZES", "NULL_BLOCK_RULE", "RandomSource",
           "Rejected", "Source",
           "accepts", "buffer_bytes", "case_seed", "choose_kernel_block_size",
           "draw_case", "draw_indexed", "for_run", "layer_reason", "unrealistic"]
