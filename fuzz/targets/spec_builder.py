"""Specs built by vLLM (case field spec_source "vllm"): layers carrying the case's model parameters, then the
release's own spec walk.

A model's attention layers register themselves in the VllmConfig's forward context when they are
constructed; the V2 runner's `get_kv_cache_spec(vllm_config)` (vllm/v1/worker/gpu/attn_utils.py) asks
each one for its spec (`layer.get_kv_cache_spec`: the cache dtype, its storage dtype and quant mode, head
sizes, window) and applies the backend's hooks (0.24-0.28 `indexes_kv_by_block_stride`, 0.28+
`customize_spec`, 0.32+ `customize_attention_spec`). kvfuzz does the same per KV-cache group: a
VllmConfig whose model config is the small local model in fuzz/targets/model (nothing is downloaded;
one per model dtype and process), the group's block size and cache dtype in its cache config, one layer
per case layer, and the walk.

Layers: `Attention` through its real constructor (full attention, sliding window where the release's
Attention keeps the configured block size for it), `MLAAttention` as a stand-in (its constructor
builds the backend's implementation, which needs a GPU): `object.__new__` with exactly the attributes
the release's `get_kv_cache_spec` reads, found in its source; a release reading one kvfuzz does not
know turns MLA layers off, with the reason. Only real backends whose layer builds here with the plain
cache dtype are used. A layer the backend refuses to build (a ValueError / NotImplementedError from its
constructor: head sizes, block sizes, dtypes the implementation does not serve) is no layout question:
the case is skipped with vLLM's reason.
"""

from __future__ import annotations

import ast
import inspect
import math
import os
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fuzz.case import Case, GroupCase
from fuzz.errors import Inexpressible, TargetError
from fuzz.targets.entry_points import Probe
from fuzz.targets.model_info import inspection_in_fork

MODEL_DIR = Path(__file__).resolve().parent / "model"
# What kvfuzz's MLA stand-in holds: every attribute MLAAttention.get_kv_cache_spec / get_attn_backend read in
# some release, with the value the constructor gives it for a dense, non-windowed, non-sparse-indexed layer (0.33+: no
# top-k buffer; 0.34: `impl`, the backend's implementation, asked for its fp8_ds_mla row bytes).
MLA_ATTRIBUTES = ("head_size", "kv_cache_dtype", "attn_backend", "sliding_window", "non_causal_multi_token_decode", "indexer",
                  "topk_buffer_width", "impl")
# DeepSeek's MLA head: the latent (kv_lora_rank) and the rotary part; the implementation's constructor keeps both.
MLA_LATENT = 512
REFUSALS = (ValueError, NotImplementedError)


