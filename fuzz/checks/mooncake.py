"""The Mooncake connector at its transport: vLLM's own Mooncake worker registers the walk's caches with a recording
stand-in for Mooncake's TransferEngine, and each layer's per-block transfer span is held against the bytes its block owns.

What runs is vLLM's: `MooncakeConnectorWorker` (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py),
built by its own constructor, and its `register_kv_caches` on the runner's caches (manager views, KV-sharing layers mapped
to their target's), which works out each registered region's base address, block stride (`block_len_per_layer`) and
transfer length (`kv_block_len_per_layer`), and registers the memory with `batch_register_memory`. Mooncake moves block
b of a region as the bytes [base + b * block_len, + kv_block_len) (`_build_transfer_params`), kernel block ids where a
manager block is several kernel blocks. What is stood in is outside that code:

- the `mooncake` package's `TransferEngine` (not installed; vLLM binds None to the name when it is missing): a recording
  engine that keeps the memory it is given and the transfers it is asked for, and copies, in memory, only between
  registered ranges of two recording engines;
- the tensor-parallel and pipeline groups, the host's address, the accelerator's device index, the model's description
  (fuzz/checks/nixl.py's `ModelStandIn`) and the connector's settings (a KVTransferConfig for MooncakeConnector);
- the network: the prefill side's listener (a ZMQ side channel and an HTTP registration with the bootstrap server), the
  bootstrap query (the decode side is told the prefill worker's address), and the decode side's ZMQ socket, which hands
  the encoded pull request to the prefill worker's own `send_kv_to_decode` and returns its encoded answers.

The judgement (oracles/transfer.py, as for NIXL): every registered range lies inside the case's buffers
(`transfer-unregistered`), each region's span of kernel block k covers exactly that block's bytes of its layers' views (the
block's own padding aside: `transfer-mismatch`), and no two spans share a byte (`transfer-overlap`).

A played transfer: the case (the prefill side) pushes its blocks into a peer (`nixl.peer_of`: the same case, a decode of
twice the TP, or of larger blocks), the decode side pulling them through vLLM's own request path (`start_load_kv` on both
sides, the decode's `MooncakeXferMetadata` of its registration, the prefill's `send_kv_to_decode` and
`batch_transfer_sync_write`), judged as NIXL's (`nixl.judge_played`): the receiver holds the sender's K and V, and nothing
else of it changed. A pull vLLM answers with an error is its refusal, never a finding.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ctypes
import functools
import importlib
import inspect
import itertools
import re
import time
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

WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"
# A vLLM attention module name with one layer index, as extract_layer_index reads it ("model.layers.3.self_attn.attn").
LAYER_INDEX = re.compile(r"(?:[A-Za-z_]\w*\.)*\d+(?:\.[A-Za-z_]\w*)*")
# What kvfuzz reads off a registered worker: the regions' bases, block strides and transfer lengths (0.29+).
REGION_FIELDS = ("kv_caches_base_addr", "block_len_per_layer", "kv_block_len_per_layer", "registered_layer_names",
                 "_physical_blocks_per_logical_kv_block")
PLAY_SECONDS = 20.0  # how long the decode side may take to report a pull finished
TRANSFER_ID = "kvfuzz-transfer"
# Before 0.32 the decode worker only logs a pull the prefill side answered with an error, and never finishes it.
NO_FAILED_PULLS = ("this release's decode worker reports no failed pull (no get_block_ids_with_load_errors): a pull vLLM "
                   "refuses cannot be told from one it lost, so no push is played")

ENGINES: weakref.WeakValueDictionary[str, RecordingEngine] = weakref.WeakValueDictionary()  # by session, "host:port"
_PORTS = itertools.count(17000)


class RecordingEngine:
    """Stands in for `mooncake.engine.TransferEngine`: keeps what it is given to register and to move; copies bytes only
    between ranges two recording engines registered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.port = next(_PORTS)
        self.session = ""
        self.registered: list[tuple[int, int]] = []
        self.transfers: list[dict[str, Any]] = []
        self.calls: list[str] = []
        self.gaps: list[str] = []

    @own_failures
    def initialize(self, hostname: str, *args: Any) -> int:
        self.calls.append("initialize")
        self.session = f"{hostname}:{self.port}"
        ENGINES[self.session] = self
        return 0

    @own_failures
    def get_rpc_port(self) -> int:
        return self.port

    @own_failures
    def batch_register_memory(self, addresses: list[int], lengths: list[int]) -> int:
        self.calls.append("batch_register_memory")
        self.registered += [(int(a), int(n)) for a, n in zip(addresses, lengths, strict=True)]
        return 0

    @own_failures
    def register_memory(self, address: int, length: int) -> int:
        self.calls.append("register_memory")
        self.registered.append((int(address), int(length)))
        return 0

    @own_failures
    def batch_unregister_memory(self, addresses: list[int]) -> int:
        self.calls.append("batch_unregister_memory")
        return 0

    @own_failures
    def unregister_memory(self, address: int) -> int:
        self.calls.append("unregister_memory")
        return 0

    @own_failures
    def batch_transfer_sync_write(self, session: str, sources: list[int], targets: list[int], lengths: list[int]) -> int:
        """Writes each source range into the peer's target range; a pair outside registered memory moves nothing and fails
        the batch (as the engine does: a nonzero return)."""
        self.calls.append("batch_transfer_sync_write")
        peer = ENGINES.get(session)
        if peer is None:
            raise StandInGap(f"no recording engine at session {session} to write to")
        fits = True
        for source, target, length in zip(sources, targets, lengths, strict=True):
            ok = self.holds(int(source), int(length)) and peer.holds(int(target), int(length))
            if ok:
                ctypes.memmove(int(target), int(source), int(length))
            self.transfers.append({"source": int(source), "target": int(target), "length": int(length), "moved": ok})
            fits &= ok
        return 0 if fits else -1

    @own_failures
    def transfer_sync_write(self, session: str, source: int, target: int, length: int) -> int:
        return self.batch_transfer_sync_write(session, [source], [target], [length])

    def holds(self, address: int, length: int) -> bool:
        return any(start <= address and address + length <= start + size for start, size in self.registered)

    def __getattr__(self, name: str) -> Any:
        gap = f"vLLM calls TransferEngine.{name}, which the recording engine does not stand in for"
        self.__dict__.setdefault("gaps", []).append(gap)
        raise StandInGap(gap)


