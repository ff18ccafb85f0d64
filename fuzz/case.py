"""The Case: one KV-cache configuration, as plain JSON, independent of any vLLM release.

A Case says what a model asks of the KV cache (groups of layers, each with a spec and an
attention backend), how many blocks the manager hands out and which physical layout is in
force. Target adapters turn it into real vLLM objects; the oracle derives the expected byte
layout from it. Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from fuzz.errors import CaseError

SCHEMA_VERSION = 1


def replace(record: Any, /, **changes: Any) -> Any:
    """`dataclasses.replace` at a fraction of its cost, for kvfuzz's frozen records (a campaign makes tens per case).

    A record whose class has no `__post_init__` and only init fields is copied field by field; any other dataclass
    (vLLM's, for instance) goes through `dataclasses.replace` itself.
    """
    names = _plain_fields(type(record))
    if names is None:
        return dataclasses.replace(record, **changes)
    unknown = changes.keys() - names
    if unknown:
        raise TypeError(f"{type(record).__name__} has no field {sorted(unknown)[0]!r}")
    copy = object.__new__(type(record))
    values = record.__dict__
    copy.__dict__.update({name: values[name] for name in names})  # fields only, as dataclasses.replace (no cached values)
    copy.__dict__.update(changes)
    return copy


_PLAIN_FIELDS: dict[type, frozenset[str] | None] = {}


def _plain_fields(cls: type) -> frozenset[str] | None:
    """The field names of a dataclass that a field-by-field copy replaces faithfully; None where it would not."""
    if cls not in _PLAIN_FIELDS:
        fields = dataclasses.fields(cls)
        plain = (not hasattr(cls, "__post_init__") and not hasattr(cls, "__slots__") and all(f.init for f in fields))
        _PLAIN_FIELDS[cls] = frozenset(f.name for f in fields) if plain else None
    return _PLAIN_FIELDS[cls]


SPEC_KINDS = (
    "full",
    "sliding_window",
    "chunked_local",
    "sink",
    "cross",
    "encoder_only",
    "mla",
    "sliding_window_mla",
    "mamba",
)
MLA_KINDS = ("mla", "sliding_window_mla")
# The dtypes a model (vLLM's ModelConfig) runs in: a cache dtype "auto" stores one of them.
MODEL_DTYPES = ("bfloat16", "float16", "float32")
WINDOWED_KINDS = ("sliding_window", "sliding_window_mla")

# Element sizes of the torch dtypes a spec may store, by their torch attribute name.
DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}

# Physical orders of the logical [L, B, H, N, C] axes (outermost first), vLLM 0.29+.
KV_CACHE_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
# Before 0.29 a layout was a hint each backend's stride order consulted: tokens or heads first.
LEGACY_LAYOUTS = ("NHD", "HND")
LAYOUTS = KV_CACHE_LAYOUTS + LEGACY_LAYOUTS
# One layout under each release's name: vLLM documents NHD as LBNHC and HND as LBHNC (the
# legacy aliases VLLM_KV_CACHE_LAYOUT accepts from 0.29, vllm/config/cache.py).
LAYOUT_EQUIVALENTS = {"NHD": "LBNHC", "HND": "LBHNC"}
SYNTHETIC_PREFIX = "synthetic:"  # a synthetic backend's name in reports and variants

# Which model runner builds the views: the V2 runner (vllm/v1/worker/gpu/), the V1 GPUModelRunner
# (vllm/v1/worker/gpu_model_runner.py, which CPUModelRunner subclasses), or both, judged against each
# other as well as against the oracle. Simplest first.
RUNNERS = ("v2", "v1", "both")
# Where each group's KV-cache spec comes from: built by kvfuzz from the case's fields, or by vLLM
# from layers (Attention, MLA, ...) carrying the case's model parameters in a VllmConfig.
SPEC_SOURCES = ("case", "vllm")
# How the planner packs layers into shared per-block slabs before 0.29 (from 0.29 the layout's
# letters say it): not at all, the cross-layer-blocks connector setting, or DeepSeek V4's
# UniformTypeKVCacheSpecs groups.
PACKINGS = ("none", "cross_layers", "uniform_type")
# The platform vLLM's allocation believes it runs on: from 0.29 ROCm pads the one backing buffer
# (oracles/contract.py, backing_allocation_bytes); the views are the same on every platform.
PLATFORMS = ("cuda", "rocm")
CASE_OPTION_DEFAULTS = {"runner": RUNNERS[0], "spec_source": SPEC_SOURCES[0], "packing": PACKINGS[0], "platform": PLATFORMS[0]}


def layout_as(layout: str, offered: tuple[str, ...]) -> str | None:
    """The name a release that offers `offered` layouts gives `layout`; None if it has none."""
    if layout in offered:
        return layout
    for legacy, placed in LAYOUT_EQUIVALENTS.items():
        if layout in (legacy, placed):
            twin = placed if layout == legacy else legacy
            if twin in offered:
                return twin
    return None

# A backend's declared cache shape (vLLM <= 0.28 get_kv_cache_shape), one entry per axis: an int,
# or a symbol with an optional multiplier ("B", "T", "H", "D", "2*D"): B kernel blocks, T stored
# slots per kernel block, H KV heads, D head size.
SHAPE_SYMBOLS = ("B", "T", "H", "D")


def parse_shape_entry(entry: int | str) -> tuple[int, str | None]:
    """(multiplier, symbol) of one shape entry; symbol None for a plain int."""
    if isinstance(entry, int) and not isinstance(entry, bool):
        return entry, None
    if isinstance(entry, str):
        factor, _, symbol = entry.rpartition("*")
        if symbol in SHAPE_SYMBOLS and (factor == "" or factor.isdigit()):
            return int(factor or 1), symbol
    raise ValueError(f"{entry!r} is not an int or one of {', '.join(SHAPE_SYMBOLS)} with an optional 'k*' factor")


def evaluate_shape(pattern: tuple[int | str, ...], *, blocks: int, slots: int, heads: int, head_size: int) -> tuple[int, ...]:
    """A declared shape pattern at concrete (kernel blocks, slots per kernel block, heads, head size)."""
    values = {"B": blocks, "T": slots, "H": heads, "D": head_size}
    shape = []
    for entry in pattern:
        factor, symbol = parse_shape_entry(entry)
        shape.append(factor if symbol is None else factor * values[symbol])
    return tuple(shape)


@dataclass(frozen=True)
class SpecCase:
    """One KV-cache spec. Fields a kind does not use stay at their defaults."""

    kind: str
    block_size: int
    num_kv_heads: int = 1
    head_size: int = 64
    head_size_v: int | None = None
    dtype: str = "bfloat16"
    cache_dtype: str = "auto"
    page_size_padded: int | None = None
    alignment: int | None = None
    compress_ratio: int = 1
    model_version: str | None = None
    kv_quant_mode: str = "none"
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    sink_len: int | None = None
    # Published by the backend (vLLM's customize_spec); None: the spec's own default.
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    block_stride_alignment: int | None = None
    block_stride_multiple_of: int | None = None
    # Mamba state tensors (per block): shapes and their dtypes, each state's bytes rounded up to
    # `state_alignment` (vLLM 0.34+).
    mamba_shapes: tuple[tuple[int, ...], ...] = ()
    mamba_dtypes: tuple[str, ...] = ()
    state_alignment: int = 1
    # The cache dtype is one kvfuzz registers with the release's dtype-handler registry (vLLM
    # 0.33+): storage `dtype`, quant mode `kv_quant_mode`, nothing else.
    registered_cache_dtype: bool = False
    # Rotary dims of a head: a model parameter that Octave cache dtypes store at more bits.
    rope_dim: int | None = None
    # Fields with no effect on the page or the view, carried to vLLM's spec (0.33+): the sparse
    # top-k buffer width of an MLA cache, and whether a draft model owns the layer.
    topk_buffer_width: int | None = None
    is_draft: bool = False

    @property
    def is_mla(self) -> bool:
        return self.kind in MLA_KINDS

    @property
    def is_attention(self) -> bool:
        return self.kind != "mamba"


@dataclass(frozen=True)
class SyntheticBackend:
    """A backend described by its declarations instead of a vLLM class.

    kernel_block_sizes holds ints (exact sizes) and strings "xN" (any multiple of N).
    layouts: the KVCacheLayout names it accepts (None: any).
    """

    name: str
    kernel_block_sizes: tuple[int | str, ...] = ("x1",)
    layouts: tuple[str, ...] | None = None
    # vLLM <= 0.28 only: the cache shape the backend declares and its stride order (None: identity).
    shape: tuple[int | str, ...] | None = None
    stride_order: tuple[int, ...] | None = None

    @property
    def registered_name(self) -> str:
        """The name the backend class kvfuzz registers in vLLM gives (its `get_name()`)."""
        return registered_name(self.name)


def registered_name(synthetic_name: str) -> str:
    return "SYNTHETIC_" + synthetic_name.upper()


def names_in_messages(backend_name: str) -> tuple[str, ...]:
    """The names a group's backend (`GroupCase.backend_name`) goes by in vLLM's messages."""
    if backend_name.startswith(SYNTHETIC_PREFIX):
        return backend_name, registered_name(backend_name[len(SYNTHETIC_PREFIX):])
    return (backend_name,)


@dataclass(frozen=True)
class GroupCase:
    """One KV-cache group: layers sharing one spec and one attention backend."""

    spec: SpecCase
    layers: tuple[str, ...]
    backend: str | None = None
    synthetic_backend: SyntheticBackend | None = None
    kernel_block_size: int | None = None
    # What the backend declares for this spec (vLLM <= 0.28), filled in by the target's declare
    # step: the cache shape pattern and its stride order. Inputs of the oracle, not of vLLM.
    declared_shape: tuple[int | str, ...] | None = None
    declared_stride_order: tuple[int, ...] | None = None
    # Layers of one type that differ in size (vLLM's UniformTypeKVCacheSpecs, packing "uniform_type"): each
    # layer's KV heads, in layer order. Empty: every layer has spec.num_kv_heads.
    layer_heads: tuple[int, ...] = ()
    # Layers of one type whose heads differ in size (UniformTypeKVCacheSpecs too): each layer's head size (an MLA layer's
    # latent), in layer order. Empty: every layer has spec.head_size.
    layer_head_sizes: tuple[int, ...] = ()
    # Layers of one group stored at two precisions (vLLM's `--kv-cache-dtype-skip-layers`): each layer's cache, in layer
    # order, either the spec's own cache dtype or the model dtype a skipped layer keeps (its cache dtype "auto").
    # Empty: every layer has spec.cache_dtype.
    layer_cache_dtypes: tuple[str, ...] = ()

    @property
    def differs_per_layer(self) -> bool:
        """Whether the group's layers differ in size (vLLM's UniformTypeKVCacheSpecs): in heads or in precision."""
        return bool(self.layer_heads or self.layer_head_sizes or self.layer_cache_dtypes)

    @property
    def backend_name(self) -> str:
        if self.synthetic_backend is not None:
            return SYNTHETIC_PREFIX + self.synthetic_backend.name
        return self.backend or "none"

    def layer_spec(self, position: int) -> SpecCase:
        """The spec of the group's layer at `position`."""
        spec = self.spec
        if self.layer_heads:
            spec = replace(spec, num_kv_heads=self.layer_heads[position])
        if self.layer_head_sizes:
            spec = replace(spec, head_size=self.layer_head_sizes[position])
        if self.layer_cache_dtypes and self.layer_cache_dtypes[position] != spec.cache_dtype:
            # A quantized format's published state (its scales) is not the plain cache's.
            spec = replace(spec, cache_dtype="auto", dtype=self.layer_cache_dtypes[position], kv_quant_mode="none", state_content_bytes=None)
        return spec

    def of_layer(self, position: int) -> GroupCase:
        """The group as its layer at `position` sees it: that layer's own spec, no per-layer fields."""
        if not self.differs_per_layer:
            return self
        return replace(self, spec=self.layer_spec(position), layer_heads=(), layer_head_sizes=(), layer_cache_dtypes=())

    @property
    def layer_specs(self) -> tuple[SpecCase, ...]:
        return tuple(self.layer_spec(i) for i in range(len(self.layers)))


