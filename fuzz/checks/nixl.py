"""The NIXL connector at its transport: vLLM's own worker registers the walk's caches with a recording stand-in for the
nixl package's agent, and every local transfer descriptor it hands the agent is held against the bytes its block owns.

What runs is vLLM's: the worker class the connector builds for its worker role (`NixlConnectorWorker`, on 0.32 the pull
worker in vllm/distributed/kv_transfer/kv_connector/v1/nixl/), built by its own constructor, and its
`register_kv_caches` on the runner's caches (manager views, KV-sharing layers mapped to their target's as the runner
maps them), which works out the regions, block lengths and strides and builds the descriptor list through
`register_local_xfer_handler`. What is stood in is outside that code:

- the nixl package's agent (`nixl._api.nixl_agent`, which vLLM reaches as `NixlWrapper`; `nixl_agent_config`): a
  recording agent that keeps what it is given (memory registrations, descriptor lists, prepared lists) and moves
  nothing. vLLM imports it lazily (vllm/distributed/nixl_utils.py), so the stand-in replaces the names the worker module
  bound, and the record says which;
- the tensor-parallel group (rank 0 of a TP size of 1), the model's description (a model config that states the case's
  heads, head size and MLA-ness: the walk's config has none), the connector's settings (a KVTransferConfig for
  NixlConnector), and the platform's NUMA query (the worker would pin the process's CPU affinity from it);
- the attention layers in the config's forward context, as fuzz/targets/consumers.py puts them (the worker asks them
  for their backends).

The judgement (oracles/transfer.py): descriptor k of each region covers exactly kernel block k's bytes of its layers'
views (the unpadded content with inline scales; padding only for a region that moves whole block-outermost rows), every
content byte of every block is covered, and no two descriptors share a byte.

A played transfer (`play`, `played`): two walks (the ends: TP size and rank, block size, layout, backend may differ),
each end's worker built and registered as above; the receiver handshakes through vLLM's own `_nixl_handshake` (the
payload the sender encoded, decoded, hash-checked and handed to `add_remote_agent`, with the ZMQ socket stood in), pulls
the sender's blocks with `start_load_kv` and completes them with `get_finished` (the receive post-processing); the
recording agents copy the bytes between the descriptors vLLM paired, in memory, only inside registered memory. Judged:
every received token holds the sender's K and V for each layer and the heads the receiver's rank reads
(`transfer-wrong`), no other byte of the receiver changed (`transfer-stray`), paired descriptors agree
(`transfer-mismatch`); a handshake vLLM refuses is a refusal. The check's run gets one walk: playing needs the peer's
walk from the runner (not wired yet).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib
import inspect
import types
import uuid
import weakref
import zlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import numpy as np

import oracles
from fuzz.case import MLA_KINDS, Case, dumps, from_dict, replace, to_dict
from fuzz.checks.protocol import Export, Judging, Off, Record, Run, TouchCheck, Unusable
from fuzz.errors import BrokenDeclaration, CaseMismatch, Inexpressible
from fuzz.tracebacks import vllm_failure
from fuzz.verdict.findings import Finding, observed
from oracles import transfer

# The worker modules, newest layout first: a package with a worker module (0.32+), the single connector module before.
WORKER_MODULES = ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker",
                  "vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector")
# What vLLM raises to refuse a configuration: in a registration, a warning (the case is valid); in a handshake, a refusal
# to transfer between the two ends (no finding: vLLM may decline what it cannot move, as long as it says so).
REFUSALS = ("NotImplementedError", "ValueError")
HANDSHAKE_REFUSALS = (*REFUSALS, "RuntimeError")
TRANSFER_KINDS = ("full", "sliding_window", "chunked_local", "sink", "mla", "sliding_window_mla")


class StandInGap(Unusable, AttributeError):
    """vLLM asked a stand-in for something it does not state: a skip that says what (an AttributeError to a getattr default)."""


def own_failures(method: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in's method whose failures are kvfuzz's (a skip that says why), never vLLM's: vLLM's frame calls it."""

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - the stand-in's own failure
            gap = error if isinstance(error, StandInGap) else StandInGap(
                f"the recording agent's {method.__name__} failed: {type(error).__name__}: {error}")
            gaps = getattr(args[0], "__dict__", {}).get("gaps") if args else None  # a recording stand-in's own list
            if isinstance(gaps, list):
                gaps.append(str(gap))
            raise gap from error

    return wrapped


PEERS: weakref.WeakValueDictionary[str, RecordingAgent] = weakref.WeakValueDictionary()  # agents by name, for the handshake