class MooncakeModel(nixl.ModelStandIn):
    def __getattr__(self, name: str) -> Any:
        raise StandInGap(f"Mooncake's worker asks the model config for {name}, which kvfuzz's stand-in does not state")


def worker_module() -> types.ModuleType | None:
    try:
        return importlib.import_module(WORKER_MODULE)
    except ImportError:
        return None


@contextlib.contextmanager
def stand_ins(module: types.ModuleType, end: End, role: str) -> Iterator[list[str]]:
    """Everything outside the code under test, stood in while a worker is built and registers (see the module's doc)."""
    import torch

    from fuzz.targets import consumers

    walk = end.walk
    config = walk.vllm_config
    transfer_config = importlib.import_module("vllm.config").KVTransferConfig(
        kv_connector="MooncakeConnector", kv_role=role, engine_id=f"kvfuzz-{uuid.uuid4().hex[:8]}",
        kv_connector_extra_config={"num_workers": 1})
    replaced = [f"{module.__name__}.TransferEngine (mooncake.engine.TransferEngine)"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(module, "TransferEngine", RecordingEngine, create=True))
        answers = {"get_tensor_model_parallel_rank": lambda: end.tp_rank, "get_tensor_model_parallel_world_size": lambda: end.tp_size,
                   "get_pp_group": lambda: types.SimpleNamespace(rank_in_group=0, world_size=1), "get_ip": lambda: "127.0.0.1",
                   "should_launch_bootstrap_server": lambda *args: False}
        for name, answer in answers.items():
            if hasattr(module, name):
                stack.enter_context(mock.patch.object(module, name, answer))
        stack.enter_context(mock.patch.object(module.current_platform, "set_device", lambda *args: None))
        if hasattr(torch, "accelerator"):
            stack.enter_context(mock.patch.object(torch.accelerator, "current_device_index", lambda: 0))
        stack.enter_context(nixl._attribute(config, "kv_transfer_config", transfer_config))
        if hasattr(config.cache_config, "kv_cache_layout"):
            stack.enter_context(nixl._attribute(config.cache_config, "kv_cache_layout", walk.case.layout))
        cache_dtype = next((g.spec.cache_dtype for g in walk.case.groups if g.spec.kind != "mamba"), "auto")
        stack.enter_context(nixl._attribute(config.cache_config, "cache_dtype", cache_dtype))
        # The user's --block-size, which the worker reads as the manager's block size (the walk's config holds another case's).
        stack.enter_context(nixl._attribute(config.cache_config, "block_size", nixl.tokens_per_block(walk)))
        stack.enter_context(nixl._attribute(config, "model_config", MooncakeModel(walk.case, end.tp_size, end.kv_heads)))
        stack.enter_context(consumers.layers_in_config(walk))
        stack.enter_context(forward_context_as(config, vllm_names(walk.case)))
        yield replaced


