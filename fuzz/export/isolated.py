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
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if vllm_tree is not None:
        env["PYTHONPATH"] = str(vllm_tree)
        env["VLLM_TARGET_DEVICE"] = "cpu"  # a release's bare tree carries no metadata saying it is a CPU build
    with tempfile.TemporaryDirectory(prefix="kvfuzz-isolated-") as folder:
        local = Path(folder) / test_file.name
        local.write_text(test_file.read_text())
        boot = BOOT.format(root=str(SOURCE_ROOT))
        done = subprocess.run([sys.executable, "-c", boot, str(local)], cwd=folder, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)
    return Run(done.returncode, done.stdout + done.stderr)
