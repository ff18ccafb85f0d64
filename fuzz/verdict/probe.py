"""The physical probe, verdict side: the bytes a probed buffer must read back, from the oracle alone.

`fuzz.targets.probe.physical_probe` writes every element through vLLM's views with the probe
pattern; here the same bytes are rebuilt from the oracle's expected view (pattern bytes where the
oracle puts each element, canary everywhere else: padding, other layers' pages, the tail) and
compared byte for byte.
"""

from __future__ import annotations

import numpy as np

from fuzz.targets.base import Outcome, decode_bytes
from oracles.expectation import Expectation, ViewExpectation


def expected_bytes(view: ViewExpectation, buffer_size: int, salt: int) -> np.ndarray:
    """The buffer as it must read after writing the oracle's view with the probe pattern."""
    from fuzz.targets.probe import CANARY, pattern  # torch: imported where a probe is judged, not by every coordinator

    out = np.full(buffer_size, CANARY, dtype=np.uint8)
    # Every element, gaps of packed kernel-page views included: the probe writes the whole view.
    starts = view.element_offsets(owned_only=False)
    values = pattern(int(starts.size), view.element_size, salt).numpy().view(np.uint8).reshape(-1, view.element_size)
    for byte in range(view.element_size):
        out[starts + byte] = values[:, byte]
    return out


def check(expected: Expectation, outcome: Outcome) -> str | None:
    """None when every probed byte is where, and what, the oracle says; else what differs."""
    if outcome.probe is None:
        return None
    for name, records in outcome.probe.items():
        layer = expected.layers.get(name)
        if layer is None:
            continue
        for salt, (record, view) in enumerate(zip(records, layer.views, strict=False)):
            actual = decode_bytes(record["bytes"])
            if actual is None:
                return f"{name}: tensor {salt} is not on a raw buffer"
            wanted = expected_bytes(view, actual.size, salt)
            differ = np.flatnonzero(actual != wanted)
            if differ.size:
                first = int(differ[0])
                return (f"{name}: {differ.size} bytes differ from the contract, first at byte {first} "
                        f"(read {actual[first]:#04x}, expected {wanted[first]:#04x})")
    return None
