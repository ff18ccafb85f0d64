"""The MoRI-IO connector at its transport: vLLM's own MoRI-IO worker registers the walk's caches with a recording stand-in
for the `mori.io` package's IOEngine, and each layer's per-block transfer span is held against the bytes its block owns.

What runs is vLLM's: `MoRIIOConnectorWorker` (vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py,
0.29+), built by its own constructor on the KVCacheConfig as the connector gets it, and its `register_kv_caches` on the
runner's caches (manager views, KV-sharing layers mapped to their target's; from 0.31 it keeps its transfer layers only),
which works out each layer's registration regions (`_iter_layer_registration_regions`,
moriio_layout.py's `iter_layer_registration_regions` and `get_layer_transfer_geometry`), registers the memory with the
engine (one page-aligned memory region over a shared backing, `_build_shared_kv_mr`, else each layer's cache) and, from
0.33, records each layer's head layout (`_record_slice_layouts`). The spans it moves for block b of a layer are its own
`_compute_block_transfer_offsets(layer, [b], [b], ...)` (what its WRITE path posts for a whole-shard copy), offsets into
the memory region the layer's session addresses. What is stood in is outside that code:

- the `mori.io` package (not installed; vLLM imports it at module level, in a try block that leaves MoRI-IO off when it
  is missing): a stand-in module put in sys.modules while vLLM's MoRI-IO modules are imported, and its names bound in
  those modules for each run: `IOEngine` (a recording engine that keeps the tensors registered with
  `register_torch_tensor`, as mori registers them: contiguous tensors only, their elements' bytes), `IOEngineConfig`,
  `EngineDesc`, `MemoryDesc`, `BackendType`, `RdmaBackendConfig`, `XgmiBackendConfig`, `PollCqMode`, `StatusCode`, and
  sessions (`create_session`) whose batch reads and writes copy bytes, in memory, only inside the memory both engines
  registered;
- the device's allocator: the case's buffers are re-homed, byte for byte, on page-aligned memory, as a GPU allocator
  places a KV-cache allocation (vLLM's `_build_shared_kv_mr` backs its region up to the page that holds the backing's first
  byte, which torch refuses below a storage's start; a CPU allocator's buffers seldom start on a page);
- the tensor-parallel and world groups, the host's address and open ports, the attention backend the platform selects
  (the case's own), the model's description (fuzz/checks/nixl.py's `ModelStandIn`) and the connector's settings (a
  KVTransferConfig for MoRIIOConnector);
- the network: the handshake listener (its thread is not started; its arguments are kept, and served to a peer through
  vLLM's own listener function over a stand-in socket) and the notify listener (`MoRIIOWrapper.async_wait_reqid`).

The judgement (oracles/transfer.py, as for NIXL and Mooncake): every registered range and every advertised region lies
inside the case's buffers, and every span inside the memory its session addresses (`transfer-unregistered`); block b's
span of each layer covers exactly that block's bytes of the layer's view (the block's own padding aside:
`transfer-mismatch`); no two spans share a byte (`transfer-overlap`).

A played transfer: the case (the prefill side) is read by a peer (`nixl.peer_of`: the same case, a decode of twice the
TP, or of larger blocks) in MoRI-IO's READ mode, through vLLM's own read path: the decode worker's `start_load_kv`, its
handshake (`_moriio_handshake`, answered by the prefill worker's own `_moriio_handshake_listener`), its sessions and the
reads `_read_blocks` posts (where vLLM asks the forward context, it answers FULL CUDA graphs: every read is awaited);
judged as NIXL's (`nixl.judge_played`). A read vLLM declines with an error (`PLAY_REFUSALS`) is its refusal, never a
finding; a pair the recording engines refuse (outside registered memory) is a `transfer-mismatch`.

Driven on 0.29 - 0.34 (the worker's registration regions arrive with the connector in 0.29). Not driven yet: a hybrid
model's mamba (KDA) layers, whose conv and SSM slots MoRI-IO moves in READ mode only (`_compute_mamba_transfer_offsets`);
such a case is skipped, as is a model without KV-cache layers.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import enum
import functools
import importlib
import importlib.util
import itertools
import json
import mmap
import sys
import types
import uuid
import weakref
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np

from fuzz.case import Case
from fuzz.checks import nixl
from fuzz.checks.nixl import End, StandInGap, own_failures
from fuzz.checks.protocol import Judging, Off, Record, Run, TouchCheck, Unusable
from fuzz.verdict.findings import Finding, observed
from oracles import transfer

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
WORKER_MODULE = f"{PACKAGE}.moriio_connector"
ENGINE_MODULE = f"{PACKAGE}.moriio_engine"
COMMON_MODULE = f"{PACKAGE}.moriio_common"
# The names vLLM's MoRI-IO modules import from mori.io, stood in (`mori_io`).
MORI_NAMES = ("IOEngine", "IOEngineConfig", "EngineDesc", "MemoryDesc", "BackendType", "RdmaBackendConfig",
              "XgmiBackendConfig", "PollCqMode", "StatusCode")
# What the worker must have for kvfuzz to read its regions and spans (0.29+).
WORKER_PARTS = ("register_kv_caches", "_iter_layer_registration_regions", "_compute_block_transfer_offsets",
                "_moriio_handshake_listener")
# What vLLM raises to decline a read between two ends: nixl's refusals, and MoRI-IO's own errors, which it raises with a
# message for pairs it does not move (0.34: "Layer ... holds N KV heads per rank here and M on the peer").
PLAY_REFUSALS = (*nixl.HANDSHAKE_REFUSALS, "MoRIIOError", "HandshakeError")
TRANSFER_ID = "kvfuzz-transfer"
PORT = 18500  # the handshake, notify and HTTP ports the connector's settings name (never bound: the network is stood in)

ENGINES: weakref.WeakValueDictionary[str, RecordingEngine] = weakref.WeakValueDictionary()  # by engine key
_OPEN_PORTS = itertools.count(19000)


# ------------------------------------------------------------------------------------------- the mori.io stand-in


class BackendType(enum.Enum):
    RDMA = 0
    XGMI = 1
    TCP = 2


class PollCqMode(enum.Enum):
    POLLING = 0
    EVENT = 1


class StatusCode(enum.IntEnum):
    INIT = 0
    IN_PROGRESS = 1
    SUCCESS = 2
    ERR_INVALID_ARGS = 3
    ERR_RDMA_OP = 4


class BackendConfig:
    """Stands in for `RdmaBackendConfig` and `XgmiBackendConfig`: the settings, as given."""

    def __init__(self, *settings: Any, **named: Any) -> None:
        self.settings = (*settings, *named.items())


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Stands in for `IOEngineConfig` (host, port)."""

    host: str
    port: int


