"""What every target adapter returns: plain records, never vLLM or torch objects.

All records convert to and from JSON-able dicts, so they cross process boundaries (workers,
Ray actors) and land in reports unchanged.
"""

from __future__ import annotations

import base64
import dataclasses
import zlib
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from fuzz.case import Case, from_dict, replace, to_dict
from oracles.contract import CONTRACTS, Contract

if TYPE_CHECKING:
    from fuzz.checks.protocol import Check


@dataclass(frozen=True)
class BackendInfo:
    """A backend's declarations, as the target reports them. Generators draw from these."""

    name: str
    is_mla: bool
    kernel_block_sizes: tuple[int | str, ...]  # ints, or "xN" for any multiple of N
    layouts: tuple[str, ...] | None  # None: any layout
    model_dtypes: tuple[str, ...]
    cache_dtypes: tuple[str, ...]
    compresses: bool = False  # serves caches that store several tokens per state
    # Backend-shaped targets: the block axis of the declared shape is not outermost (K/V first).
    kv_first: bool = False
    # The backend takes K and V heads of different sizes (its customize_spec refuses them otherwise).
    asymmetric_kv: bool = True
    # Backend-shaped targets: the backend reads the V head size the model sets (DiffKV's set_head_size_v), so its
    # declared shape can hold K and V heads of different sizes.
    sets_value_heads: bool = False


@dataclass(frozen=True)
class TargetInfo:
    vllm_version: str
    generation: str
    contract: Contract
    spec_kinds: tuple[str, ...]
    backends: tuple[BackendInfo, ...]
    layouts: tuple[str, ...]
    # Case fields (beyond the basics) each spec kind can express on this target.
    spec_fields: dict[str, tuple[str, ...]] = field(default_factory=dict)
    kv_sharing: bool = True
    # Checks this target cannot run, one line each: "name: why" (an entry point was not found).
    checks_off: tuple[str, ...] = ()
    # The cache dtypes the release accepts, each with the torch dtype it stores (None: the model's).
    cache_dtypes: dict[str, str | None] = field(default_factory=lambda: {"auto": None})
    # KVQuantMode member names (lower case), aliases included.
    quant_modes: tuple[str, ...] = ("none",)
    # Whether kvfuzz can register cache dtypes of its own with the release's handler registry.
    registers_dtypes: bool = False
    # Where the probe found each vLLM entry point kvfuzz drives: role -> module.name.
    entry_points: dict[str, str] = field(default_factory=dict)
    # Layout inputs the release defines that kvfuzz's case space does not draw (never silently).
    uncovered: tuple[str, ...] = ()
    # Model runners whose KV-cache code this target drives ("v2"; "v1" where GPUModelRunner has it).
    runners: tuple[str, ...] = ("v2",)
    # Spec kinds and backends vLLM can build specs for from layers here (spec_source "vllm").
    layer_kinds: tuple[str, ...] = ()
    layer_backends: tuple[str, ...] = ()
    layer_fields: tuple[str, ...] = ()  # spec fields beyond the basics that layers carry (head_size_v)
    # How the planner can pack layers into per-block slabs (case field packing), "none" first.
    packings: tuple[str, ...] = ("none",)
    # The deeper checks this target runs (fuzz/checks), by name; `consumers` are those a case names in touches.consumers.
    checks: tuple[str, ...] = ()
    consumers: tuple[str, ...] = ()
    # The platforms whose answers change what vLLM's allocation does here (case field platform), "cuda" first.
    platforms: tuple[str, ...] = ("cuda",)
    # Whether cases of attention-free models (no KV-cache groups) run here.
    attention_free: bool = False

    def backend(self, name: str) -> BackendInfo | None:
        return next((b for b in self.backends if b.name == name), None)

    def can(self, kind: str, field_name: str) -> bool:
        return field_name in self.spec_fields.get(kind, ())

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["contract"] = self.contract.name
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetInfo:
        backends = tuple(
            BackendInfo(**{**b, "kernel_block_sizes": tuple(b["kernel_block_sizes"]),
                           "layouts": None if b["layouts"] is None else tuple(b["layouts"]),
                           "model_dtypes": tuple(b["model_dtypes"]), "cache_dtypes": tuple(b["cache_dtypes"])})
            for b in data["backends"]
        )
        return cls(
            vllm_version=data["vllm_version"],
            generation=data["generation"],
            contract=CONTRACTS[data["contract"]],
            spec_kinds=tuple(data["spec_kinds"]),
            backends=backends,
            layouts=tuple(data["layouts"]),
            spec_fields={k: tuple(v) for k, v in data.get("spec_fields", {}).items()},
            kv_sharing=data.get("kv_sharing", True),
            checks_off=tuple(data.get("checks_off", ())),
            cache_dtypes=dict(data.get("cache_dtypes", {"auto": None})),
            quant_modes=tuple(data.get("quant_modes", ("none",))),
            registers_dtypes=bool(data.get("registers_dtypes", False)),
            entry_points=dict(data.get("entry_points", {})),
            uncovered=tuple(data.get("uncovered", ())),
            runners=tuple(data.get("runners", ("v2",))),
            layer_kinds=tuple(data.get("layer_kinds", ())),
            layer_backends=tuple(data.get("layer_backends", ())),
            layer_fields=tuple(data.get("layer_fields", ())),
            packings=tuple(data.get("packings", ("none",))),
            checks=tuple(data.get("checks", ())),
            consumers=tuple(data.get("consumers", ())),
            platforms=tuple(data.get("platforms", ("cuda",))),
            attention_free=bool(data.get("attention_free", False)),
        )


