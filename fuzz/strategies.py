"""Hypothesis strategies that draw Cases a real vLLM configuration could build.

Drawn from the target's own declarations (TargetInfo: its backends, their kernel block sizes,
layouts and dtypes) so that every case is reachable: the kernel block size is chosen by the
rule vLLM applies (the manager block size when the backend takes it, else the largest
explicit size that divides it), layouts are ones the backends accept, a mamba page is padded
to the attention page as vLLM's hybrid allocator does. Biased toward compression, padding,
kernel splitting and hybrid groups; every choice shrinks toward one group, one layer, one
block, 16-token blocks and the model's default dtype.
"""

from __future__ import annotations

from hypothesis import assume
from hypothesis import strategies as st

from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend
from fuzz.targets.base import BackendInfo, TargetInfo
from oracles import pages

BLOCK_SIZES = (16, 32, 64, 128, 256, 512)
HEAD_SIZES = (64, 32, 16, 128, 80, 96)
MLA_HEAD_SIZES = (512, 576, 128, 132)
COMPRESS_RATIOS = (1, 4, 128, 2, 8)
MAMBA_SHAPES = (((2, 8),), ((3, 8), (2, 4, 4)), ((4, 16),), ((1, 2, 2),))
SYNTHETIC_KERNELS = (("x1",), ("x16",), (16,), (64,), (16, 32), (256,), ("x32",))

# Cache dtype string -> (storage dtype or None for the model dtype, KV quant mode).
CACHE_DTYPES: dict[str, tuple[str | None, str]] = {
    "auto": (None, "none"),
    "float16": ("float16", "none"),
    "bfloat16": ("bfloat16", "none"),
    "fp8": ("uint8", "fp8_per_tensor"),
    "fp8_e4m3": ("uint8", "fp8_per_tensor"),
    "fp8_e5m2": ("uint8", "fp8_per_tensor"),
    "int8_per_token_head": ("int8", "int8_per_token_head"),
    "fp8_per_token_head": ("uint8", "fp8_per_token_head"),
    "fp8_ds_mla": ("uint8", "fp8_per_tensor"),
}
# Bytes per stored token of the fp8_ds_mla format: DeepSeek V3.2, and V4 (model_version set).
DS_MLA_BYTES = {None: 656, "deepseek_v4": 584}


def accepts(sizes: tuple[int | str, ...], size: int) -> bool:
    return any(size == s if isinstance(s, int) else size % int(s[1:]) == 0 for s in sizes)


def choose_kernel_block_size(block_size: int, sizes: tuple[int | str, ...]) -> int | None:
    """The kernel block size vLLM picks for a backend declaring `sizes`, or None if none fits."""
    if accepts(sizes, block_size):
        return block_size
    explicit = sorted({s for s in sizes if isinstance(s, int) and block_size % s == 0}, reverse=True)
    return next((s for s in explicit if accepts(sizes, s)), None)


@st.composite
def synthetic_backends(draw: st.DrawFn, layouts: tuple[str, ...]) -> SyntheticBackend:
    allowed = draw(st.none() | st.lists(st.sampled_from(layouts), min_size=1, max_size=3, unique=True))
    return SyntheticBackend(
        name=draw(st.sampled_from(("alpha", "beta"))),
        kernel_block_sizes=draw(st.sampled_from(SYNTHETIC_KERNELS)),
        layouts=None if allowed is None else tuple(sorted(allowed)),
    )


@st.composite
def attention_specs(draw: st.DrawFn, kind: str, backend: BackendInfo | None) -> SpecCase:
    mla = kind in ("mla", "sliding_window_mla")
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    if backend is None:
        model_dtype = draw(st.sampled_from(("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8", "int8")))
        cache_dtype = "auto"
    else:
        model_dtype = draw(st.sampled_from(tuple(sorted(backend.model_dtypes, key=_dtype_rank)) or ("bfloat16",)))
        cache_dtype = draw(st.sampled_from(tuple(c for c in backend.cache_dtypes if c in CACHE_DTYPES) or ("auto",)))
    storage, quant = CACHE_DTYPES[cache_dtype]
    fields: dict[str, object] = {
        "kind": kind,
        "block_size": block_size,
        "dtype": storage or model_dtype,
        "cache_dtype": cache_dtype,
        "kv_quant_mode": quant,
    }
    if mla:
        fields["num_kv_heads"] = 1
        fields["head_size"] = draw(st.sampled_from(MLA_HEAD_SIZES))
        compresses = backend is None or backend.compresses
        ratio = draw(st.sampled_from(COMPRESS_RATIOS + (block_size,))) if compresses else 1
        assume(block_size % ratio == 0)
        fields["compress_ratio"] = ratio
        version = "deepseek_v4" if ratio > 1 else draw(st.sampled_from((None, "deepseek_v4")))
        fields["model_version"] = version
        if cache_dtype == "fp8_ds_mla":
            fields["state_content_bytes"] = DS_MLA_BYTES[version]
        fields["alignment"] = draw(st.sampled_from((None, 576, 512)))
    else:
        fields["num_kv_heads"] = draw(st.integers(1, 4))
        fields["head_size"] = draw(st.sampled_from(HEAD_SIZES))
        if draw(st.booleans()):
            fields["head_size_v"] = draw(st.sampled_from(HEAD_SIZES))
    if kind in ("sliding_window", "sliding_window_mla"):
        fields["sliding_window"] = draw(st.sampled_from((128, 1024)))
    if kind == "chunked_local":
        fields["attention_chunk_size"] = draw(st.sampled_from((256, 1024)))
    if kind == "sink":
        fields["sink_len"] = draw(st.sampled_from((4, 16)))
    spec = SpecCase(**fields)  # type: ignore[arg-type]
    if not mla and draw(st.integers(0, 3)) == 0:
        # Padding by whole elements, as vLLM's page-size unification pads.
        extra = draw(st.sampled_from((64, 128, 256, 4096)))
        spec = SpecCase(**{**fields, "page_size_padded": pages.page(spec).page_bytes + extra})  # type: ignore[arg-type]
    return spec


