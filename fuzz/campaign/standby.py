"""A started target kept warm between campaigns: the second campaign on a release or tree starts in well under a second.

Importing vLLM takes seconds; forking a process that has imported it takes milliseconds. When a pool's zygote has
imported its target, it leaves a copy of itself behind (a fork, detached from the campaign): the standby. The standby
listens on a socket named after everything the zygote's state depends on (the interpreter, kvfuzz's own source, the
target's tree and the environment), so a later pool with the same key asks it for a zygote instead of importing again:
the standby forks, and the fork connects to the new pool as a freshly started zygote would (fuzz/campaign/worker.py).

A standby that no pool asked for `KVFUZZ_KEEP_WARM` seconds (default 600; 0 turns standbys off) exits; at most
`KVFUZZ_KEEP_WARM_COUNT` (default 4) targets' standbys run at once, the least recently used giving way. The base standby
(fuzz/campaign/preload.py) is pinned: it serves every target that has no standby of its own, so targets coming and going
never evict it (it still leaves when idle). Any change to a file of the target
or of kvfuzz, or to the environment, makes a new key: a standby never serves code or settings other than its own.
Standbys live in a folder only this user can enter (`kvfuzz-standby-<uid>` in the temporary folder).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from fuzz import SOURCE_ROOT
from fuzz.campaign import protocol
from fuzz.targets.releases import TargetSource

try:
    import fcntl
except ImportError:  # not POSIX: no standbys
    fcntl = None  # type: ignore[assignment]

DEFAULT_SECONDS = 600.0
DEFAULT_COUNT = 4
# Variables that differ between processes of one session and that nothing in a target process reads.
VOLATILE = ("PWD", "OLDPWD", "SHLVL", "_", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID",
            "PYTEST_XDIST_WORKER_COUNT", "COLUMNS", "LINES", "KVFUZZ_KEEP_WARM", "KVFUZZ_KEEP_WARM_COUNT", "KVFUZZ_STANDBY_DIR")
ASK_TIMEOUT = 5.0  # seconds for a standby to answer a request for a zygote
SIDE_FILES = (".pid", ".label", ".pinned")  # beside a standby's socket, removed with it


def idle_seconds(env: Mapping[str, str] | None = None) -> float:
    text = (os.environ if env is None else env).get("KVFUZZ_KEEP_WARM", "")
    try:
        return max(0.0, float(text)) if text else DEFAULT_SECONDS
    except ValueError:
        return DEFAULT_SECONDS


def max_count(env: Mapping[str, str] | None = None) -> int:
    text = (os.environ if env is None else env).get("KVFUZZ_KEEP_WARM_COUNT", "")
    return max(1, int(text)) if text.isdigit() else DEFAULT_COUNT


def folder() -> Path:
    """The standbys' sockets (`KVFUZZ_STANDBY_DIR` where set: a test session keeps its own and stops them at its end);
    created private (0700) and refused if anyone else owns it or can enter it."""
    path = Path(os.environ.get("KVFUZZ_STANDBY_DIR") or Path(tempfile.gettempdir()) / f"kvfuzz-standby-{os.getuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    status = path.stat()
    if status.st_uid != os.getuid() or status.st_mode & 0o077:
        raise PermissionError(f"{path} is not private to this user")
    return path


def key(source: TargetSource, env: Mapping[str, str]) -> str:
    """What a target process's state depends on: the interpreter, kvfuzz's source, the target's tree, the environment."""
    return key_of(env, _vllm_root(source))


