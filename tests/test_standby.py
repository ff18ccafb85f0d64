"""Standby targets (fuzz/campaign/standby.py): the second pool on a target is forked from a process that imported it
already, gets the same answers, and never outlives what it may: its idle spell, the count, a changed tree or setting,
or a killed coordinator."""

from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from fuzz.campaign import protocol, standby
from fuzz.campaign.pool import Pool, RemoteTarget
from fuzz.corpus.file import load
from fuzz.targets.releases import TargetSource, resolve
from tests.processes import alive, children, wait_for

REPO = Path(__file__).resolve().parent.parent
SEED_CASE = REPO / "corpus" / "seeds" / "cpu-attn-lbhnc-two-layers.json"


@pytest.fixture
def standbys(monkeypatch):
    """A private standby folder (short: a socket's path has at most 107 bytes); its standbys stop with the test."""
    folder = Path(tempfile.mkdtemp(prefix="kvs-"))
    monkeypatch.setenv("KVFUZZ_STANDBY_DIR", str(folder))
    yield folder
    standby.stop_all()
    shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- the key


def fake_tree(root: Path) -> TargetSource:
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "utils.py").write_text("X = 1\n")
    return TargetSource(spec=str(root), kind="checkout", version=None, python_path=root)


def test_the_key_follows_the_tree_and_the_environment_but_not_what_varies_between_test_processes(tmp_path):
    source = fake_tree(tmp_path)
    env = {"PATH": "/bin", "VLLM_KV_CACHE_LAYOUT": "LBNHC", "PYTEST_XDIST_WORKER": "gw0"}
    first = standby.key(source, env)
    assert standby.key(source, {**env, "PYTEST_XDIST_WORKER": "gw1", "PWD": "/elsewhere", "KVFUZZ_KEEP_WARM": "5"}) == first
    assert standby.key(source, {**env, "VLLM_KV_CACHE_LAYOUT": "LHBNC"}) != first
    assert standby.key(source, {k: v for k, v in env.items() if k != "VLLM_KV_CACHE_LAYOUT"}) != first
    # A folder named again on the module path changes no import (a pool appends kvfuzz's own to a path that may hold it).
    def on_path(*folders: str) -> str:
        return standby.key(source, {**env, "PYTHONPATH": os.pathsep.join(folders)})

    assert on_path("/a", "/b", "/a") == on_path("/a", "/b") != on_path("/b", "/a")
    edited = tmp_path / "vllm" / "utils.py"
    edited.write_text("X = 2\n")  # same size: the modification time tells
    os.utime(edited, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert standby.key(source, env) != first
    (tmp_path / "vllm" / "new.py").write_text("")
    assert len({first, standby.key(source, env)}) == 2


# ------------------------------------------------------------------------------- the mechanics, without vLLM


def zygote_reporting_its_pid(request: dict) -> None:
    """What a standby's fork runs here: connect to the asker's address and say who it is."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(request["address"])
    with Connection(sock.detach()) as conn:
        protocol.send(conn, protocol.HELLO, {"pid": os.getpid(), "cwd": os.getcwd()})


def ask_and_hear(key: str, where: Path) -> tuple[int | None, dict | None]:
    address = where / f"asker-{key}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(address))
    listener.listen(1)
    try:
        pid = standby.ask(key, str(address), str(where), str(where / "log"))
        if pid is None:
            return None, None
        listener.settimeout(10)
        sock, _ = listener.accept()
        sock.setblocking(True)
        with Connection(sock.detach()) as conn:
            return pid, protocol.receive(conn)[1]
    finally:
        listener.close()
        address.unlink()


def test_a_standby_forks_for_each_asker_gives_way_to_newer_ones_and_leaves_when_idle(standbys, monkeypatch):
    monkeypatch.setenv("KVFUZZ_KEEP_WARM", "3")
    monkeypatch.setenv("KVFUZZ_KEEP_WARM_COUNT", "2")
    work = Path(tempfile.mkdtemp(prefix="kvw-"))
    try:
        assert ask_and_hear("k1", work) == (None, None)  # nothing left yet: the pool imports the target itself
        standby.leave("k1", zygote_reporting_its_pid)
        wait_for(lambda: "k1" in standby.running(), 10, "the standby of k1 listening")
        pid, said = ask_and_hear("k1", work)
        assert pid is not None and said == {"pid": pid, "cwd": str(work)}  # the fork works in the asker's folder
        kept = standby.running()["k1"]
        assert kept not in (os.getpid(), pid) and kept not in children(os.getpid())  # detached: no child of the campaign's

        time.sleep(0.1)
        standby.leave("k2", zygote_reporting_its_pid)
        wait_for(lambda: "k2" in standby.running(), 10, "the standby of k2 listening")
        ask_and_hear("k1", work)  # k1 is now the most recently used
        standby.leave("k3", zygote_reporting_its_pid)
        wait_for(lambda: set(standby.running()) == {"k1", "k3"}, 10, "k2, the least recently used, stopped for k3")
        assert ask_and_hear("k2", work) == (None, None)

        pids = standby.running()
        wait_for(lambda: not standby.running(), 15, "both standbys gone after 3 s without an asker")
        wait_for(lambda: not any(alive(pid) for pid in pids.values()), 10, "both standby processes ended")
        assert not list(standbys.glob("*.sock")) and not list(standbys.glob("*.pid"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_a_pinned_standby_is_never_evicted_and_takes_no_targets_place(standbys, monkeypatch):
    """The base standby (pinned) serves every target without one of its own: targets coming and going never stop it, and
    the count is the targets' alone."""
    monkeypatch.setenv("KVFUZZ_KEEP_WARM", "3")
    monkeypatch.setenv("KVFUZZ_KEEP_WARM_COUNT", "1")
    standby.leave("base", zygote_reporting_its_pid, pinned=True)
    wait_for(lambda: "base" in standby.running(), 10, "the pinned standby listening")
    base = standby.running()["base"]
    standby.leave("k1", zygote_reporting_its_pid)
    wait_for(lambda: set(standby.running()) == {"base", "k1"}, 10, "k1 beside the pinned standby (count 1)")
    time.sleep(0.1)
    standby.leave("k2", zygote_reporting_its_pid)
    wait_for(lambda: set(standby.running()) == {"base", "k2"}, 10, "k1 stopped for k2, the pinned standby kept")
    assert standby.running()["base"] == base
    wait_for(lambda: not standby.running(), 15, "all gone after 3 s without an asker, the pinned one too")
    assert not [path.name for path in standbys.iterdir() if not path.name.startswith(".")]


def test_keep_warm_0_leaves_no_standby_and_asks_none(standbys, monkeypatch):
    monkeypatch.setenv("KVFUZZ_KEEP_WARM", "0")
    standby.leave("k0", zygote_reporting_its_pid)
    time.sleep(0.5)
    assert not standby.running() and not list(standbys.iterdir())


# ------------------------------------------------------------------------------------- real targets (vLLM)


@pytest.mark.slow
def test_a_second_pool_is_forked_from_the_standby_and_gets_the_same_answers(standbys):
    source, case = resolve("installed"), load(SEED_CASE)
    with Pool(source, workers=1, keep_warm=False) as pool:
        assert not pool.warm
        cold = RemoteTarget(pool).execute(case, "cpu").to_dict()
    assert not standby.running()  # keep_warm=False (a mutant's tree) leaves none
    with Pool(source, workers=1) as pool:
        assert not pool.warm
        assert RemoteTarget(pool).execute(case, "cpu").to_dict() == cold
        key = pool.standby_key
    assert key in standby.running()
    with Pool(source, workers=1) as pool:
        assert pool.warm  # forked from the standby: no import of its own, however busy the machine
        zygote = pool.zygote.pid
        assert zygote in children(standby.running()[key])
        assert RemoteTarget(pool).execute(case, "cpu").to_dict() == cold
    wait_for(lambda: not alive(zygote), 10, "the forked zygote gone with its pool")


@pytest.mark.slow
@pytest.mark.parametrize("start", ["warm", "preloaded"])
def test_sigkill_of_a_warm_coordinator_takes_its_zygote_and_workers_down(standbys, tmp_path, start):
    """The zygote is a fork of a standby, no child of the coordinator: the target's own standby (warm), or the base with
    vLLM's dependencies imported when the target's own is gone (preloaded)."""
    source = resolve("installed")
    with Pool(source, workers=1) as pool:
        pass  # leaves the standby, and the first cold start in this folder the base
    pid = standby.running()[pool.standby_key]
    if start == "preloaded":
        wait_for(lambda: len(standby.running()) == 2, 60, "the base standby")
        standby.stop(pool.standby_key)
        (pid,) = standby.running().values()
    process = subprocess.Popen([sys.executable, "-m", "fuzz.cli", "run", "--max-time", "300", "--workers", "2", "--corpus",
                                str(tmp_path / "corpus"), "--quiet"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said = {"warm": "forked from a standby", "preloaded": "dependencies preloaded"}[start]
        assert said in process.stdout.readline() + process.stdout.readline()
        wait_for(lambda: any(len(children(z)) == 2 for z in children(pid)), 30, "a zygote of the standby with two workers")
        (zygote,) = children(pid)
        family = {zygote, *children(zygote)}
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    wait_for(lambda: not any(alive(p) for p in family), 10, "the zygote and its workers gone with their coordinator")
    assert alive(pid), "the standby stays for the next campaign"


@pytest.mark.slow
@pytest.mark.releases
def test_a_target_no_standby_holds_imports_only_its_vllm_in_a_fork_of_the_base_and_gets_the_same_answers(standbys):
    """The first cold start lists vLLM's dependencies and leaves the base standby; a second release then starts as a
    fork of the base that imports its own tree, and answers as the same release started from nothing does."""
    from fuzz.campaign import preload

    first, second, case = resolve("0.28.0"), resolve("0.27.1"), load(SEED_CASE)
    with Pool(second, workers=1, keep_warm=False) as pool:
        cold_info, cold = pool.info.to_dict(), RemoteTarget(pool).execute(case, "cpu").to_dict()
    with Pool(first, workers=1) as pool:
        assert not pool.preloaded
    listed = preload.modules_file().read_text().split()
    assert "torch" in listed and not any(name.partition(".")[0] in ("vllm", "fuzz", "oracles") for name in listed)
    wait_for(lambda: len(standby.running()) == 2, 60, "the base standby beside the first release's")
    with Pool(second, workers=1) as pool:
        assert pool.preloaded and not pool.warm
        assert pool.info.to_dict() == cold_info
        assert RemoteTarget(pool).execute(case, "cpu").to_dict() == cold
        key = pool.standby_key
    assert key in standby.running()  # the preloaded zygote leaves its own target's standby
    assert sorted(standby.label(k).split(" (")[0].split(" from ")[0] for k in standby.running()) == [
        "vLLM 0.27.1", "vLLM 0.28.0", "vLLM's dependencies"]


def test_the_base_is_keyed_without_what_only_vllm_reads(standbys, tmp_path):
    from fuzz.campaign import preload

    tree = str(tmp_path / "tree")
    env = {"PATH": "/bin", "PYTHONPATH": os.pathsep.join([tree, "/src"]), "VLLM_CACHE_ROOT": "/c/1", "TRITON_INTERPRET": "1"}
    base = preload.base_key(env, tree)
    assert preload.base_key({**env, "PYTHONPATH": os.pathsep.join(["/other", "/src"]), "VLLM_CACHE_ROOT": "/c/2"}, "/other") == base
    assert preload.base_key({**env, "TRITON_INTERPRET": "0"}, tree) != base  # read by a dependency
    assert preload.base_key({**env, "PYTHONPATH": os.pathsep.join([tree, "/src", "/more"])}, tree) != base
    assert preload.base_environment(env, tree) == {"PATH": "/bin", "PYTHONPATH": "/src", "TRITON_INTERPRET": "1"}
    # The fork sets the bytecode switch for its own import (a release's tree wants its bytecode written, a checkout maybe not).
    assert preload.base_key({**env, "PYTHONDONTWRITEBYTECODE": "1"}, tree) == base


def test_the_base_is_keyed_without_what_vllm_s_import_sets(standbys, tmp_path):
    """A pool started by a process that imported vLLM before (an in-process target, a test session) holds the variables
    vLLM's import set: it asks the same base as a pool started by a fresh process."""
    from fuzz.campaign import preload

    tree = str(tmp_path / "tree")
    env = {"PATH": "/bin", "PYTHONPATH": os.pathsep.join([tree, "/src"])}
    preload.modules_file().write_text("json\n")
    preload.record_modules({"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    base = preload.base_key(env, tree)
    assert preload.base_key({**env, "TORCHINDUCTOR_COMPILE_THREADS": "1"}, tree) == base
    assert preload.base_key({**env, "TORCHINDUCTOR_COMPILE_THREADS": "4"}, tree) != base  # not what vLLM would have set
    preload.record_modules({"TORCHINDUCTOR_COMPILE_THREADS": "8"})  # written once: the first zygote's list stays
    assert preload.base_key({**env, "TORCHINDUCTOR_COMPILE_THREADS": "1"}, tree) == base


def test_a_measurement_waits_only_for_a_base_that_is_importing(standbys, tmp_path):
    from fuzz.campaign import preload

    env, tree = {"PATH": "/bin"}, str(tmp_path / "tree")
    starting = standbys / f"{preload.base_key(env, tree)}.starting"

    def waited() -> float:
        began = time.monotonic()
        preload.wait_for_base(env, tree, timeout=1.0)
        return time.monotonic() - began

    assert waited() < 0.5  # no base was started
    starting.touch()
    assert waited() >= 1.0  # one is importing and does not answer yet: wait, up to the timeout
    old = time.time() - preload.IMPORT_LIMIT - 1
    os.utime(starting, (old, old))
    assert waited() < 0.5  # a marker older than an import may take: a base that never came


def test_a_base_still_importing_when_the_standbys_stop_does_not_start(standbys, tmp_path):
    from fuzz import SOURCE_ROOT
    from fuzz.campaign import preload

    (tmp_path / "slow_dependency.py").write_text("import time\ntime.sleep(3)\n")
    preload.modules_file().write_text("json\nslow_dependency\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SOURCE_ROOT)])}
    preload.leave_base(env, None)
    key = preload.base_key(env, None)

    def importing() -> list[int]:
        return [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if alive(pid) and key in _cmdline(pid)]

    wait_for(lambda: importing(), 10, "the base importing")
    assert standby.stop_all() == 0
    wait_for(lambda: not importing(), 20, "the base gone without starting")
    assert key not in standby.running()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_the_standby_command_lists_them_and_stops_them(standbys, monkeypatch):
    from fuzz import cli

    monkeypatch.setenv("KVFUZZ_KEEP_WARM", "60")
    standby.leave("k9", zygote_reporting_its_pid, label="vLLM 9.9.9 from /somewhere")
    wait_for(lambda: "k9" in standby.running(), 10, "the standby of k9 listening")
    pid = standby.running()["k9"]
    listed = io.StringIO()
    assert cli.main(["standby"], stdout=listed) == 0
    assert f"k9  pid {pid}  vLLM 9.9.9 from /somewhere\n" in listed.getvalue() and "1 standby(s)" in listed.getvalue()
    stopped = io.StringIO()
    assert cli.main(["standby", "--stop"], stdout=stopped) == 0
    assert "stopped 1 standby(s)" in stopped.getvalue()
    wait_for(lambda: not alive(pid), 10, "the standby gone")