@st.composite
def mamba_specs(draw: st.DrawFn, block_size: int, attention_page: int | None) -> SpecCase:
    shapes = draw(st.sampled_from(MAMBA_SHAPES))
    dtypes = tuple(draw(st.sampled_from(("float32", "bfloat16", "float16"))) for _ in shapes)
    spec = SpecCase(kind="mamba", block_size=block_size, mamba_shapes=shapes, mamba_dtypes=dtypes)
    content = pages.page(spec).page_bytes
    if attention_page is not None:
        assume(content <= attention_page)
        if content != attention_page:
            spec = SpecCase(kind="mamba", block_size=block_size, mamba_shapes=shapes, mamba_dtypes=dtypes,
                            page_size_padded=attention_page)
    return spec


@st.composite
def cases(draw: st.DrawFn, info: TargetInfo, synthetic: bool = True, max_groups: int = 3) -> Case:
    """Cases for the target described by `info`."""
    kinds = [k for k in info.spec_kinds if k != "mamba"]
    first_kind = draw(st.sampled_from(sorted(kinds, key=_kind_rank)))
    group_kinds = [first_kind]
    if first_kind != "encoder_only":
        family = [k for k in kinds if (k in ("mla", "sliding_window_mla")) == (first_kind in ("mla", "sliding_window_mla"))
                  and k != "encoder_only"]
        extra = draw(st.lists(st.sampled_from(sorted(family, key=_kind_rank) + (["mamba"] if "mamba" in info.spec_kinds else [])),
                              max_size=max_groups - 1))
        group_kinds += extra
    groups: list[GroupCase] = []
    layouts = set(info.layouts)
    attention_page: int | None = None
    for index, kind in enumerate(group_kinds):
        layer_count = draw(st.integers(1, 3))
        layers = tuple(f"g{index}.l{j}" for j in range(layer_count))
        if kind == "mamba":
            spec = draw(mamba_specs(groups[0].spec.block_size, attention_page))
            groups.append(GroupCase(spec=spec, layers=layers, kernel_block_size=spec.block_size))
            continue
        mla = kind in ("mla", "sliding_window_mla")
        candidates = [b for b in info.backends if b.is_mla == mla]
        use_synthetic = synthetic and (not candidates or draw(st.integers(0, 4)) == 0)
        backend = None if use_synthetic else draw(st.sampled_from(candidates))
        spec = draw(attention_specs(kind, backend))
        if use_synthetic:
            fake = draw(synthetic_backends(info.layouts))
            sizes, allowed = fake.kernel_block_sizes, fake.layouts
        else:
            assert backend is not None
            fake, sizes, allowed = None, backend.kernel_block_sizes, backend.layouts
        kernel = choose_kernel_block_size(spec.block_size, sizes)
        assume(kernel is not None)
        if allowed is not None:
            layouts &= set(allowed)
        if attention_page is None:
            attention_page = pages.page(spec).page_bytes
        groups.append(GroupCase(spec=spec, layers=layers, backend=None if backend is None else backend.name,
                                synthetic_backend=fake, kernel_block_size=kernel))
    page_sizes = {pages.page(g.spec).page_bytes for g in groups}
    if len(page_sizes) > 1:
        layouts = {name for name in layouts if set(name[:2]) == {"L", "B"} and (len(groups) == 1 or name[0] == "B")}
    assume(layouts)
    layout = draw(st.sampled_from(sorted(layouts, key=_layout_rank)))
    sharing: tuple[tuple[str, str], ...] = ()
    if groups[0].spec.kind != "mamba" and draw(st.integers(0, 5)) == 0:
        sharing = (("g0.shared", groups[0].layers[-1]),)
    case = Case(groups=tuple(groups), num_blocks=draw(st.integers(1, 4)), layout=layout, kv_sharing=sharing)
    assume(_buffer_bytes(case) <= 8 << 20)
    return case


def _buffer_bytes(case: Case) -> int:
    return case.num_blocks * sum(len(g.layers) * pages.page(g.spec).page_bytes for g in case.groups)


def _kind_rank(kind: str) -> int:
    order = ("full", "sliding_window", "mla", "sliding_window_mla", "chunked_local", "sink", "cross", "encoder_only", "mamba")
    return order.index(kind) if kind in order else len(order)


def _dtype_rank(dtype: str) -> int:
    return ("bfloat16", "float16", "float32").index(dtype) if dtype in ("bfloat16", "float16", "float32") else 3


def _layout_rank(layout: str) -> int:
    return ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC").index(layout)


__all__ = ["accepts", "cases", "choose_kernel_block_size"]
