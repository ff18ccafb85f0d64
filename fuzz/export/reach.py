"""How far a finding is from a real deployment: the one rule every report, export and table uses.

- `latent`: only a synthetic backend reaches it (a layout or declaration no shipped backend has), or vLLM's own
  validation refuses the configuration before the code under test runs (a layout override the backends do not
  list, which `resolve_kv_cache_layout` rejects).
- `flag`: a shipped backend reaches it once a setting overrides what vLLM would choose by itself: the layout
  (`VLLM_KV_CACHE_LAYOUT` other than the one vLLM resolves for the backends), or cross-layer blocks.
- `deployment`: a real model's configuration reaches it with vLLM's own choices. Options that switch on the
  feature under test (a KV connector) are listed as settings but are no override.

vLLM resolves the layout from what the backends declare (`supported_kv_cache_layouts`, most preferred first); a
backend that declares nothing follows the default preference, whose first entry is LBNHC (NHD before 0.29). A KV
connector's own layout (the offloading connector's LBHNC) wins over the backends' preference when they accept it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fuzz.case import LAYOUT_EQUIVALENTS, Case
from fuzz.checks.registry import BY_NAME
from oracles.pages import page

REACH_CLASSES = ("deployment", "flag", "latent")
# The compress ratios a model vLLM ships builds its compressed caches with: DeepSeek V4's compressor asserts 4 or 128
# (vllm/models/deepseek_v4/compressor.py, 0.22 - 0.28), V4.1's takes 1 or 2 (vllm/models/deepseek_v41/compressor.py,
# 0.32+); sparse_swa.py sizes its caches for 2, 4 and 128 only. Another ratio comes from no model's configuration.
MODEL_COMPRESS_RATIOS = frozenset({1, 2, 4, 128})
# Compressed, sliding-window and page-aligned (`alignment`) MLA layers are DeepSeek V4's (and V4.1's) own: only
# vllm/models/deepseek_v4*/ and backends/mla/sparse_swa.py build such specs, and those models have no Mamba layers.
DEFAULT_LAYOUT = "LBNHC"
LEGACY_DEFAULT_LAYOUT = "NHD"



@dataclass(frozen=True)
class Reach:
    kind: str  # one of REACH_CLASSES
    why: str  # one line
    overrides: tuple[str, ...] = ()  # settings that override vLLM's own choice (they make it `flag`)
    settings: tuple[str, ...] = ()  # options that switch on the code under test

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "why": self.why, "overrides": list(self.overrides), "settings": list(self.settings)}


def _placed(layout: str) -> str:
    return LAYOUT_EQUIVALENTS.get(layout, layout)


def resolved_layout(declared: list[tuple[str, ...] | None], legacy: bool) -> tuple[str | None, set[str] | None]:
    """The layout vLLM picks for backends that declare `declared` (None: nothing), and the layouts it accepts as an
    override (None: any). A simplification of `resolve_kv_cache_layout`: the first declaring backend's first layout
    that every declaring backend lists."""
    sets = [tuple(_placed(name) for name in names) for names in declared if names]
    if not sets:
        return (LEGACY_DEFAULT_LAYOUT if legacy else DEFAULT_LAYOUT), None
    common = set(sets[0]).intersection(*sets[1:])
    first = next((name for name in sets[0] if name in common), None)
    return first, common


def _unmatched_mamba_padding(case: Case) -> str | None:
    """Why a Mamba page of the case is padded as no model's is, or None. vLLM pads a hybrid model's Mamba page up to
    its attention page, so that every group's pages are one size (HybridAttentionMambaModelConfig, 0.20+); a model
    without attention layers gets no padding."""
    attention = {page(spec).page_bytes for g in case.groups for spec in g.layer_specs if spec.kind != "mamba"}
    for spec in (spec for g in case.groups for spec in g.layer_specs if spec.kind == "mamba"):
        if spec.page_size_padded is not None and spec.page_size_padded not in attention:
            pads = f"up to its attention page ({', '.join(map(str, sorted(attention)))} bytes)" if attention else "not at all without attention"
            return f"vLLM pads a model's Mamba page {pads}; this case pads it to {spec.page_size_padded} bytes"
    return None


def reach_of(case: Case, meta: Mapping[str, object], backend_layouts: Mapping[str, tuple[str, ...] | None] | None) -> Reach:
    """The finding's reach. `backend_layouts`: each shipped backend's declared layouts as the release reports them
    (None where it declares none); None when no release was asked, in which case undeclared is assumed."""
    # What the case's checks need switched on (a KV connector): the vLLM option, in a user's words.
    named = [BY_NAME[name] for name in (case.touches.consumers if case.touches else ()) if name in BY_NAME]
    settings = tuple(check.setting for check in named if check.setting is not None)
    specs = [spec for g in case.groups for spec in g.layer_specs]
    if any(spec.registered_cache_dtype for spec in specs):
        return Reach("latent", "no platform vLLM ships registers a cache dtype with this mode: only an out-of-tree platform's "
                               "dtype handler (register_kv_cache_dtype) reaches it", settings=settings)
    ratios = sorted({spec.compress_ratio for spec in specs} - MODEL_COMPRESS_RATIOS)
    if ratios:
        return Reach("latent", f"no model vLLM ships compresses its cache by {', '.join(map(str, ratios))} (DeepSeek V4 and "
                               f"V4.1 use {', '.join(map(str, sorted(MODEL_COMPRESS_RATIOS)))})", settings=settings)
    deepseek_v4 = [s for s in specs if s.kind == "sliding_window_mla" or s.compress_ratio > 1 or (s.is_mla and s.alignment)]
    if deepseek_v4 and any(s.kind == "mamba" for s in specs):
        return Reach("latent", "no model vLLM ships has both DeepSeek V4's compressed, sliding-window or page-aligned MLA "
                               "layers and Mamba layers", settings=settings)
    padding = _unmatched_mamba_padding(case)
    if padding is not None:
        return Reach("latent", padding, settings=settings)
    if case.is_latent:
        backends = ", ".join(g.synthetic_backend.name for g in case.groups if g.synthetic_backend is not None)
        return Reach("latent", f"only a synthetic backend ({backends}) reaches it: no shipped backend declares this configuration",
                     settings=settings)
    legacy = case.layout in LAYOUT_EQUIVALENTS
    known = backend_layouts or {}
    declared = [known.get(g.backend) for g in case.groups if g.backend]
    default, accepted = resolved_layout(declared, legacy)
    # The layout a KV connector asks for (its get_required_kvcache_layout, 0.29+): vLLM takes it when the backends accept it.
    wanted = [check.required_layout for check in named if check.required_layout is not None]
    if wanted and not legacy and (accepted is None or wanted[0] in accepted):
        default = wanted[0]
    layout = case.layout if legacy else _placed(case.layout)
    names = ", ".join(sorted({g.backend for g in case.groups if g.backend})) or "the default backend"
    if accepted is not None and _placed(layout) not in accepted:
        return Reach("latent", f"{names} declare{'s' if ',' not in names else ''} {', '.join(sorted(accepted))}: vLLM refuses "
                               f"VLLM_KV_CACHE_LAYOUT={layout} before this code runs", settings=settings)
    overrides: list[str] = []
    if default is not None and _placed(layout) != _placed(default):
        overrides.append(f"VLLM_KV_CACHE_LAYOUT={layout}")
    if case.packing == "cross_layers":
        overrides.append("--kv-transfer-config with kv_connector_extra_config {\"enable_cross_layers_blocks\": \"true\"}")
    if overrides:
        chooser = f"{names} with the connector" if wanted else names
        return Reach("flag", f"{chooser}: vLLM resolves {default} by itself; this needs {' and '.join(overrides)}",
                     tuple(overrides), settings)
    how = "" if backend_layouts is not None else " (the backends' declared layouts were not asked of a release)"
    return Reach("deployment", f"{names} with the layout vLLM resolves itself ({default}){how}", settings=settings)
