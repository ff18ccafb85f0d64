"""The target side of a campaign: a zygote that imports vLLM once, and workers forked from it.

`python -m fuzz.campaign.worker SOCKET PARENT MAX_MEMORY` starts the zygote with the target's
vLLM first on its path. It imports the adapter, reports the target's declarations (READY), then
forks a worker for every SPAWN: a fork costs milliseconds, a fresh vLLM import seconds, so a
worker the target killed comes back fast. Workers ignore SIGINT (Ctrl-C belongs to the
coordinator, so a KeyboardInterrupt inside a worker can only come from the target), cap their own
memory, and record the case in flight in their Slot before running it.

Neither outlives its parent: the zygote holds a parent-death signal (SIGKILL) tied to the
coordinator, each worker one tied to the zygote, so killing the coordinator, even with SIGKILL,
takes all of them down. The zygote caps its memory too, so a target that allocates without end
while it is imported fails the start instead of taking the machine down.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import signal
import socket
import sys
import time
from collections import Counter
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from fuzz.campaign import protocol, standby
from fuzz.campaign.schedule import CONSUMERS_EVERY, Schedule
from fuzz.case import from_dict, to_dict
from fuzz.checks import timing
from fuzz.corpus.minimize import shrink_finding
from fuzz.errors import KvfuzzError, TargetError
from fuzz.space import Rejected, draw_indexed, for_run
from fuzz.targets.base import Target
from fuzz.tracebacks import describe, one_line
from fuzz.verdict.findings import Finding, normalize
from fuzz.verdict.runner import run_case


def connect(address: str) -> Connection:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    return Connection(sock.detach())


PR_SET_PDEATHSIG = 1
# What the zygote may allocate at least (vLLM's and torch's import takes well under it) before it counts as a memory hog.
IMPORT_MEMORY = 3 << 29


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` (the process that started it) ends (Linux; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent ended before the signal was armed
        os._exit(1)


def zygote_main(address: str, parent: int, max_memory: int, standby_key: str = "") -> None:
    die_with_parent(parent)
    load_and_serve(address, max_memory, standby_key)


def load_and_serve(address: str, max_memory: int, standby_key: str, record: bool = True) -> None:
    """Import the target, report it, leave a standby of it, and serve its pool; `record`: list the dependencies it
    imported for the base standby (fuzz/campaign/module_list.py; a zygote forked from the base had them already)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _limit_memory(max(max_memory, IMPORT_MEMORY) if max_memory > 0 else 0)
    control = connect(address)
    before = dict(os.environ)
    try:
        from fuzz.targets.loader import load_local

        target = load_local()
    except BaseException as error:  # noqa: BLE001 - report any import failure as one line
        protocol.send(control, protocol.FAILED, {"error": f"{type(error).__name__}: {error}".splitlines()[0][:400]})
        return
    if record and standby_key:
        from fuzz.campaign.module_list import record_modules

        with contextlib.suppress(OSError):
            record_modules({name: value for name, value in os.environ.items() if before.get(name) != value})
    import torch

    torch.set_num_threads(1)
    # vLLM's and torch's import leave ~700k objects that live as long as the process: out of the collector's sight, a
    # full collection takes milliseconds instead of half a second, and forks share those pages instead of copying them.
    gc.freeze()
    if standby_key:  # a copy of this process, kept warm for the next pool with the same key (fuzz/campaign/standby.py)
        import vllm

        where = os.path.dirname(os.path.dirname(vllm.__file__ or ""))
        standby.leave(standby_key, lambda request: _adopted(request, target), label=f"vLLM {target.info.vllm_version} from {where}")
    _serve_zygote(address, control, target)