@dataclass(frozen=True)
class Touches:
    """What the code that addresses KV blocks by bytes is asked on a case (fuzz/targets/consumers.py
    and kernel_probe.py): which consumers run, the manager blocks they zero or map, the block
    copies (source, destination), and the tokens the kernel probe writes, each (manager block,
    position in the block; taken modulo each group's block size)."""

    consumers: tuple[str, ...] = ()
    blocks: tuple[int, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    tokens: tuple[tuple[int, int], ...] = ()

    def within(self, num_blocks: int) -> Touches:
        """Only what names blocks below `num_blocks` (a case shrunk to fewer blocks keeps the rest)."""
        return Touches(consumers=self.consumers, blocks=tuple(b for b in self.blocks if b < num_blocks),
                       copies=tuple(c for c in self.copies if max(c) < num_blocks), tokens=tuple(t for t in self.tokens if t[0] < num_blocks))

    @property
    def size(self) -> int:
        return len(self.consumers) + len(self.blocks) + len(self.copies) + len(self.tokens)


@dataclass(frozen=True)
class Case:
    groups: tuple[GroupCase, ...]
    num_blocks: int
    layout: str = "LBNHC"
    kv_sharing: tuple[tuple[str, str], ...] = ()
    device: str | None = None
    runner: str = "v2"
    spec_source: str = "case"
    packing: str = "none"
    platform: str = "cuda"
    schema: int = SCHEMA_VERSION
    touches: Touches | None = None

    @property
    def layer_names(self) -> list[str]:
        return [name for group in self.groups for name in group.layers]

    @property
    def is_latent(self) -> bool:
        """True when some group needs a synthetic backend: no shipped backend reaches it."""
        return any(g.synthetic_backend is not None for g in self.groups)

    def group_of(self, layer: str) -> int:
        for index, group in enumerate(self.groups):
            if layer in group.layers:
                return index
        raise KeyError(layer)

    def content_hash(self) -> str:
        return hashlib.sha256(dumps(self).encode()).hexdigest()[:16]

    def describe(self) -> str:
        kinds = "+".join(g.spec.kind for g in self.groups)
        backends = "+".join(g.backend_name for g in self.groups)
        extras = [getattr(self, name) for name, default in CASE_OPTION_DEFAULTS.items() if getattr(self, name) != default]
        return f"{kinds}/{backends}/{self.layout}" + "".join(f"/{extra}" for extra in extras)


# ---------------------------------------------------------------- JSON codec


def to_dict(case: Case) -> dict[str, Any]:
    def clean(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: clean(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, tuple):
            return [clean(v) for v in value]
        return value

    data = clean(case)
    data["kv_sharing"] = dict(case.kv_sharing)
    # Fields added after schema 1 are written only when set, so a case that does not use them keeps its
    # JSON (and its content hash) as older kvfuzz wrote it.
    for name, default in CASE_OPTION_DEFAULTS.items():
        if data[name] == default:
            del data[name]
    if case.touches is None:
        del data["touches"]  # cases without consumers keep the JSON (and content hash) they always had
    for group in data["groups"]:
        for name in ("layer_heads", "layer_head_sizes", "layer_cache_dtypes"):
            if not group[name]:
                del group[name]
    return data


def dumps(case: Case) -> str:
    return json.dumps(to_dict(case), sort_keys=True, separators=(",", ":"))


def from_dict(data: Any) -> Case:
    """Build a Case from parsed JSON; CaseError names the first offending field."""
    _expect(isinstance(data, dict), "case", "must be a JSON object")
    schema = data.get("schema", SCHEMA_VERSION)
    _expect(schema == SCHEMA_VERSION, "schema", f"is {schema!r}, this kvfuzz reads {SCHEMA_VERSION}")
    _known_keys(data, Case, "case")
    groups_raw = data.get("groups")
    _expect(isinstance(groups_raw, list), "groups", "must be a list (empty for an attention-free model)")
    groups = tuple(_group_from_dict(g, f"groups[{i}]") for i, g in enumerate(groups_raw))
    sharing = data.get("kv_sharing", {})
    _expect(isinstance(sharing, dict), "kv_sharing", "must map a layer name to its target")
    case = Case(
        groups=groups,
        num_blocks=_int(data.get("num_blocks"), "num_blocks", minimum=1),
        layout=data.get("layout", "LBNHC"),
        kv_sharing=tuple(sorted(sharing.items())),
        device=data.get("device"),
        **{name: data.get(name, default) for name, default in CASE_OPTION_DEFAULTS.items()},
        touches=_touches_from_dict(data.get("touches"), "touches"),
    )
    validate(case)
    return case


def loads(text: str) -> Case:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise CaseError(f"case: not valid JSON ({error.msg} at line {error.lineno})") from None
    return from_dict(data)


def validate(case: Case) -> None:
    """Consistency rules every case obeys, whatever the target."""
    _expect(case.layout in LAYOUTS, "layout", f"{case.layout!r} is not one of {', '.join(LAYOUTS)}")
    for name, options in (("runner", RUNNERS), ("spec_source", SPEC_SOURCES), ("packing", PACKINGS), ("platform", PLATFORMS)):
        value = getattr(case, name)
        _expect(value in options, name, f"{value!r} is not one of {', '.join(options)}")
    _expect(case.device in (None, "cpu", "cuda") or str(case.device).startswith("cuda:"), "device", f"{case.device!r} is not cpu or cuda")
    seen: set[str] = set()
    for i, group in enumerate(case.groups):
        where = f"groups[{i}]"
        _expect(len(group.layers) > 0, f"{where}.layers", "must name at least one layer")
        for name in group.layers:
            _expect(isinstance(name, str) and name, f"{where}.layers", "names must be non-empty strings")
            _expect(name not in seen, f"{where}.layers", f"layer {name!r} appears twice")
            seen.add(name)
        _validate_spec(group.spec, f"{where}.spec")
        if group.spec.is_attention:
            _expect(
                (group.backend is None) != (group.synthetic_backend is None),
                f"{where}.backend",
                "an attention group names exactly one of backend / synthetic_backend",
            )
        if group.layer_heads:
            _expect(len(group.layer_heads) == len(group.layers), f"{where}.layer_heads", "must give one head count per layer")
            _expect(all(h >= 1 for h in group.layer_heads), f"{where}.layer_heads", "head counts must be positive")
            _expect(group.spec.is_attention and not group.spec.is_mla, f"{where}.layer_heads",
                    "only attention layers with KV heads (not MLA) differ in heads")
            _expect(case.packing == "uniform_type", f"{where}.layer_heads", "layers that differ in size need packing uniform_type")
        if group.layer_head_sizes:
            spec, where_sizes = group.spec, f"{where}.layer_head_sizes"
            _expect(len(group.layer_head_sizes) == len(group.layers), where_sizes, "must give one head size per layer")
            _expect(all(h >= 1 for h in group.layer_head_sizes), where_sizes, "head sizes must be positive")
            _expect(spec.is_attention, where_sizes, "only attention layers have heads")
            _expect(spec.head_size_v is None and spec.rope_dim is None, where_sizes,
                    "a spec that states a value head or rotary dims holds one head size")
            _expect(case.packing == "uniform_type", where_sizes, "layers that differ in size need packing uniform_type")
        if group.layer_cache_dtypes:
            spec, where_dtypes = group.spec, f"{where}.layer_cache_dtypes"
            _expect(len(group.layer_cache_dtypes) == len(group.layers), where_dtypes, "must give one cache dtype per layer")
            _expect(spec.cache_dtype != "auto" and not spec.registered_cache_dtype, where_dtypes,
                    "layers skip the quantization of a quantized cache dtype only")
            _expect(all(d in (spec.cache_dtype, *MODEL_DTYPES) for d in group.layer_cache_dtypes), where_dtypes,
                    f"each is the spec's cache dtype {spec.cache_dtype!r} or a model dtype ({', '.join(MODEL_DTYPES)})")
            _expect(spec.is_attention and not spec.is_mla, where_dtypes, "only attention layers with KV heads (not MLA) differ in precision")
            _expect(case.packing == "uniform_type", where_dtypes, "layers that differ in size need packing uniform_type")
        kbs = group.kernel_block_size
        if kbs is not None:
            _expect(kbs >= 1, f"{where}.kernel_block_size", "must be positive")
        # A synthetic backend is the case's own input and must be well formed; what a real backend declared is
        # recorded as it was, for the oracle to judge (a broken declaration is a finding, not a malformed case).
        _validate_shape(group.declared_shape, None, f"{where}.declared_shape", strict=False)
        if group.synthetic_backend is not None:
            _validate_shape(group.synthetic_backend.shape, group.synthetic_backend.stride_order, f"{where}.synthetic_backend.shape")
    for sharer, target in case.kv_sharing:
        _expect(sharer not in seen, "kv_sharing", f"sharing layer {sharer!r} must not own a cache")
        _expect(target in seen, "kv_sharing", f"target {target!r} of {sharer!r} is not a layer of any group")
    if case.touches is not None:
        _validate_touches(case.touches, case.num_blocks)


def _validate_touches(touches: Touches, num_blocks: int) -> None:
    blocks = [*touches.blocks, *(b for pair in touches.copies for b in pair), *(b for b, _ in touches.tokens)]
    _expect(all(0 <= b < num_blocks for b in blocks), "touches", f"names a block outside 0..{num_blocks - 1}")
    _expect(all(src != dst for src, dst in touches.copies), "touches.copies", "a block is copied onto itself")
    _expect(all(position >= 0 for _, position in touches.tokens), "touches.tokens", "positions must be >= 0")


def _touches_from_dict(data: Any, where: str) -> Touches | None:
    if data is None:
        return None
    _expect(isinstance(data, dict), where, "must be an object")
    _known_keys(data, Touches, where)
    try:
        return Touches(
            consumers=tuple(str(c) for c in data.get("consumers", ())),
            blocks=tuple(_int(b, f"{where}.blocks", minimum=0) for b in data.get("blocks", ())),
            copies=tuple((_int(s, f"{where}.copies", minimum=0), _int(d, f"{where}.copies", minimum=0)) for s, d in data.get("copies", ())),
            tokens=tuple((_int(b, f"{where}.tokens", minimum=0), _int(p, f"{where}.tokens", minimum=0)) for b, p in data.get("tokens", ())),
        )
    except (TypeError, ValueError):
        raise CaseError(f"{where}: copies and tokens are lists of integer pairs") from None


def _validate_spec(spec: SpecCase, where: str) -> None:
    _expect(spec.kind in SPEC_KINDS, f"{where}.kind", f"{spec.kind!r} is not one of {', '.join(SPEC_KINDS)}")
    _int(spec.block_size, f"{where}.block_size", minimum=1)
    _int(spec.num_kv_heads, f"{where}.num_kv_heads", minimum=1)
    _int(spec.head_size, f"{where}.head_size", minimum=1)
    _expect(spec.dtype in DTYPE_SIZES, f"{where}.dtype", f"{spec.dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
    _int(spec.compress_ratio, f"{where}.compress_ratio", minimum=1)
    _expect(spec.block_size % spec.compress_ratio == 0, f"{where}.compress_ratio", "must divide block_size")
    _expect(spec.compress_ratio == 1 or spec.is_mla, f"{where}.compress_ratio", "only MLA specs compress")
    for name in ("page_size_padded", "alignment", "state_content_bytes", "num_head_slots", "head_size_v",
                 "block_stride_alignment", "block_stride_multiple_of", "rope_dim", "topk_buffer_width"):
        value = getattr(spec, name)
        if value is not None:
            _int(value, f"{where}.{name}", minimum=0 if name == "head_size_v" else 1)
    _int(spec.state_alignment, f"{where}.state_alignment", minimum=1)
    if spec.kind in WINDOWED_KINDS:
        _expect(spec.sliding_window is not None, f"{where}.sliding_window", "is required for this kind")
    if spec.kind == "chunked_local":
        _expect(spec.attention_chunk_size is not None, f"{where}.attention_chunk_size", "is required for chunked_local")
    if spec.kind == "mamba":
        _expect(len(spec.mamba_shapes) > 0, f"{where}.mamba_shapes", "a mamba spec needs at least one state shape")
        _expect(len(spec.mamba_shapes) == len(spec.mamba_dtypes), f"{where}.mamba_dtypes", "needs one dtype per shape")
        for dtype in spec.mamba_dtypes:
            _expect(dtype in DTYPE_SIZES, f"{where}.mamba_dtypes", f"{dtype!r} is not a known dtype")


def _validate_shape(shape: tuple[int | str, ...] | None, order: tuple[int, ...] | None, where: str, strict: bool = True) -> None:
    if shape is None:
        return
    for entry in shape:
        try:
            parse_shape_entry(entry)
        except ValueError as error:
            raise CaseError(f"{where}: {error}") from None
    if not strict:
        return
    symbols = [parse_shape_entry(e)[1] for e in shape]
    _expect(symbols.count("B") == 1, where, "needs exactly one block axis 'B'")
    if order is not None:
        _expect(sorted(order) == list(range(len(shape))), where, f"stride order {list(order)} is not a permutation of its axes")


def _group_from_dict(data: Any, where: str) -> GroupCase:
    _expect(isinstance(data, dict), where, "must be an object")
    _known_keys(data, GroupCase, where)
    spec_raw = data.get("spec")
    _expect(isinstance(spec_raw, dict), f"{where}.spec", "must be an object")
    _known_keys(spec_raw, SpecCase, f"{where}.spec")
    _expect("kind" in spec_raw, f"{where}.spec.kind", "is missing")
    _expect("block_size" in spec_raw, f"{where}.spec.block_size", "is missing")
    spec_fields = dict(spec_raw)
    try:
        spec_fields["mamba_shapes"] = tuple(tuple(int(d) for d in s) for s in spec_raw.get("mamba_shapes", ()))
        spec_fields["mamba_dtypes"] = tuple(spec_raw.get("mamba_dtypes", ()))
    except (TypeError, ValueError):
        raise CaseError(f"{where}.spec.mamba_shapes: must be a list of integer lists") from None
    layers = data.get("layers")
    _expect(isinstance(layers, list), f"{where}.layers", "must be a list of layer names")
    synthetic = data.get("synthetic_backend")
    if synthetic is not None:
        _expect(isinstance(synthetic, dict), f"{where}.synthetic_backend", "must be an object")
        _known_keys(synthetic, SyntheticBackend, f"{where}.synthetic_backend")
        sizes = tuple(synthetic.get("kernel_block_sizes", ("x1",)))
        for size in sizes:
            _expect(
                (isinstance(size, int) and size > 0) or (isinstance(size, str) and size[:1] == "x" and size[1:].isdigit()),
                f"{where}.synthetic_backend.kernel_block_sizes",
                f"{size!r} is neither a positive int nor 'xN'",
            )
        layouts = synthetic.get("layouts")
        synthetic = SyntheticBackend(
            name=str(synthetic.get("name", "synthetic")),
            kernel_block_sizes=sizes,
            layouts=None if layouts is None else tuple(layouts),
            shape=_optional_tuple(synthetic.get("shape"), f"{where}.synthetic_backend.shape"),
            stride_order=_optional_tuple(synthetic.get("stride_order"), f"{where}.synthetic_backend.stride_order"),
        )
    kbs = data.get("kernel_block_size")
    return GroupCase(
        spec=SpecCase(**spec_fields),
        layers=tuple(layers),
        backend=data.get("backend"),
        synthetic_backend=synthetic,
        kernel_block_size=None if kbs is None else _int(kbs, f"{where}.kernel_block_size", minimum=1),
        declared_shape=_optional_tuple(data.get("declared_shape"), f"{where}.declared_shape"),
        declared_stride_order=_optional_tuple(data.get("declared_stride_order"), f"{where}.declared_stride_order"),
        layer_heads=_int_tuple(data.get("layer_heads", []), f"{where}.layer_heads"),
        layer_head_sizes=_int_tuple(data.get("layer_head_sizes", []), f"{where}.layer_head_sizes"),
        layer_cache_dtypes=_str_tuple(data.get("layer_cache_dtypes", []), f"{where}.layer_cache_dtypes"),
    )


def _int_tuple(values: Any, where: str) -> tuple[int, ...]:
    _expect(isinstance(values, list), where, "must be a list of positive integers")
    return tuple(_int(v, where, minimum=1) for v in values)


def _str_tuple(values: Any, where: str) -> tuple[str, ...]:
    _expect(isinstance(values, list) and all(isinstance(v, str) for v in values), where, "must be a list of strings")
    return tuple(values)


def _optional_tuple(value: Any, where: str) -> tuple[Any, ...] | None:
    if value is None:
        return None
    _expect(isinstance(value, list), where, "must be a list")
    return tuple(value)


def _known_keys(data: dict[str, Any], cls: type, where: str) -> None:
    allowed = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        _expect(key in allowed, f"{where}.{key}", "is not a known field")


def _int(value: Any, where: str, minimum: int) -> int:
    _expect(isinstance(value, int) and not isinstance(value, bool), where, f"must be an integer, got {value!r}")
    _expect(value >= minimum, where, f"must be >= {minimum}, got {value}")
    return value


def _expect(condition: bool, where: str, message: str) -> None:
    if not condition:
        raise CaseError(f"{where}: {message}")


__all__ = [
    "Case",
    "GroupCase",
    "SpecCase",
    "SyntheticBackend",
    "Touches",
    "dumps",
    "from_dict",
    "loads",
    "to_dict",
    "validate",
]
