"""Messages between the coordinator, the zygote and the workers: (name, JSON payload) pairs.

Every name is declared here once, with the direction it travels; receivers dispatch on it and
refuse unknown names. Payloads are plain JSON (cases, findings, outcomes as dicts), never
pickled objects, so nothing a target does can run code in the coordinator.

coordinator -> zygote : SPAWN {worker, slot}, SHUTDOWN {}
zygote -> coordinator : READY {info, pid}, EXITED {worker, pid, status}, FAILED {error}
coordinator -> worker : FUZZ {batch, seed, start, count, synthetic, device, known, probe_every, probe_kind, consumers_every},
                        EXECUTE {id, case, device, probe}, ACK {}, STOP {}
worker -> coordinator : HELLO {worker, pid}, FINDING {batch, index, case, finding},
                        MINIMIZED {batch, index, case, finding, steps}, BATCH {batch, done, tallies...},
                        EXECUTED {id, execution} or {id, error} (kvfuzz could not run the case)
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

SPAWN, SHUTDOWN = "spawn", "shutdown"
READY, EXITED, FAILED = "ready", "exited", "failed"
FUZZ, EXECUTE, ACK, STOP = "fuzz", "execute", "ack", "stop"
HELLO, FINDING, MINIMIZED, BATCH, EXECUTED = "hello", "finding", "minimized", "batch", "executed"
NAMES = frozenset({SPAWN, SHUTDOWN, READY, EXITED, FAILED, FUZZ, EXECUTE, ACK, STOP, HELLO, FINDING, MINIMIZED, BATCH, EXECUTED})


class ProtocolError(Exception):
    pass


@dataclass(frozen=True)
class Task:
    """A FUZZ batch: cases start .. start+count-1 of the campaign, each drawn from (seed, index) alone. Its defaults are
    the only ones: the coordinator sends `to_dict()`, the worker reads `from_dict()`."""

    batch: int
    seed: int
    start: int
    count: int
    synthetic: bool
    device: str
    campaign: str | None = None  # a worker outlives campaigns: a new one forgets the last one's findings
    known: tuple[str, ...] = ()  # signatures the campaign has already: not reported again
    probe_every: int = 0
    probe_kind: str = "physical"
    consumers_every: int | None = 0  # None: the worker's schedule decides where the deeper checks run
    scale: str = "small"
    max_buffer_bytes: int = 1 << 30
    shrink_seconds: float = 60.0  # how long the worker may shrink a finding (the campaign's time left)
    changed: list[dict[str, Any]] | None = None  # kvfuzz ci: the changed functions to trace (fuzz.ci.direct)
    policy: dict[str, Any] | None = None  # kvfuzz ci: the directed draws' policy, once warmed up

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "known": list(self.known)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Task:
        try:
            return cls(**{**data, "known": tuple(data.get("known", ()))})
        except TypeError as error:  # a missing or unknown field
            raise ProtocolError(f"bad FUZZ task: {error}") from None


def send(conn: Connection, name: str, payload: dict[str, Any] | None = None) -> None:
    if name not in NAMES:
        raise ProtocolError(f"unknown message {name!r}")
    conn.send_bytes(json.dumps([name, payload or {}], separators=(",", ":")).encode())


def receive(conn: Connection) -> tuple[str, dict[str, Any]]:
    name, payload = json.loads(conn.recv_bytes())
    if name not in NAMES:
        raise ProtocolError(f"unknown message {name!r}")
    return name, payload


IDLE, RUNNING, SHRINKING, WAITING = 0, 1, 2, 3  # Slot phases
READS = 100  # a Slot read retried at most this often while the worker writes it (one write takes nanoseconds)


class Slot:
    """What a worker is doing right now, in a small shared file the coordinator can read after
    the worker died: (batch, case index, start time in ns, phase). While SHRINKING, the case is
    the finding being shrunk and the time is the current candidate's start. WAITING: the case
    found something and the worker waits for the coordinator's ack, which takes no case timeout."""

    FORMAT = "<qqqq"
    SIZE = struct.calcsize(FORMAT)

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.exists() or path.stat().st_size < self.SIZE:
            path.write_bytes(b"\0" * self.SIZE)
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, self.SIZE)

    def start(self, batch: int, index: int, phase: int = RUNNING) -> None:
        struct.pack_into(self.FORMAT, self._map, 0, batch, index, time.monotonic_ns(), phase)

    def finish(self) -> None:
        struct.pack_into("<q", self._map, 24, IDLE)

    def read(self) -> tuple[int, int, int, int]:
        """(batch, index, start time, phase), read until two reads agree. The worker may be writing the slot as it is
        read, and one read can then hold the new phase with the old start time: a case that has just begun would look as
        old as the worker's last one (or as the clock's epoch, in a fresh slot) and be killed as a hang."""
        last = struct.unpack_from(self.FORMAT, self._map, 0)
        for _ in range(READS):
            now = struct.unpack_from(self.FORMAT, self._map, 0)
            if now == last:
                break
            last = now
        batch, index, started, phase = last
        return batch, index, started, phase

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