def _adopted(request: dict[str, Any], target: Target) -> None:
    """A standby's fork serving the pool that asked; with a patch (a mutant), the patched function's code swapped in first.
    The target stays the one loaded from the unpatched tree: its catalog and case space are the baseline's (case i the
    same case on both trees), and the functions it calls are the objects that now run the patched body."""
    control = connect(request["address"])
    if request.get("patch"):
        try:
            from fuzz.mutate.swap import swap_function

            swap_function(**request["patch"])
        except BaseException as error:  # noqa: BLE001 - the pool imports the patched tree itself instead
            protocol.send(control, protocol.FAILED, {"error": f"patch: {type(error).__name__}: {error}".splitlines()[0][:400]})
            return
    _serve_zygote(request["address"], control, target)


def _serve_zygote(address: str, control: Connection, target: Target) -> None:
    """Report the target (READY), then fork a worker for every SPAWN until the pool shuts the zygote down or is gone."""
    protocol.send(control, protocol.READY, {"info": target.info.to_dict(), "pid": os.getpid()})
    children: dict[int, int] = {}
    while True:
        _reap(control, children)
        if not wait([control], timeout=0.05):
            continue
        try:
            name, payload = protocol.receive(control)
        except (EOFError, OSError):
            break
        if name == protocol.SHUTDOWN:
            break
        if name == protocol.SPAWN:
            pid = os.fork()
            if pid == 0:
                control.close()
                _worker_main(address, target, payload, zygote=os.getppid())
                os._exit(0)
            children[pid] = payload["worker"]
    for pid in children:
        _kill(pid)
    # Threads that vLLM's import started would keep the interpreter alive past shutdown.
    os._exit(0)