class LayerSpecs:
    """Builds each group's spec from layers; `kinds` / `backends` say what can be built here, `off` why not."""

    def __init__(self, probe: Probe, backends: dict[str, type], current_config: Callable[[Any], Any], make_config: Callable[..., Any]) -> None:
        self.probe = probe
        self.backend_classes = backends
        self.set_current = current_config
        self.make_config = make_config
        self.walk = _obj(probe.find("layer spec walk"))
        self.attention = _obj(probe.find("Attention layer"))
        self.mla = _obj(probe.find("MLA layer"))
        self.model_config = _obj(probe.find("ModelConfig"))
        self.cache_config = _obj(probe.find("CacheConfig"))
        self.off: str | None = None
        self.mla_aligns = False
        self._configs: dict[str, Any] = {}
        self._mla_alignments: dict[tuple[Any, ...], Any] = {}
        self.kinds: tuple[str, ...] = ()
        # Whether this release's sliding-window layers choose their own block size (0.32: "SW chooses its own
        # block_size, decoupled from the user's --block-size"): then the case's block size is not theirs to keep.
        self.window_picks_block = False
        self.backends: tuple[str, ...] = ()
        self.fields: tuple[str, ...] = ()
        needed = (("layer spec walk", self.walk), ("Attention layer", self.attention), ("ModelConfig", self.model_config),
                  ("CacheConfig", self.cache_config))
        missing = [role for role, found in needed if found is None]
        if missing:
            self.off = "; ".join(probe.missing(role) for role in missing)
            return
        self.attention_takes = set(_parameters(self.attention.__init__))
        self.mla_reads = _mla_reads(self.mla)
        self.mla_aligns = _declares_alignment(self.mla)
        self.canonical_mla_dtype = stored_mla_dtype(self.mla)
        self._survey(backends)

    # ------------------------------------------------------------------ what builds here

    def _survey(self, backends: dict[str, type]) -> None:
        """Which backends' layers build with the plain cache dtype, and which kinds the layers give as kvfuzz means them."""
        kinds: set[str] = set()
        usable: list[str] = []
        mla_unknown = self.mla_reads - set(MLA_ATTRIBUTES) if self.mla is not None else set()
        for name, backend in backends.items():
            is_mla = bool(getattr(backend, "is_mla", lambda: False)())
            if is_mla and (self.mla is None or mla_unknown):
                continue
            # A block of several kernel blocks: a layer that picks its own block size (the smallest kernel block) shows.
            sizes = [s for s in backend.get_supported_kernel_block_sizes() if isinstance(s, int)]
            block = 4 * (sizes[0] if sizes else 16)
            try:
                spec = self._trial(backend, is_mla, block, None)
            except Exception:  # noqa: BLE001 - a backend whose layer does not build here is not used for vLLM-built specs
                continue
            if spec is None or spec.block_size != block:
                continue
            usable.append(name)
            kinds.add("mla" if is_mla else "full")
            if not is_mla and "per_layer_sliding_window" in self.attention_takes:
                try:
                    windowed = self._trial(backend, False, block, 4 * block)
                except Exception:  # noqa: BLE001 - as above
                    windowed = None
                # Some releases pick a sliding-window layer's block size themselves (page unification sizes it later).
                if windowed is not None and windowed.block_size == block:
                    kinds.add("sliding_window")
                elif windowed is not None:
                    self.window_picks_block = True
        self.backends = tuple(usable)
        self.kinds = tuple(kind for kind in ("full", "sliding_window", "mla") if kind in kinds)
        self.fields = ("head_size_v",) if "head_size_v" in self.attention_takes else ()
        if mla_unknown:
            self.off = (f"MLAAttention.get_kv_cache_spec reads {', '.join(sorted(mla_unknown))}, which kvfuzz's MLA stand-in does not "
                        "hold; MLA specs are not built by vLLM")

    def _trial(self, backend: type, is_mla: bool, block: int, window: int | None) -> Any:
        cfg = self._config("bfloat16", block, "auto")
        name = "model.layers.0.kvfuzz"
        with self.set_current(cfg):
            if is_mla:
                self._mla_layer(cfg, name, backend, 576)
            else:
                self._attention_layer(cfg, name, backend, 2, 64, None, window)
            return self.walk(cfg).get(name)

    # ------------------------------------------------------------------ building

    def build(self, case: Case) -> list[tuple[Any, str]]:
        """Each group's spec as vLLM builds it from the group's layers, with the layer class that built it."""
        return [self._group(group) for group in case.groups]

    def _group(self, group: GroupCase) -> tuple[Any, str]:
        spec = group.spec
        model_dtype = spec.dtype if spec.cache_dtype == "auto" else "bfloat16"
        cfg = self._config(model_dtype, spec.block_size, spec.cache_dtype)
        backend = self.backend_classes[group.backend or ""]
        with self.set_current(cfg):
            for name in group.layers:
                try:
                    if spec.is_mla:
                        layer = self._mla_layer(cfg, name, backend, spec.head_size, spec.cache_dtype)
                    else:
                        layer = self._attention_layer(cfg, name, backend, spec.num_kv_heads, spec.head_size, spec.head_size_v,
                                                      spec.sliding_window)
                except REFUSALS as error:
                    raise Inexpressible(f"field spec_source: {group.backend_name} refuses to build this layer "
                                        f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from None
            built = self.walk(cfg)
        made = built[group.layers[0]]
        if self.window_picks_block and spec.sliding_window is not None and made is not None and made.block_size != spec.block_size:
            raise Inexpressible(f"field spec_source: vLLM picks this sliding-window layer's block size itself ({made.block_size}, "
                                f"not the case's {spec.block_size})")
        return made, type(layer).__name__

    def mla_block_stride_alignment(self, backend: type, spec: Any) -> Any:
        """The block-stride alignment vLLM's MLA layer declares for a layer of `spec` on `backend` (0.31 declares the row
        width for backends that read the cache as flat rows), or None: where a release's layer, not the backend, adds
        it, a spec without it is no spec that release builds."""
        if not self.mla_aligns:
            return None
        key = (backend, spec.head_size, spec.cache_dtype, spec.sliding_window, spec.block_size)
        if key not in self._mla_alignments:
            alignment = None
            if self.mla is not None and not self.off:
                cfg = self._config("bfloat16", spec.block_size, spec.cache_dtype)
                with self.set_current(cfg):
                    layer = self._mla_layer(cfg, "model.layers.0.kvfuzz", backend, spec.head_size, spec.cache_dtype)
                    layer.sliding_window = spec.sliding_window
                    alignment = getattr(layer.get_kv_cache_spec(cfg), "block_stride_alignment", None)
            self._mla_alignments[key] = alignment
        return self._mla_alignments[key]

    def _config(self, model_dtype: str, block_size: int, cache_dtype: str) -> Any:
        """A VllmConfig of the local model in `model_dtype` (one per dtype and process), emptied of layers, set to the
        group's block size and cache dtype (set after construction: a platform may refuse some pairs at construction)."""
        cfg = self._configs.get(model_dtype)
        if cfg is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            if not (MODEL_DIR / "config.json").is_file():  # vLLM would take the path for a hub repo id and retry for a minute
                raise TargetError(f"kvfuzz is installed without its model configuration ({MODEL_DIR / 'config.json'})")
            with inspection_in_fork():
                model = self.model_config(model=str(MODEL_DIR), dtype=model_dtype, skip_tokenizer_init=True)
            cfg = self._configs[model_dtype] = self.make_config(model_config=model, cache_config=self.cache_config(block_size=16))
        cfg.compilation_config.static_forward_context.clear()
        cfg.cache_config.block_size = block_size
        cfg.cache_config.cache_dtype = cache_dtype
        return cfg

    def _attention_layer(self, cfg: Any, name: str, backend: type, heads: int, head_size: int, head_size_v: int | None,
                         window: int | None) -> Any:
        extra: dict[str, Any] = {}
        if head_size_v is not None:
            extra["head_size_v"] = head_size_v
        if window is not None:
            extra["per_layer_sliding_window"] = window
        assert self.attention is not None
        return self.attention(num_heads=heads, head_size=head_size, scale=1 / math.sqrt(head_size), num_kv_heads=heads,
                              cache_config=cfg.cache_config, prefix=name, attn_backend=backend, **extra)

    def _mla_layer(self, cfg: Any, name: str, backend: type, head_size: int, cache_dtype: str = "auto") -> Any:
        """MLAAttention as its constructor leaves it for the spec walk, without the backend implementation it would build."""
        if self.canonical_mla_dtype is not None:
            stored = self.canonical_mla_dtype(backend, cache_dtype)
            if stored != cache_dtype:
                raise Inexpressible(f"field cache_dtype: MLAAttention stores {stored} for a {cache_dtype} cache on {backend.get_name()}")
        layer = object.__new__(self.mla)
        torch.nn.Module.__init__(layer)
        values = {"head_size": head_size, "kv_cache_dtype": cache_dtype, "attn_backend": backend, "sliding_window": None,
                  "non_causal_multi_token_decode": False, "indexer": None, "topk_buffer_width": None,
                  "impl": _mla_impl(backend, head_size, cache_dtype) if "impl" in self.mla_reads else None}
        for attribute in MLA_ATTRIBUTES:
            setattr(layer, attribute, values[attribute])
        layer.layer_name = name
        layer.kv_cache = torch.tensor([])
        cfg.compilation_config.static_forward_context[name] = layer
        return layer


def _mla_impl(backend: type, head_size: int, cache_dtype: str) -> Any:
    """The backend's MLA implementation as its constructor leaves the fields the spec asks it for (its latent and rotary
    head sizes), without the kernels it would set up; None where the release's layer never asks (no fp8_ds_mla)."""
    if cache_dtype != "fp8_ds_mla":
        return None
    try:
        impl = object.__new__(backend.get_impl_cls())
    except Exception as error:  # noqa: BLE001 - an implementation that does not import here sizes no fp8_ds_mla row here
        raise Inexpressible(f"field cache_dtype: {backend.get_name()}'s implementation does not import here "
                            f"({type(error).__name__})") from None
    impl.kv_lora_rank = min(head_size, MLA_LATENT)
    impl.qk_rope_head_dim = head_size - impl.kv_lora_rank
    return impl


def stored_mla_dtype(mla_layer: Any) -> Callable[[type, str], str] | None:
    """vLLM's MLA layer's rule for the cache dtype it stores on a backend (a sparse MLA backend stores `fp8_ds_mla` for
    `auto` / `fp8`), or None where the release has no such rule."""
    return _module_function(mla_layer, "_canonicalize_sparse_mla_kv_cache_dtype")


def _obj(found: Any) -> Any:
    return None if found is None else found.obj


def _parameters(function: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(inspect.unwrap(function)).parameters)
    except (TypeError, ValueError):
        return ()


def _module_function(cls: Any, name: str) -> Callable[..., Any] | None:
    if cls is None:
        return None
    import importlib

    function = getattr(importlib.import_module(cls.__module__), name, None)
    return function if callable(function) else None


def _declares_alignment(cls: Any) -> bool:
    """Whether the release's MLA layer sets a block-stride alignment in its spec (0.31), from its source."""
    try:
        return cls is not None and "block_stride_alignment" in inspect.getsource(cls.get_kv_cache_spec)
    except (OSError, TypeError, AttributeError):
        return False


def _mla_reads(cls: Any) -> set[str]:
    """The attributes MLAAttention's spec method and backend getter read off the layer (`self.X`), from their source,
    through the class's own methods they call (`self._uses_flat_kv_cache()` reads what that method reads)."""
    if cls is None:
        return set()
    reads: set[str] = set()
    pending, seen = ["get_kv_cache_spec", "get_attn_backend"], set()
    while pending:
        method = pending.pop()
        seen.add(method)
        function = getattr(cls, method, None)
        if function is None:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        except (OSError, TypeError, SyntaxError):
            return {"<source unavailable>"}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
                continue
            if inspect.isfunction(inspect.getattr_static(cls, node.attr, None)):
                if node.attr not in seen:
                    pending.append(node.attr)
            else:
                reads.add(node.attr)
    return reads
