"""A campaign across machines: the local pool's interface, backed by Ray actors on a cluster's nodes.

Each fuzzing actor runs in its own process on its node and owns a local `fuzz.pool.Pool` with one
worker (a zygote plus one fork), so a target that segfaults, hangs or eats memory is caught on the
node exactly as on one machine and comes back as a `Loss` event. An actor call relays one stretch of
a FUZZ batch: it returns the worker's messages once the batch ends, a worker is lost, or a FINDING
arrives; after a finding the actor waits for `ack`, so every finding is on the coordinator's disk
before that worker runs its next case.

The driver stays the single coordinator. Campaign workers are logical: worker i's batches run on
its home actor i while that actor lives. An actor that dies (its node is lost, its process killed)
is not a finding: the batch it held is queued again whole and taken by the next free live actor,
Ray restarts the dead actor somewhere, and once it answers again it takes back its own worker.

The target's vLLM is resolved once on the driver; a release or checkout is packed into a tar that a
depot actor on the driver's node hands out through Ray's object store (each node unpacks it once),
and kvfuzz's own packages travel as the job's py_modules, so every node fuzzes the same vLLM with
the same kvfuzz and needs neither a package index nor kvfuzz installed. Ray is optional: this
module imports without it, and `open_ray_pool` says how to install it.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import logging
import os
import shutil
import socket
import tarfile
import tempfile
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import fuzz
import oracles
from fuzz import protocol
from fuzz.case import Case, to_dict
from fuzz.errors import TargetError, UsageError
from fuzz.pool import Loss, Message, Pool
from fuzz.releases import TargetSource
from fuzz.targets.base import Execution, TargetInfo

START_TIMEOUT = 300.0  # seconds for every actor to start and load the target
LOST_TIMEOUT = 300.0  # seconds without any live fuzzing actor before the campaign gives up
RECHECK_S = 1.0  # how often a lost actor is asked whether Ray has restarted it
MAX_ATTEMPTS = 3  # actor deaths one batch may cause before it is taken for the culprit
RELAY_POLL_S = 0.2
INSTALL_HINT = "--ray needs Ray: pip install 'kvfuzz[ray]' (or pip install ray)"
_EXCLUDES = ["__pycache__", "*.pyc"]


# ---------------------------------------------------------------------------------------- the node side


class NodeRelay:
    """A Ray actor's body: one local Pool (zygote + one worker) on this node, driven call by call."""

    def __init__(self, source: dict[str, Any], depot: str | None, case_timeout: float, max_memory: int) -> None:
        import ray

        self.error: str | None = None
        self.awaiting_ack = False
        self.pool: Pool | None = None
        self.target_path = ""
        try:
            python_path = unpack_target(ray.get(ray.get_actor(depot).fetch.remote())) if depot is not None else None
            self.target_path = str(python_path or "")
            local = TargetSource(source["spec"], source["kind"], source["version"], python_path)
            self.pool = Pool(local, workers=1, case_timeout=case_timeout, max_memory=max_memory)
        except Exception as error:  # noqa: BLE001 - hello() reports it; a raising constructor would only be restarted
            self.error = f"{type(error).__name__}: {error}".splitlines()[0][:400]

    def hello(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        answer = {"node": context.get_node_id(), "address": ray.util.get_node_ip_address(), "pid": os.getpid(),
                  "kvfuzz": str(Path(__file__).resolve().parent), "target_path": self.target_path}
        if self.pool is None or self.pool.info is None:
            return {**answer, "error": self.error or "the target did not load"}
        return {**answer, "info": self.pool.info.to_dict(), "restarts": self.pool.restarts}

    def run_batch(self, task: dict[str, Any]) -> dict[str, Any]:
        assert self.pool is not None
        if self.awaiting_ack:  # a conversation the driver gave up on (it thought this actor lost)
            self._reset_worker()
        self.pool.start_batch(0, task)
        return self._until_stop()

    def ack(self) -> dict[str, Any]:
        assert self.pool is not None
        if not self.awaiting_ack:  # restarted since the finding was sent: the batch is gone with the old process
            return {"events": [], "restarts": self.pool.restarts, "reset": True}
        self.awaiting_ack = False
        self.pool.ack(0)
        return self._until_stop()

    def execute(self, case: dict[str, Any], device: str, probe: bool) -> dict[str, Any]:
        from fuzz.case import from_dict

        assert self.pool is not None
        execution = self.pool.execute(from_dict(case), device, probe=probe)
        return {"execution": execution.to_dict(), "restarts": self.pool.restarts}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def _until_stop(self) -> dict[str, Any]:
        """Relay the worker's messages until its batch ends, it is lost, or it waits for an ack."""
        assert self.pool is not None
        events: list[dict[str, Any]] = []
        while True:
            messages, losses = self.pool.poll(RELAY_POLL_S)
            events += [{"message": name, "payload": payload} for _, name, payload in messages]
            events += [{"loss": dataclasses.asdict(loss)} for loss in losses]
            self.awaiting_ack = any(name == protocol.FINDING for _, name, _ in messages)
            if losses or self.awaiting_ack or any(name == protocol.BATCH for _, name, _ in messages):
                return {"events": events, "restarts": self.pool.restarts, "reset": False}

    def _reset_worker(self) -> None:
        assert self.pool is not None
        handle = self.pool.workers[0]
        self.pool._kill(handle, "reset")
        while not self.pool.poll(RELAY_POLL_S)[1]:
            pass
        self.awaiting_ack = False


class TargetDepot:
    """A Ray actor on the driver's node that hands the packed vLLM to every relay that (re)starts.

    Relays look it up by name: an ObjectRef or actor handle among a restartable actor's constructor
    arguments makes Ray warn that a restart may not find it again (ray-project/ray#53727)."""

    def __init__(self, archive: bytes) -> None:
        self.archive = archive

    def fetch(self) -> bytes:
        return self.archive


def pack_target(source: TargetSource) -> bytes | None:
    """The source's `vllm/` package as a gzipped tar (None for the nodes' installed vLLM)."""
    if source.python_path is None:
        return None
    buffer = io.BytesIO()
    # No timestamp in the gzip header: the same tree packs to the same bytes, so nodes unpack it once.
    with gzip.GzipFile(fileobj=buffer, mode="wb", compresslevel=6, mtime=0) as packed, tarfile.open(fileobj=packed, mode="w") as archive:
        archive.add(source.python_path / "vllm", arcname="vllm", filter=_without_bytecode)
    return buffer.getvalue()


def _without_bytecode(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
    name = Path(member.name)
    return None if "__pycache__" in name.parts or name.suffix in (".pyc", ".pyo") else member


def unpack_target(archive: bytes) -> Path:
    """Unpack a shipped vLLM once per node (keyed by content), committed with one rename."""
    root = Path(tempfile.gettempdir()) / "kvfuzz-ray"
    entry = root / hashlib.sha256(archive).hexdigest()[:20]
    if (entry / "vllm" / "__init__.py").is_file():
        return entry
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=root))
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4 (and the security backports)
                tar.extractall(staging, filter="data")
            else:
                tar.extractall(staging)
        try:
            os.rename(staging, entry)
        except OSError:
            if not (entry / "vllm" / "__init__.py").is_file():  # not a lost race with another actor
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return entry