def shut(worker: Any) -> None:
    """Stops what the worker started (its event loops' threads, its sender pool, its ZMQ context), whatever it got to."""
    executor = getattr(worker, "_sender_executor", None)
    if executor is not None:
        executor.shutdown(wait=True)
    for loop_name, thread_name in (("sender_loop", "_sender_listener_t"), ("receiver_loop", "_mooncake_receiver_t")):
        loop, thread = getattr(worker, loop_name, None), getattr(worker, thread_name, None)
        if loop is not None and thread is not None and thread.is_alive():
            asyncio.run_coroutine_threadsafe(_cancel_others(), loop).result(timeout=10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
        if loop is not None and not loop.is_running():
            loop.close()
    context = getattr(worker, "async_zmq_ctx", None)
    if context is not None:
        context.term()
    worker.shutdown = lambda: None  # its __del__ shuts it down again: nothing is left to stop


def vllm_names(case: Case) -> dict[str, str]:
    """The case's layers under the names vLLM gives attention modules, one layer index each: Mooncake's worker reads the
    index from the name (extract_layer_index). A case already named so keeps its names."""
    names = [*case.layer_names, *(sharer for sharer, _ in case.kv_sharing if sharer not in case.layer_names)]
    if all(LAYER_INDEX.fullmatch(name) for name in names):
        return {name: name for name in names}
    return {name: f"model.layers.{index}.self_attn.attn" for index, name in enumerate(names)}


def renamed_config(config: Any, names: dict[str, str]) -> Any:
    """A copy of the runner's KVCacheConfig with its layers under `names`: groups, tensors and per-layer specs."""
    copied = copy.deepcopy(config)
    for group in copied.kv_cache_groups:
        group.layer_names = [names.get(name, name) for name in group.layer_names]
        specs = getattr(group.kv_cache_spec, "kv_cache_specs", None)
        if isinstance(specs, dict):
            renamed = {names.get(name, name): spec for name, spec in specs.items()}
            specs.clear()
            specs.update(renamed)
    for tensor in copied.kv_cache_tensors:
        for field in ("layers", "shared_by"):  # 0.31+ names a tensor's layers `layers`
            if hasattr(tensor, field):
                setattr(tensor, field, [names.get(name, name) for name in getattr(tensor, field)])
    for attribute, value in vars(type(copied)).items():  # what the config derived from the old names, derived again
        if isinstance(value, functools.cached_property):
            copied.__dict__.pop(attribute, None)
    return copied


@contextlib.contextmanager
def forward_context_as(config: Any, names: dict[str, str]) -> Iterator[None]:
    """The config's layers (vLLM's and kvfuzz's stand-ins) also under their vLLM names, while a worker looks them up."""
    context = config.compilation_config.static_forward_context
    added = [new for old, new in names.items() if new != old and old in context and new not in context]
    for old, new in names.items():
        if new in added:
            context[new] = context[old]
    try:
        yield
    finally:
        for new in added:
            context.pop(new, None)


def build(cls: type, module: types.ModuleType, end: End, role: str) -> Any:
    """vLLM's worker for `role`, built and registered on the end's caches under the stand-ins, its layers under vLLM's
    names (`vllm_names`); the caller shuts it."""
    from fuzz.targets.consumers import with_sharers

    names = vllm_names(end.walk.case)
    caches = {names.get(name, name): cache for name, cache in with_sharers(end.walk).items()}
    with stand_ins(module, end, role):
        worker = cls.__new__(cls)
        try:
            cls.__init__(worker, end.walk.vllm_config, end.walk.vllm_config.kv_transfer_config.engine_id,
                         renamed_config(end.walk.config, names))
            if role != "kv_consumer":
                worker._mooncake_sender_listener = _listening  # the side channel and the bootstrap registration: network
            worker.register_kv_caches(caches)
        except BaseException:
            shut(worker)
            raise
    return worker


async def _listening(ready: Any) -> None:
    ready.set()


async def _cancel_others() -> None:
    """Cancels every other task of the running loop (a pull left waiting) and lets them finish."""
    mine = asyncio.current_task()
    others = [task for task in asyncio.all_tasks() if task is not mine]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


# ------------------------------------------------------------------------------------------- the registration


def registration(cls: type, module: types.ModuleType, walk: Any, where: str) -> Record:
    worker = build(cls, module, End(walk), "kv_consumer")
    shut(worker)
    engine = worker.engine
    if engine.gaps:
        raise StandInGap(engine.gaps[0])
    missing = [name for name in REGION_FIELDS if not hasattr(worker, name)]
    if missing:
        raise Unusable(f"{where}: this release's worker keeps no {', '.join(missing)}, by which kvfuzz reads its regions")
    ratio = int(worker._physical_blocks_per_logical_kv_block)
    blocks = walk.case.num_blocks * ratio
    case_name = {new: old for old, new in vllm_names(walk.case).items()}
    regions = [{"name": case_name.get(name, name), "base": int(base), "stride": int(stride), "length": int(length), "blocks": blocks}
               for base, stride, length, name in zip(worker.kv_caches_base_addr, worker.block_len_per_layer,
                                                     worker.kv_block_len_per_layer, worker.registered_layer_names, strict=True)]
    rows = np.array([[r["base"] + k * r["stride"], r["length"], 0] for r in regions for k in range(blocks)], dtype=np.uint64)
    registered = np.array([[address, length, 0] for address, length in engine.registered], dtype=np.uint64).reshape(-1, 3)
    return {"where": where, "ratio": ratio, "regions": regions, "descriptors": nixl.located(walk, rows.reshape(-1, 3)),
            "registered": nixl.located(walk, registered), "buffer_bytes": [int(raw.untyped_storage().nbytes()) for raw in walk.raw],
            "calls": sorted(set(engine.calls))}


def outside(record: Record) -> str | None:
    """A registered range that is not inside one of the case's buffers, described."""
    for buffer, start, end in record["registered"]:
        if buffer < 0 or end > record["buffer_bytes"][buffer]:
            where = f"at address {start}" if buffer < 0 else f"at byte {start} of buffer {buffer} ({record['buffer_bytes'][buffer]} bytes)"
            return f"registers {end - start} bytes {where}, outside the KV-cache buffers"
    return None


# ------------------------------------------------------------------------------------------- a played transfer


class DecodeSocket:
    """Stands in for the decode side's ZMQ socket to a prefill worker: the encoded pull request goes to that worker's own
    `send_kv_to_decode` (as its listener hands it over), whose encoded answers come back one `recv` at a time."""

    def __init__(self, producer: Any) -> None:
        self.producer = producer
        self.answers: list[bytes] = []
        self.gaps: list[str] = []

    def __enter__(self) -> DecodeSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def setsockopt(self, *args: Any) -> None:
        pass

    async def send(self, message: bytes) -> None:
        done = asyncio.run_coroutine_threadsafe(self._serve(bytes(message)), self.producer.sender_loop)
        await asyncio.wrap_future(done)

    async def recv(self) -> bytes:
        if not self.answers:
            gap = "the decode side waits for an answer the prefill worker never sent"
            self.gaps.append(gap)
            raise StandInGap(gap)
        return self.answers.pop(0)

    async def _serve(self, message: bytes) -> None:
        """What the prefill worker's sender task does with one request: decode it and serve it, an error answered."""
        producer, socket = self.producer, PrefillSocket(self.answers)
        try:
            await producer.send_kv_to_decode(b"kvfuzz-decode", socket, producer._xfer_meta_decoder.decode(message))
        except Exception as error:  # noqa: BLE001 - vLLM's _sender_worker answers any failure with an error response
            response = importlib.import_module(type(producer).__module__).MooncakeXferResponse
            status = importlib.import_module(type(producer).__module__).MooncakeXferResponseStatus.ERROR
            self.answers.append(producer._encoder.encode(response(status=status, err_msg=f"{type(error).__name__}: {error}")))


class PrefillSocket:
    """The prefill worker's side of the channel: what it sends to the decode identity is queued for its `recv`."""

    def __init__(self, answers: list[bytes]) -> None:
        self.answers = answers

    async def send_multipart(self, parts: Any) -> None:
        self.answers.append(bytes(list(parts)[-1]))


def play(cls: type, sender: End, receiver: End, sent: list[int], received: list[int]) -> Record:
    """The case's prefill worker pushes blocks `sent` into the decode worker's blocks `received`, each side driven through
    its own `start_load_kv`; the recording engines move the bytes. The record compares the receiver's views with the
    sender's (`nixl.compare_ends`)."""
    module = importlib.import_module(cls.__module__)
    nixl.fill(sender.walk, 1)
    nixl.fill(receiver.walk, 2)
    before = [raw.clone() for raw in receiver.walk.raw]
    producer = build(cls, module, sender, "kv_producer")
    try:
        consumer = build(cls, module, receiver, "kv_consumer")
    except BaseException:
        shut(producer)
        raise
    socket = DecodeSocket(producer)
    try:
        with stand_ins(module, receiver, "kv_consumer"), mock.patch.object(module, "make_zmq_socket", lambda *args, **kwargs: socket):
            failed, finished = pull(module, producer, consumer, sender, sent, received)
    finally:
        shut(consumer)
        shut(producer)
    gaps = producer.engine.gaps + consumer.engine.gaps + socket.gaps
    if gaps:
        raise StandInGap(gaps[0])
    moves = producer.engine.transfers
    refused = [{"local": [m["source"], m["length"]], "remote": [m["target"], m["length"]]} for m in moves if not m["moved"]]
    record: Record = {"moved": sum(1 for m in moves if m["moved"]), "refused": refused[:5],
                      "sent": list(sent), "received": list(received), "failed": failed, "finished": finished,
                      "receiver": nixl.to_dict(receiver.walk.case), "receiver_buffers": len(receiver.walk.raw)}
    if not failed:
        record.update(nixl.compare_ends(sender, receiver, sent, received, before))
    return record


def pull(module: types.ModuleType, producer: Any, consumer: Any, sender: End, sent: list[int], received: list[int]) -> tuple[list[str], bool]:
    """Both sides' `start_load_kv`: the prefill's request to send, then the decode's pull (the bootstrap server's answer, the
    prefill worker's address, put where its query leaves it). Returns the failures the decode side reported and whether it
    reported the pull finished."""
    groups = len(consumer.kv_cache_config.kv_cache_groups)
    # The scheduler's two steps: the request allocated (no blocks yet: update_state_after_alloc), then finished with its blocks.
    for blocks in ([], [list(sent) for _ in range(groups)]):
        outgoing = module.MooncakeConnectorMetadata()
        outgoing.add_new_req("kvfuzz-prefill", blocks, {"transfer_id": TRANSFER_ID}, load_remote_cache=False)
        producer.start_load_kv(outgoing)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), producer.sender_loop).result(timeout=PLAY_SECONDS)  # it ran: FIFO
    waiting = producer.reqs_need_send.get(TRANSFER_ID)
    if waiting is None or not waiting.ready.is_set():
        raise StandInGap("the prefill worker did not take kvfuzz's request to send as ready (its record_send_reqs changed)")
    consumer._remote_agents[producer.engine_id] = {sender.tp_rank: {0: "tcp://kvfuzz-prefill:0"}}
    consumer._tp_size[producer.engine_id] = sender.tp_size
    incoming = module.MooncakeConnectorMetadata()
    incoming.add_new_req("kvfuzz-req", [list(received) for _ in range(groups)],
                         {"transfer_id": TRANSFER_ID, "remote_engine_id": producer.engine_id, "remote_bootstrap_addr": "http://kvfuzz-bootstrap"})
    consumer.start_load_kv(incoming)
    deadline = time.monotonic() + PLAY_SECONDS
    finished = False
    while not finished and time.monotonic() < deadline:
        finished = "kvfuzz-req" in (consumer.get_finished()[1] or ())
        time.sleep(0.01)
    failed = [f"load errors in blocks {sorted(errors)}" for errors in [consumer.get_block_ids_with_load_errors()] if errors]
    if hasattr(consumer, "_failed_recv_reqs"):  # 0.32+: a hybrid model's failures, by request
        failed += [str(req) for req in nixl._drained(consumer._failed_recv_reqs)]
    if not finished:
        failed.append(f"the pull did not finish within {PLAY_SECONDS:.0f} s")
    return failed, finished