class RecordingAgent:
    """Stands in for `nixl._api.nixl_agent`: keeps every registration and descriptor list vLLM hands it, moves nothing."""

    def __init__(self, name: str, config: Any = None) -> None:
        self.name = name
        self.config = config
        self.registered: list[tuple[list[tuple[int, int, int]], str]] = []
        self.dlists: dict[int, tuple[str, np.ndarray, str]] = {}
        self.calls: list[str] = []
        self.transfers: dict[int, tuple[str, np.ndarray, np.ndarray, RecordingAgent]] = {}
        self.moved: list[dict[str, Any]] = []
        self.gaps: list[str] = []  # the stand-in's own failures, which vLLM's transfer code may catch and log
        PEERS[name] = self

    @own_failures
    def get_reg_descs(self, ranges: list[tuple[Any, ...]], mem_type: str) -> tuple[list[tuple[int, int, int]], str]:
        self.calls.append("get_reg_descs")
        return [(int(r[0]), int(r[1]), int(r[2])) for r in ranges], mem_type

    @own_failures
    def register_memory(self, descs: tuple[list[tuple[int, int, int]], str], backends: Any = None) -> None:
        self.calls.append("register_memory")
        self.registered.append(descs)

    @own_failures
    def deregister_memory(self, descs: Any) -> None:
        self.calls.append("deregister_memory")

    @own_failures
    def get_xfer_descs(self, blocks: Any, mem_type: str) -> tuple[np.ndarray, str]:
        self.calls.append("get_xfer_descs")
        return expanded(np.array(blocks, dtype=np.uint64)), mem_type

    @own_failures
    def prep_xfer_dlist(self, agent: str, descs: Any, mem_type: str | None = None, *args: Any, **kwargs: Any) -> int:
        """A list made by get_xfer_descs, or (as nixl also takes, and vLLM 0.34 passes) the rows with their memory type."""
        self.calls.append("prep_xfer_dlist")
        if isinstance(descs, tuple):
            rows, mem_type = descs
        else:
            rows = expanded(np.array(descs, dtype=np.uint64))
        handle = len(self.dlists) + 1
        self.dlists[handle] = (agent, rows, str(mem_type))
        return handle

    @own_failures
    def release_dlist_handle(self, handle: int) -> None:
        self.calls.append("release_dlist_handle")

    @own_failures
    def get_agent_metadata(self) -> bytes:
        self.calls.append("get_agent_metadata")
        return self.name.encode()

    @own_failures
    def add_remote_agent(self, metadata: bytes) -> str:
        self.calls.append("add_remote_agent")
        name = bytes(metadata).decode()
        if name not in PEERS:
            raise StandInGap(f"no recording agent named {name} to connect to")
        return name

    @own_failures
    def make_prepped_xfer(self, operation: str, local: int, local_ids: Any, remote: int, remote_ids: Any, notif_msg: Any = b"",
                          *args: Any, **kwargs: Any) -> int:
        """A transfer between two prepared lists: row local_ids[i] of `local` with row remote_ids[i] of `remote`."""
        self.calls.append("make_prepped_xfer")
        local_agent, local_rows, _ = self.dlists[local]
        remote_agent, remote_rows, _ = self.dlists[remote]
        if local_agent != "NIXL_INIT_AGENT" or remote_agent not in PEERS:
            raise StandInGap(f"make_prepped_xfer between lists of {local_agent} and {remote_agent}")
        mine = local_rows[np.asarray(local_ids, dtype=np.int64)]
        theirs = remote_rows[np.asarray(remote_ids, dtype=np.int64)]
        if len(mine) != len(theirs):
            raise StandInGap(f"make_prepped_xfer pairs {len(mine)} local descriptors with {len(theirs)} remote ones")
        handle = len(self.transfers) + 1
        self.transfers[handle] = (operation, mine, theirs, PEERS[remote_agent])
        return handle

    @own_failures
    def transfer(self, handle: int, *args: Any, **kwargs: Any) -> str:
        """Moves the bytes of a prepared transfer (READ: remote -> local; WRITE: local -> remote), each pair only where both
        descriptors lie in memory their agents registered and have one length; what it moved or refused goes in `moved`."""
        self.calls.append("transfer")
        operation, mine, theirs, peer = self.transfers[handle]
        for local_row, remote_row in zip(mine.tolist(), theirs.tolist(), strict=True):
            source, target = (remote_row, local_row) if operation == "READ" else (local_row, remote_row)
            source_agent, target_agent = (peer, self) if operation == "READ" else (self, peer)
            fits = (local_row[1] == remote_row[1] and source_agent.holds(source[0], source[1]) and target_agent.holds(target[0], target[1]))
            if fits:
                ctypes.memmove(int(target[0]), int(source[0]), int(source[1]))
            self.moved.append({"operation": operation, "local": local_row[:2], "remote": remote_row[:2], "moved": fits})
        return "DONE"

    @own_failures
    def check_xfer_state(self, handle: int) -> str:
        return "DONE"

    @own_failures
    def send_notif(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("send_notif")

    @own_failures
    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}

    @own_failures
    def release_xfer_handle(self, handle: int) -> None:
        self.calls.append("release_xfer_handle")

    @own_failures
    def get_xfer_telemetry(self, handle: int) -> Any:
        """nixl's telemetry of a finished transfer (0.30 - 0.31 record it unguarded): no time spent, the bytes and descriptors it
        paired."""
        _, mine, _, _ = self.transfers[handle]
        return types.SimpleNamespace(xferDuration=0, postDuration=0, totalBytes=int(mine[:, 1].sum()) if len(mine) else 0,
                                     descCount=len(mine))

    @own_failures
    def check_remote_metadata(self, *args: Any) -> bool:
        return True

    @own_failures
    def remove_remote_agent(self, name: str) -> None:
        self.calls.append("remove_remote_agent")

    def holds(self, address: int, length: int) -> bool:
        """The bytes [address, address + length) lie in one range this agent registered."""
        return any(start <= address and address + length <= start + size
                   for descs, _ in self.registered for start, size, _ in descs)

    def __getattr__(self, name: str) -> Any:
        gap = f"vLLM calls nixl_agent.{name}, which the recording agent does not stand in for"
        self.__dict__.setdefault("gaps", []).append(gap)
        raise StandInGap(gap)

    def local_lists(self) -> list[np.ndarray]:
        """The descriptor lists prepared for this agent's own memory (vLLM names its own agent NIXL_INIT_AGENT)."""
        return [rows for agent, rows, _ in self.dlists.values() if agent == "NIXL_INIT_AGENT"]


