"""The UMBP store connector at its transport: vLLM's own UMBP connector, built for its worker role, registers the walk's
caches with a recording stand-in for MORI's UMBP client, and the per-block layout it plans is held against the bytes each
block owns.

What runs is vLLM's (vllm/distributed/kv_transfer/kv_connector/v1/umbp/, 0.34+): `UMBPStoreConnector`, built by its own
constructor for the worker role in each runtime mode ("embedded", the default, and "standalone"), which derives its
namespace, plans each layer's region of a stored object (`data.KVLayoutPlanner.from_kv_cache_config`: page bytes, block
stride, the runs of a page whose heads lie outside its block) and builds the runtime's worker handle; then its
`register_kv_caches`, which goes to `UMBPStoreConnectorWorker.register_kv_caches`: the planner captures each layer's base
address and block stride (`KVLayoutPlanner.register_kv_caches`), and the runtime handle registers each KV storage with
the client and precomputes each group's bulk-load layout (`runtime.embedded._MoriWorkerHandle.register_buffers`,
`_register_load_layouts`; `runtime.standalone._SharedPoolWorkerHandle.register_buffers`). The spans it moves for block b
are the planner's own plan (`KVLayoutPlanner.plan_registered_block`, per cache group), and the bulk-load layout's
addresses for block b. What is stood in is outside that code:

- MORI's `mori.cpp` bindings (not installed; the runtime imports them when it builds a client and registers): a stand-in
  module in sys.modules while the connector is built and registers, with `UMBPClient` (a recording client that keeps the
  memory it is asked to register), `UMBPConfig` (its DRAM and standalone-process settings), `UMBPStandaloneProcessConfig`,
  `UMBPDeploymentMode` and `MemoryLocationType`;
- the network: the embedded worker's lookup server (`_MoriLookupServer.start`, a Unix socket for the scheduler);
- the model's description (fuzz/checks/nixl.py's `ModelStandIn`), the connector's settings (a KVTransferConfig for
  UMBPStoreConnector) and the layout the engine core resolved into the KVCacheConfig (the case's).

The judgement (oracles/transfer.py, as for the other connectors): every registered storage lies inside the case's buffers
(`transfer-unregistered`); the plan of block b covers exactly that block's bytes of its layers' views (the block's own
padding aside: `transfer-mismatch`), no two spans share a byte (`transfer-overlap`), no two ranges of one block's plan
share a byte of the stored object (`transfer-overlap`), and the bulk-load layout moves for block b the spans the plan moves
(`transfer-mismatch`).
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import sys
import tempfile
import types
import uuid
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np

from fuzz.case import Case
from fuzz.checks import moriio, nixl
from fuzz.checks.nixl import StandInGap, own_failures
from fuzz.checks.protocol import Judging, Off, Record, Run, TouchCheck, Unusable
from fuzz.verdict.findings import Finding, observed
from oracles import transfer

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.umbp"
CONNECTOR_MODULE = f"{PACKAGE}.connector"
EMBEDDED_MODULE = f"{PACKAGE}.runtime.embedded"
MODES = ("embedded", "standalone")
# The names vLLM's UMBP runtime imports from mori.cpp, stood in (`mori_cpp`).
MORI_NAMES = ("UMBPClient", "UMBPConfig", "UMBPStandaloneProcessConfig", "UMBPDeploymentMode", "MemoryLocationType")
ENDPOINT = "/tmp/kvfuzz-umbp-standalone.sock"  # the standalone server the settings name (never reached: the client is stood in)


# ------------------------------------------------------------------------------------------- the mori.cpp stand-in


class MemoryLocationType(enum.Enum):
    CPU = 0
    GPU = 1


class UMBPDeploymentMode(enum.Enum):
    Embedded = 0  # noqa: N815 - MORI's spelling
    StandaloneProcess = 1  # noqa: N815


class UMBPConfig:
    """Stands in for `mori.cpp.UMBPConfig`: the settings vLLM writes (its DRAM's, a standalone process's)."""

    def __init__(self) -> None:
        self.dram = types.SimpleNamespace(capacity_bytes=0)
        self.standalone_process: Any = None


class UMBPStandaloneProcessConfig(types.SimpleNamespace):
    """Stands in for `mori.cpp.UMBPStandaloneProcessConfig`: the settings, as written."""


class RecordingClient:
    """Stands in for `mori.cpp.UMBPClient`: keeps the memory vLLM registers; stores nothing."""

    def __init__(self, config: UMBPConfig) -> None:
        self.config = config
        self.registered: list[tuple[int, int]] = []
        self.calls: list[str] = []
        self.gaps: list[str] = []

    @own_failures
    def get_deployment_mode(self) -> UMBPDeploymentMode:
        standalone = self.config.standalone_process is not None
        return UMBPDeploymentMode.StandaloneProcess if standalone else UMBPDeploymentMode.Embedded

    @own_failures
    def register_memory(self, pointer: int, size: int, location: Any, device: int) -> bool:
        self.calls.append("register_memory")
        self.registered.append((int(pointer), int(size)))
        return True

    @own_failures
    def deregister_memory(self, *args: Any) -> bool:
        self.calls.append("deregister_memory")
        return True

    @own_failures
    def batch_exists(self, keys: Any) -> list[bool]:
        return [False for _ in keys]

    @own_failures
    def clear(self) -> bool:
        return True

    @own_failures
    def flush(self) -> bool:
        return True

    @own_failures
    def close(self) -> None:
        self.calls.append("close")

    def __getattr__(self, name: str) -> Any:
        gap = f"vLLM calls UMBPClient.{name}, which the recording client does not stand in for"
        self.__dict__.setdefault("gaps", []).append(gap)
        raise StandInGap(gap)


def mori_cpp() -> types.ModuleType:
    """The stand-in `mori.cpp` module: the names vLLM's UMBP runtime imports from it."""
    module = types.ModuleType("mori.cpp")
    stand_ins = {"UMBPClient": RecordingClient, "UMBPConfig": UMBPConfig, "UMBPStandaloneProcessConfig": UMBPStandaloneProcessConfig,
                 "UMBPDeploymentMode": UMBPDeploymentMode, "MemoryLocationType": MemoryLocationType}
    for name in MORI_NAMES:
        setattr(module, name, stand_ins[name])
    return module


