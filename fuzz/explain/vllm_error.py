"""What vLLM raised, in words: the error line, and torch's setStorage refusal parsed into the view
vLLM tried to build, set against the storage it had and the view the oracle expects."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fuzz.targets.base import Outcome
from oracles.expectation import Expectation

SET_STORAGE = re.compile(
    r"sizes \[([^\]]*)\], strides \[([^\]]*)\], storage offset (\d+), and itemsize (\d+) "
    r"requiring a storage size of (\d+) are out of bounds for storage of size (\d+)")


@dataclass(frozen=True)
class StorageDemand:
    """A torch setStorage refusal: the view vLLM tried to build and the storage it had."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    itemsize: int
    needed: int
    available: int


def parse_storage_error(message: str | None) -> StorageDemand | None:
    """The view and storage a setStorage refusal names, None when the message is not one."""
    match = SET_STORAGE.search(message or "")
    if match is None:
        return None
    numbers = [tuple(int(x) for x in part.split(",") if x.strip()) for part in match.group(1, 2)]
    return StorageDemand(numbers[0], numbers[1], *(int(match.group(i)) for i in range(3, 7)))


def demand_lines(demand: StorageDemand, expectation: Expectation | None, layer: str | None) -> list[str]:
    """The demanded view in words: its bytes against the buffer's, and its axes against the oracle's view."""
    lines = [f"vLLM asked for a view of sizes {list(demand.sizes)}, byte strides {[s * demand.itemsize for s in demand.strides]}",
             f"it needs {demand.needed:,} B; the buffer has {demand.available:,} B: "
             f"{demand.needed - demand.available:,} B past its end ({demand.needed / max(demand.available, 1):.1f}x the buffer)"]
    if expectation is None or not expectation.accepted:
        return lines
    candidates = [expectation.layers[layer]] if layer in expectation.layers else list(expectation.layers.values())
    for candidate in candidates:
        for view in candidate.views:
            if len(view.shape) == len(demand.sizes):
                axes = [f"axis {a}: {got} instead of {want}" for a, (got, want) in enumerate(zip(demand.sizes, view.shape, strict=True))
                        if got != want]
                if axes:
                    lines.append(f"against the oracle's {candidate.name} view {view.shape}: " + ", ".join(axes))
                return lines
    return lines


def error_text(outcome: Outcome) -> str:
    """vLLM's error in one line: type, function, layer, source line and message."""
    where = f" in {outcome.error_function}" if outcome.error_function else ""
    layer = f" (layer {outcome.error_layer})" if outcome.error_layer else ""
    line = f" at vllm/{outcome.error_file}:{outcome.error_line}" if outcome.error_file else ""
    return f"{outcome.error_type}{where}{layer}{line}: {outcome.error_message}"
