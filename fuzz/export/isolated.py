"""Running an exported test module as a vLLM maintainer would: a Python with vllm, torch and pytest, and no kvfuzz.

The interpreter is kvfuzz's own (it has torch and pytest), started in an empty folder with the release's tree first
on PYTHONPATH; before pytest starts, kvfuzz's editable-install finder and the repository leave sys.path and
sys.meta_path, the test checks that `fuzz` and `oracles` cannot be imported, and kvfuzz's pytest plugin is off.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fuzz import SOURCE_ROOT

BOOT = """
import importlib.util, sys
def kvfuzz_s(entry):
    return str(getattr(entry, "__module__", "")).startswith("__editable__") or "__editable__" in str(entry)
sys.meta_path[:] = [f for f in sys.meta_path if not kvfuzz_s(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not kvfuzz_s(h)]
sys.path[:] = [p for p in sys.path if p and not kvfuzz_s(p) and p.rstrip("/") != {root!r}]
sys.path_importer_cache.clear()
for name in ("fuzz", "oracles"):
    assert importlib.util.find_spec(name) is None, name + " is importable: the run is not isolated from kvfuzz"
import pytest
sys.exit(pytest.main(["-q", "-p", "no:kvfuzz", "-p", "no:cacheprovider", "-p", "no:randomly", "-W", "ignore", *sys.argv[1:]]))
"""


@dataclass(frozen=True)
class Run:
    status: int  # pytest's exit status: 0 passed, 1 a test failed, 5 nothing collected (the module skipped itself), else errors
    output: str

    @property
    def outcome(self) -> str:
        lines = self.output.strip().splitlines()
        summary = lines[-1] if lines else ""
        if self.status in (0, 5) and "skipped" in summary and "passed" not in summary:
            return "skip"
        return {0: "pass", 1: "fail"}.get(self.status, f"error ({self.status})")


def run_isolated(test_file: Path, vllm_tree: Path | None, timeout: float = 600.0) -> Run:
    """Runs one test module with the vLLM at `vllm_tree` (the folder holding `vllm/`; None: the installed one)."""
    return _run([test_file], vllm_tree, timeout)


def run_isolated_many(test_files: list[Path], vllm_tree: Path | None, timeout: float = 600.0) -> dict[str, str]:
    """Runs several test modules in one pytest session (one import of vLLM, as a maintainer's suite runs them) and
    returns each module's outcome by file name: pass, fail, skip or error (it did not import)."""
    names = [path.name for path in test_files]
    assert len(set(names)) == len(names), "modules of one run need distinct file names"
    run = _run(test_files, vllm_tree, timeout, "-rA")
    return {name: _outcome_of(name, run.output) for name in names}


SUMMARY = (("ERROR", "error"), ("FAILED", "fail"), ("PASSED", "pass"), ("SKIPPED", "skip"))  # the first one said wins


def _outcome_of(name: str, output: str) -> str:
    """A module's outcome from pytest's `-rA` short summary (`PASSED f.py::t`, `FAILED f.py::t - ...`, `ERROR f.py`,
    `SKIPPED [1] f.py:3: ...`); a module the summary does not name did not run."""
    said = set()
    for line in output.splitlines():
        word, _, rest = line.partition(" ")
        where = rest.lstrip("[0123456789] ")
        if where == name or where.startswith((name + ":", name + " ")):
            said.add(word)
    return next((outcome for word, outcome in SUMMARY if word in said), "error")


def _run(test_files: list[Path], vllm_tree: Path | None, timeout: float, *options: str) -> Run:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if vllm_tree is not None:
        env["PYTHONPATH"] = str(vllm_tree)
        env["VLLM_TARGET_DEVICE"] = "cpu"  # a release's bare tree carries no metadata saying it is a CPU build
    with tempfile.TemporaryDirectory(prefix="kvfuzz-isolated-") as folder:
        for test_file in test_files:
            (Path(folder) / test_file.name).write_text(test_file.read_text())
        boot = BOOT.format(root=str(SOURCE_ROOT))
        done = subprocess.run([sys.executable, "-c", boot, *options, *(path.name for path in test_files)], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)
    return Run(done.returncode, done.stdout + done.stderr)