def replaced_names() -> list[str]:
    return [f"mori.cpp.{name} (imported by {PACKAGE}.runtime)" for name in MORI_NAMES] + \
           [f"{EMBEDDED_MODULE}._MoriLookupServer.start (a Unix socket)"]


# ------------------------------------------------------------------------------------------- the connector, built and registered


def connector_module() -> types.ModuleType | None:
    try:
        return importlib.import_module(CONNECTOR_MODULE)
    except ImportError:
        return None


@contextlib.contextmanager
def stand_ins(walk: Any, mode: str) -> Iterator[None]:
    """Everything outside the code under test, stood in while the connector is built and registers (see the module's doc)."""
    from fuzz.targets import consumers

    config = walk.vllm_config
    package = types.ModuleType("mori")
    package.cpp = mori_cpp()  # type: ignore[attr-defined]
    settings = {"mode": mode, "lookup_dir": tempfile.gettempdir(), "lookup_instance": f"kvfuzz-{uuid.uuid4().hex[:8]}"}
    if mode == "standalone":
        settings["endpoint"] = ENDPOINT
    transfer_config = importlib.import_module("vllm.config").KVTransferConfig(
        kv_connector="UMBPStoreConnector", kv_role="kv_both", kv_connector_extra_config=settings)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(sys.modules, {"mori": package, "mori.cpp": package.cpp}))  # type: ignore[attr-defined]
        stack.enter_context(mock.patch.object(importlib.import_module(EMBEDDED_MODULE)._MoriLookupServer, "start", lambda self: None))
        stack.enter_context(nixl._attribute(config, "kv_transfer_config", transfer_config))
        stack.enter_context(nixl._attribute(config, "model_config", UmbpModel(walk.case, 1)))
        stack.enter_context(nixl._attribute(config.cache_config, "block_size", walk.case.groups[0].spec.block_size))
        stack.enter_context(consumers.layers_in_config(walk))
        yield


class UmbpModel(nixl.ModelStandIn):
    """The model's description UMBP reads for its namespace (a fingerprint of what shapes the KV)."""

    revision = None
    quantization = None

    def __getattr__(self, name: str) -> Any:
        raise StandInGap(f"UMBP asks the model config for {name}, which kvfuzz's stand-in does not state")


def connector_config(walk: Any) -> Any:
    """The KVCacheConfig as the worker's connector gets it (moriio.connector_config), with the layout the engine core
    resolved for the workers (GPUWorker.initialize_from_config adopts `kv_cache_config.kv_cache_layout`)."""
    config = moriio.connector_config(walk)
    if hasattr(config, "kv_cache_layout"):
        config.kv_cache_layout = walk.case.layout
    return config


def build(cls: type, walk: Any, mode: str) -> Any:
    """vLLM's connector for the worker role in `mode`, registered on the walk's caches under the stand-ins."""
    from fuzz.targets.consumers import with_sharers

    role = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base").KVConnectorRole.WORKER
    with stand_ins(walk, mode):
        connector = cls(walk.vllm_config, role, connector_config(walk))
        try:
            connector.register_kv_caches(with_sharers(walk))
        except BaseException:
            shut(connector)
            raise
    return connector