def played(cls: type, sender: End, receiver: End, sent: list[int], received: list[int]) -> Record:
    """Mooncake's `play` as a check's record (`nixl.as_record`)."""
    return nixl.as_record(play, f"{cls.__module__}.{cls.__name__}.send_kv_to_decode", cls, sender, receiver, sent, received)


# ------------------------------------------------------------------------------------------- the check


class MooncakeCheck(TouchCheck):
    """Mooncake's register_kv_caches at its transport, and a played push (see the module's doc)."""

    name = "mooncake"
    drawn = True
    setting = "--kv-transfer-config '{\"kv_connector\": \"MooncakeConnector\", \"kv_role\": \"kv_both\"}'"
    required_layout = "LBHNC"  # its get_required_kvcache_layout for attention models (0.29+): vLLM takes it when the backends accept it
    reads_buffers = False  # registration reads no byte of the caches (a played transfer fills both ends itself)
    kinds = {**nixl.NixlCheck.kinds,
             "transfer-unregistered": "a transfer connector registers memory with its transport outside the KV-cache buffers"}

    def offer(self, probe: Any) -> Run | Off | None:
        module = worker_module()
        cls = getattr(module, "MooncakeConnectorWorker", None)
        if module is None or cls is None:
            return None
        source = inspect.getsource(cls)
        if "region_caches" not in source or "self.kv_block_len_per_layer" not in source:
            return Off(f"{cls.__module__}.{cls.__name__} registers K and V as caches of their own (its registration before "
                       "0.29); kvfuzz drives Mooncake from the one-page-per-layer registration of 0.29+, and has not triaged the older one")
        from fuzz.targets import consumers  # torch and vLLM: the worker's, never the coordinator's

        where = f"{cls.__module__}.{cls.__name__}.register_kv_caches"
        reports_failed_pulls = hasattr(cls, "get_block_ids_with_load_errors")

        def run(walk: Any, touches: Any) -> Record:
            reason = self.unrealistic(walk.case)
            if reason is not None:
                raise Unusable(reason)
            record = registration(cls, module, walk, where)
            return {**record, "played": nixl.with_peer(cls, walk, played) if reports_failed_pulls else {"skipped": NO_FAILED_PULLS}}

        return consumers.consumer_run("transfer", where, consumers.runners_calling(r"\bregister_kv_caches\("), run)

    def unrealistic(self, case: Case) -> str | None:
        reason = nixl.CHECK.unrealistic(case)  # the same attention kinds, layouts and one backend per model as NIXL
        return None if reason is None else reason.replace("NIXL", "Mooncake")

    def judge(self, judging: Judging, record: Record) -> Finding | None:
        case, expected = judging.case, judging.expected
        if "skipped" in record or expected is None:
            return None
        function = record["where"].rsplit(".", 1)[-1]
        if "error" in record:
            error = record["error"]
            if record.get("handshake"):
                if error["type"] in nixl.HANDSHAKE_REFUSALS:
                    return None
                kind = "assert-on-invalid" if error["type"] == "AssertionError" else "crash-on-valid"
            elif not transfer.block_is_one_run(case.layout):
                return None  # it moves one span per block and layer, so it must refuse blocks that are not one run of bytes
            else:
                kind = "refused-valid" if error["type"] in nixl.REFUSALS else "crash-on-valid"
            return observed(case, kind, error.get("function") or function, f"{record['where']}: {error['type']}: {error['message']}")
        if "moved" in record:
            return nixl.judge_played(judging, record, function)
        stray = outside(record)
        if stray is not None:
            return observed(case, "transfer-unregistered", function, f"{record['where']} {stray}")
        problem = transfer.check(case, expected, nixl.descriptors_of(record, nixl.buffer_map(judging)), record["ratio"],
                                 [region["name"] for region in record["regions"]])
        if problem is None:
            played_record = record.get("played") or {"skipped": "no transfer played"}
            return None if "skipped" in played_record else self.judge(judging, played_record)
        region = record["regions"][problem.region] if problem.region >= 0 else None
        owner = (f"the span of region {problem.region} ({region['name']}: stride {region['stride']}, length {region['length']}), "
                 f"kernel block {problem.kernel_block}") if region else "a block"
        kind = "transfer-overlap" if problem.kind == "overlap" else "transfer-mismatch"
        return observed(case, kind, function, f"{record['where']}: {owner} {problem.message}", region["name"] if region else None)


CHECK = MooncakeCheck()
