"""The coordinator's side of the target processes: a zygote per target, workers forked from it.

The pool owns process lifetimes. It starts the zygote (with the target's vLLM first on the
path), asks it to fork workers, notices when one dies (its connection closes; the zygote reports
the exit status), hangs (its Slot shows a case running past the timeout) or grows past its
memory cap (its resident size, read from /proc), kills it if needed, and tells the caller what
the worker was running at the time. A lost worker is replaced by a new fork.

Every wait here has a deadline: the zygote's start (`start_timeout`), a worker's hello, and each
case (`case_timeout`, for batches and for `execute` alike). The zygote's start and `execute` look at
the stop request (fuzz.campaign.stop) every WAIT_STEP seconds and raise `Stopped` when there is one;
the campaign polls in steps as short. A worker can also be stopped on purpose (`interrupt`): that
is no finding.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from fuzz import SOURCE_ROOT
from fuzz.campaign import preload, protocol, standby, stop
from fuzz.case import Case, to_dict
from fuzz.checks.protocol import Check
from fuzz.checks.registry import offered_checks
from fuzz.errors import InternalError, TargetError
from fuzz.targets.base import TARGET_CRASHED, TARGET_HUNG, TARGET_OUT_OF_MEMORY, Execution, Outcome, TargetInfo
from fuzz.targets.releases import TargetSource, worker_environment

START_TIMEOUT = 300.0  # seconds for the zygote to import the target's vLLM
SPAWN_TIMEOUT = 30.0  # seconds for a fork of the zygote to say hello
EXIT_TIMEOUT = 2.0  # seconds to wait for the exit status of a worker that closed its connection
# Beyond the case timeout, what `execute` allows a worker that never started the case (its Slot idle).
ANSWER_MARGIN = 5.0
WAIT_STEP = 0.1  # seconds between looks at the stop request in every wait
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class WorkerHandle:
    number: int
    slot: protocol.Slot
    conn: Connection | None = None
    pid: int | None = None
    busy: bool = False  # has work the coordinator waits on
    status: int | None = None  # exit status, once the zygote reported it
    killed_for: str | None = None  # "hang", "oom" or "stopped" when the pool killed it
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


class ZygoteGone(TargetError):
    """The target process ended before it said why (killed by a signal, or exited while importing)."""


class Pool:
    def __init__(self, source: TargetSource, *, workers: int = 1, case_timeout: float = 60.0, max_memory: int = 4 << 30,
                 start_timeout: float = START_TIMEOUT, keep_warm: bool = True, fork_of: tuple[str, dict[str, Any]] | None = None) -> None:
        self._closed = False
        self.keep_warm = keep_warm  # start from a standby of this target where one is left, and leave one (fuzz/campaign/standby.py)
        # (key, patch): a zygote forked from another target's standby (the same tree in another environment), with `patch`
        # applied where given (a mutant: fuzz/mutate/swap.py); where none answers or the patch does not apply, the pool
        # imports its own target.
        self.fork_of = fork_of
        self.standby_key = ""  # the key of the standby this pool's zygote leaves ("" for none)
        self.fork_failure: str | None = None  # why a patched fork of `fork_of` failed and the pool imported its target itself
        self.warm = False  # whether the zygote came from a standby
        self.preloaded = False  # whether it came from the base standby, vLLM's dependencies imported (fuzz/campaign/preload.py)
        self.source = source
        self.case_timeout = case_timeout
        self.max_memory = max_memory
        self.start_timeout = start_timeout
        # A private folder (mode 0700) guards the socket: only this user's processes can connect.
        self.folder = Path(tempfile.mkdtemp(prefix="kvfuzz-pool-"))
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.folder / "socket"))
        self.listener.listen(64)
        self.zygote: subprocess.Popen[bytes] | standby.Adopted | None = None
        self.control: Connection | None = None
        self.info: TargetInfo | None = None
        self.workers: dict[int, WorkerHandle] = {}
        self.restarts = 0
        # What a one-case execute() received for other workers meanwhile; the next poll() returns it.
        self._backlog: tuple[list[Message], list[Loss]] = ([], [])
        self._spare: int | None = None
        try:
            self._start_zygote()
            for number in range(workers):
                self.spawn(number)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ lifecycle

    def _start_zygote(self) -> None:
        env = worker_environment(self.source)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), str(SOURCE_ROOT)]))
        address, log = str(self.folder / "socket"), str(self.folder / "zygote.log")
        self.standby_key = standby.key(self.source, env) if self.keep_warm and standby.idle_seconds() else ""
        key, patch = self.fork_of or (self.standby_key, None)
        pid = standby.ask(key, address, str(self.folder), log, patch) if key else None
        if pid is not None:
            self.zygote, self.warm = standby.Adopted(pid), True
            try:
                self._handshake()
                return
            except TargetError as error:
                if patch is None:
                    raise
                self.fork_failure = str(error)
                self._discard_zygote()  # the patch did not apply to the standby's target: import the patched tree itself
        tree = str(self.source.python_path) if self.source.python_path is not None else None
        if self.standby_key and self.fork_of is None:
            pid = preload.ask(env, tree, address, str(self.folder), log, self.max_memory, self.standby_key)
            if pid is not None:
                self.zygote, self.preloaded = standby.Adopted(pid), True
                try:
                    self._handshake()
                    return
                except ZygoteGone:  # died importing: a zygote of its own tells how (its exit status)
                    self._discard_zygote()
                    self.preloaded = False
        command = [sys.executable, "-m", "fuzz.campaign.worker", address, str(os.getpid()), str(self.max_memory), self.standby_key]
        with open(log, "ab") as file:
            self.zygote = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=file,
                                           start_new_session=True, cwd=self.folder)  # never the caller's folder (worker_environment)
        self.warm = False
        self._handshake()
        if self.standby_key:
            preload.leave_base(env, tree)  # the next target no standby holds imports only its vLLM

    def _handshake(self) -> None:
        """Wait for the zygote's READY (its target's declarations) or its one-line failure."""
        deadline = time.monotonic() + self.start_timeout
        what = "the target process did not start"
        self.control = self._accept(deadline, self.start_timeout, what)
        if not self._wait_on([self.control], deadline, what):
            raise TargetError(f"--vllm {self.source.spec}: {what} within {self.start_timeout:.0f} s (stuck importing vLLM?)")
        try:
            name, payload = protocol.receive(self.control)
        except (EOFError, OSError):
            raise ZygoteGone(f"--vllm {self.source.spec}: {what}: {self._zygote_error()}") from None
        if name == protocol.FAILED:
            raise TargetError(f"--vllm {self.source.spec}: cannot load the target: {payload['error']}")
        self.info = TargetInfo.from_dict(payload["info"])

    def _discard_zygote(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.zygote is not None:
            _signal(self.zygote.pid, signal.SIGKILL)
            self.zygote = None

    def _wait_on(self, conns: list[Any], deadline: float, what: str) -> bool:
        """Whether one of `conns` became readable before `deadline`; the zygote's death ends it early, and while
        the target starts (a fork only takes milliseconds) so does a stop request."""
        while time.monotonic() < deadline:
            if self.info is None:
                stop.check()
            if self.zygote is not None and self.zygote.poll() is not None and self.control not in conns:
                raise TargetError(f"--vllm {self.source.spec}: {what}: {self._zygote_error()}")
            if wait(conns, timeout=max(0.0, min(WAIT_STEP, deadline - time.monotonic()))):
                return True
        return False

    def _accept(self, deadline: float, limit: float, what: str) -> Connection:
        if not self._wait_on([self.listener], deadline, what):
            raise TargetError(f"--vllm {self.source.spec}: {what} within {limit:.0f} s")
        sock, _ = self.listener.accept()
        return Connection(sock.detach())

    def _zygote_error(self) -> str:
        """One line on why the zygote is gone: how it ended, and the last error its log shows."""
        try:
            lines = [line for line in (self.folder / "zygote.log").read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            lines = []
        last = ([line for line in lines if "Error" in line] or [""])[-1].strip()[:300]
        code = None
        if self.zygote is not None:
            try:  # its connection closes a moment before its exit status is there
                code = self.zygote.wait(timeout=EXIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        ended = "" if code is None else (f"killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}")
        return "; ".join(filter(None, [ended, last])) or "exited"

    def spawn(self, number: int) -> WorkerHandle:
        handle = self.workers.get(number)
        if handle is None:
            handle = WorkerHandle(number, protocol.Slot(self.folder / f"slot-{number}"))
            self.workers[number] = handle
        handle.slot.finish()
        handle.conn, handle.pid, handle.busy, handle.status, handle.killed_for, handle.task = None, None, False, None, None, {}
        assert self.control is not None
        try:
            protocol.send(self.control, protocol.SPAWN, {"worker": number, "slot": str(handle.slot.path), "max_memory": self.max_memory})
        except OSError:
            raise TargetError(f"--vllm {self.source.spec}: the target process that forks the workers is gone: {self._zygote_error()}") from None
        deadline = time.monotonic() + SPAWN_TIMEOUT
        conn = self._accept(deadline, SPAWN_TIMEOUT, "a worker did not start")
        if not self._wait_on([conn], deadline, "a worker did not start"):
            conn.close()
            raise TargetError(f"--vllm {self.source.spec}: a worker did not say hello within {SPAWN_TIMEOUT:g} s")
        try:
            name, payload = protocol.receive(conn)
        except (EOFError, OSError):
            raise TargetError(f"--vllm {self.source.spec}: a worker died as it started") from None
        if name != protocol.HELLO:
            raise TargetError(f"--vllm {self.source.spec}: a worker sent {name} instead of hello")
        handle.conn, handle.pid = conn, payload["pid"]
        return handle

    def close(self) -> None:
        """Stop every process of the pool (a busy worker at once) and remove its folder; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for handle in self.workers.values():
            if handle.conn is not None:
                try:
                    protocol.send(handle.conn, protocol.STOP)
                except OSError:
                    pass
                handle.conn.close()
            if handle.pid is not None and handle.busy:
                _signal(handle.pid, signal.SIGKILL)
        if self.control is not None:
            try:
                protocol.send(self.control, protocol.SHUTDOWN)
            except OSError:
                pass
            self.control.close()
        if self.zygote is not None:
            try:
                self.zygote.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _signal(-self.zygote.pid, signal.SIGKILL)
                self.zygote.wait()
        self.listener.close()
        for handle in self.workers.values():
            handle.slot.close()
            if handle.pid is not None:  # workers run in sessions of their own: make sure none outlives the pool
                _signal(handle.pid, signal.SIGKILL)
        shutil.rmtree(self.folder, ignore_errors=True)

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

    def spare_target(self, fresh: bool = False) -> RemoteTarget:
        """A target on a worker of its own, for running cases that may kill it; `fresh`: on a new
        fork of the zygote that has run nothing yet."""
        if self._spare is None:
            self._spare = max(self.workers) + 1
            self.spawn(self._spare)
        elif fresh:
            self.interrupt(self._spare)
        return RemoteTarget(self, worker=self._spare)

    def interrupt(self, worker: int) -> tuple[int, int, int]:
        """Stop a worker at once, whatever it is doing (no finding, no restart counted), and fork a
        fresh one in its place. Returns what its Slot showed: (batch, case index, phase)."""
        handle = self.workers[worker]
        batch, index, _, phase = handle.slot.read()
        if handle.pid is not None:
            self._kill(handle, "stopped")
            self._await_status(handle)
        if handle.conn is not None:
            handle.conn.close()
        self.spawn(worker)
        return batch, index, phase

    # ------------------------------------------------------------------ talking to workers

    def send(self, handle: WorkerHandle, name: str, payload: dict[str, Any]) -> None:
        assert handle.conn is not None
        if name in (protocol.FUZZ, protocol.EXECUTE):
            handle.busy, handle.task = True, payload
        protocol.send(handle.conn, name, payload)

    def poll(self, timeout: float) -> tuple[list[Message], list[Loss]]:
        """Messages that arrived within `timeout`, and workers lost meanwhile (already respawned);
        what `execute` received for other workers comes first."""
        backlog, self._backlog = self._backlog, ([], [])
        messages, losses = self._collect(0.0 if backlog[0] or backlog[1] else timeout)
        return backlog[0] + messages, backlog[1] + losses

    def _collect(self, timeout: float) -> tuple[list[Message], list[Loss]]:
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
        try:
            while self.control.poll():
                name, payload = protocol.receive(self.control)
                if name == protocol.EXITED and payload["worker"] in self.workers:
                    handle = self.workers[payload["worker"]]
                    if handle.pid == payload["pid"]:
                        handle.status = payload["status"]
        except (EOFError, OSError):
            raise TargetError(f"--vllm {self.source.spec}: the target process that forks the workers died: {self._zygote_error()}") from None

    def _watch(self) -> None:
        """Kill workers whose case runs past the timeout or whose memory passes the cap."""
        now = time.monotonic_ns()
        for handle in self.workers.values():
            if handle.pid is None or handle.killed_for:
                continue
            _, _, started, phase = handle.slot.read()
            if phase in (protocol.RUNNING, protocol.SHRINKING) and (now - started) / 1e9 > self.case_timeout:
                self._kill(handle, "hang")
            elif self.max_memory and _resident_bytes(handle.pid) > self.max_memory + (1 << 30):
                self._kill(handle, "oom")

    def _kill(self, handle: WorkerHandle, reason: str) -> None:
        handle.killed_for = reason
        if handle.pid is not None:
            _signal(handle.pid, signal.SIGKILL)

    def _await_status(self, handle: WorkerHandle) -> None:
        """Wait (briefly) for the zygote to report how the worker ended."""
        deadline = time.monotonic() + EXIT_TIMEOUT
        while handle.status is None and time.monotonic() < deadline:
            if self.control is not None and wait([self.control], timeout=0.05):
                self._drain_control()

    def _lose(self, handle: WorkerHandle) -> Loss:
        self._await_status(handle)
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

    def execute(self, case: Case, device: str, probe: bool | str = False, worker: int = 0) -> Execution:
        """Run one case on a worker; a worker the case kills, or that does not answer within the case
        timeout, becomes an outcome, not an exception. A stop request interrupts the worker and raises
        Stopped; a case kvfuzz itself could not run raises TargetError (InternalError, with the worker's traceback, when
        kvfuzz's own code raised)."""
        handle = self.workers[worker]
        self.send(handle, protocol.EXECUTE, {"id": 0, "case": to_dict(case), "device": device, "probe": probe})
        deadline = time.monotonic() + self.case_timeout + ANSWER_MARGIN
        while True:
            if stop.requested() is not None:
                self.interrupt(worker)
                stop.check()
            messages, losses = self._collect(WAIT_STEP)
            result: Execution | None = None
            for owner, name, payload in messages:
                if owner == worker and name == protocol.EXECUTED:
                    if "traceback" in payload:  # kvfuzz's own code raised
                        raise InternalError(payload["error"], payload["traceback"])
                    if "error" in payload:
                        raise TargetError(payload["error"])
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
            if time.monotonic() > deadline and handle.killed_for is None:
                self._kill(handle, "hang")  # it never even started the case (its Slot stayed idle)


class RemoteTarget:
    """A Target whose vLLM lives in a worker process: for replay, explain, bisect, minimize."""

    max_buffer_bytes = 1 << 30  # the worker's own cap holds; a one-case target has no other

    def __init__(self, pool: Pool, worker: int = 0) -> None:
        assert pool.info is not None
        self.pool = pool
        self.info = pool.info
        self.worker = worker

    def execute(self, case: Case, device: str, probe: bool | str = False, checks: Collection[str] | None = None) -> Execution:
        """The case on the worker, with every deeper check it asks for (`checks` must be None: one case is judged whole)."""
        assert checks is None, "a remote target runs every check a case asks for"
        return self.pool.execute(case, device, probe=probe, worker=self.worker)

    def checks(self) -> tuple[Check, ...]:
        return offered_checks(self.info)


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
        return "crash-signal", f"killed by {_signal_name(number)}"
    return "crash-signal", f"exited with status {os.WEXITSTATUS(status)}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _signal(pid: int, number: int) -> None:
    """Send a signal to one process (or, with a negative pid, its group) that may be gone already."""
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def _resident_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return 0