def expanded(rows: np.ndarray) -> np.ndarray:
    """Descriptor rows as (address, length, device), one per block: nixl takes plain rows and, from 1.5 (vLLM 0.34), strided
    rows (address, length, device, stride, count) that stand for `count` rows `stride` bytes apart."""
    if rows.ndim != 2 or rows.shape[1] not in (3, 5):
        raise StandInGap(f"the recording agent takes descriptor rows of 3 or 5 numbers, not an array of shape {rows.shape}")
    if rows.shape[1] == 3:
        return rows.copy()
    counts = rows[:, 4].astype(np.int64)
    steps = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.empty((steps.size, 3), dtype=np.uint64)
    out[:, 0] = np.repeat(rows[:, 0], counts) + np.repeat(rows[:, 3], counts) * steps.astype(np.uint64)
    out[:, 1] = np.repeat(rows[:, 1], counts)
    out[:, 2] = np.repeat(rows[:, 2], counts)
    return out


def agent_config(**settings: Any) -> dict[str, Any]:
    """Stands in for `nixl._api.nixl_agent_config`: the settings, as given."""
    return settings


class ModelStandIn:
    """The model's description the worker reads (heads, head size, layers, dtype, MLA): the walk's config has no model."""

    def __init__(self, case: Case, tp_size: int, kv_heads: int | None = None) -> None:
        spec = case.groups[0].spec
        self.model = "kvfuzz"
        self.dtype = spec.dtype
        self.use_mla = spec.kind in MLA_KINDS
        self.enable_sleep_mode = False
        # The model's KV heads: MLA's one latent, else the rank's heads times the TP size (unless stated: replicated heads).
        self._heads = kv_heads or (1 if self.use_mla else spec.num_kv_heads * tp_size)
        self._head_size = spec.head_size
        self._layers = len(case.layer_names)

    def get_total_num_kv_heads(self) -> int:
        return self._heads

    def get_head_size(self) -> int:
        return self._head_size

    def get_total_num_hidden_layers(self) -> int:
        return self._layers

    def get_layers_start_end_indices(self, parallel_config: Any) -> tuple[int, int]:
        return 0, self._layers

    def __getattr__(self, name: str) -> Any:
        raise StandInGap(f"NIXL's worker asks the model config for {name}, which kvfuzz's stand-in does not state")


def worker_class() -> type | None:
    """The worker class the connector builds for its worker role."""
    for name in WORKER_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        cls = getattr(module, "NixlConnectorWorker", None)
        if cls is not None:
            return cls
    return None


def agent_module(cls: type) -> types.ModuleType:
    """The module whose globals hold `NixlWrapper` for the worker's constructor (its base class's, where it has one)."""
    for klass in cls.__mro__:
        module = importlib.import_module(klass.__module__)
        if hasattr(module, "NixlWrapper"):
            return module
    raise Unusable(f"{cls.__module__}.{cls.__name__}: no module of its classes binds NixlWrapper")


@contextlib.contextmanager
def _attribute(obj: Any, name: str, value: Any) -> Iterator[None]:
    had = hasattr(obj, name)
    previous = getattr(obj, name, None)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, previous)
        else:
            delattr(obj, name)


@contextlib.contextmanager
def stand_ins(cls: type, walk: Any, tp_size: int = 1, tp_rank: int = 0, kv_heads: int | None = None) -> Iterator[list[str]]:
    """Everything outside the code under test, stood in while the worker is built and registers (see the module's doc)."""
    from fuzz.targets import consumers

    module = agent_module(cls)
    config = walk.vllm_config
    transfer_config = importlib.import_module("vllm.config").KVTransferConfig(
        kv_connector="NixlConnector", kv_role="kv_both", engine_id=f"kvfuzz-{uuid.uuid4().hex[:8]}")
    replaced = [f"{module.__name__}.NixlWrapper (nixl._api.nixl_agent)"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(module, "NixlWrapper", RecordingAgent))
        if hasattr(module, "nixl_agent_config"):
            stack.enter_context(mock.patch.object(module, "nixl_agent_config", agent_config))
            replaced.append(f"{module.__name__}.nixl_agent_config (nixl._api.nixl_agent_config)")
        for name, value in (("get_tensor_model_parallel_rank", tp_rank), ("get_tensor_model_parallel_world_size", tp_size)):
            if hasattr(module, name):
                stack.enter_context(mock.patch.object(module, name, lambda value=value: value))
        platform = getattr(module, "current_platform", None)
        if platform is not None and hasattr(platform, "discover_numa_topology"):
            stack.enter_context(mock.patch.object(platform, "discover_numa_topology", lambda: []))
        stack.enter_context(_attribute(config, "kv_transfer_config", transfer_config))
        # The config is the adapter's, set for the case it walked last: this end's layout and cache dtype (two ends of a
        # played transfer are two walks of one config).
        if hasattr(config.cache_config, "kv_cache_layout"):
            stack.enter_context(_attribute(config.cache_config, "kv_cache_layout", walk.case.layout))
        cache_dtype = next((g.spec.cache_dtype for g in walk.case.groups if g.spec.kind != "mamba"), "auto")
        stack.enter_context(_attribute(config.cache_config, "cache_dtype", cache_dtype))
        stack.enter_context(_attribute(config, "model_config", ModelStandIn(walk.case, tp_size, kv_heads)))
        stack.enter_context(consumers.layers_in_config(walk))
        yield replaced


