"""A campaign across machines: the local pool's interface, backed by Ray actors on a cluster's nodes.

The driver stays the single coordinator; `RayPool` is what the campaign (`fuzz.campaign.engine`) drives
in place of `fuzz.campaign.pool.Pool`. Campaign workers are logical: worker i's batches run on its home
actor i (a `fuzz.cluster.actor.NodeRelay`, one local worker on its node) while that actor lives. An
actor that dies (its node is lost, its process killed) is not a finding: the batch it held is
queued again whole and taken by the next free live actor, Ray restarts the dead actor somewhere,
and once it answers again it takes back its own worker.

The target's vLLM is resolved once on the driver; a release or checkout is packed and handed to
the nodes by a depot actor (`fuzz.cluster.actor`), and kvfuzz's own packages travel as the job's
py_modules (`runtime_env`, from `fuzz.cluster.connect`), so every node fuzzes the same vLLM with the
same kvfuzz. Crash findings are shrunk on a spare actor of their own (`spare_target`, see
`fuzz.cluster.spare`). Ray is optional: this module imports without it, and `open_ray_pool` says how
to install it.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections import deque
from functools import cache
from typing import Any

from fuzz.campaign import protocol
from fuzz.campaign.pool import Loss, Message
from fuzz.cluster.actor import NodeRelay, TargetDepot, pack_target
from fuzz.cluster.connect import INSTALL_HINT, cluster_slots, connect, first_line, resources_text, runtime_env
from fuzz.cluster.members import MAX_ATTEMPTS, RECHECK_S, Job, Member, NodeStats, cases_through
from fuzz.cluster.spare import RaySpareTarget
from fuzz.errors import TargetError, UsageError
from fuzz.targets.base import TargetInfo
from fuzz.targets.releases import TargetSource

START_TIMEOUT = 300.0  # seconds for every actor to start and load the target
LOST_TIMEOUT = 300.0  # seconds without any live fuzzing actor before the campaign gives up


class RayPool:
    """The local Pool's campaign interface (info, source, restarts, fuzzers, start_batch, ack, poll,
    spare_target, close) over Ray actors; `nodes()` adds per-node progress."""

    def __init__(self, source: TargetSource, *, device: str = "cpu", workers: int | None = None, case_timeout: float = 60.0,
                 max_memory: int = 4 << 30, start_timeout: float = START_TIMEOUT, lost_timeout: float = LOST_TIMEOUT,
                 owns_ray: bool = False) -> None:
        self.source = source
        self.device = device
        self.case_timeout = case_timeout
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
        self.spare: Member | None = None  # the actor of spare_target(), once started
        self._depot: Any = None
        try:
            depot = self._ship(source)
            self._arguments = ({"spec": source.spec, "kind": source.kind, "version": source.version}, depot, case_timeout, max_memory)
            slots = cluster_slots(device)
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
                              f"{self.start_timeout:.0f} s (the cluster offers {resources_text()})")
        for ref in ready:
            try:
                hello = ray.get(ref)
            except ray.exceptions.RayError as error:
                raise TargetError(f"--vllm {self.source.spec}: a Ray worker failed to start: {first_line(error)} (does the job ship "
                                  "kvfuzz? ray.init(runtime_env=fuzz.cluster.pool.runtime_env()), or install kvfuzz on the nodes)") from None
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

        members = [m for m in [*self.members, self.spare] if m is not None and not m.retired]
        # Closing the local pools removes their folders; a lost actor's processes are gone with it.
        closing = [m.handle.close.remote() for m in members if m.alive]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=10)
        for handle in [m.handle for m in members] + ([self._depot] if self._depot is not None else []):
            ray.kill(handle, no_restart=True)
        self.members, self.spare, self._depot = [], None, None
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

    def spare_target(self, fresh: bool = False) -> RaySpareTarget:
        """A target on an actor of its own (on a fuzzing node, sharing its GPU), for cases that may kill it;
        `fresh`: its worker re-forked first, so that it has run nothing yet."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self.spare is not None and fresh:
            try:
                ray.get(self.spare.handle.refresh.remote(), timeout=self.start_timeout)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                pass  # a spare actor that is down comes back with a fresh worker
        if self.spare is None:
            home = next((m.node for m in self.members if m.alive), None)
            strategy = NodeAffinitySchedulingStrategy(home, soft=True) if home else "DEFAULT"
            spare = Member(-1, self._create(scheduling=strategy, spare=True))
            self.spare = spare
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
                stats.cases += cases_through(loss, job.task)
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
            raise TargetError(f"all {len(self.members)} Ray workers are gone and cannot be restarted (the cluster offers {resources_text()})")
        if now - self.none_alive_since > self.lost_timeout:
            raise TargetError(f"no Ray worker has been alive for {self.lost_timeout:.0f} s: the nodes are lost "
                              f"(the cluster offers {resources_text()})")


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
        connect(address)
    try:
        return RayPool(source, device=device, workers=workers, case_timeout=case_timeout, max_memory=max_memory, owns_ray=owns)
    except BaseException:
        if owns and ray.is_initialized():
            ray.shutdown()
        raise


@cache
def _relay_class() -> Any:
    import ray

    return ray.remote(NodeRelay)


# runtime_env (fuzz.cluster.connect) and RaySpareTarget (fuzz.cluster.spare) stay importable from here, as before the split.
__all__ = ["RayPool", "RaySpareTarget", "open_ray_pool", "runtime_env"]