# ---------------------------------------------------------------------------------------- the driver side


@dataclass(frozen=True)
class Job:
    """One FUZZ task of a campaign worker; `attempts` counts the actors that died running it."""

    worker: int
    task: dict[str, Any]
    attempts: int = 0


@dataclass
class Member:
    """A fuzzing actor as the driver sees it."""

    number: int
    handle: Any
    node: str = ""
    address: str = ""
    alive: bool = False
    retired: bool = False  # dead for good, or serving a different vLLM
    call: Any = None  # ObjectRef of the call in flight
    calling: str = ""  # "fuzz" or "hello"
    job: Job | None = None  # the batch it holds (running, or waiting for an ack)
    seen_restarts: int = 0  # its local pool's restart count, as last reported
    checked: float = 0.0  # when it was last asked whether it is back


@dataclass
class NodeStats:
    address: str
    joined: float  # when its first actor answered (monotonic)
    left: float | None = None  # when its last live actor was lost
    cases: int = 0
    restarts: int = 0

    def rate(self, began: float | None, now: float) -> float:
        """Cases per second while the node took part in the campaign."""
        if began is None:
            return 0.0
        seconds = (self.left or now) - max(began, self.joined)
        return self.cases / seconds if seconds > 0 else 0.0


class RayPool:
    """The local Pool's campaign interface (info, source, restarts, fuzzers, start_batch, ack, poll,
    spare_target, close) over Ray actors; `nodes()` adds per-node progress."""

    def __init__(self, source: TargetSource, *, device: str = "cpu", workers: int | None = None, case_timeout: float = 60.0,
                 max_memory: int = 4 << 30, start_timeout: float = START_TIMEOUT, lost_timeout: float = LOST_TIMEOUT,
                 owns_ray: bool = False) -> None:
        self.source = source
        self.device = device
        self.lost_timeout = lost_timeout
        self.start_timeout = start_timeout
        self.owns_ray = owns_ray
        self.restarts = 0
        self.reruns = 0  # batches run again because the actor holding them was lost
        self.info: TargetInfo | None = None
        self.queue: deque[Job] = deque()
        self.node_stats: dict[str, NodeStats] = {}
        self.began: float | None = None
        self.none_alive_since: float | None = None
        self.members: list[Member] = []
        self._spare: Member | None = None
        self._depot: Any = None
        try:
            depot = self._ship(source)
            self._arguments = ({"spec": source.spec, "kind": source.kind, "version": source.version}, depot, case_timeout, max_memory)
            slots = _cluster_slots(device)
            count = workers or slots
            self.members = [Member(number, self._create(scheduling="SPREAD")) for number in range(count)]
            self._start(self.members)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ lifecycle

    def _ship(self, source: TargetSource) -> str | None:
        """Pack a release or checkout once, into a depot actor on this node; its name, or None for `installed`."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        archive = pack_target(source)
        if archive is None:
            return None
        name = f"kvfuzz-depot-{uuid.uuid4().hex}"
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._depot = ray.remote(TargetDepot).options(name=name, num_cpus=0, scheduling_strategy=here).remote(archive)
        return name

    def _create(self, *, scheduling: Any, spare: bool = False) -> Any:
        gpu = self.device.startswith("cuda")
        options: dict[str, Any] = {
            "num_cpus": 0 if spare else 1,
            "num_gpus": 0 if spare or not gpu else 1,  # a spare sees its node's GPUs without holding one
            "max_restarts": -1,
            "max_task_retries": 0,
            "scheduling_strategy": scheduling,
        }
        return _relay_class().options(**options).remote(*self._arguments)

    def _start(self, members: list[Member]) -> None:
        """Wait until every actor loaded the target; all must report the same vLLM."""
        import ray

        calls = {member.handle.hello.remote(): member for member in members}
        ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=self.start_timeout)
        if len(ready) < len(calls):
            raise TargetError(f"--vllm {self.source.spec}: only {len(ready)} of {len(calls)} Ray workers started within "
                              f"{self.start_timeout:.0f} s (the cluster offers {_resources_text()})")
        for ref in ready:
            try:
                hello = ray.get(ref)
            except ray.exceptions.RayError as error:
                raise TargetError(f"--vllm {self.source.spec}: a Ray worker failed to start: {_first_line(error)} (does the job ship "
                                  "kvfuzz? ray.init(runtime_env=fuzz.ray_pool.runtime_env()), or install kvfuzz on the nodes)") from None
            if "error" in hello:
                raise TargetError(f"--vllm {self.source.spec}: cannot load the target on node {hello['address']}: {hello['error']}")
            self._admit(calls[ref], hello)

    def _admit(self, member: Member, hello: dict[str, Any]) -> bool:
        """Take an actor's hello; False (and the actor retired) if it serves another vLLM."""
        info = TargetInfo.from_dict(hello["info"])
        if self.info is None:
            self.info = info
        elif info.to_dict() != self.info.to_dict():
            if not self.began:
                raise TargetError(f"--vllm {self.source.spec}: node {hello['address']} has vLLM {info.vllm_version} ({info.generation}), "
                                  f"other nodes {self.info.vllm_version} ({self.info.generation}): every node must fuzz the same vLLM")
            self._retire(member)
            return False
        member.node, member.address, member.alive = hello["node"], hello["address"], True
        member.seen_restarts = hello["restarts"]
        self.node_stats.setdefault(member.node, NodeStats(member.address, time.monotonic())).left = None
        return True

    def _retire(self, member: Member) -> None:
        import ray

        member.alive, member.retired = False, True
        ray.kill(member.handle, no_restart=True)
        self._note_departure(member.node)

    def _note_departure(self, node: str) -> None:
        stats = self.node_stats.get(node)
        if stats is not None and not any(m.alive and m.node == node for m in self.members):
            stats.left = time.monotonic()

    def close(self) -> None:
        import ray

        members = [m for m in [*self.members, self._spare] if m is not None and not m.retired]
        # Closing the local pools removes their folders; a lost actor's processes are gone with it.
        closing = [m.handle.close.remote() for m in members if m.alive]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=10)
        for handle in [m.handle for m in members] + ([self._depot] if self._depot is not None else []):
            ray.kill(handle, no_restart=True)
        self.members, self._spare, self._depot = [], None, None
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ what a campaign uses

    @property
    def workers(self) -> dict[int, Member]:
        return {member.number: member for member in self.members}

    def fuzzers(self) -> list[int]:
        return [member.number for member in self.members]

    def start_batch(self, worker: int, task: dict[str, Any]) -> None:
        if self.began is None:
            self.began = time.monotonic()
        self.queue.append(Job(worker, task))
        self._schedule()

    def ack(self, worker: int) -> None:
        """Let the actor holding `worker`'s batch go on: its finding is on disk."""
        member = next((m for m in self.members if m.job is not None and m.job.worker == worker and m.call is None), None)
        if member is not None:  # else its actor was lost meanwhile and the batch is queued to run again
            self._call(member, "fuzz", member.handle.ack.remote())

    def poll(self, timeout: float) -> tuple[list[Message], list[Loss]]:
        """Messages from finished actor calls within `timeout`, and workers lost on their nodes."""
        import ray

        self._recheck_lost()
        messages: list[Message] = []
        losses: list[Loss] = []
        calls = {member.call: member for member in self.members if member.call is not None}
        if calls:
            ready, _ = ray.wait(list(calls), num_returns=1, timeout=timeout)
            if ready:
                ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=0)
            for ref in ready:
                self._finish(calls[ref], ref, messages, losses)
        else:
            time.sleep(timeout)
        self._schedule()
        self._check_alive()
        return messages, losses

    def spare_target(self) -> RaySpareTarget:
        """A target on an actor of its own (on a fuzzing node, sharing its GPU), for cases that may kill it."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self._spare is None:
            home = next((m.node for m in self.members if m.alive), None)
            strategy = NodeAffinitySchedulingStrategy(home, soft=True) if home else "DEFAULT"
            spare = Member(-1, self._create(scheduling=strategy, spare=True))
            self._spare = spare
            hello = ray.get(spare.handle.hello.remote(), timeout=self.start_timeout)
            if "error" in hello:
                raise TargetError(f"--vllm {self.source.spec}: cannot load the target on node {hello['address']}: {hello['error']}")
            spare.node, spare.alive, spare.seen_restarts = hello["node"], True, hello["restarts"]
        assert self.info is not None
        return RaySpareTarget(self, self.info)

    def nodes(self) -> list[dict[str, Any]]:
        """Per node: id, address, live fuzzing actors, cases done, cases/s since the first batch, restarts."""
        now = time.monotonic()
        rows = []
        for node, stats in sorted(self.node_stats.items(), key=lambda item: (item[1].address, item[0])):
            alive = sum(1 for m in self.members if m.alive and m.node == node)
            rows.append({"node": node, "address": stats.address, "workers": alive, "cases": stats.cases,
                         "cases_per_s": round(stats.rate(self.began, now), 1), "restarts": stats.restarts})
        return rows

    # ------------------------------------------------------------------ scheduling batches onto actors

    def _schedule(self) -> None:
        for member in self.members:
            if member.alive and member.job is None and member.call is None:
                job = self._next_job(member)
                if job is not None:
                    member.job = job
                    self._call(member, "fuzz", member.handle.run_batch.remote(job.task))

    def _next_job(self, member: Member) -> Job | None:
        """The oldest queued batch of this actor's own worker or of a worker whose actor is down."""
        for job in self.queue:
            home = self.members[job.worker]
            if home is member or not home.alive:
                self.queue.remove(job)
                return job
        return None

    def _call(self, member: Member, kind: str, ref: Any) -> None:
        member.call, member.calling = ref, kind

    def _finish(self, member: Member, ref: Any, messages: list[Message], losses: list[Loss]) -> None:
        import ray

        kind, member.call = member.calling, None
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as error:
            if kind == "hello":
                self._hello_failed(member, error)
            else:
                self._lost(member)
            return
        except ray.exceptions.RayError:
            # The actor lives but its local pool broke (its zygote is gone): restart the actor.
            ray.kill(member.handle, no_restart=False)
            self._lost(member)
            return
        if kind == "hello":
            if "error" in result:
                self._retire(member)
            else:
                self._admit(member, result)
            return
        self._relay(member, result, messages, losses)

    def _relay(self, member: Member, result: dict[str, Any], messages: list[Message], losses: list[Loss]) -> None:
        job = member.job
        assert job is not None
        stats = self.node_stats[member.node]
        local = result["restarts"] - member.seen_restarts
        member.seen_restarts = result["restarts"]
        self.restarts += local
        stats.restarts += local
        if result["reset"]:
            self._lost(member)
            return
        for event in result["events"]:
            if "loss" in event:
                loss = Loss(**{**event["loss"], "worker": job.worker})
                losses.append(loss)
                stats.cases += _cases_through(loss, job.task)
                member.job = None
                continue
            name, payload = event["message"], event["payload"]
            messages.append((job.worker, name, payload))
            if name == protocol.BATCH:
                stats.cases += payload["done"]
                member.job = None

    # ------------------------------------------------------------------ lost actors

    def _lost(self, member: Member) -> None:
        """The actor died (or cannot be trusted): re-run the batch it held elsewhere; Ray restarts it."""
        if member.alive and member.node in self.node_stats:
            self.node_stats[member.node].restarts += 1
        self.restarts += 1
        member.alive, member.checked = False, time.monotonic()
        self._note_departure(member.node)
        job, member.job = member.job, None
        if job is None:
            return
        if job.attempts + 1 >= MAX_ATTEMPTS:
            task = job.task
            raise TargetError(f"batch {task['batch']} (cases {task['start']}..{task['start'] + task['count'] - 1} of seed {task['seed']}) "
                              f"took down {MAX_ATTEMPTS} Ray workers in a row; see the Ray logs of the nodes")
        self.reruns += 1
        self.queue.appendleft(dataclasses.replace(job, attempts=job.attempts + 1))

    def _hello_failed(self, member: Member, error: Exception) -> None:
        import ray

        # Unavailable: Ray is restarting it (or has no room yet); Died: it will not come back.
        if not isinstance(error, ray.exceptions.ActorUnavailableError):
            member.retired = True

    def _recheck_lost(self) -> None:
        now = time.monotonic()
        for member in self.members:
            if not member.alive and not member.retired and member.call is None and now - member.checked >= RECHECK_S:
                member.checked = now
                self._call(member, "hello", member.handle.hello.remote())

    def _check_alive(self) -> None:
        if any(member.alive for member in self.members):
            self.none_alive_since = None
            return
        now = time.monotonic()
        if self.none_alive_since is None:
            self.none_alive_since = now
        if all(member.retired for member in self.members):
            raise TargetError(f"all {len(self.members)} Ray workers are gone and cannot be restarted (the cluster offers {_resources_text()})")
        if now - self.none_alive_since > self.lost_timeout:
            raise TargetError(f"no Ray worker has been alive for {self.lost_timeout:.0f} s: the nodes are lost "
                              f"(the cluster offers {_resources_text()})")

    # ------------------------------------------------------------------ the spare

    def _execute(self, case: Case, device: str, probe: bool) -> Execution:
        import ray

        for _ in range(MAX_ATTEMPTS):
            spare = self._spare
            assert spare is not None
            try:
                result = ray.get(spare.handle.execute.remote(to_dict(case), device, probe))
            except ray.exceptions.RayActorError:
                self.restarts += 1
                self._wait_back(spare)
                continue
            self.restarts += result["restarts"] - spare.seen_restarts
            spare.seen_restarts = result["restarts"]
            return Execution.from_dict(result["execution"])
        raise TargetError(f"the Ray worker that shrinks crash findings died {MAX_ATTEMPTS} times in a row")

    def _wait_back(self, member: Member) -> None:
        import ray

        deadline = time.monotonic() + self.lost_timeout
        while time.monotonic() < deadline:
            try:
                hello = ray.get(member.handle.hello.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.ActorUnavailableError:
                time.sleep(RECHECK_S)
                continue
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                break
            member.seen_restarts = hello.get("restarts", 0)
            return
        raise TargetError("the Ray worker that shrinks crash findings is gone and did not come back")


@dataclass(frozen=True)
class RaySpareTarget:
    """A Target whose vLLM lives in the pool's spare actor; a case that kills its worker is an outcome."""

    pool: RayPool = field(repr=False)
    info: TargetInfo

    def execute(self, case: Case, device: str, probe: bool = False) -> Execution:
        return self.pool._execute(case, device, probe)


# ---------------------------------------------------------------------------------------- opening


def open_ray_pool(source: TargetSource, address: str = "auto", *, device: str = "cpu", workers: int | None = None,
                  case_timeout: float = 60.0, max_memory: int = 4 << 30) -> RayPool:
    """A RayPool on the cluster at `address` ("auto": the running one, else a new local one)."""
    try:
        import ray
    except ImportError:
        raise UsageError(INSTALL_HINT) from None
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--ray runs each worker on a GPU of its own: use --device cuda, not {device}")
    owns = False
    if not ray.is_initialized():
        owns = True
        _connect(address)
    try:
        return RayPool(source, device=device, workers=workers, case_timeout=case_timeout, max_memory=max_memory, owns_ray=owns)
    except BaseException:
        if owns and ray.is_initialized():
            ray.shutdown()
        raise


def runtime_env() -> dict[str, Any]:
    """The Ray job runtime environment that ships kvfuzz's own packages to every node (Ray accepts
    local folders only for a whole job, in ray.init, not per actor)."""
    return {"py_modules": [str(Path(fuzz.__file__).resolve().parent), str(Path(oracles.__file__).resolve().parent)],
            "excludes": _EXCLUDES}


def _connect(address: str) -> None:
    import ray

    quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING, "runtime_env": runtime_env()}
    if address != "auto":
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, ValueError, RuntimeError) as error:
            raise TargetError(f"--ray {address}: cannot join the Ray cluster: {_first_line(error)}") from None
        return
    running = _running_cluster()
    if running is not None:
        try:
            ray.init(address=running, **quiet)
            return
        except (ConnectionError, ValueError, RuntimeError):
            pass
    ray.init(address="local", object_store_memory=256 << 20, **quiet)