def shut(worker: Any) -> None:
    """Stop the worker's handshake thread pool (its shutdown would also talk to the agent)."""
    executor = getattr(worker, "_handshake_initiation_executor", None)
    if executor is not None:
        executor.shutdown(wait=False)


def register(cls: type, walk: Any) -> tuple[Any, RecordingAgent, list[str]]:
    """vLLM's worker, built and registered on the walk's caches under the stand-ins."""
    from fuzz.targets.consumers import with_sharers

    with stand_ins(cls, walk) as replaced:
        worker = cls(walk.vllm_config, walk.vllm_config.kv_transfer_config.engine_id, walk.config)
        try:
            worker.register_kv_caches(with_sharers(walk))
        finally:
            shut(worker)
    return worker, worker.nixl_wrapper, replaced


def located(walk: Any, rows: np.ndarray) -> list[list[int]]:
    """Each descriptor row (address, length, device) as [buffer, start, end] on the walk's raw buffers."""
    from fuzz.targets import readback

    addresses = readback.Addresses(walk.raw)
    return [addresses.locate(int(address), int(length)) for address, length, _ in rows.tolist()]


# What kvfuzz reads off a registered worker to name each descriptor's region (the worker's own bookkeeping, 0.29+).
REGION_FIELDS = ("region_names", "block_len_per_layer", "block_stride_per_layer", "region_num_blocks", "_physical_blocks_per_logical_kv_block")


def record_of(worker: Any, agent: RecordingAgent, walk: Any, where: str, replaced: list[str]) -> Record:
    missing = [name for name in REGION_FIELDS if not hasattr(worker, name)]
    if missing:
        raise Unusable(f"{where}: this release's worker keeps no {', '.join(missing)}, by which kvfuzz names its descriptors' regions")
    lists = agent.local_lists()
    if len(lists) != 1:
        raise Unusable(f"{where} prepared {len(lists)} local descriptor lists, kvfuzz expects one")
    regions = [{"name": name, "block_len": int(length), "stride": int(stride), "blocks": int(blocks)}
               for name, length, stride, blocks in zip(worker.region_names, worker.block_len_per_layer,
                                                       worker.block_stride_per_layer, worker.region_num_blocks, strict=True)]
    return {"where": where, "replaced": replaced, "ratio": int(worker._physical_blocks_per_logical_kv_block),
            "regions": regions, "descriptors": located(walk, lists[0]),
            "registered": [located(walk, np.array([[start, length, device] for start, length, device in descs], dtype=np.uint64))
                           for descs, _ in agent.registered],
            "calls": sorted(set(agent.calls))}


# ------------------------------------------------------------------------------------------- a played transfer


class PeerSocket:
    """Stands in for the handshake's ZMQ socket to the peer: answers each (GET_META_MSG, pp rank, tp rank) query with the
    payload that rank's own worker encoded, as the peer's side channel sends it."""

    def __init__(self, payloads: dict[int, bytes]) -> None:
        self.payloads = payloads
        self.asked = -1

    def setsockopt(self, *args: Any) -> None:
        pass

    def send(self, message: bytes) -> None:
        import msgspec

        self.asked = int(msgspec.msgpack.decode(message)[2])

    def recv_multipart(self) -> list[bytes]:
        import time

        import msgspec

        if self.asked not in self.payloads:
            raise StandInGap(f"the handshake asks for tp rank {self.asked} of the peer, which kvfuzz did not build")
        return [self.payloads[self.asked], msgspec.msgpack.encode(time.perf_counter())]