def key_of(env: Mapping[str, str], tree: Path | None = None) -> str:
    """The key of a process that imported kvfuzz, `tree` (a vLLM tree, or none) and its dependencies in `env`."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(sys.executable.encode())
    for root in (SOURCE_ROOT / "fuzz", SOURCE_ROOT / "oracles", tree):
        digest.update(_tree_stamp(root))
    for name in sorted(set(env) - set(VOLATILE)):
        value = _first_entries(env[name]) if name == "PYTHONPATH" else env[name]
        digest.update(f"\0{name}={value}".encode())
    return digest.hexdigest()


def _first_entries(path: str) -> str:
    """A module path with each folder at its first place only: a folder named again (kvfuzz's own, which a pool appends
    to a path that may hold it already) changes no import."""
    return os.pathsep.join(dict.fromkeys(path.split(os.pathsep)))


def _vllm_root(source: TargetSource) -> Path | None:
    if source.python_path is not None:
        return source.python_path / "vllm"
    found = importlib.util.find_spec("vllm")
    return Path(found.origin).parent if found is not None and found.origin else None


def _tree_stamp(root: Path | None) -> bytes:
    """Every Python file under `root` with its size and modification time (a tenth of a second for vLLM's tree)."""
    if root is None:
        return b"-"
    parts = []
    for folder_name, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder_name, name)
                try:
                    status = os.stat(path)
                except OSError:
                    continue
                parts.append(f"{path}\0{status.st_size}\0{status.st_mtime_ns}")
    return "\n".join(sorted(parts)).encode()


def ask(standby_key: str, address: str, cwd: str, log: str, patch: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None) -> int | None:
    """Ask the standby of `standby_key` for a zygote that connects to `address` (with `patch` applied to its target
    first: fuzz/mutate/swap.py; `extra`, more for the standby's own kind: fuzz/campaign/preload.py): its pid, or None
    when no standby answers (none was left, or it just exited)."""
    if fcntl is None or idle_seconds() == 0:
        return None
    path = folder() / f"{standby_key}.sock"
    if not path.exists():
        return None
    try:
        with _connect(path) as conn:
            protocol.send(conn, protocol.SPAWN, {**(extra or {}), "address": address, "cwd": cwd, "log": log, "patch": patch})
            if not conn.poll(ASK_TIMEOUT):
                return None
            name, payload = protocol.receive(conn)
    except (OSError, EOFError):
        return None
    return int(payload["pid"]) if name == protocol.READY else None


