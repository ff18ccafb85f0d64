"""A process that has imported vLLM's dependencies, kept warm: a target no standby holds yet starts in a fraction of its
cold import.

Most of a cold target start is not vLLM's own code: torch, its compiler packages, transformers, openai and the rest of
vLLM's dependencies take about three quarters of it, and they are the same for every release and checkout run by one
interpreter. A zygote that imported its target the slow way writes the names of the other modules it imported, in
import order, next to the standbys (`record_modules`); the pool then leaves a *base* standby that imports just those
modules (`python -m fuzz.campaign.preload`). The next pool whose target has no standby of its own asks the base for a
zygote: the fork takes the pool's environment and module path and imports only vLLM's tree (`_become_target`), then
leaves its own target standby as any zygote does (fuzz/campaign/standby.py).

The base is keyed like a standby (the interpreter, kvfuzz's source, the environment) but without what only the target's
import reads: the vLLM tree on the module path, `VLLM_*` variables and PYTHONDONTWRITEBYTECODE (the fork sets it for its
own import), and without the variables vLLM's import sets itself (`record_modules` lists them too), which a pool's
environment holds when its process imported vLLM before (an in-process target, a test session). A module list that pulls
in any `vllm` module is refused, so a target always imports its own tree. One difference from a cold start remains by
design: the dependencies were imported before vLLM set its import-time environment overrides (compiler thread counts and
the like, which no layout reads).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fuzz.campaign import standby
from fuzz.campaign.module_list import modules_file, overrides_file, record_modules, recorded_overrides

__all__ = ["modules_file", "overrides_file", "record_modules"]

IMPORT_LIMIT = 120  # seconds the base may take to import the listed modules


def base_environment(env: Mapping[str, str], tree: str | None) -> dict[str, str]:
    """`env` without what only the target's import reads (its tree on PYTHONPATH, the VLLM_* variables,
    PYTHONDONTWRITEBYTECODE) and without the variables vLLM's import would set to the value they hold."""
    overrides = recorded_overrides()
    kept = {name: value for name, value in env.items()
            if not name.startswith("VLLM_") and name != "PYTHONDONTWRITEBYTECODE" and overrides.get(name) != value}
    parts = [part for part in env.get("PYTHONPATH", "").split(os.pathsep) if part and part != tree]
    kept["PYTHONPATH"] = os.pathsep.join(parts)
    return kept


def base_key(env: Mapping[str, str], tree: str | None) -> str:
    path = modules_file()
    listed = path.read_bytes() if path.exists() else b""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(b"preload\0" + hashlib.blake2b(listed).digest())
    digest.update(standby.key_of(base_environment(env, tree)).encode())
    return digest.hexdigest()


def ask(env: Mapping[str, str], tree: str | None, address: str, cwd: str, log: str, max_memory: int, standby_key: str) -> int | None:
    """A zygote forked from the base standby that imports the target itself: its pid, or None without a base."""
    request = {"env": dict(env), "max_memory": max_memory, "standby_key": standby_key}
    return standby.ask(base_key(env, tree), address, cwd, log, extra=request)


def leave_base(env: Mapping[str, str], tree: str | None) -> None:
    """Start the base standby in the background, unless one answers or no zygote has listed its modules yet."""
    if not modules_file().exists() or not standby.idle_seconds():
        return
    key = base_key(env, tree)
    starting = standby.folder() / f"{key}.starting"
    with contextlib.suppress(FileNotFoundError):
        if time.time() - starting.stat().st_mtime < IMPORT_LIMIT:
            return  # one is importing (pools that start at once start one base), or hung and about to be stopped
    if key in standby.running():
        return
    starting.touch()
    base_env = base_environment(env, tree)
    if "PYTHONDONTWRITEBYTECODE" in env:  # the user's choice for the dependencies' bytecode too
        base_env["PYTHONDONTWRITEBYTECODE"] = env["PYTHONDONTWRITEBYTECODE"]
    subprocess.Popen([sys.executable, "-m", "fuzz.campaign.preload", key, str(modules_file()), str(starting)], env=base_env,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                     cwd=standby.folder())


def wait_for_base(env: Mapping[str, str], tree: str | None, timeout: float = IMPORT_LIMIT) -> None:
    """Return once the base a pool of `env` and `tree` would ask for answers, if one started importing in the last
    IMPORT_LIMIT seconds (a measurement that follows should not share the cores with its imports); at most `timeout`."""
    key = base_key(env, tree)
    starting = standby.folder() / f"{key}.starting"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and key not in standby.running():
        try:
            if time.time() - starting.stat().st_mtime >= IMPORT_LIMIT:
                return
        except FileNotFoundError:
            return
        time.sleep(0.2)


def _base_main(key: str, listed: str, starting: str) -> None:
    signal.alarm(IMPORT_LIMIT)  # a module whose import hangs: no base, and the next cold start may try again
    names = Path(listed).read_text().split()
    for name in [*names, "fuzz.campaign.worker"]:
        with contextlib.suppress(Exception):  # a module that needs what only vLLM sets up: vLLM imports it itself
            importlib.import_module(name)
    if any(name.partition(".")[0] == "vllm" for name in sys.modules):
        return  # a dependency imported vLLM: its tree would not be the target's
    if not Path(starting).exists():
        return  # the standbys were stopped (`kvfuzz standby --stop`, a test session's end) while this one imported
    signal.alarm(0)
    gc.freeze()
    base_path = [part for part in os.environ.get("PYTHONPATH", "").split(os.pathsep) if part]
    standby.leave(key, lambda request: _become_target(request, base_path), label=f"vLLM's dependencies ({len(names)} modules), preloaded",
                  pinned=True)


def _become_target(request: dict[str, Any], base_path: list[str]) -> None:
    """The base's fork: the pool's environment and module path, then a zygote that imports the target's vLLM."""
    from fuzz.campaign.worker import load_and_serve

    os.environ.clear()
    os.environ.update(request["env"])
    sys.dont_write_bytecode = bool(request["env"].get("PYTHONDONTWRITEBYTECODE"))  # read at start-up: the base's own
    wanted = [part for part in request["env"].get("PYTHONPATH", "").split(os.pathsep) if part]
    sys.path[:] = [*wanted, *(part for part in sys.path if part not in base_path and part not in wanted)]
    importlib.invalidate_caches()
    load_and_serve(request["address"], request["max_memory"], request["standby_key"], record=False)


if __name__ == "__main__":
    _base_main(sys.argv[1], sys.argv[2], sys.argv[3])