@contextlib.contextmanager
def peer_channel(module: types.ModuleType, payloads: dict[int, bytes]) -> Iterator[None]:
    """The network between the two ends: the handshake's socket (and the device the handshake thread would select)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(module, "zmq_ctx", lambda *args: contextlib.nullcontext(PeerSocket(payloads))))
        platform = getattr(module, "current_platform", None)
        if platform is not None:
            stack.enter_context(mock.patch.object(platform, "set_device", lambda *args: None))
        yield


@dataclasses.dataclass
class End:
    """One end of a played transfer: its walk and its place in its tensor-parallel group."""

    walk: Any
    tp_size: int = 1
    tp_rank: int = 0
    kv_heads: int | None = None  # the model's KV heads where the rank's heads times the TP size is not it (replicated heads)


def play(cls: type, sender: End, receiver: End, sent: list[int], received: list[int]) -> Record:
    """vLLM's workers at both ends, the receiver pulling the sender's blocks `sent` into its blocks `received` through the
    real handshake (`_nixl_handshake`: payload decode, compatibility hash, `add_remote_agent`) and `start_load_kv`; the
    recording agents move the bytes. The record says what moved and compares the receiver's views with the sender's."""
    import msgspec

    from fuzz.targets.consumers import with_sharers

    fill(sender.walk, 1)
    fill(receiver.walk, 2)
    with stand_ins(cls, sender.walk, sender.tp_size, sender.tp_rank, sender.kv_heads):
        producer = cls(sender.walk.vllm_config, sender.walk.vllm_config.kv_transfer_config.engine_id, sender.walk.config)
        try:
            producer.register_kv_caches(with_sharers(sender.walk))
        finally:
            shut(producer)
    before = [raw.clone() for raw in receiver.walk.raw]
    payload = msgspec.msgpack.Encoder().encode(producer.xfer_handshake_metadata)
    module = agent_module(cls)
    with stand_ins(cls, receiver.walk, receiver.tp_size, receiver.tp_rank, receiver.kv_heads), peer_channel(module, {sender.tp_rank: payload}):
        consumer = cls(receiver.walk.vllm_config, receiver.walk.vllm_config.kv_transfer_config.engine_id, receiver.walk.config)
        try:
            consumer.register_kv_caches(with_sharers(receiver.walk))
            agents, _ = consumer._nixl_handshake("kvfuzz-peer", 0, sender.tp_size, producer.engine_id)
            consumer._remote_agents[producer.engine_id] = agents  # what the handshake's completion callback keeps
            metadata = importlib.import_module(type(producer.xfer_handshake_metadata).__module__).NixlConnectorMetadata()
            groups = len(receiver.walk.config.kv_cache_groups)
            metadata.add_new_req_to_recv("kvfuzz-req", tuple(list(received) for _ in range(groups)), {
                "remote_block_ids": tuple(list(sent) for _ in range(groups)), "remote_engine_id": producer.engine_id,
                "remote_request_id": "kvfuzz-req", "remote_host": "kvfuzz-peer", "remote_port": 0, "tp_size": sender.tp_size,
                # The proxy forwards the prompt's length (0.34 declines a pull between block sizes without it).
                "remote_num_tokens": len(sent) * sender.walk.case.groups[0].spec.block_size})
            consumer.start_load_kv(metadata)
            failed = set(consumer._recv_failures) | set(list(consumer._failed_recv_reqs.queue))
            finished = consumer.get_finished()  # completes the reads: the receive post-processing runs here
            load_errors = sorted(consumer.get_block_ids_with_load_errors())
        finally:
            shut(consumer)
    agent = consumer.nixl_wrapper
    if agent.gaps:
        raise StandInGap(agent.gaps[0])
    failed |= set(consumer._recv_failures) | set(_drained(consumer._failed_recv_reqs))
    if load_errors:
        failed.add(f"load errors in blocks {load_errors}")
    record: Record = {"moved": len([m for m in agent.moved if m["moved"]]), "refused": [m for m in agent.moved if not m["moved"]][:5],
                      "sent": list(sent), "received": list(received), "failed": sorted(failed),
                      "finished": "kvfuzz-req" in finished[1], "receiver": to_dict(receiver.walk.case),
                      "receiver_buffers": len(receiver.walk.raw)}
    if not failed:
        record.update(compare_ends(sender, receiver, sent, received, before))
    return record


def _drained(found: Any) -> list[Any]:
    items = []
    while not found.empty():
        items.append(found.get_nowait())
    return items


def played(cls: type, sender: End, receiver: End, sent: list[int], received: list[int]) -> Record:
    """NIXL's `play` as a check's record (`as_record`)."""
    return as_record(play, f"{cls.__module__}.{cls.__name__}.start_load_kv", cls, sender, receiver, sent, received)


def as_record(playing: Callable[[type, End, End, list[int], list[int]], Record], where: str, cls: type, sender: End,
              receiver: End, sent: list[int], received: list[int]) -> Record:
    """A connector's played transfer as a check's record: a stand-in's gap is a skip, an error raised in vLLM's code an
    `error` record (a handshake that refuses the pair is vLLM saying it cannot transfer it: a refusal, never a finding)."""
    try:
        return {"where": where, **playing(cls, sender, receiver, sent, received)}
    except Unusable as why:
        return {"skipped": str(why)}
    except Exception as error:  # noqa: BLE001 - vLLM raising is data; kvfuzz's own errors propagate
        failure = vllm_failure(error)
        if failure is None:
            raise
        return {"where": where, "handshake": True, "error": {"type": failure.error_type, "message": failure.error_message,
                                                             "function": failure.error_function}}


def fill(walk: Any, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    for raw in walk.raw:
        raw.view(torch.uint8).copy_(torch.randint(0, 256, (raw.numel() * raw.element_size(),), dtype=torch.uint8, generator=generator))


def compare_ends(sender: End, receiver: End, sent: list[int], received: list[int], before: list[Any]) -> Record:
    """Token by token, layer by layer, head by head: does the receiver hold the sender's K and V, and which of its bytes
    changed (`changed`, to be held against the received tokens' bytes, `allowed`). Views are (block, head, token, K and
    V) manager views; the receiver's heads are the slice of the sender's its TP rank reads."""
    import torch

    from fuzz.targets import readback

    wrong: list[dict[str, Any]] = []
    allowed: list[list[int]] = []
    addresses = readback.Addresses(receiver.walk.raw)
    sender_size, receiver_size = tokens_per_block(sender.walk), tokens_per_block(receiver.walk)
    for layer, mine in receiver.walk.manager_views.items():
        theirs = sender.walk.manager_views.get(layer)
        if theirs is None or mine.dim() != 4:
            raise Unusable(f"played transfers compare (block, head, token, content) views; {layer} has shape {tuple(mine.shape)}")
        for end, view in ((receiver, mine), (sender, theirs)):
            size = tokens_per_block(end.walk)
            if size % view.shape[2] or view.shape[0] != end.walk.case.num_blocks * (size // view.shape[2]):
                raise Unusable(f"played transfers compare (block, head, token, content) views; {layer} has shape {tuple(view.shape)} "
                               f"for {end.walk.case.num_blocks} blocks of {size} tokens")
        heads, first = mine.shape[1], heads_read(theirs.shape[1], sender, receiver)
        for token in range(min(len(sent) * sender_size, len(received) * receiver_size)):
            source, target = sent[token // sender_size], received[token // receiver_size]
            got = mine[slot(mine, target, token % receiver_size, receiver_size)]
            want = theirs[slot(theirs, source, token % sender_size, sender_size)][first : first + heads]
            allowed += readback.region_of(got, None, addresses)
            differs = [h for h in range(heads) if not torch.equal(got[h].contiguous().view(torch.uint8), want[h].contiguous().view(torch.uint8))]
            if differs and len(wrong) < 5:
                wrong.append({"layer": layer, "token": token, "heads": differs, "receiver_block": target, "sender_block": source})
    changed = [[index, *span] for index, raw in enumerate(receiver.walk.raw) for span in _changed_spans(before[index], raw)]
    return {"wrong": wrong, "changed": changed, "allowed": allowed}


def tokens_per_block(walk: Any) -> int:
    sizes = {group.spec.block_size for group in walk.case.groups}
    if len(sizes) != 1:
        raise Unusable(f"played transfers between groups of one block size; this end has {sorted(sizes)}")
    return sizes.pop()


def slot(view: Any, block: int, position: int, block_size: int) -> tuple[Any, ...]:
    """Index of token `position` of manager block `block` in a (block, head, token, content) view, whose blocks may be
    kernel blocks (a manager block of block_size tokens is block_size // view tokens consecutive kernel blocks)."""
    kernel_tokens = view.shape[2]
    per_block = block_size // kernel_tokens
    return block * per_block + position // kernel_tokens, slice(None), position % kernel_tokens


def heads_read(sender_heads: int, sender: End, receiver: End) -> int:
    """The first of the sender's heads the receiver's rank holds: a receiver of `ratio` times the sender's TP size splits
    each sender rank's heads in `ratio` slices, or, with fewer heads than that (replicated heads, MLA's latent), reads the
    head its slice falls in."""
    if receiver.tp_size <= sender.tp_size:
        return 0
    ratio = receiver.tp_size // sender.tp_size
    return (receiver.tp_rank % ratio) * sender_heads // ratio


def _changed_spans(before: Any, after: Any) -> list[tuple[int, int]]:
    import torch

    differs = (before.view(torch.uint8) != after.view(torch.uint8)).numpy()
    edges = np.flatnonzero(np.diff(np.concatenate(([0], differs.astype(np.int8), [0]))))
    return [(int(start), int(end)) for start, end in zip(edges[::2], edges[1::2], strict=True)]


class NixlCheck(TouchCheck):
    """NIXL's register_kv_caches at its transport (see the module's doc)."""

    name = "nixl"
    exports = (Export(("crash-on-valid", "refused-valid"), "register_kv_caches", "fuzz.export.nixl:nixl_test"),
               Export(("transfer-wrong",), "start_load_kv", "fuzz.export.nixl:nixl_receive_test"))
    setting = "--kv-transfer-config '{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\"}'"
    reads_buffers = False  # registration reads no byte of the caches (a played transfer fills both ends itself)
    kinds = {
        "transfer-mismatch": "a transfer descriptor covers bytes other than its block's content, or leaves some of a block's content uncovered",
        "transfer-overlap": "two of a transfer connector's descriptors share a byte",
        "transfer-wrong": "after a played transfer the receiver's views hold other bytes than the sender's K and V for a token, layer or head",
        "transfer-stray": "a played transfer changed bytes of the receiver that hold none of the received tokens",
    }

    def offer(self, probe: Any) -> Run | Off | None:
        cls = worker_class()
        if cls is None:
            return None
        source = "".join(inspect.getsource(k) for k in cls.__mro__ if k.__module__.startswith("vllm."))
        if "self.block_stride_per_layer" not in source:
            return Off(f"{cls.__module__}.{cls.__name__} registers no per-layer block strides (its registration before 0.29); "
                       "kvfuzz drives NIXL from the registration that does, and has not triaged the older one")
        from fuzz.targets import consumers  # torch and vLLM: the worker's, never the coordinator's

        where = f"{cls.__module__}.{cls.__name__}.register_kv_caches"

        def descriptors(walk: Any, touches: Any) -> Record:
            reason = self.unrealistic(walk.case)
            if reason is not None:
                raise Unusable(reason)
            worker, agent, replaced = register(cls, walk)
            return {**record_of(worker, agent, walk, where, replaced), "played": with_peer(cls, walk)}

        return consumers.consumer_run("transfer", where, consumers.runners_calling(r"\bregister_kv_caches\("), descriptors)

    def unrealistic(self, case: Case) -> str | None:
        kinds = {group.spec.kind for group in case.groups}
        if not kinds or not kinds <= set(TRANSFER_KINDS):
            return f"kvfuzz drives NIXL's attention descriptors only, not {sorted(kinds - set(TRANSFER_KINDS)) or 'a model without groups'}"
        if case.packing != "none":
            return "NIXL on packed cross-layer blocks is not driven"
        if case.layout[0] != "B" and any(group.spec.compress_ratio > 1 for group in case.groups):
            # Every model with compressed caches (DeepSeek V4) has the V4 indexer, whose backend supports only BLHNC and
            # BLNHC (0.30+ DeepseekV4IndexerBackend.supported_kv_cache_layouts); 0.32 - 0.33's NIXL asserts it.
            return "a model with compressed caches runs in a block-outermost layout (its indexer's backend supports no other)"
        if len({(group.backend_name, group.synthetic_backend) for group in case.groups}) > 1:  # a synthetic one: by its declaration
            # NixlConnectorWorker picks one kernel block size for the model (select_common_block_size over every layer's
            # backend) and refuses, with a ValueError, groups whose backends share none.
            return "NIXL moves a model of one attention backend"
        return None

    def judge(self, judging: Judging, record: Record) -> Finding | None:
        case, expected = judging.case, judging.expected
        if "skipped" in record or expected is None:
            return None
        function = record["where"].rsplit(".", 1)[-1]
        if "error" in record:
            error = record["error"]
            if "sent" in record or record.get("handshake"):  # the two ends of a played transfer
                if error["type"] in HANDSHAKE_REFUSALS:
                    return None
                kind = "assert-on-invalid" if error["type"] == "AssertionError" else "crash-on-valid"
            else:
                kind = "refused-valid" if error["type"] in REFUSALS else "crash-on-valid"
            return observed(case, kind, error.get("function") or function, f"{record['where']}: {error['type']}: {error['message']}")
        if "moved" in record:
            return judge_played(judging, record, function)
        descriptors = descriptors_of(record, buffer_map(judging))
        problem = transfer.check(case, expected, descriptors, record["ratio"])
        if problem is None:
            played = record.get("played") or {"skipped": "no transfer played"}
            if "skipped" in played:
                return None
            return self.judge(replace(judging, case=case), played)
        region = record["regions"][problem.region]["name"] if problem.region >= 0 else None
        owner = f"the descriptor of region {problem.region} ({region}), kernel block {problem.kernel_block}" if region else "a block"
        kind = "transfer-overlap" if problem.kind == "overlap" else "transfer-mismatch"
        return observed(case, kind, function, f"{record['where']}: {owner} {problem.message}", region)


def judge_played(judging: Judging, record: Record, function: str) -> Finding | None:
    """A played transfer (`play`): every pair moved, every received token holding the sender's K and V in each layer and
    head, and no byte of the receiver changed outside the receiving blocks. A receive vLLM reported failed is its refusal,
    never a finding."""
    case = judging.case
    # Counts, not lists: the signature strips numbers, so a list would make each length of it a bug of its own.
    where = f"{record['where']}: {len(record['sent'])} sender block(s) played into {len(record['received'])} receiver block(s)"
    if record["failed"]:
        return None
    if record["refused"]:
        pair = record["refused"][0]
        return observed(case, "transfer-mismatch", function, f"{where}: a local descriptor of {pair['local'][1]} bytes is paired with a "
                                                             f"remote one of {pair['remote'][1]}, or lies outside registered memory")
    if record["wrong"]:
        first = record["wrong"][0]
        return observed(case, "transfer-wrong", function, f"{where}: token {first['token']} of receiver block {first['receiver_block']} "
                                                          f"holds other bytes than the sender's in {len(first['heads'])} head(s), "
                                                          f"head {first['heads'][0]} first", first["layer"])
    stray = transfer.stray(record["changed"], record["allowed"] + received_tiles(judging, record))
    if stray:
        return observed(case, "transfer-stray", function, f"{where}: the transfer changed {stray} of the receiver outside the receiving blocks")
    return None


def received_tiles(judging: Judging, record: Record) -> list[list[int]]:
    """The bytes the receiving blocks own (padding included), where the receiver's one raw buffer is the oracle's one."""
    if record["receiver_buffers"] != 1:
        return []
    receiver = from_dict(record["receiver"])
    expected = oracles.expect(receiver, judging.contract)
    return transfer.received_tiles(receiver, expected, record["received"]) if expected.accepted and len(expected.buffers) == 1 else []


def buffer_map(judging: Judging) -> dict[int, int]:
    """vLLM's buffer -> the oracle's, matched by the layers each holds (one buffer: itself)."""
    expected = judging.expected
    assert expected is not None
    mapping: dict[int, int] = {}
    for name, layer in expected.layers.items():
        for view, wanted in zip(judging.outcome.views.get(name, ()), layer.views, strict=False):
            if view.buffer >= 0:
                mapping.setdefault(view.buffer, wanted.buffer)
    return mapping


def descriptors_of(record: Record, buffers: dict[int, int]) -> list[transfer.Descriptor]:
    """The record's descriptor rows, each with its region and kernel block (regions' rows are consecutive, block-ordered)."""
    rows = record["descriptors"]
    found: list[transfer.Descriptor] = []
    position = 0
    for index, region in enumerate(record["regions"]):
        count = region["blocks"]
        for kernel_block, (buffer, start, end) in enumerate(rows[position : position + count]):
            mapped = buffers.get(buffer, buffer) if buffer >= 0 else -1
            found.append(transfer.Descriptor(index, kernel_block, mapped, start, end))
        position += count
    if position != len(rows):
        raise ValueError(f"{record['where']}: {len(rows)} descriptors for regions of {position} blocks")
    return found


# ------------------------------------------------------------------------------------------- the peer a campaign plays with

# How the receiver differs from the case (the sender). A receiver of smaller blocks than its sender's is not drawn: vLLM
# refuses the pair by an assertion (FINDINGS.md, candidates).
PEERS_DRAWN = ("same", "tp", "blocks-up")


def peer_of(case: Case) -> tuple[str, Case, int, int]:
    """The receiving end a campaign plays the case's transfer into, a function of the case alone: the same case, a decode
    instance of twice the TP (each rank holding half the KV heads; an MLA latent is replicated), or one whose blocks are
    twice as large (where each end's kernel block is its block). Returns (what differs, the receiver's case, its TP size,
    its rank)."""
    seed = zlib.crc32(dumps(replace(case, touches=None)).encode())
    how = PEERS_DRAWN[seed % len(PEERS_DRAWN)]
    if how == "tp":
        mla = any(group.spec.kind in MLA_KINDS for group in case.groups)
        # A rank pads and publishes its own page: a case whose pages say so (padding, published slots) has no TP peer here.
        own_page = any(group.spec.page_size_padded or group.spec.num_head_slots or group.spec.state_content_bytes for group in case.groups)
        if not own_page and (mla or all(group.spec.num_kv_heads % 2 == 0 and not group.layer_heads for group in case.groups)):
            groups = tuple(replace(group, spec=replace(group.spec, num_kv_heads=group.spec.num_kv_heads // 2)) for group in case.groups)
            halved = case if mla else replace(case, groups=groups)
            return how, halved, 2, (seed >> 8) % 2
        how = "same"
    if how == "blocks-up":
        groups = []
        for group in case.groups:
            split = (group.kernel_block_size or group.spec.block_size) != group.spec.block_size
            if split or group.synthetic_backend is not None or group.spec.page_size_padded is not None:
                return "same", case, 1, 0
            groups.append(replace(group, spec=replace(group.spec, block_size=2 * group.spec.block_size), kernel_block_size=None))
        return how, replace(case, groups=tuple(groups)), 1, 0
    return "same", case, 1, 0


def with_peer(cls: type, walk: Any, playing: Callable[[type, End, End, list[int], list[int]], Record] | None = None) -> Record:
    """The case's blocks (the null block aside) pulled into a peer's (`peer_of`), played through vLLM's own handshake and
    read path: the record of `played` (or of another connector's `playing`), or why no transfer was played."""
    how, case, tp_size, tp_rank = peer_of(walk.case)
    sent = [block for block in (walk.case.touches.blocks if walk.case.touches else ()) if block] or list(range(1, min(walk.case.num_blocks, 3)))
    if not sent:
        return {"skipped": "a pool of one block holds only the null block"}
    try:
        peer = walk.walk_of(case)
    except (Inexpressible, CaseMismatch, BrokenDeclaration) as error:  # a peer the target cannot express: no transfer to play
        return {"skipped": f"the {how} peer does not build here ({type(error).__name__}: {error})".splitlines()[0]}
    except Exception as error:  # noqa: BLE001 - vLLM failing on the peer's own views is the view path's to find, on that case
        if vllm_failure(error) is None:
            raise  # kvfuzz's own error: an internal error, never a skip
        return {"skipped": f"the {how} peer's views fail in vLLM ({type(error).__name__}: {error})".splitlines()[0]}
    tokens = len(sent) * walk.case.groups[0].spec.block_size
    needed = max(1, -(-tokens // peer.case.groups[0].spec.block_size))
    if needed >= peer.case.num_blocks:
        return {"skipped": f"the {how} peer has {peer.case.num_blocks} blocks, too few for {needed} received blocks"}
    received = list(range(peer.case.num_blocks - 1, peer.case.num_blocks - 1 - needed, -1))
    return {"peer": how, **(playing or played)(cls, End(walk), End(peer, tp_size, tp_rank), sent, received)}


CHECK = NixlCheck()