def _connect(path: Path) -> Connection:
    """A connection to the standby at `path`; connecting waits at most ASK_TIMEOUT (a standby whose backlog is full)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(ASK_TIMEOUT)
        sock.connect(str(path))
        sock.setblocking(True)  # a Connection reads whole messages
    except OSError:
        sock.close()
        raise
    return Connection(sock.detach())


def leave(standby_key: str, serve_zygote: Any, label: str = "", pinned: bool = False) -> None:
    """Called by a zygote that has imported its target: fork a standby that outlives it (detached, in a session of its
    own), which forks a zygote running `serve_zygote(request)` for every pool that asks; `label` says what it holds
    (`kvfuzz standby` lists it); a `pinned` standby is never evicted to make room for another."""
    if fcntl is None or idle_seconds() == 0:
        return
    first = os.fork()
    if first:
        os.waitpid(first, 0)
        return
    try:  # the middle process: detach, fork the standby, exit (the standby is no child of the campaign's)
        os.setsid()
        if os.fork() == 0:
            _standby_main(standby_key, serve_zygote, label, pinned)
    finally:
        os._exit(0)


def _standby_main(standby_key: str, serve_zygote: Any, label: str, pinned: bool) -> None:
    for fd in range(3, 1024):  # the zygote's connections (its pool sees their end as the zygote's) and files
        with contextlib.suppress(OSError):
            os.close(fd)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # its zygotes are reaped by the kernel
    path = folder() / f"{standby_key}.sock"
    listener = _bind(path, label, pinned)
    if listener is not None and _serve(listener, path, serve_zygote) == "idle":
        _unbind(path, listener)


def _bind(path: Path, label: str = "", pinned: bool = False) -> socket.socket | None:
    """The standby's socket, unless a live standby of the same key holds it; then the least recently used standbys
    beyond the count are stopped (pinned ones neither count nor go)."""
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _answers(path):
            return None
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(16)
        path.with_suffix(".pid").write_text(str(os.getpid()))
        path.with_suffix(".label").write_text(label)
        if pinned:
            path.with_suffix(".pinned").touch()
        else:
            _evict(path, max_count())
        return listener


def _unbind(path: Path, listener: socket.socket) -> None:
    """Leave after an idle spell: under the lock, so that no pool is told of a standby that is going."""
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        listener.close()
        _remove(path)


def _answers(path: Path) -> bool:
    try:
        _connect(path).close()
    except OSError:
        return False
    return True


def _evict(keep: Path, count: int) -> None:
    """Stop the least recently used standbys that are not pinned so that at most `count` remain, `keep` among them."""
    others = sorted((p for p in keep.parent.glob("*.sock") if p != keep and not p.with_suffix(".pinned").exists()),
                    key=lambda p: p.stat().st_mtime if p.exists() else 0)
    for path in others[: max(0, len(others) - (count - 1))]:
        _stop(path)


def running() -> dict[str, int]:
    """The standbys that answer, by key: their pids."""
    found = {}
    for path in folder().glob("*.sock"):
        with contextlib.suppress(OSError, ValueError):
            if _answers(path):
                found[path.stem] = int(path.with_suffix(".pid").read_text())
    return found


def label(standby_key: str) -> str:
    """What the standby of `standby_key` holds, as it said when it started ("" if it said nothing)."""
    try:
        return (folder() / f"{standby_key}.label").read_text()
    except OSError:
        return ""


def stop_all() -> int:
    """Stop every standby in the folder, and tell those still starting not to start (fuzz/campaign/preload.py); how many
    answered."""
    for starting in folder().glob("*.starting"):
        with contextlib.suppress(FileNotFoundError):
            starting.unlink()
    stopped = 0
    for path in folder().glob("*.sock"):
        stopped += _answers(path)
        _stop(path)
    return stopped


def stop(standby_key: str) -> None:
    """Stop the standby of `standby_key`, if one runs."""
    _stop(folder() / f"{standby_key}.sock")


def _stop(path: Path) -> None:
    with contextlib.suppress(OSError), _connect(path) as conn:
        protocol.send(conn, protocol.SHUTDOWN)
    _remove(path)


def _remove(path: Path) -> None:
    """A standby's socket and the files beside it."""
    for stale in (path, *(path.with_suffix(suffix) for suffix in SIDE_FILES)):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()


def _serve(listener: socket.socket, path: Path, serve_zygote: Any) -> str:
    """Fork a zygote for every pool that asks, until idle for too long ("idle") or told to stop ("stopped": whoever
    stopped it removed its socket)."""
    idle = idle_seconds()
    last = time.monotonic()
    while True:
        left = last + idle - time.monotonic()
        if left <= 0:
            return "idle"
        listener.settimeout(left)
        try:
            sock, _ = listener.accept()
        except OSError:  # the idle spell is over (TimeoutError), or the socket is gone
            return "idle"
        sock.setblocking(True)
        conn = Connection(sock.detach())
        try:
            if not conn.poll(ASK_TIMEOUT):
                raise EOFError
            name, request = protocol.receive(conn)
        except (OSError, EOFError, ValueError):
            conn.close()
            continue
        if name == protocol.SHUTDOWN:
            conn.close()
            return "stopped"
        last = time.monotonic()  # a connection that asks nothing (a look whether the standby answers) is no use
        with contextlib.suppress(OSError):
            os.utime(path)  # the most recently used standby is the last evicted
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _become_zygote(request, serve_zygote)
            os._exit(0)
        with contextlib.suppress(OSError):
            protocol.send(conn, protocol.READY, {"pid": pid})
        conn.close()


def _become_zygote(request: dict[str, Any], serve_zygote: Any) -> None:
    """The fork of a standby, set up as a zygote the pool had started itself: its own session, its folder, its log."""
    os.setsid()
    os.chdir(request["cwd"])
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(log, 2)
    os.close(log)
    serve_zygote(request)


class Adopted:
    """A zygote a standby forked for a pool: no child of the pool's process, so it is watched by its pid (the standby
    reaps it, so its exit status is not known)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return 0
        except PermissionError:
            return None
        return None

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"zygote {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return None
