"""Entry points are found where a refactor moved them, and a missing one turns its check off.

The fast tests probe tiny fake `vllm` packages in a subprocess; the slow ones refactor a copy of
the installed vLLM (laid out as a source checkout: vllm/ beside csrc/, tests/ and setup.py, no
compiled extensions) and fuzz it through the command line.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.cli import main

REPO = Path(__file__).resolve().parents[1]


def fake_vllm(root: Path, files: dict[str, str]) -> Path:
    """A `vllm` package holding just these modules (every folder a package)."""
    for name, text in {"vllm/__init__.py": '__version__ = "9.0.0"\n', **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            if str(parent) != ".":
                (root / parent / "__init__.py").touch()
        path.write_text(text)
    return root


def probe_in(root: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


PLANNER = "def get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, available_memory):\n    return 'planned'\n"


def test_a_moved_entry_point_is_found_by_its_definition(tmp_path):
    root = fake_vllm(tmp_path, {
        "vllm/v1/core/kv_cache_utils.py": "def unrelated():\n    pass\n",
        "vllm/v1/core/placement/tensors.py": PLANNER,
    })
    code = "from fuzz.targets.entry_points import Probe; f = Probe('9.0.0').find('planner'); print(f.where, f.obj(1, 2, 3))"
    result = probe_in(root, code)
    assert result.stdout.split() == ["vllm.v1.core.placement.tensors.get_kv_cache_config_from_groups", "planned"], result.stderr


def test_a_namesake_that_takes_other_arguments_is_passed_over(tmp_path):
    root = fake_vllm(tmp_path, {
        "vllm/v1/core/kv_cache_utils.py": "def get_kv_cache_config_from_groups(groups):\n    return 'wrong'\n",
        "vllm/v1/core/kv_cache_planning.py": "import functools\n\ndef logged(f):\n    @functools.wraps(f)\n"
                                             "    def inner(*args, **kwargs):\n        return f(*args, **kwargs)\n    return inner\n\n"
                                             "@logged\n" + PLANNER,
    })
    code = "from fuzz.targets.entry_points import Probe; f = Probe('9.0.0').find('planner'); print(f.where, f.parameters)"
    result = probe_in(root, code)
    # Found through its decorator (inspect.unwrap), in the module after the one with the namesake.
    assert result.stdout.split()[0] == "vllm.v1.core.kv_cache_planning.get_kv_cache_config_from_groups", result.stderr
    assert "available_memory" in result.stdout


def test_a_signature_that_says_nothing_is_a_one_line_target_error(tmp_path):
    root = fake_vllm(tmp_path, {
        "vllm/v1/worker/gpu/attn_utils.py": "def _reshape_kv_cache(*args, **kwargs):\n    pass\n"
                                            "def _allocate_kv_cache(kv_cache_config, device):\n    pass\n",
    })
    code = ("from fuzz.errors import TargetError\nfrom fuzz.targets.loader import load_local\n"
            "try:\n    load_local()\nexcept TargetError as error:\n    print('TargetError:', error)\n")
    result = probe_in(root, code)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("TargetError: vLLM 9.0.0: cannot tell which vLLM API generation "
                                                   "vllm.v1.worker.gpu.attn_utils._reshape_kv_cache(*args, **kwargs) belongs to"), \
        result.stdout + result.stderr


def test_no_view_code_anywhere_refuses_the_target(tmp_path):
    root = fake_vllm(tmp_path, {"vllm/v1/core/kv_cache_utils.py": PLANNER})
    code = ("from fuzz.errors import TargetError\nfrom fuzz.targets.loader import load_local\n"
            "try:\n    load_local()\nexcept TargetError as error:\n    print(error)\n")
    result = probe_in(root, code)
    assert "has neither allocate_kv_cache" in result.stdout and "kvfuzz supports 0.19.1 and later" in result.stdout, result.stderr


def test_view_code_that_does_not_import_is_named_with_its_error(tmp_path):
    # What PyPI's torchvision does beside a CPU torch: vLLM's modules stop importing. The view code is there; the
    # message must say why it cannot be used, not that the release lacks it.
    root = fake_vllm(tmp_path, {
        "vllm/v1/core/kv_cache_utils.py": PLANNER,
        "vllm/v1/worker/gpu/attn_utils.py": "raise RuntimeError('operator torchvision::nms does not exist')\n"
                                            "def _reshape_kv_cache(kv_cache_config, kv_cache_raw_tensors, attn_backends):\n    pass\n",
    })
    code = ("from fuzz.errors import TargetError\nfrom fuzz.targets.loader import load_local\n"
            "try:\n    load_local()\nexcept TargetError as error:\n    print(error)\n")
    result = probe_in(root, code)
    assert result.stdout.strip().splitlines() == [
        "vLLM 9.0.0: the module of its KV-cache views does not import here "
        "(vllm.v1.worker.gpu.attn_utils: RuntimeError: operator torchvision::nms does not exist)"], result.stdout + result.stderr


# ---------------------------------------------------------------------------------- real refactors


def installed_vllm() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent


def checkout_of_installed(root: Path) -> Path:
    """The installed vLLM as a source checkout: its pure-Python files linked, no compiled extensions, no
    generated _version.py (a git clone has none), csrc/, tests/ and setup.py beside vllm/. Its bytecode is linked
    too, as a clone that has been imported once holds it (Python checks it against each source file, so an edited
    module is compiled afresh): each target process started on it reads it instead of compiling vLLM again."""
    shutil.copytree(installed_vllm(), root / "vllm", symlinks=True, copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("*.so", "_version.py"))
    for folder in ("csrc", "tests"):
        (root / folder).mkdir()
    (root / "setup.py").write_text("# vLLM's build script\n")
    return root


def rewrite(root: Path, module: str, edit) -> None:
    """Replace a linked module file by an edited copy."""
    path = root / module
    text = path.read_text()
    path.unlink()
    path.write_text(edit(text))


def planner_home(root: Path) -> str:
    return next(name for name in ("vllm/v1/core/kv_cache_planning.py", "vllm/v1/core/kv_cache_utils.py")
                if (root / name).exists() and "\ndef get_kv_cache_config_from_groups(" in (root / name).read_text())


def campaign(spec: str, tmp_path: Path, name: str) -> dict:
    report = tmp_path / f"{name}.json"
    out = io.StringIO()
    # A fixed ratio of deeper checks, so two trees see the same checks on the same cases (a schedule runs them by time).
    main(["run", "--vllm", spec, "--max-cases", "150", "--seed", "4", "--device", "cpu", "--corpus", str(tmp_path / f"corpus-{name}"),
          "--consumers-every", "8", "--report", str(report), "--quiet"], stdout=out)
    data = json.loads(report.read_text())
    data["terminal"] = out.getvalue()
    return data


@pytest.mark.slow
def test_a_planner_moved_to_another_module_fuzzes_with_every_check_on(tmp_path):
    root = checkout_of_installed(tmp_path / "moved")
    home = planner_home(root)
    moved = "vllm/v1/core/kv_cache_placement.py"
    (root / moved).write_text((root / home).read_text())
    # The old module keeps its own callers working under a private name; the public name is gone.
    rewrite(root, home, lambda text: re.sub(r"(?<![.\w])get_kv_cache_config_from_groups\(", "_planned_kv_cache_config(", text))
    for importer in ("vllm/v1/worker/gpu_model_runner.py", "vllm/v1/worker/gpu/cudagraph_utils.py"):
        if (root / importer).exists() and "get_kv_cache_config_from_groups" in (root / importer).read_text():
            rewrite(root, importer, lambda text: text.replace(home[:-3].replace("/", "."), moved[:-3].replace("/", ".")))

    refactored = campaign(str(root), tmp_path, "refactored")
    original = campaign("installed", tmp_path, "original")
    assert refactored["target"]["checks_off"] == original["target"]["checks_off"] == []
    assert "check off" not in refactored["terminal"]
    assert refactored["verdicts"] == original["verdicts"]
    assert refactored["verdicts"].get("pass", 0) > 50 and not refactored["internal_errors"]


@pytest.mark.slow
def test_a_missing_shared_layer_wiring_turns_that_check_off_and_fuzzes_the_rest(tmp_path):
    root = checkout_of_installed(tmp_path / "unwired")
    for module in ("vllm/v1/worker/utils.py", "vllm/v1/worker/gpu/attn_utils.py", "vllm/v1/worker/gpu_model_runner.py"):
        if (root / module).exists():
            rewrite(root, module, lambda text: text.replace("add_kv_sharing_layers_to_kv_cache_groups", "_wire_shared_layers"))

    report = campaign(str(root), tmp_path, "unwired")
    off = report["target"]["checks_off"]
    assert len(off) == 1 and off[0].startswith("kv-sharing: no add_kv_sharing_layers_to_kv_cache_groups (shared-layer wiring)"), off
    assert f"kvfuzz: check off: {off[0]}" in report["terminal"]
    assert report["cases"] == 150 and report["verdicts"].get("pass", 0) > 50 and not report["internal_errors"]

    # A case with a KV-sharing layer is not run: it is skipped, naming the check.
    shared = next(p for p in (REPO / "corpus" / "seeds").glob("*.json") if json.loads(p.read_text()).get("kv_sharing"))
    out = io.StringIO()
    assert main(["replay", str(shared), "--vllm", str(root), "--device", "cpu"], stdout=out) == 0
    assert out.getvalue().startswith("skipped") and "check kv-sharing is off" in out.getvalue()


def test_a_wrapper_that_forwards_is_called_positionally_unless_its_parameters_decide_the_call(tmp_path):
    root = fake_vllm(tmp_path, {
        "vllm/v1/worker/utils.py": "def allocate_kv_cache(kv_cache_config, *args, **kwargs):\n    return 'views'\n",
        "vllm/v1/worker/gpu/attn_utils.py": "def _reshape_kv_cache(kv_cache_config, kv_cache_raw_tensors, *args, cache_dtype='auto'):\n"
                                            "    pass\n",
    })
    code = ("from fuzz.errors import TargetError\nfrom fuzz.targets.entry_points import Probe\nprobe = Probe('9.0.0')\n"
            "print(probe.find('allocation').where)\n"
            "try:\n    probe.find('legacy reshape')\nexcept TargetError as error:\n    print(error)\n")
    lines = probe_in(root, code).stdout.splitlines()
    assert lines[0] == "vllm.v1.worker.utils.allocate_kv_cache"
    assert lines[1] == ("vLLM 9.0.0: vllm.v1.worker.gpu.attn_utils._reshape_kv_cache forwards *args/**kwargs (even unwrapped) and its "
                        "parameters decide how kvfuzz calls it; kvfuzz will not guess")