def shut(connector: Any) -> None:
    """Stops the runtime handle's transfer pool (its close would also talk to the client)."""
    worker = getattr(connector, "connector_worker", None)
    executor = getattr(getattr(worker, "runtime", None), "_executor", None)
    if executor is not None:
        executor.shutdown(wait=True)


# ------------------------------------------------------------------------------------------- the record


def registration(cls: type, walk: Any, where: str) -> Record:
    """The planned spans and registered memory of vLLM's UMBP worker in the default mode, and what each mode registers."""
    records = {}
    for mode in MODES:
        connector = build(cls, walk, mode)
        shut(connector)
        records[mode] = connector.connector_worker
    worker = records["embedded"]
    gaps = [gap for item in records.values() for gap in item.runtime.client.gaps]
    if gaps:
        raise StandInGap(gaps[0])
    layout = worker.layout
    if layout is None or not layout.regions:
        raise Unusable(f"{where}: the planner has no region to move (no transfer group)")
    names = [region.layer_name for region in layout.regions]
    plans = planned(layout, walk.case.num_blocks)
    return {"where": where, "replaced": replaced_names(), "ratio": 1, "regions": [{"name": name} for name in names],
            "spans": [[names.index(r.layer_name), block, *place] for (group, block), ranges in plans.items() for r, place in
                      zip(ranges, _located(walk, [[r.base_address, r.length] for r in ranges]), strict=True)],
            "objects": objects(plans), "load_layouts": load_layouts(worker.runtime, plans, walk),
            "registered": {mode: _located(walk, item.runtime.client.registered) for mode, item in records.items()},
            "buffer_bytes": [int(raw.untyped_storage().nbytes()) for raw in walk.raw],
            "calls": sorted({call for item in records.values() for call in item.runtime.client.calls})}


def planned(layout: Any, blocks: int) -> dict[tuple[int, int], tuple[Any, ...]]:
    """The planner's ranges for each (cache group, block), as the worker asks for them (a plan per group)."""
    groups = sorted({region.group_id for region in layout.regions})
    return {(group, block): layout.plan_registered_block(f"kvfuzz:{group}:{block}", block, group_id=group).ranges
            for group in groups for block in range(blocks)}


def objects(plans: dict[tuple[int, int], tuple[Any, ...]]) -> list[list[Any]]:
    """Where each (group, block) plan puts its ranges in the stored object: [group, block, [[offset, length], ...]]."""
    return [[group, block, [[int(r.object_offset), int(r.length)] for r in ranges]] for (group, block), ranges in plans.items()]


def load_layouts(handle: Any, plans: dict[tuple[int, int], tuple[Any, ...]], walk: Any) -> list[list[Any]]:
    """The runtime's bulk-load spans of each (group, block) beside the plan's: [group, block, theirs, plan's], each a
    sorted list of [buffer, start, end]; groups without a bulk-load layout (vLLM plans those per load) are left out."""
    rows = []
    for (group, block), ranges in plans.items():
        layout = getattr(handle, "_load_layouts", {}).get(group)
        if layout is None or block >= layout.num_blocks:
            continue
        addresses = (np.asarray(layout.bases, dtype=np.uint64) + np.uint64(block) * np.asarray(layout.strides, dtype=np.uint64)).tolist()
        bulk = sorted(_located(walk, [[address, size] for address, size in zip(addresses, layout.sizes, strict=True)]))
        plan = sorted(_located(walk, [[r.base_address, r.length] for r in ranges]))
        rows.append([group, block, bulk, plan])
    return rows


def _located(walk: Any, pairs: Any) -> list[list[int]]:
    rows = np.array([[address, length, 0] for address, length in pairs], dtype=np.uint64).reshape(-1, 3)
    return nixl.located(walk, rows)


# ------------------------------------------------------------------------------------------- the judgement


def unregistered(record: Record) -> str | None:
    for mode, rows in record["registered"].items():
        row = moriio.outside(rows, record["buffer_bytes"])
        if row is not None:
            where = f"at address {row[1]}" if row[0] < 0 else f"at byte {row[1]} of buffer {row[0]}"
            return f"registers {row[2] - row[1]} bytes {where} in {mode} mode, outside the KV-cache buffers"
    return None


def object_overlap(record: Record) -> str | None:
    """Two ranges of one block's plan that share a byte of the stored object, described."""
    for group, block, ranges in record["objects"]:
        ordered = sorted(ranges)
        for (start, length), (after, _) in zip(ordered, ordered[1:], strict=False):
            if after < start + length:
                return (f"the plan of block {block} (group {group}) puts two ranges on object bytes {after} to "
                        f"{min(start + length, after + length)}: a load writes those bytes into both")
    return None


