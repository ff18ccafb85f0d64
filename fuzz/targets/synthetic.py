"""What a synthetic backend publishes: only what a real backend of its release would.

A synthetic backend stands in for a backend no release ships yet, so it keeps the obligations its
release puts on real ones. From 0.28 a backend that stores a packed or scaled cache publishes its
state bytes (`customize_spec`; `AttentionSpec.state_content_bytes`: "None means dense K/V content"),
so a synthetic backend that takes such a cache dtype publishes them too.
"""

from __future__ import annotations

from typing import Any

from fuzz.case import replace
from oracles import dtypes, pages


def published_state(spec: Any) -> Any:
    """The spec with the state bytes a backend of a packed or scaled cache dtype publishes (its definition's content
    per state); a plain, registered or already published spec unchanged."""
    if spec.state_content_bytes is not None or spec.registered_cache_dtype:
        return spec
    definition = dtypes.definition(spec.cache_dtype)
    if definition is None or definition.plain:
        return spec
    content = pages.defined_content_bytes(spec)
    return spec if content is None else replace(spec, state_content_bytes=content)