@dataclasses.dataclass(frozen=True)
class EngineDesc:
    """Stands in for `EngineDesc`: the engine's key, packed as mori packs it (opaque bytes)."""

    key: str

    def pack(self) -> bytes:
        return json.dumps({"engine": self.key}).encode()

    @staticmethod
    def unpack(packed: bytes) -> EngineDesc:
        return EngineDesc(json.loads(bytes(packed))["engine"])


@dataclasses.dataclass(frozen=True)
class MemoryDesc:
    """Stands in for `MemoryDesc`: registered memory (`data` its address, `size` its bytes) of one engine."""

    engine: str
    data: int
    size: int

    def pack(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @staticmethod
    def unpack(packed: bytes) -> MemoryDesc:
        return MemoryDesc(**json.loads(bytes(packed)))


class TransferStatus:
    """Stands in for mori's `TransferStatus`: finished when it is made (the recording engine copies synchronously)."""

    def __init__(self, failure: str | None = None) -> None:
        self.failure = failure

    def Succeeded(self) -> bool:  # noqa: N802 - mori's spelling
        return self.failure is None

    def Failed(self) -> bool:  # noqa: N802
        return self.failure is not None

    def Message(self) -> str:  # noqa: N802
        return self.failure or ""

    def Code(self) -> StatusCode:  # noqa: N802
        return StatusCode.SUCCESS if self.failure is None else StatusCode.ERR_RDMA_OP


class RecordingSession:
    """Stands in for mori's `IOEngineSession` between a local and a remote memory region: a read copies remote bytes into
    local ones, a write local into remote, each pair only where both ranges lie in memory their engines registered (a pair
    outside moves nothing and fails the status, as an RDMA access outside a registered region does)."""

    def __init__(self, engine: RecordingEngine, local: MemoryDesc, remote: MemoryDesc) -> None:
        self.engine = engine
        self.local = local
        self.remote = remote

    @own_failures
    def batch_read(self, local_offsets: list[int], remote_offsets: list[int], sizes: list[int], uid: int) -> TransferStatus:
        return self.engine.move("read", self.local, local_offsets, self.remote, remote_offsets, sizes)

    @own_failures
    def batch_write(self, local_offsets: list[int], remote_offsets: list[int], sizes: list[int], uid: int) -> TransferStatus:
        return self.engine.move("write", self.local, local_offsets, self.remote, remote_offsets, sizes)

    @own_failures
    def read(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus:
        return self.batch_read([local_offset], [remote_offset], [size], uid)

    @own_failures
    def write(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus:
        return self.batch_write([local_offset], [remote_offset], [size], uid)

    def alive(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        gap = f"vLLM calls IOEngineSession.{name}, which the recording session does not stand in for"
        self.engine.gaps.append(gap)
        raise StandInGap(gap)


class RecordingEngine:
    """Stands in for `mori.io.IOEngine`: keeps the memory it registers and the transfers its sessions make."""

    wait_all = None  # a mori build without the batched wait: vLLM polls each status

    def __init__(self, key: str, config: Any = None) -> None:
        self.key = f"{key}#{uuid.uuid4().hex[:8]}"  # two workers of one walk may ask for one key
        self.registered: list[MemoryDesc] = []
        self.transfers: list[dict[str, Any]] = []
        self.calls: list[str] = []
        self.gaps: list[str] = []
        self._uids = itertools.count()
        ENGINES[self.key] = self

    @own_failures
    def create_backend(self, backend: Any, config: Any = None) -> None:
        self.calls.append("create_backend")

    @own_failures
    def get_engine_desc(self) -> EngineDesc:
        return EngineDesc(self.key)

    @own_failures
    def register_remote_engine(self, desc: EngineDesc) -> None:
        self.calls.append("register_remote_engine")
        if desc.key not in ENGINES:
            raise StandInGap(f"no recording engine {desc.key} to connect to")

    def register_torch_tensor(self, tensor: Any) -> MemoryDesc:
        """As mori's: a contiguous tensor only (mori's RuntimeError otherwise, which vLLM meets), registered as its elements'
        bytes."""
        self.calls.append("register_torch_tensor")
        if not tensor.is_contiguous():
            raise RuntimeError("input tensor must be contiguous")
        return self._register(tensor)

    @own_failures
    def _register(self, tensor: Any) -> MemoryDesc:
        memory = MemoryDesc(self.key, int(tensor.data_ptr()), int(tensor.nelement() * tensor.element_size()))
        self.registered.append(memory)
        return memory

    @own_failures
    def deregister_memory(self, memory: MemoryDesc) -> None:
        self.calls.append("deregister_memory")

    @own_failures
    def allocate_transfer_uid(self) -> int:
        return next(self._uids)

    @own_failures
    def create_session(self, local: MemoryDesc, remote: MemoryDesc) -> RecordingSession:
        self.calls.append("create_session")
        return RecordingSession(self, local, remote)

    def holds(self, address: int, length: int) -> bool:
        return any(m.data <= address and address + length <= m.data + m.size for m in self.registered)

    def move(self, operation: str, local: MemoryDesc, local_offsets: list[int], remote: MemoryDesc, remote_offsets: list[int],
             sizes: list[int]) -> TransferStatus:
        """Copies each pair (a read: remote into local; a write: local into remote), where both lie in registered memory."""
        self.calls.append(f"batch_{operation}")
        peer = ENGINES.get(remote.engine)
        if peer is None:
            raise StandInGap(f"no recording engine {remote.engine} holds the remote memory")
        failed = 0
        for local_offset, remote_offset, size in zip(local_offsets, remote_offsets, sizes, strict=True):
            mine, theirs = local.data + int(local_offset), remote.data + int(remote_offset)
            fits = (size > 0 and self.holds(mine, int(size)) and peer.holds(theirs, int(size))
                    and local_offset >= 0 and remote_offset >= 0 and local_offset + size <= local.size and remote_offset + size <= remote.size)
            if fits:
                source, target = (theirs, mine) if operation == "read" else (mine, theirs)
                ctypes.memmove(target, source, int(size))
            failed += not fits
            self.transfers.append({"operation": operation, "local": [mine, int(size)], "remote": [theirs, int(size)], "moved": fits})
        return TransferStatus(f"{failed} of {len(sizes)} ranges lie outside registered memory" if failed else None)

    def __getattr__(self, name: str) -> Any:
        gap = f"vLLM calls IOEngine.{name}, which the recording engine does not stand in for"
        self.__dict__.setdefault("gaps", []).append(gap)
        raise StandInGap(gap)


def mori_io() -> types.ModuleType:
    """The stand-in `mori.io` module: the names vLLM imports from it."""
    module = types.ModuleType("mori.io")
    stand_ins = {"IOEngine": RecordingEngine, "IOEngineConfig": EngineConfig, "EngineDesc": EngineDesc, "MemoryDesc": MemoryDesc,
                 "BackendType": BackendType, "RdmaBackendConfig": BackendConfig, "XgmiBackendConfig": BackendConfig,
                 "PollCqMode": PollCqMode, "StatusCode": StatusCode}
    for name in MORI_NAMES:
        setattr(module, name, stand_ins[name])
    return module


@contextlib.contextmanager
def mori_importable() -> Iterator[None]:
    """The stand-in `mori.io` in sys.modules (where no real mori is installed), while vLLM's MoRI-IO modules are imported."""
    if importlib.util.find_spec("mori") is not None:
        yield
        return
    package = types.ModuleType("mori")
    package.io = mori_io()  # type: ignore[attr-defined]
    added = {"mori": package, "mori.io": package.io}  # type: ignore[attr-defined]
    sys.modules.update(added)
    try:
        yield
    finally:  # only these two: the vLLM modules imported meanwhile stay imported
        for name, module in added.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


def worker_module() -> types.ModuleType | None:
    """vLLM's MoRI-IO connector module, first imported with the stand-in `mori.io` importable; None where the release has none."""
    try:
        with mori_importable():
            importlib.import_module(ENGINE_MODULE)
            return importlib.import_module(WORKER_MODULE)
    except ImportError:
        return None


# ------------------------------------------------------------------------------------------- everything else stood in


class MoriioModel(nixl.ModelStandIn):
    """The model's description, with the HF config MoRI-IO reads (its model type: Llama 4's local attention)."""

    def __init__(self, case: Case, tp_size: int, kv_heads: int | None = None) -> None:
        super().__init__(case, tp_size, kv_heads)
        self.hf_config = types.SimpleNamespace(model_type="kvfuzz")
        self.hf_text_config = self.hf_config

    def __getattr__(self, name: str) -> Any:
        raise StandInGap(f"MoRI-IO's worker asks the model config for {name}, which kvfuzz's stand-in does not state")


def replaced_names() -> list[str]:
    return [f"{WORKER_MODULE}.{name} (mori.io.{name})" for name in ("IOEngine", "IOEngineConfig", "BackendType")] + \
           [f"{ENGINE_MODULE}.{name} (mori.io.{name})" for name in MORI_NAMES if name != "IOEngineConfig"]


@dataclasses.dataclass
class Listener:
    """The handshake listener's arguments as register_kv_caches hands them to its thread (its metadata first)."""

    args: tuple[Any, ...] = ()

    @property
    def metadata(self) -> Any:
        return self.args[0]


@contextlib.contextmanager
def stand_ins(end: End, role: str, read_mode: bool) -> Iterator[Listener]:
    """Everything outside the code under test, stood in while a worker is built and registers (see the module's doc)."""
    from fuzz.targets import consumers

    modules = [importlib.import_module(name) for name in (WORKER_MODULE, ENGINE_MODULE, COMMON_MODULE)]
    worker_module_, engine_module, _ = modules
    walk, listener = end.walk, Listener()
    config = walk.vllm_config
    settings = {"handshake_port": PORT, "notify_port": PORT + 100, "http_port": PORT + 200, "host_ip": "127.0.0.1",
                "read_mode": read_mode}
    transfer_config = importlib.import_module("vllm.config").KVTransferConfig(
        kv_connector="MoRIIOConnector", kv_role=role, engine_id=f"kvfuzz-{uuid.uuid4().hex[:8]}", kv_connector_extra_config=settings)
    backend = next(iter(consumers.layer_backends(walk).values()), None)
    groups = types.SimpleNamespace(rank=0, local_rank=0, world_size=end.tp_size, rank_in_group=end.tp_rank, cpu_group=None)
    answers = {"get_world_group": lambda: groups, "get_tp_group": lambda: groups, "get_tensor_model_parallel_rank": lambda: end.tp_rank,
               "get_tensor_model_parallel_world_size": lambda: end.tp_size, "get_open_port": lambda: next(_OPEN_PORTS),
               "get_ip": lambda: "127.0.0.1", "get_attn_backend": lambda *args, **kwargs: backend}
    mori = mori_io()
    with contextlib.ExitStack() as stack:
        for module in modules:
            for name, answer in answers.items():
                if hasattr(module, name):
                    stack.enter_context(mock.patch.object(module, name, answer))
        for module in (worker_module_, engine_module):
            for name in MORI_NAMES:
                stack.enter_context(mock.patch.object(module, name, getattr(mori, name), create=True))
        stack.enter_context(mock.patch.object(worker_module_, "MoRIIO_enabled", True, create=True))
        stack.enter_context(mock.patch.object(engine_module.MoRIIOWrapper, "async_wait_reqid", lambda self: None))
        stack.enter_context(mock.patch.object(worker_module_.MoRIIOConnectorWorker, "_moriio_handshake_listener",
                                              staticmethod(_listening(listener))))
        stack.enter_context(nixl._attribute(config, "kv_transfer_config", transfer_config))
        if hasattr(config.cache_config, "kv_cache_layout"):
            stack.enter_context(nixl._attribute(config.cache_config, "kv_cache_layout", walk.case.layout))
        cache_dtype = next((g.spec.cache_dtype for g in walk.case.groups if g.spec.kind != "mamba"), "auto")
        stack.enter_context(nixl._attribute(config.cache_config, "cache_dtype", cache_dtype))
        stack.enter_context(nixl._attribute(config.cache_config, "block_size", walk.case.groups[0].spec.block_size))
        stack.enter_context(nixl._attribute(config, "model_config", MoriioModel(walk.case, end.tp_size, end.kv_heads)))
        stack.enter_context(consumers.layers_in_config(walk))
        yield listener


def _listening(listener: Listener) -> Any:
    """The handshake listener's thread body, stood in: keeps its arguments and says it is listening (the socket is network)."""

    def listen(*args: Any) -> None:
        listener.args = args
        args[1].set()  # its ready event

    return listen


def rehomed(walk: Any) -> Any:
    """The walk on page-aligned copies of its buffers (a device allocator's placement): each buffer's bytes, dtype, shape and
    strides, and each view on the copy of the buffer it lies in, at the same offset."""
    import torch

    copies, storages = [], {}
    for raw in walk.raw:
        storage = raw.untyped_storage()
        aligned = torch.frombuffer(mmap.mmap(-1, storage.nbytes()), dtype=torch.uint8)  # anonymous memory: page-aligned
        aligned.copy_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,)))
        storages[storage.data_ptr()] = aligned.untyped_storage()
        copies.append(_on(raw, aligned.untyped_storage()))

    def moved(views: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for name, view in views.items():
            storage = storages.get(view.untyped_storage().data_ptr())
            if storage is None:
                raise StandInGap(f"the view of {name} lies in none of the walk's raw buffers")
            out[name] = _on(view, storage)
        return out

    return dataclasses.replace(walk, raw=copies, manager_views=moved(walk.manager_views), bound_views=moved(walk.bound_views))


def _on(tensor: Any, storage: Any) -> Any:
    import torch

    return torch.empty(0, dtype=tensor.dtype).set_(storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


def connector_config(walk: Any) -> Any:
    """The KVCacheConfig as the worker's connector gets it: before the model runner adds the KV-sharing layers to their
    targets' groups (GPUWorker.initialize_from_config: "This need to be done before `initialize_kv_cache`, because
    `initialize_kv_cache` will inject kv cache groups not related to kv cache connector (e.g. kv cache sharing layers)")."""
    sharers = {sharer for sharer, _ in walk.case.kv_sharing}
    copied = copy.deepcopy(walk.config)
    for group in copied.kv_cache_groups:
        group.layer_names = [name for name in group.layer_names if name not in sharers]
    for attribute, value in vars(type(copied)).items():  # what the config derived from its groups, derived again
        if isinstance(value, functools.cached_property):
            copied.__dict__.pop(attribute, None)
    return copied


def build(cls: type, end: End, role: str, read_mode: bool = False) -> tuple[Any, Listener]:
    """vLLM's worker for `role`, built and registered on the end's caches under the stand-ins; the caller shuts it."""
    from fuzz.targets.consumers import with_sharers

    with stand_ins(end, role, read_mode) as listener:
        worker = cls.__new__(cls)
        try:
            cls.__init__(worker, end.walk.vllm_config, end.walk.vllm_config.kv_transfer_config.engine_id, connector_config(end.walk))
            worker.register_kv_caches(with_sharers(end.walk))
        except BaseException:
            shut(worker)
            raise
    return worker, listener


def shut(worker: Any) -> None:
    """Stops what the worker started (its handshake pool, its ZMQ context); its own shutdown would talk to the network."""
    executor = getattr(worker, "_handshake_initiation_executor", None)
    if executor is not None:
        executor.shutdown(wait=True)
    context = getattr(worker, "zmq_context", None)
    if context is not None:
        context.term()
    worker.shutdown = lambda: None  # its __del__ shuts it down again: nothing is left to stop


# ------------------------------------------------------------------------------------------- the registration


def registration(cls: type, walk: Any, where: str) -> Record:
    """The regions, registered memory and per-block spans of vLLM's worker on the walk (re-homed: `rehomed`)."""
    home = rehomed(walk)
    worker, listener = build(cls, End(home), "kv_consumer")
    shut(worker)
    engine = worker.moriio_engine
    if engine.gaps:
        raise StandInGap(engine.gaps[0])
    layers = list(worker.kv_caches)
    memories = [MemoryDesc.unpack(worker.layer_name_to_local_kv_cache_metadata[layer][0]) for layer in layers]
    advertised = [[int(cache.data_ptr()), int(length)] for layer in layers for cache, length in worker._iter_layer_registration_regions(layer)]
    spans = [(index, block, address, size) for index, layer in enumerate(layers) for block in range(walk.case.num_blocks)
             for address, size in block_spans(worker, layer, block, memories[index], listener.metadata)]
    placed = _located(home, [[address, size] for _, _, address, size in spans])
    return {"where": where, "replaced": replaced_names(), "ratio": 1, "regions": [{"name": layer} for layer in layers],
            "spans": [[index, block, *place] for (index, block, _, _), place in zip(spans, placed, strict=True)],
            "registered": _located(home, [[m.data, m.size] for m in engine.registered]), "advertised": _located(home, advertised),
            "sessions": _located(home, [[m.data, m.size] for m in memories]),
            "buffer_bytes": [int(raw.untyped_storage().nbytes()) for raw in home.raw], "calls": sorted(set(engine.calls))}


def block_spans(worker: Any, layer: str, block: int, memory: MemoryDesc, advertised: Any) -> list[tuple[int, int]]:
    """The (address, length) spans vLLM moves for block `block` of the layer (to the same block of a peer that advertises
    what this worker does): its `_compute_block_transfer_offsets`, offsets into the memory the layer's session addresses."""
    offsets, _, sizes = worker._compute_block_transfer_offsets(layer, [block], [block], advertised)
    return [(memory.data + int(offset), int(size)) for offset, size in zip(offsets, sizes, strict=True)]


def _located(walk: Any, pairs: list[list[int]]) -> list[list[int]]:
    """Each (address, length) as [buffer, start, end] on the walk's raw buffers (buffer -1: in none of them)."""
    rows = np.array([[address, length, 0] for address, length in pairs], dtype=np.uint64).reshape(-1, 3)
    return nixl.located(walk, rows)


def outside(rows: list[list[int]], buffer_bytes: list[int]) -> list[int] | None:
    """The first [buffer, start, end] row that does not lie inside one of the case's buffers."""
    return next((row for row in rows if row[0] < 0 or row[2] > buffer_bytes[row[0]] or row[1] < 0), None)


def unregistered(record: Record) -> str | None:
    """What of the record lies outside the memory it must lie in, described: registered memory or an advertised region
    outside the buffers, or a block's span outside the memory region its layer's session addresses."""
    for key, what in (("registered", "registers"), ("advertised", "advertises a region of")):
        row = outside(record[key], record["buffer_bytes"])
        if row is not None:
            where = f"at address {row[1]}" if row[0] < 0 else f"at byte {row[1]} of buffer {row[0]} ({record['buffer_bytes'][row[0]]} bytes)"
            return f"{what} {row[2] - row[1]} bytes {where}, outside the KV-cache buffers"
    for region, block, buffer, start, end in record["spans"]:
        session = record["sessions"][region]
        if buffer != session[0] or start < session[1] or end > session[2]:
            name = record["regions"][region]["name"]
            return (f"moves {end - start} bytes at byte {start} of buffer {buffer} for block {block} of {name}, outside the "
                    f"memory region its session addresses (bytes {session[1]} to {session[2]} of buffer {session[0]})")
    return None


def descriptors_of(record: Record, buffers: dict[int, int]) -> list[transfer.Descriptor]:
    return [transfer.Descriptor(region, block, buffers.get(buffer, buffer) if buffer >= 0 else -1, start, end)
            for region, block, buffer, start, end in record["spans"]]


# ------------------------------------------------------------------------------------------- a played transfer


class HandshakeSocket:
    """Stands in for the decode side's ZMQ socket to the prefill worker's side channel: its query is answered by vLLM's own
    listener function (`_moriio_handshake_listener`, run on the arguments the prefill worker's register_kv_caches gave its
    thread) over a `ListenerSocket`, whose frames come back one `recv_multipart` at a time."""

    def __init__(self, listen: Any, served: Listener) -> None:
        self.listen = listen
        self.served = served
        self.frames: list[list[bytes]] = []
        self.gaps: list[str] = []

    def setsockopt(self, *args: Any) -> None:
        pass

    def send(self, message: bytes) -> None:
        if not self.served.args:
            self._gap("the prefill worker's register_kv_caches started no handshake listener")
        with contextlib.suppress(ListenerDone):
            self.listen(*self.served.args)

    def recv_multipart(self) -> list[bytes]:
        if not self.frames:
            return self._gap("the decode side waits for a frame the prefill worker's listener never sent")
        return self.frames.pop(0)

    def _gap(self, gap: str) -> Any:
        self.gaps.append(gap)
        raise StandInGap(gap)


class ListenerDone(Exception):  # noqa: N818 - a signal, not an error
    """Ends the prefill worker's listener loop once it has answered the one query."""


class ListenerSocket:
    """The prefill listener's ROUTER socket: one GET_META_MSG query from the decode side, then `ListenerDone`; what it
    sends the decode identity goes to the decode side's frames."""

    def __init__(self, decode: HandshakeSocket, query: bytes) -> None:
        self.decode = decode
        self.queries = [[b"kvfuzz-decode", query]]

    def recv_multipart(self) -> list[bytes]:
        if not self.queries:
            raise ListenerDone()
        return self.queries.pop(0)

    def send_multipart(self, parts: Any) -> None:
        _, *frames = [bytes(part) for part in parts]
        self.decode.frames.append(frames)


@contextlib.contextmanager
def side_channel(module: types.ModuleType, listen: Any, served: Listener) -> Iterator[HandshakeSocket]:
    """The network between the ends while the decode worker pulls: its handshake socket (answered by the prefill worker's
    own listener), the TP group's all-reduce vote (one rank: its own), and the forward context the read barrier asks for
    its CUDA-graph mode (FULL: every read is awaited before the forward)."""
    decode = HandshakeSocket(listen, served)
    query = importlib.import_module(COMMON_MODULE).MoRIIOConstants.GET_META_MSG

    @contextlib.contextmanager
    def socket(kind: Any, path: str) -> Iterator[Any]:
        import zmq

        yield ListenerSocket(decode, query) if kind == zmq.ROUTER else decode

    full = importlib.import_module("vllm.config").CUDAGraphMode.FULL
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(module, "zmq_ctx", socket))
        stack.enter_context(mock.patch("torch.distributed.all_reduce", lambda *args, **kwargs: None))
        if hasattr(module, "get_forward_context"):  # 0.34 awaits every read whatever the mode
            stack.enter_context(mock.patch.object(module, "get_forward_context", lambda: types.SimpleNamespace(cudagraph_runtime_mode=full)))
        yield decode


def play(cls: type, sender: End, receiver: End, sent: list[int], received: list[int]) -> Record:
    """The decode worker (the receiver) reads the prefill worker's blocks `sent` into its blocks `received` in READ mode,
    through its own `start_load_kv`; the recording engines move the bytes. The record compares the receiver's views with
    the sender's (`nixl.compare_ends`)."""
    module = importlib.import_module(cls.__module__)
    listen = vars(cls)["_moriio_handshake_listener"].__func__  # vLLM's own listener, kept before `stand_ins` replaces it
    sender = dataclasses.replace(sender, walk=rehomed(sender.walk))
    receiver = dataclasses.replace(receiver, walk=rehomed(receiver.walk))
    nixl.fill(sender.walk, 1)
    nixl.fill(receiver.walk, 2)
    before = [raw.clone() for raw in receiver.walk.raw]
    producer, served = build(cls, sender, "kv_producer", read_mode=True)
    try:
        consumer, _ = build(cls, receiver, "kv_consumer", read_mode=True)
    except BaseException:
        shut(producer)
        raise
    try:
        with stand_ins(receiver, "kv_consumer", True), side_channel(module, listen, served) as socket:
            statuses = pull(module, consumer, producer, sender, sent, received)
    finally:
        shut(consumer)
        shut(producer)
    gaps = producer.moriio_engine.gaps + consumer.moriio_engine.gaps + socket.gaps
    if gaps:
        raise StandInGap(gaps[0])
    moves = consumer.moriio_engine.transfers
    refused = [{"local": m["local"], "remote": m["remote"]} for m in moves if not m["moved"]]
    record: Record = {"moved": sum(1 for m in moves if m["moved"]), "refused": refused[:5], "sent": list(sent),
                      "received": list(received), "failed": [], "finished": bool(statuses) and all(s.Succeeded() for s in statuses),
                      "receiver": nixl.to_dict(receiver.walk.case), "receiver_buffers": len(receiver.walk.raw)}
    record.update(nixl.compare_ends(sender, receiver, sent, received, before))
    return record


def pull(module: types.ModuleType, consumer: Any, producer: Any, sender: End, sent: list[int], received: list[int]) -> list[Any]:
    """The decode worker's `start_load_kv` for one request whose KV the prefill worker holds in blocks `sent` (its
    handshake, sessions and reads); returns the statuses of the reads it posted."""
    metadata = module.MoRIIOConnectorMetadata()
    metadata.add_new_req("kvfuzz-req", per_group(consumer, received), {
        "transfer_id": TRANSFER_ID, "remote_engine_id": producer.engine_id, "remote_block_ids": per_group(consumer, sent),
        "remote_host": "kvfuzz-prefill", "remote_handshake_port": producer.moriio_config.handshake_port,
        "remote_notify_port": producer.moriio_config.notify_port, "remote_tp_size": sender.tp_size, "remote_dp_size": 1})
    metadata.transfer_id_to_request_id = {TRANSFER_ID: "kvfuzz-req"}
    consumer.start_load_kv(metadata)
    posted = consumer._recving_transfers.get("kvfuzz-req", {}).values()  # per layer: a status (0.29 - 0.30) or a list (0.31+)
    return [status for layer in posted for status in (layer if isinstance(layer, list | tuple) else [layer])]


def per_group(worker: Any, blocks: list[int]) -> list[Any]:
    """A request's block ids as the worker reads them: one list per transfer group (0.30+), or one list (0.29)."""
    groups = getattr(worker, "layer_to_group", None)
    if groups is None:
        return list(blocks)
    return [list(blocks) for _ in range(max(groups.values(), default=0) + 1)]


def played(cls: type, sender: End, receiver: End, sent: list[int], received: list[int]) -> Record:
    """MoRI-IO's `play` as a check's record (`nixl.as_record`)."""
    return nixl.as_record(play, f"{cls.__module__}.{cls.__name__}.start_load_kv", cls, sender, receiver, sent, received)


# ------------------------------------------------------------------------------------------- the check


def undriven(case: Case) -> str | None:
    """Why kvfuzz does not drive MoRI-IO on the case, where it does not."""
    if not case.groups:
        return "a model without KV-cache layers has nothing for MoRI-IO to register"
    if any(group.spec.kind == "mamba" for group in case.groups):
        # Hybrid models move each mamba layer's conv and SSM slot in READ mode (_compute_mamba_transfer_offsets), under
        # the dim-first conv layout; kvfuzz does not state those yet.
        return "kvfuzz drives MoRI-IO's attention regions; a mamba layer's conv and SSM state transfer is not driven yet"
    return None



class MoriioCheck(TouchCheck):
    """MoRI-IO's register_kv_caches at its transport (see the module's doc)."""

    name = "moriio"
    # Not drawn into campaigns until its generated-case runs on 0.32 and 0.34 are triaged (its report; FINDINGS.md).
    drawn = False
    setting = "--kv-transfer-config '{\"kv_connector\": \"MoRIIOConnector\", \"kv_role\": \"kv_both\"}'"
    reads_buffers = False  # registration reads no byte of the caches (a played transfer fills both ends itself)
    kinds = {**nixl.NixlCheck.kinds,
             "transfer-unregistered": "a transfer connector registers memory with its transport outside the KV-cache buffers"}

    def offer(self, probe: Any) -> Run | Off | None:
        module = worker_module()
        cls = getattr(module, "MoRIIOConnectorWorker", None)
        if module is None or cls is None:
            return None
        missing = [part for part in WORKER_PARTS if not hasattr(cls, part)]
        if missing:
            return Off(f"{cls.__module__}.{cls.__name__} has no {', '.join(missing)}, by which kvfuzz reads its regions and spans")
        from fuzz.targets import consumers  # torch and vLLM: the worker's, never the coordinator's

        where = f"{cls.__module__}.{cls.__name__}.register_kv_caches"

        def run(walk: Any, touches: Any) -> Record:
            reason = self.unrealistic(walk.case) or undriven(walk.case)
            if reason is not None:
                raise Unusable(reason)
            return {**registration(cls, walk, where), "played": nixl.with_peer(cls, walk, played)}

        return consumers.consumer_run("transfer", where, consumers.runners_calling(r"\bregister_kv_caches\("), run)

    def unrealistic(self, case: Case) -> str | None:
        if case.platform != "rocm":
            # The mori package drives AMD GPUs (XGMI, RDMA from ROCm memory), and vLLM pads the backing for it only there
            # (0.29+ allocate_kv_cache: "Pad to the page granularity MoRIIO needs ... Other platforms keep the exact-size
            # allocation"; oracles/contract.py backing_allocation_bytes).
            return "MoRI-IO runs on ROCm"
        if any(group.spec.kind == "encoder_only" for group in case.groups):
            # EncoderOnlyAttentionSpec: "Encoder-only layers do not need KV cache"; the model runner adds them to its own copy
            # of the config after the connector is built (GPUModelRunner.may_add_encoder_only_layers_to_kv_cache_config).
            return "encoder-only layers keep no KV cache for a connector to move"
        if case.packing == "cross_layers":
            return "MoRI-IO asks for no cross-layer blocks"
        if case.layout[0] != "B" and any(group.spec.compress_ratio > 1 for group in case.groups):
            return "a model with compressed caches runs in a block-outermost layout (its indexer's backend supports no other)"
        return None

    def judge(self, judging: Judging, record: Record) -> Finding | None:
        case, expected = judging.case, judging.expected
        if "skipped" in record or expected is None:
            return None
        function = record["where"].rsplit(".", 1)[-1]
        if "error" in record:
            error = record["error"]
            if record.get("handshake"):
                if error["type"] in PLAY_REFUSALS:
                    return None
                kind = "assert-on-invalid" if error["type"] == "AssertionError" else "crash-on-valid"
            else:
                kind = "refused-valid" if error["type"] in nixl.REFUSALS else "crash-on-valid"
            return observed(case, kind, error.get("function") or function, f"{record['where']}: {error['type']}: {error['message']}")
        if "moved" in record:
            return nixl.judge_played(judging, record, function)
        stray = unregistered(record)
        if stray is not None:
            return observed(case, "transfer-unregistered", function, f"{record['where']} {stray}")
        problem = transfer.check(case, expected, descriptors_of(record, nixl.buffer_map(judging)), record["ratio"],
                                 [region["name"] for region in record["regions"]])
        if problem is None:
            played_record = record.get("played") or {"skipped": "no transfer played"}
            return None if "skipped" in played_record else self.judge(judging, played_record)
        region = record["regions"][problem.region]["name"] if problem.region >= 0 else None
        owner = f"the span of {region}, block {problem.kernel_block}" if region else "a block"
        kind = "transfer-overlap" if problem.kind == "overlap" else "transfer-mismatch"
        return observed(case, kind, "_compute_block_transfer_offsets", f"{record['where']}: {owner} {problem.message}", region)


CHECK = MoriioCheck()