@dataclass(frozen=True)
class ViewRecord:
    """Metadata of one tensor vLLM produced: enough to compute every element's byte address."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]  # in elements
    offset_bytes: int  # from the start of its raw buffer
    dtype: str
    element_size: int
    buffer: int  # index into Outcome.buffers; -1: not on any raw buffer kvfuzz knows

    @property
    def byte_strides(self) -> tuple[int, ...]:
        return tuple(s * self.element_size for s in self.stride)


@dataclass(frozen=True)
class BufferRecord:
    size: int  # bytes
    layers: tuple[str, ...]  # the layers vLLM put on this buffer


@dataclass(frozen=True)
class Outcome:
    """What the real vLLM code did with a case."""

    views: dict[str, tuple[ViewRecord, ...]] = field(default_factory=dict)
    buffers: tuple[BufferRecord, ...] = ()
    kernel_block_sizes: dict[int, int] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # layer -> layer whose tensor object it reuses
    error_type: str | None = None
    error_message: str | None = None
    error_function: str | None = None
    error_layer: str | None = None  # the layer vLLM was working on when it raised, if it says
    # Where vLLM raised: the innermost vLLM frame, its path relative to the vllm/ package folder.
    error_file: str | None = None
    error_line: int | None = None
    # Physical probe: per layer and tensor, the byte ranges each element was read back from.
    probe: dict[str, Any] | None = None
    # Per group index: what the spec vLLM built for it says (kv_quant_mode, unpadded page bytes; for
    # specs vLLM built from layers also the layer class and the spec's fields).
    specs: dict[int, dict[str, Any]] = field(default_factory=dict)
    # The model runner whose code produced these views ("v2" or "v1").
    runner: str = "v2"
    # What each deeper check that ran on the case recorded (fuzz/checks), by check name: plain JSON.
    checks: dict[str, Any] = field(default_factory=dict)
    # The blocks the planner's KVCacheConfig gives (the override's, or an attention-free model's own).
    planned_blocks: int | None = None
    # Groups whose kernel block size vLLM picked against its own rule (oracles/contract.py kernel_block_size): group index ->
    # [vLLM's size, the rule's]. The case is then judged at vLLM's sizes.
    kernel_rule: dict[int, list[int]] = field(default_factory=dict)

    @property
    def raised(self) -> bool:
        return self.error_type is not None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(replace(self, probe=None))
        if self.probe is not None:
            data["probe"] = {name: [{"buffer": r["buffer"], "bytes": encode_bytes(r["bytes"])} for r in records]
                             for name, records in self.probe.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Outcome:
        views = {name: tuple(ViewRecord(**{**v, "shape": tuple(v["shape"]), "stride": tuple(v["stride"])}) for v in records)
                 for name, records in data.get("views", {}).items()}
        buffers = tuple(BufferRecord(size=b["size"], layers=tuple(b["layers"])) for b in data.get("buffers", ()))
        return cls(
            views=views,
            buffers=buffers,
            kernel_block_sizes={int(k): v for k, v in data.get("kernel_block_sizes", {}).items()},
            aliases=dict(data.get("aliases", {})),
            error_type=data.get("error_type"),
            error_message=data.get("error_message"),
            error_function=data.get("error_function"),
            error_layer=data.get("error_layer"),
            error_file=data.get("error_file"),
            error_line=data.get("error_line"),
            probe=data.get("probe"),
            specs={int(k): dict(v) for k, v in data.get("specs", {}).items()},
            runner=data.get("runner", "v2"),
            checks=dict(data.get("checks", {})),
            planned_blocks=data.get("planned_blocks"),
            kernel_rule={int(k): list(v) for k, v in data.get("kernel_rule", {}).items()},
        )


def encode_bytes(data: Any) -> str | None:
    """Raw buffer bytes as JSON text: compressed (probe buffers are mostly canary), then base64."""
    if data is None:
        return None
    return base64.b64encode(zlib.compress(np.asarray(data, dtype=np.uint8).tobytes(), 1)).decode()


def decode_bytes(data: Any) -> np.ndarray | None:
    if data is None or isinstance(data, np.ndarray):
        return data
    return np.frombuffer(zlib.decompress(base64.b64decode(data)), dtype=np.uint8)


# Error types kvfuzz itself puts in an Outcome when the target process does not answer.
TARGET_CRASHED = "TargetCrashed"
TARGET_HUNG = "TargetHung"
TARGET_OUT_OF_MEMORY = "TargetOutOfMemory"


@dataclass(frozen=True)
class Execution:
    """One case through a target: the case as its backends declared it, and what happened."""

    case: Case
    outcome: Outcome | None = None
    skipped: str | None = None  # the target cannot express the case: a skip, never a finding
    # A field the case derives differs from what vLLM derives (field, both values): the case is wrong, not vLLM.
    case_error: str | None = None
    # A backend's declaration breaks the layout contract: (vLLM function, message, layer).
    declaration: tuple[str, str, str | None] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"case": to_dict(self.case), "outcome": None if self.outcome is None else self.outcome.to_dict(),
                "skipped": self.skipped, "case_error": self.case_error,
                "declaration": None if self.declaration is None else list(self.declaration)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Execution:
        outcome, declaration = data.get("outcome"), data.get("declaration")
        return cls(case=from_dict(data["case"]), outcome=None if outcome is None else Outcome.from_dict(outcome),
                   skipped=data.get("skipped"), case_error=data.get("case_error"),
                   declaration=None if declaration is None else (declaration[0], declaration[1], declaration[2]))


# What a run writes on the device besides comparing metadata: nothing, every view's elements, or tokens
# through each backend's own cache write. `probe=True` is "physical", `False` "metadata".
PROBES = ("metadata", "physical", "kernel")


def probe_kind(probe: bool | str) -> str:
    if isinstance(probe, bool):
        return "physical" if probe else "metadata"
    if probe not in PROBES:
        raise ValueError(f"probe {probe!r} is not one of {', '.join(PROBES)}")
    return probe


class Target(Protocol):
    """What the worker, replay and the tools call on a target: an adapter in this process (fuzz/targets/common.py) or a
    target process (fuzz/campaign/pool.py)."""

    info: TargetInfo
    max_buffer_bytes: int  # cases whose buffers need more are skipped on real devices

    def execute(self, case: Case, device: str, probe: bool | str = False, checks: Collection[str] | None = None) -> Execution:
        """Declare the case's backend fields, build the real objects, call vLLM, record the views (with the physical
        probe, write through every view and read the raw bytes back), and run the deeper checks the case asks for
        (`checks`: only these by name, where a campaign's schedule leaves others out; None: every one it asks for)."""
        ...

    def checks(self) -> tuple[Check, ...]:
        """The deeper checks this target offers (fuzz/checks), in the order a case meets them."""
        ...
