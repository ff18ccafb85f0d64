"""The coordinator's side of the target processes: a zygote per target, workers forked from it.

The pool owns process lifetimes. It starts the zygote (with the target's vLLM first on the
path), asks it to fork workers, notices when one dies (its connection closes; the zygote reports
the exit status), hangs (its Slot shows a case running past the timeout) or grows past its
memory cap (its resident size, read from /proc), kills it if needed, and tells the caller what
the worker was running at the time. A lost worker is replaced by a new fork.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from fuzz import SOURCE_ROOT
from fuzz.campaign import protocol
from fuzz.case import Case, to_dict
from fuzz.errors import TargetError
from fuzz.targets.base import TARGET_CRASHED, TARGET_HUNG, TARGET_OUT_OF_MEMORY, Execution, Outcome, TargetInfo
from fuzz.targets.releases import TargetSource, worker_environment

START_TIMEOUT = 300.0
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class WorkerHandle:
    number: int
    slot: protocol.Slot
    conn: Connection | None = None
    pid: int | None = None
    busy: bool = False  # has work the coordinator waits on
    status: int | None = None  # exit status, once the zygote reported it
    killed_for: str | None = None  # "hang" or "oom" when the pool killed it
    task: dict[str, Any] = field(default_factory=dict)


Message = tuple[int, str, dict[str, Any]]  # (worker, name, payload)


@dataclass(frozen=True)
class Loss:
    """A worker that died, and what it was doing."""

    worker: int
    kind: str  # crash-signal, hang or oom
    detail: str
    batch: int | None
    index: int | None
    phase: int  # protocol.IDLE, RUNNING (the case at index killed it) or SHRINKING (a candidate did)


class Pool:
    def __init__(self, source: TargetSource, *, workers: int = 1, case_timeout: float = 60.0, max_memory: int = 4 << 30) -> None:
        self.source = source
        self.case_timeout = case_timeout
        self.max_memory = max_memory
        # A private folder (mode 0700) guards the socket: only this user's processes can connect.
        self.folder = Path(tempfile.mkdtemp(prefix="kvfuzz-pool-"))
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.folder / "socket"))
        self.listener.listen(64)
        self.zygote: subprocess.Popen[bytes] | None = None
        self.control: Connection | None = None
        self.info: TargetInfo | None = None
        self.workers: dict[int, WorkerHandle] = {}
        self.restarts = 0
        # What a one-case execute() received for other workers meanwhile; the next poll() returns it.
        self._backlog: tuple[list[Message], list[Loss]] = ([], [])
        self._spare: int | None = None
        self._start_zygote()
        for number in range(workers):
            self.spawn(number)

    # ------------------------------------------------------------------ lifecycle

    def _start_zygote(self) -> None:
        env = worker_environment(self.source)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), str(SOURCE_ROOT)]))
        self.zygote = subprocess.Popen([sys.executable, "-m", "fuzz.campaign.worker", str(self.folder / "socket")],
                                       env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=open(self.folder / "zygote.log", "wb"), start_new_session=True)
        self.control = self._accept(START_TIMEOUT, "the target process did not start")
        name, payload = self._receive_control(START_TIMEOUT)
        if name == protocol.FAILED:
            raise TargetError(f"--vllm {self.source.spec}: cannot load the target: {payload['error']}")
        self.info = TargetInfo.from_dict(payload["info"])

    def _accept(self, timeout: float, what: str) -> Connection:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.zygote is not None and self.zygote.poll() is not None:
                raise TargetError(f"--vllm {self.source.spec}: {what}: {self._zygote_error()}")
            if wait([self.listener], timeout=0.2):
                sock, _ = self.listener.accept()
                return Connection(sock.detach())
        raise TargetError(f"--vllm {self.source.spec}: {what} within {timeout:.0f} s")

    def _zygote_error(self) -> str:
        lines = [line for line in (self.folder / "zygote.log").read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line]
        return (errors or lines or ["exited"])[-1].strip()[:300]

    def _receive_control(self, timeout: float) -> tuple[str, dict[str, Any]]:
        assert self.control is not None
        if not wait([self.control], timeout=timeout):
            raise TargetError(f"--vllm {self.source.spec}: the target process stopped answering")
        return protocol.receive(self.control)

    def spawn(self, number: int) -> WorkerHandle:
        handle = self.workers.get(number)
        if handle is None:
            handle = WorkerHandle(number, protocol.Slot(self.folder / f"slot-{number}"))
            self.workers[number] = handle
        handle.slot.finish()
        handle.conn, handle.pid, handle.busy, handle.status, handle.killed_for, handle.task = None, None, False, None, None, {}
        assert self.control is not None
        protocol.send(self.control, protocol.SPAWN, {"worker": number, "slot": str(handle.slot.path), "max_memory": self.max_memory})
        conn = self._accept(30.0, "a worker did not start")
        name, payload = protocol.receive(conn)
        if name != protocol.HELLO:
            raise TargetError(f"--vllm {self.source.spec}: a worker sent {name} instead of hello")
        handle.conn, handle.pid = conn, payload["pid"]
        return handle

    def close(self) -> None:
        for handle in self.workers.values():
            if handle.conn is not None:
                try:
                    protocol.send(handle.conn, protocol.STOP)
                except OSError:
                    pass
                handle.conn.close()
        if self.control is not None:
            try:
                protocol.send(self.control, protocol.SHUTDOWN)
            except OSError:
                pass
        if self.zygote is not None:
            try:
                self.zygote.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.zygote.pid, signal.SIGKILL)
                self.zygote.wait()
        self.listener.close()
        for handle in self.workers.values():
            handle.slot.close()
            if handle.pid is not None:  # workers run in sessions of their own: make sure none outlives the pool
                try:
                    os.kill(handle.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ what a campaign uses

    def fuzzers(self) -> list[int]:
        """The workers started for fuzzing (a spare for shrinking, once made, is not one)."""
        return sorted(n for n in self.workers if n != self._spare)

    def start_batch(self, worker: int, task: dict[str, Any]) -> None:
        self.send(self.workers[worker], protocol.FUZZ, task)

    def ack(self, worker: int) -> None:
        """Let a worker that reported a finding go on: the finding is on disk."""
        self.send(self.workers[worker], protocol.ACK, {})

    def spare_target(self) -> RemoteTarget:
        """A target on a worker of its own, for running cases that may kill it."""
        if self._spare is None:
            self._spare = max(self.workers) + 1
            self.spawn(self._spare)
        return RemoteTarget(self, worker=self._spare)

    # ------------------------------------------------------------------ talking to workers

    def send(self, handle: WorkerHandle, name: str, payload: dict[str, Any]) -> None:
        assert handle.conn is not None
        if name in (protocol.FUZZ, protocol.EXECUTE):
            handle.busy, handle.task = True, payload
        protocol.send(handle.conn, name, payload)

    def poll(self, timeout: float) -> tuple[list[Message], list[Loss]]:
        """Messages that arrived within `timeout`, and workers lost meanwhile (already respawned)."""
        if self._backlog[0] or self._backlog[1]:
            backlog, self._backlog = self._backlog, ([], [])
            return backlog
        conns = {h.conn: h for h in self.workers.values() if h.conn is not None}
        messages: list[Message] = []
        dead: list[WorkerHandle] = []
        for conn in wait(list(conns) + ([self.control] if self.control else []), timeout=timeout):
            if conn is self.control:
                self._drain_control()
                continue
            handle = conns[conn]  # type: ignore[index]
            try:
                while conn.poll():
                    name, payload = protocol.receive(conn)  # type: ignore[arg-type]
                    if name in (protocol.BATCH, protocol.EXECUTED):
                        handle.busy = False
                    messages.append((handle.number, name, payload))
            except (EOFError, OSError):
                dead.append(handle)
        self._watch()
        return messages, [self._lose(h) for h in dead]

    def _drain_control(self) -> None:
        assert self.control is not None
        while self.control.poll():
            name, payload = protocol.receive(self.control)
            if name == protocol.EXITED and payload["worker"] in self.workers:
                handle = self.workers[payload["worker"]]
                if handle.pid == payload["pid"]:
                    handle.status = payload["status"]

    def _watch(self) -> None:
        """Kill workers whose case runs past the timeout or whose memory passes the cap."""
        now = time.monotonic_ns()
        for handle in self.workers.values():
            if handle.pid is None or handle.killed_for:
                continue
            _, _, started, phase = handle.slot.read()
            if phase != protocol.IDLE and (now - started) / 1e9 > self.case_timeout:
                self._kill(handle, "hang")
            elif self.max_memory and _resident_bytes(handle.pid) > self.max_memory + (1 << 30):
                self._kill(handle, "oom")

    def _kill(self, handle: WorkerHandle, reason: str) -> None:
        handle.killed_for = reason
        try:
            os.kill(handle.pid or -1, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _lose(self, handle: WorkerHandle) -> Loss:
        deadline = time.monotonic() + 2.0
        while handle.status is None and time.monotonic() < deadline:
            if self.control is not None and wait([self.control], timeout=0.05):
                self._drain_control()
        batch, index, _, phase = handle.slot.read()
        kind, detail = _classify(handle.status, handle.killed_for, self.case_timeout)
        busy = phase != protocol.IDLE
        loss = Loss(handle.number, kind, detail, batch if busy else None, index if busy else None, phase)
        if handle.conn is not None:
            handle.conn.close()
        self.restarts += 1
        self.spawn(handle.number)
        return loss

    # ------------------------------------------------------------------ one case at a time

    def execute(self, case: Case, device: str, probe: bool = False, worker: int = 0) -> Execution:
        """Run one case on a worker; a worker the case kills becomes an outcome, not an exception."""
        handle = self.workers[worker]
        self.send(handle, protocol.EXECUTE, {"id": 0, "case": to_dict(case), "device": device, "probe": probe})
        while True:
            messages, losses = self.poll(0.1)
            result: Execution | None = None
            for owner, name, payload in messages:
                if owner == worker and name == protocol.EXECUTED:
                    result = Execution.from_dict(payload["execution"])
                else:
                    self._backlog[0].append((owner, name, payload))
            for loss in losses:
                if loss.worker == worker:
                    error = {"crash-signal": TARGET_CRASHED, "hang": TARGET_HUNG, "oom": TARGET_OUT_OF_MEMORY}[loss.kind]
                    result = Execution(case, outcome=Outcome(error_type=error, error_message=loss.detail, error_function="worker"))
                else:
                    self._backlog[1].append(loss)
            if result is not None:
                return result


class RemoteTarget:
    """A Target whose vLLM lives in a worker process: for replay, explain, bisect, minimize."""

    def __init__(self, pool: Pool, worker: int = 0) -> None:
        assert pool.info is not None
        self.pool = pool
        self.info = pool.info
        self.worker = worker

    def execute(self, case: Case, device: str, probe: bool = False) -> Execution:
        return self.pool.execute(case, device, probe=probe, worker=self.worker)


def _classify(status: int | None, killed_for: str | None, timeout: float) -> tuple[str, str]:
    if killed_for == "hang":
        return "hang", f"no answer within {timeout:g} s"
    if killed_for == "oom":
        return "oom", "resident memory passed the worker's cap"
    if status is None:
        return "crash-signal", "the worker vanished"
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number == signal.SIGKILL:
            return "oom", "killed by SIGKILL (the kernel's out-of-memory killer?)"
        return "crash-signal", f"killed by {signal.Signals(number).name}"
    return "crash-signal", f"exited with status {os.WEXITSTATUS(status)}"


def _resident_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return 0
