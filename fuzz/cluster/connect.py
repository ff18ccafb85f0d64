"""Joining a Ray cluster for a campaign, and what it offers.

kvfuzz's own packages travel as the job's py_modules (`runtime_env`), so every node fuzzes with
the same kvfuzz and needs neither a package index nor kvfuzz installed. `connect` joins the
cluster at an address, or with "auto" the running one (probed first: Ray waits minutes on a
stale address), else starts a local one. Ray is optional: this module imports without it.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import fuzz
import oracles
from fuzz.errors import TargetError

INSTALL_HINT = "--ray needs Ray: pip install 'kvfuzz[ray]' (or pip install ray)"
_EXCLUDES = ["__pycache__", "*.pyc"]


def runtime_env() -> dict[str, Any]:
    """The Ray job runtime environment that ships kvfuzz's own packages to every node (Ray accepts
    local folders only for a whole job, in ray.init, not per actor)."""
    return {"py_modules": [str(Path(fuzz.__file__).resolve().parent), str(Path(oracles.__file__).resolve().parent)],
            "excludes": _EXCLUDES}


def connect(address: str) -> None:
    """ray.init for a campaign, shipping kvfuzz: at `address`, or ("auto") the running cluster, else a new local one."""
    import ray

    quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING, "runtime_env": runtime_env()}
    if address != "auto":
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, ValueError, RuntimeError) as error:
            raise TargetError(f"--ray {address}: cannot join the Ray cluster: {first_line(error)}") from None
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


def cluster_slots(device: str) -> int:
    """Fuzzing actors the cluster has room for: its GPUs for cuda, else its CPUs."""
    import ray

    resources = ray.cluster_resources()
    slots = int(resources.get("GPU" if device.startswith("cuda") else "CPU", 0))
    if slots < 1:
        raise TargetError(f"the Ray cluster offers no {'GPU' if device.startswith('cuda') else 'CPU'} ({resources_text()})")
    return slots


def resources_text() -> str:
    """The cluster's live nodes, CPUs and GPUs, for error messages."""
    import ray

    resources = ray.cluster_resources()
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    return f"{nodes} node(s), {resources.get('CPU', 0):g} CPU, {resources.get('GPU', 0):g} GPU"


def first_line(error: BaseException) -> str:
    """An error's first non-empty line (its type's name when it has none), at most 300 characters."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines or [type(error).__name__])[0][:300]
