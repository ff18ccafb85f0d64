"""The node side of a Ray campaign: the actor that fuzzes on a node, and the vLLM shipped to it.

Each fuzzing actor (`NodeRelay`) runs in its own process on its node and owns a local
`fuzz.campaign.pool.Pool` with one worker (a zygote plus one fork), so a target that segfaults, hangs or
eats memory is caught on the node exactly as on one machine and comes back as a `Loss` event. An
actor call relays one stretch of a FUZZ batch: it returns the worker's messages once the batch
ends, a worker is lost, or a FINDING arrives; after a finding the actor waits for `ack`, so every
finding is on the coordinator's disk before that worker runs its next case.

A release or checkout is packed into a tar (`pack_target`) that a `TargetDepot` actor on the
driver's node hands out through Ray's object store; each node unpacks it once (`unpack_target`).
This module travels to the nodes with the rest of the `fuzz` package (the job's py_modules,
`fuzz.cluster.connect.runtime_env`), so Ray finds these classes there by module path.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from fuzz import SOURCE_ROOT
from fuzz.campaign import protocol
from fuzz.campaign.pool import Pool
from fuzz.targets.releases import TargetSource

RELAY_POLL_S = 0.2  # seconds an actor waits on its local pool per poll


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
                  "kvfuzz": str(SOURCE_ROOT / "fuzz"), "target_path": self.target_path}
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

    def execute(self, case: dict[str, Any], device: str, probe: bool | str) -> dict[str, Any]:
        from fuzz.case import from_dict

        assert self.pool is not None
        execution = self.pool.execute(from_dict(case), device, probe=probe)
        return {"execution": execution.to_dict(), "restarts": self.pool.restarts}

    def refresh(self) -> None:
        """Re-fork the local worker, so that the next case runs on one that has run nothing yet."""
        assert self.pool is not None
        self.pool.interrupt(0)

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
