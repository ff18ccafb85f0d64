"""The spec check: the KV-cache spec vLLM built for each group says what the case asked for.

A layer asks vLLM for its spec with a cache dtype; vLLM's own tables give the quant mode, and
the spec (0.20-0.27) or the backend publishing its state size (0.28+) gives the page. Before any
view is judged, each group's spec must carry the case's quant mode (vLLM must not hand back
another mode than the one asked for) and a page before padding equal to the one the cache
dtype's definition gives (oracles/dtypes.py). Targets that cannot say a fact leave it out, and
the check of that fact is skipped.

A spec vLLM built from layers (case spec_source "vllm") must also be of the case's kind and carry
the case's block size, heads, head sizes, storage dtype, window and the head slots and state bytes
its backend publishes, with no padding the case does not have; the finding names the layer class
whose get_kv_cache_spec built it.
"""

from __future__ import annotations

from typing import Any

from fuzz.case import Case, SpecCase
from fuzz.targets.base import Outcome
from fuzz.verdict.findings import Finding, observed
from oracles import pages

# Case spec kind -> the vLLM spec class a layer must build for it (or a subclass).
KIND_CLASSES = {"full": "FullAttentionSpec", "sliding_window": "SlidingWindowSpec", "mla": "MLAAttentionSpec"}


def check_specs(case: Case, outcome: Outcome) -> Finding | None:
    for index, facts in sorted(outcome.specs.items()):
        if index >= len(case.groups):
            continue
        group = case.groups[index]
        spec = group.spec
        if spec.kind == "mamba":
            continue
        layer = group.layers[0]
        built_by = facts.get("layer")
        # A dtype kvfuzz registers has a name of its own making; the finding names what it is.
        dtype = "a registered cache dtype" if spec.registered_cache_dtype else f"cache dtype {spec.cache_dtype}"
        mode = facts.get("kv_quant_mode")
        if mode is not None and mode != spec.kv_quant_mode:
            if built_by is None:
                # The mode comes from the dtype alone (vLLM's lookup) for specs kvfuzz builds: one signature whatever the class.
                return observed(case, "spec-mismatch", "get_kv_quant_mode", f"{dtype}: kv_quant_mode {mode} instead of {spec.kv_quant_mode}",
                                layer)
            # A layer that sets no mode sets none for every dtype of a family: one signature for them (the dtype is in the case).
            message = f"kv_quant_mode {mode} instead of {spec.kv_quant_mode}"
            return observed(case, "spec-mismatch", f"{built_by}.get_kv_cache_spec", message, layer)
        if built_by is not None:
            wrong = _built_field(spec, facts)
            if wrong is not None:
                return observed(case, "spec-mismatch", f"{built_by}.get_kv_cache_spec", f"{dtype}: {wrong}", layer)
        page = facts.get("page_bytes")
        defined = pages.defined_unpadded_bytes(spec)
        if page is not None and defined is not None and page != defined:
            function = f"{built_by}.get_kv_cache_spec" if built_by else "kv_cache_spec"
            # A spec class that sizes a quant mode's pages wrongly does so for every dtype of that mode: one signature.
            sized_as = "a registered cache dtype" if spec.registered_cache_dtype else f"kv_quant_mode {spec.kv_quant_mode}"
            message = f"{sized_as}: a page of {page} bytes before padding instead of {defined}"
            return observed(case, "spec-mismatch", function, message, layer)
    return None


def _built_field(spec: SpecCase, facts: dict[str, Any]) -> str | None:
    """What a spec vLLM built from a layer says differently from the case (None: nothing)."""
    wanted = KIND_CLASSES.get(spec.kind)
    if wanted is not None and wanted not in facts.get("classes", ()):
        return f"a {facts['classes'][0]} instead of a {wanted}"
    fields = facts.get("fields", {})
    expected: dict[str, Any] = {"block_size": spec.block_size, "num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size,
                                "dtype": spec.dtype, "page_size_padded": spec.page_size_padded}
    if spec.head_size_v is not None:
        expected["head_size_v"] = spec.head_size_v
    if spec.sliding_window is not None:
        expected["sliding_window"] = spec.sliding_window
    # Published by the backend (customize_spec): the case carries what the backend published for kvfuzz's own spec.
    for name in ("num_head_slots", "state_content_bytes"):
        if getattr(spec, name) is not None and fields.get(name) is not None:
            expected[name] = getattr(spec, name)
    for name, value in expected.items():
        if name in fields and fields[name] != value:
            return f"{name} {fields[name]} instead of {value}"
    return None
