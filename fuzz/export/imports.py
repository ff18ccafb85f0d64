"""Where an exported test imports each vLLM name from, and the import block it writes.

A name that moved between releases lists its modules newest first; the test tries them in that order, so one
module runs on every release a finding affects.
"""

from __future__ import annotations

from fuzz.homes import HOMES

# Where an exported test imports each name from: fuzz/homes.py, the table the entry-point probe reads too.
WHERE = HOMES

# Names older releases lack, with the definition the test falls back to there.
SHIMS: dict[str, list[str]] = {
    "customize_attention_spec": ["    def customize_attention_spec(backend, spec):  # before 0.29: the backend's own (0.28), or none",
                                 "        customize = getattr(backend, \"customize_spec\", None)",
                                 "        return spec if customize is None else customize(spec)"],
}
# Names only some releases have: the test skips (with this reason) where the name is missing.
OPTIONAL: dict[str, str] = {
    "register_kv_cache_dtype": "the dtype-handler registry (vLLM 0.33+)",
    "_reshape_kv_cache": "the V2 model runner's _reshape_kv_cache (vLLM 0.19 - 0.28; 0.29 replaced it with allocate_kv_cache)",
    "_allocate_kv_cache": "the V2 model runner's _allocate_kv_cache (vLLM 0.19 - 0.28)",
    "GPUModelRunner": "the V1 model runner (vllm/v1/worker/gpu_model_runner.py, gone in 0.34)",
    "allocate_kv_cache": "the allocation by KVCacheLayout (vLLM 0.29+)",
    "KVCacheLayout": "the KVCacheLayout names (vLLM 0.29+)",
    "get_supported_kv_cache_layouts": "the backends' supported KVCacheLayouts (vLLM 0.29+)",
    "resolve_kv_cache_layout": "the KVCacheLayout resolution (vLLM 0.29+)",
    "SlidingWindowMLASpec": "SlidingWindowMLASpec (vLLM 0.20+)",
    "KVQuantMode": "the KV-cache quant modes (vLLM 0.20+)",
    "get_kv_quant_mode": "the KV-cache quant modes (vLLM 0.20+)",
    "copy_kv_cache_blocks_inplace": "the KV-cache block copy (vLLM 0.26+)",
    "get_kv_cache_layout": "the NHD / HND layout setting (vLLM 0.19 - 0.28)",
}
# Names only some releases have, None elsewhere: the test runs that step only where the release has it.
NONE_WHERE_MISSING: dict[str, str] = {
    "map_kv_caches_to_kernel_blocks": "vLLM 0.32+ binds kernel-block views to layers",
    "CPUModelRunner": "vllm/v1/worker/cpu_model_runner.py, gone in 0.34",
    "CPUKVBlockZeroer": "the CPU runner's block zeroer of vLLM 0.34+",
    "KVBlockZeroer": "the runner's block zeroer (vLLM 0.23+)",
}


def import_block(names: set[str], stdlib: tuple[str, ...] = ()) -> str:
    """The standard modules in `stdlib`, pytest, torch and the vLLM imports `names` need, grouped by module, sorted."""
    lines = [f"import {name}" for name in sorted(stdlib)] + ([""] if stdlib else []) + ["import pytest", "import torch", ""]
    plain: dict[str, list[str]] = {}
    moved: list[str] = []
    for name in sorted(names):
        modules = WHERE[name]
        if len(modules) == 1 and name not in OPTIONAL and name not in SHIMS and name not in NONE_WHERE_MISSING:
            plain.setdefault(modules[0], []).append(name)
        else:
            moved.append(name)
    for module in sorted(plain):
        members = sorted(plain[module])
        one_line = f"from {module} import {', '.join(members)}"
        if len(one_line) <= 100:
            lines.append(one_line)
        else:
            lines += [f"from {module} import ("] + [f"    {member}," for member in members] + [")"]
    for name in moved:
        lines += [""] + _fallbacks(name)
    return "\n".join(lines)


def _fallbacks(name: str) -> list[str]:
    modules = WHERE[name]
    if name in OPTIONAL:
        return ["try:", f"    from {modules[0]} import {name}", "except ImportError:",
                f"    pytest.skip(\"{OPTIONAL[name]} is not in this vLLM\", allow_module_level=True)"]
    lines = [f"try:  # {name} lives in {modules[0]} in newer releases" if len(modules) > 1 else "try:"]
    lines.append(f"    from {modules[0]} import {name}")
    for module in modules[1:]:
        lines += ["except ImportError:", f"    from {module} import {name}"]
    if name in SHIMS:
        lines += ["except ImportError:", *SHIMS[name]]
    if name in NONE_WHERE_MISSING:
        lines += [f"except ImportError:  # {NONE_WHERE_MISSING[name]}", f"    {name} = None"]
    return lines