def _reap(control: Connection, children: dict[int, int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        worker = children.pop(pid, None)
        if worker is not None:
            protocol.send(control, protocol.EXITED, {"worker": worker, "pid": pid, "status": status})


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _limit_memory(max_bytes: int) -> None:
    """Cap private data (malloc, anonymous maps) at what is used now plus `max_bytes`, so a
    target that allocates without end gets MemoryError instead of taking the machine down."""
    if max_bytes <= 0:
        return
    used = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            used = int(line.split()[1]) * 1024
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (used + max_bytes, resource.RLIM_INFINITY))
    except (ValueError, OSError):
        pass


def _worker_main(address: str, target: Target, spawn: dict[str, Any], zygote: int) -> None:
    # A session of its own: the scheduler (autogroup) then shares CPU per worker, not per zygote.
    os.setsid()
    die_with_parent(zygote)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Die at once on a fatal signal: the handlers some libraries install print symbolized stack
    # traces for seconds, and a core file is of no use here.
    for fatal in (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT):
        signal.signal(fatal, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    conn = connect(address)
    protocol.send(conn, protocol.HELLO, {"worker": spawn["worker"], "pid": os.getpid()})
    _limit_memory(spawn.get("max_memory", 0))
    Worker(target, conn, protocol.Slot(Path(spawn["slot"]))).serve()


class Worker:
    """Runs what the coordinator asks, one message at a time."""

    def __init__(self, target: Target, conn: Connection, slot: protocol.Slot) -> None:
        self.target = target
        self.conn = conn
        self.slot = slot
        self.known: set[str] = set()
        self.variants: dict[str, set[tuple[str, ...]]] = {}  # per signature, the variants reported to the coordinator
        self.campaign: str | None = None
        self.schedule: Schedule | None = None  # which deeper checks run on a case, and the verdicts of keys judged (per campaign)
        self.reach: Any = None  # fuzz.ci.direct.WorkerReach, when the task names changed functions to trace (kvfuzz ci)

    def serve(self) -> None:
        while True:
            try:
                name, payload = protocol.receive(self.conn)
            except (EOFError, OSError):
                return
            if name == protocol.STOP:
                return
            if name == protocol.FUZZ:
                self.fuzz(protocol.Task.from_dict(payload))
            elif name == protocol.EXECUTE:
                self.execute(payload)

    def execute(self, payload: dict[str, Any]) -> None:
        self.slot.start(-1, payload["id"])
        try:
            execution = self.target.execute(from_dict(payload["case"]), payload["device"], probe=payload.get("probe") or False)
        except Exception as error:  # noqa: BLE001 - kvfuzz's own failure (or a call that does not fit vLLM): the caller's error
            self.slot.finish()
            protocol.send(self.conn, protocol.EXECUTED, {"id": payload["id"], **_error_payload(error)})
            return
        self.slot.finish()
        protocol.send(self.conn, protocol.EXECUTED, {"id": payload["id"], "execution": execution.to_dict()})

    def fuzz(self, task: protocol.Task) -> None:
        """Cases start .. start+count-1 of the campaign, each drawn from (seed, index) alone."""
        if task.campaign != self.campaign:  # a worker outlives campaigns: forget the last one's findings
            self.campaign, self.known, self.variants, self.schedule, self.reach = task.campaign, set(), {}, None, None
        self.known.update(task.known)
        tallies: dict[str, Counter[str]] = {"verdicts": Counter(), "rejections": Counter(), "skips": Counter(), "errors": Counter(),
                                            "mismatches": Counter()}
        internal: dict[str, dict[str, Any]] = {}  # the first case of each kvfuzz error in this batch, saved by the coordinator
        variants: list[list[str]] = []  # (signature, spec kind, backend, layout) of each bug's variants first met in this batch
        began = time.monotonic()
        # Shrinking a finding here stops when the campaign's time does (counted from receipt: clocks of other machines differ).
        shrink_until = began + task.shrink_seconds
        batch, info = task.batch, self.target.info
        self.target.max_buffer_bytes = task.max_buffer_bytes  # type: ignore[attr-defined]
        probe_every, probe_kind, consumers_every, scale = task.probe_every, task.probe_kind, task.consumers_every, task.scale
        if self.schedule is None:
            self.schedule = Schedule(self.target.checks())
        reach = self._reach(task)
        for index in range(task.start, task.start + task.count):
            self.slot.start(batch, index)
            try:
                if reach is None:
                    case = draw_indexed(info, task.seed, index, synthetic=task.synthetic, scale=scale, touches=True)
                else:
                    case = reach.draw(info, task, index)
            except Rejected:
                tallies["verdicts"]["unbuildable"] += 1
                continue
            probe: bool | str = probe_kind if probe_every and index % probe_every == 0 else False
            plan = None
            if consumers_every is None and scale == "small" and probe != "kernel":
                # The deeper checks run where the worker's schedule says (fuzz/campaign/schedule.py); the case then names them.
                plan = self.schedule.plan(case)
                case = plan.case
            else:  # a fixed ratio (--consumers-every), production scale, or the kernel probe asked on every case
                every = CONSUMERS_EVERY if consumers_every is None else consumers_every
                case = for_run(case, consumers=bool(every) and index % every == 0 and scale == "small", kernel=probe == "kernel")
            # Production-size metadata runs describe their buffers on the meta device; everything
            # else allocates, up to the cap (the adapter skips larger cases).
            device = "meta" if scale == "production" and not probe else task.device
            trace: str | None = None  # the traceback of kvfuzz's own error
            ran_from = time.perf_counter()
            if reach is not None:
                reach.start()
            try:
                if plan is None:
                    result = run_case(self.target, case, device, probe=probe)
                else:
                    timing.take()  # whatever ran since the last case (a shrink, an execute) is not this case's
                    result = run_case(self.target, case, device, probe=probe, checks=plan.running, reuse=plan.reuse)
                    self.schedule.record(plan, result, time.perf_counter() - ran_from, timing.take())
            except TargetError as error:  # kvfuzz's call does not fit this vLLM: the coordinator decides
                tallies["verdicts"]["internal-error"] += 1
                tallies["mismatches"][str(error)] += 1
                continue
            except Exception as error:  # noqa: BLE001 - a kvfuzz bug must not pass for a target crash
                result, described = None, describe(error)
                message, trace = described.summary, described.traceback
            else:
                # A drawn case that vLLM derives differently from the generator is the generator's bug.
                message = f"case error: {result.verdict.reason}"[:200] if result.verdict.status == "case-error" else None
            finally:
                if reach is not None:
                    reach.stop(index, case)
            if result is None or message is not None:
                tallies["verdicts"]["internal-error"] += 1
                tallies["errors"][message] += 1
                internal.setdefault(message, {"error": message, "index": index, "case": to_dict(case), "traceback": trace})
                continue
            verdict = result.verdict
            tallies["verdicts"][verdict.status] += 1
            if verdict.status == "rejected":
                tallies["rejections"][normalize(verdict.reason or "")[:160]] += 1
            elif verdict.status == "skipped":
                tallies["skips"][verdict.reason or ""] += 1
            finding = verdict.finding
            if finding is not None and finding.variant not in self.variants.setdefault(finding.signature, set()):
                self.variants[finding.signature].add(finding.variant)
                variants.append([finding.signature, *finding.variant])
            if finding is not None and finding.signature not in self.known:
                self.known.add(finding.signature)
                self._report(batch, index, case, finding.to_dict(), device, shrink_until)
        self.slot.finish()
        protocol.send(self.conn, protocol.BATCH, {"batch": batch, "done": task.count, "elapsed": time.monotonic() - began,
                                                  "internal": list(internal.values()), "variants": variants,
                                                  "checks": self.schedule.take_tallies(),
                                                  **({"reach": reach.report()} if reach is not None else {}),
                                                  **{k: dict(v) for k, v in tallies.items()}})

    def _reach(self, task: protocol.Task) -> Any:
        """The changed lines' tracer and directed draws for this batch (None: the task names no changed functions)."""
        if not task.changed:
            return None
        if self.reach is None:
            from fuzz.ci.direct import WorkerReach

            self.reach = WorkerReach(task.changed)
        self.reach.begin()
        return self.reach

    def _report(self, batch: int, index: int, case: Any, finding: dict[str, Any], device: str, shrink_until: float) -> None:
        """Hand a new finding to the coordinator, wait until it is on disk, then shrink it here."""
        self.slot.start(batch, index, protocol.WAITING)
        protocol.send(self.conn, protocol.FINDING, {"batch": batch, "index": index, "case": to_dict(case), "finding": finding})
        name, _ = protocol.receive(self.conn)
        if name != protocol.ACK:
            raise protocol.ProtocolError(f"expected ack, got {name}")

        def find(candidate: Any) -> Finding | None:
            # A candidate that kills the worker cuts the shrinking short, not the campaign.
            self.slot.start(batch, index, protocol.SHRINKING)
            try:
                return run_case(self.target, candidate, device).verdict.finding
            except Exception:  # noqa: BLE001 - a candidate kvfuzz cannot judge does not fail the same way
                return None

        seconds = shrink_until - time.monotonic()
        small, smallest, steps = case, Finding.from_dict(finding), 0
        if seconds > 0:
            small, smallest, steps = shrink_finding(case, smallest, find, self.target.info, max_seconds=seconds)
        self.slot.start(batch, index)
        protocol.send(self.conn, protocol.MINIMIZED,
                      {"batch": batch, "index": index, "case": to_dict(small), "finding": smallest.to_dict(), "steps": steps})


def _error_payload(error: Exception) -> dict[str, str]:
    """kvfuzz's own error as the caller gets it: one line naming the innermost kvfuzz and vLLM frames, and the traceback.
    A KvfuzzError (a call that does not fit this vLLM) says all in its message."""
    if isinstance(error, KvfuzzError):
        return {"error": one_line(error)}
    described = describe(error)
    return {"error": described.summary, "traceback": described.traceback}


if __name__ == "__main__":
    zygote_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5])
