"""What a planner must give (oracles/contract.py): from memory, the blocks and tensor bytes one worker's memory holds
(`fitted`, the block-count override unset; `fitted_blocks`); across the workers of one model (vLLM's engine-level
`get_kv_cache_configs`), the whole model's groups projected on each worker's layers (`projected`), tensors that back
exactly a worker's own layers (`stray_layers`), one block count for all (`least_blocks`, and `shrunk` after warmup), and
with the hybrid KV-cache manager off one group of one type (`unified`).

Plans are read as plain data (`Group.of` a record's group); nothing here knows how vLLM computes them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fuzz.case import Case
from oracles import contract as rules

# The kinds whose unification the contract states (`unified_kind`): attention over the whole context or a window of it,
# and Mamba's state, which no attention layer unifies with.
UNIFIABLE_KINDS = ("full", *rules.LOCAL_ATTENTION_KINDS)


def fitted(available_memory: int, bytes_per_block: int) -> tuple[int, int]:
    """(blocks, bytes of tensors) planned from `available_memory` at `bytes_per_block` bytes a block."""
    blocks = rules.fitted_blocks(available_memory, bytes_per_block)
    return blocks, blocks * bytes_per_block


@dataclass(frozen=True)
class Group:
    """A planned KV-cache group: its layers in order, its block size, its spec's kind ("uniform_type" where each layer has
    a spec of its own), and each layer's kind and page bytes (None where the plan names a layer its spec does not hold)."""

    layers: tuple[str, ...]
    block_size: int
    kind: str
    kinds: tuple[str | None, ...]
    pages: tuple[int | None, ...]

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> Group:
        return cls(tuple(record["layers"]), int(record["block_size"]), str(record["kind"]), tuple(record["kinds"]),
                   tuple(record["pages"]))

    def keeping(self, layers: Collection[str]) -> Group:
        """The group with only `layers` of its own, each keeping its kind and page."""
        kept = rules.projected_layers(self.layers, layers)
        index = {name: i for i, name in enumerate(self.layers)}
        return Group(kept, self.block_size, self.kind, tuple(self.kinds[index[n]] for n in kept),
                     tuple(self.pages[index[n]] for n in kept))


def projected(groups: Sequence[Group], worker_layers: Collection[str]) -> list[Group]:
    """The groups a worker owning `worker_layers` must plan: every group of the whole model, in order, with its block size
    and spec, holding the worker's own layers of it (none, where it owns none)."""
    return [group.keeping(worker_layers) for group in groups]


def stray_layers(tensor_layers: Sequence[Sequence[str]], worker_layers: Collection[str]) -> tuple[list[str], list[str], list[str]]:
    """What a worker's tensors get wrong about its layers: (layers of other workers they back, its own layers none backs,
    its own layers more than one backs)."""
    owned = rules.owned_tensor_layers(worker_layers)
    backed = [name for layers in tensor_layers for name in layers]
    foreign = sorted({name for name in backed if name not in owned})
    missing = sorted(owned - set(backed))
    twice = sorted({name for name in backed if backed.count(name) > 1})
    return foreign, missing, twice


def least_blocks(memories: Sequence[int], bytes_per_block: Sequence[int]) -> int:
    """The one block count of workers with these memories and these bytes per block each (their plans' own)."""
    return rules.least_blocks([fitted(memory, per_block)[0] for memory, per_block in zip(memories, bytes_per_block, strict=True)])


def shrunk(requested: int) -> int:
    """The block count of every worker's plan shrunk to `requested` blocks."""
    return rules.shrunk_blocks(requested)


@dataclass(frozen=True)
class Unified:
    """What the planner must do with the hybrid KV-cache manager off: plan every layer as `kind` in one group, or refuse
    (`kind` None)."""

    kind: str | None
    why: str


def unified(case: Case) -> Unified | None:
    """The hybrid-off plan of the case's layers (KV-sharing layers plan nothing of their own); None where the contract
    states nothing: a model of Mamba layers alone, other kinds of layers than full, sliding-window, chunked-local attention
    and Mamba, or attention layers of several block sizes (which block size a promoted layer takes changed across
    releases)."""
    specs = [group.spec for group in case.groups]
    kinds = {spec.kind for spec in specs}
    attention = [spec for spec in specs if spec.kind != "mamba"]
    if not attention or not kinds <= {*UNIFIABLE_KINDS, "mamba"}:
        return None
    if "mamba" in kinds:
        return Unified(None, "Mamba layers beside attention layers are no one type")
    if len({spec.block_size for spec in attention}) > 1:
        return None
    windows = [spec.sliding_window or 0 for spec in attention if spec.kind == "sliding_window"]
    chunks = [spec.attention_chunk_size or 0 for spec in attention if spec.kind == "chunked_local"]
    kind = rules.unified_kind(kinds, windows, chunks)
    named = " and ".join(sorted(kinds))
    if kind is None:
        return Unified(None, f"{named} layers of {len(set(windows))} windows and {len(set(chunks))} chunk sizes are no one type")
    return Unified(kind, f"{named} layers are planned as {kind} attention")
