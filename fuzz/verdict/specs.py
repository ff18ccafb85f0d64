"""The spec check: the KV-cache spec vLLM built for each group says what the case asked for.

A layer asks vLLM for its spec with a cache dtype; vLLM's own tables give the quant mode, and
the spec (0.20-0.27) or the backend publishing its state size (0.28+) gives the page. Before any
view is judged, each group's spec must carry the case's quant mode (vLLM must not hand back
another mode than the one asked for) and a page before padding equal to the one the cache
dtype's definition gives (oracles/dtypes.py). Targets that cannot say a fact leave it out, and
the check of that fact is skipped.
"""

from __future__ import annotations

from fuzz.case import Case
from fuzz.targets.base import Outcome
from fuzz.verdict.findings import Finding, observed
from oracles import pages


def check_specs(case: Case, outcome: Outcome) -> Finding | None:
    for index, facts in sorted(outcome.specs.items()):
        if index >= len(case.groups):
            continue
        group = case.groups[index]
        spec = group.spec
        if spec.kind == "mamba":
            continue
        layer = group.layers[0]
        # A dtype kvfuzz registers has a name of its own making; the finding names what it is.
        dtype = "a registered cache dtype" if spec.registered_cache_dtype else f"cache dtype {spec.cache_dtype}"
        mode = facts.get("kv_quant_mode")
        if mode is not None and mode != spec.kv_quant_mode:
            # The mode comes from the dtype alone (vLLM's lookup), whatever the spec class: one signature.
            return observed(case, "spec-mismatch", "get_kv_quant_mode", f"{dtype}: kv_quant_mode {mode} instead of {spec.kv_quant_mode}", layer)
        page = facts.get("page_bytes")
        defined = pages.defined_unpadded_bytes(spec)
        if page is not None and defined is not None and page != defined:
            message = f"{dtype}: a page of {page} bytes before padding instead of {defined}"
            return observed(case, "spec-mismatch", "kv_cache_spec", message, layer)
    return None