def load_mismatch(record: Record) -> str | None:
    """A group whose bulk-load layout moves other spans for a block than the plan does, described."""
    for group, block, bulk, plan in record["load_layouts"]:
        if bulk != plan:
            return f"the bulk-load layout of group {group} moves {bulk[:3]} for block {block}, where its plan moves {plan[:3]}"
    return None


class UmbpCheck(TouchCheck):
    """UMBP's register_kv_caches and planned block layout at its transport (see the module's doc)."""

    name = "umbp"
    # Not drawn into campaigns until its generated-case runs are triaged (its report; FINDINGS.md).
    drawn = False
    setting = "--kv-transfer-config '{\"kv_connector\": \"UMBPStoreConnector\", \"kv_role\": \"kv_both\"}'"
    reads_buffers = False  # registration and planning read no byte of the caches
    kinds = {"transfer-mismatch": nixl.NixlCheck.kinds["transfer-mismatch"], "transfer-overlap": nixl.NixlCheck.kinds["transfer-overlap"],
             "transfer-unregistered": moriio.MoriioCheck.kinds["transfer-unregistered"]}

    def offer(self, probe: Any) -> Run | Off | None:
        module = connector_module()
        cls = getattr(module, "UMBPStoreConnector", None)
        if module is None or cls is None:
            return None
        runtime = importlib.import_module(f"{PACKAGE}.runtime")
        if not hasattr(runtime, "EmbeddedRuntime"):
            return Off(f"{PACKAGE}.runtime registers no runtime adapter (embedded and standalone arrive in 0.34): "
                       "the connector cannot build its worker")
        from fuzz.targets import consumers  # torch and vLLM: the worker's, never the coordinator's

        where = f"{cls.__module__}.{cls.__name__}.register_kv_caches"

        def run(walk: Any, touches: Any) -> Record:
            reason = self.unrealistic(walk.case) or undriven(walk.case)
            if reason is not None:
                raise Unusable(reason)
            return registration(cls, walk, where)

        return consumers.consumer_run("transfer", where, consumers.runners_calling(r"\bregister_kv_caches\("), run)

    def unrealistic(self, case: Case) -> str | None:
        if case.platform != "rocm":
            return "UMBP runs on ROCm (MORI, built with BUILD_UMBP=ON, drives AMD GPUs)"
        if any(group.spec.kind == "encoder_only" for group in case.groups):
            return "encoder-only layers keep no KV cache for a connector to move"  # see moriio.MoriioCheck.unrealistic
        if case.packing == "cross_layers":
            return "UMBP asks for no cross-layer blocks"
        return None

    def judge(self, judging: Judging, record: Record) -> Finding | None:
        case, expected = judging.case, judging.expected
        if "skipped" in record or expected is None:
            return None
        function = record["where"].rsplit(".", 1)[-1]
        if "error" in record:
            error = record["error"]
            kind = "refused-valid" if error["type"] in nixl.REFUSALS else "crash-on-valid"
            return observed(case, kind, error.get("function") or function, f"{record['where']}: {error['type']}: {error['message']}")
        stray = unregistered(record)
        if stray is not None:
            return observed(case, "transfer-unregistered", "register_buffers", f"{record['where']} {stray}")
        names = [region["name"] for region in record["regions"]]
        problem = transfer.check(case, expected, descriptors_of(record, nixl.buffer_map(judging)), record["ratio"], names)
        if problem is not None:
            region = names[problem.region] if problem.region >= 0 else None
            owner = f"the plan of {region}, block {problem.kernel_block}" if region else "a block's plan"
            kind = "transfer-overlap" if problem.kind == "overlap" else "transfer-mismatch"
            return observed(case, kind, "plan_registered_block", f"{record['where']}: {owner} {problem.message}", region)
        shared = object_overlap(record)
        if shared is not None:
            return observed(case, "transfer-overlap", "plan_registered_block", f"{record['where']}: {shared}")
        bulk = load_mismatch(record)
        if bulk is not None:
            return observed(case, "transfer-mismatch", "_register_load_layouts", f"{record['where']}: {bulk}")
        return None


def descriptors_of(record: Record, buffers: dict[int, int]) -> list[transfer.Descriptor]:
    return moriio.descriptors_of(record, buffers)


def undriven(case: Case) -> str | None:
    if not case.groups:
        return "a model without KV-cache layers has nothing for UMBP to register"
    return None


CHECK = UmbpCheck()