def _running_cluster() -> str | None:
    """The address `ray.init(address="auto")` would join, if a Ray head answers there.

    Ray itself waits minutes on a stale address file (a cluster that was killed), so probe first."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if not address:
        record = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        try:
            address = record.read_text().strip()
        except OSError:
            return None
    if "://" in address:  # ray://, or a job server: let Ray resolve it
        return address
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=2.0).close()
    except (OSError, ValueError):
        return None
    return address


def _cases_through(loss: Loss, task: dict[str, Any]) -> int:
    """Cases of `task` done when its worker was lost, the one that killed it included (as the campaign counts them)."""
    if loss.index is None or loss.batch != task["batch"]:
        return 0
    return loss.index - task["start"] + 1


@cache
def _relay_class() -> Any:
    import ray

    return ray.remote(NodeRelay)


def _cluster_slots(device: str) -> int:
    import ray

    resources = ray.cluster_resources()
    slots = int(resources.get("GPU" if device.startswith("cuda") else "CPU", 0))
    if slots < 1:
        raise TargetError(f"the Ray cluster offers no {'GPU' if device.startswith('cuda') else 'CPU'} ({_resources_text()})")
    return slots


def _resources_text() -> str:
    import ray

    resources = ray.cluster_resources()
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    return f"{nodes} node(s), {resources.get('CPU', 0):g} CPU, {resources.get('GPU', 0):g} GPU"


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines or [type(error).__name__])[0][:300]
