"""Where in vLLM's source a failure sits, for SARIF and the summary.

An exception names its own line: the innermost vLLM frame, which the target records in the
Outcome (`error_file`, `error_line`). A wrong view, a case vLLM should have refused, or a dead
process has no traceback; it is located at the functions under test, the ones that turn the raw
buffer into views in every vLLM generation kvfuzz drives, found by name in the target's own
source (so a function that moved between modules is still found).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from fuzz.ci.model import Location
from fuzz.targets.base import Outcome
from fuzz.targets.releases import TargetSource

# The view builders, innermost first: create_kv_cache_views (0.29+) and its kernel-block mapping
# (0.32+), _reshape_kv_cache (up to 0.28). The first one the tree defines is the primary location.
FUNCTIONS_UNDER_TEST = ("create_kv_cache_views", "map_kv_caches_to_kernel_blocks", "_reshape_kv_cache")


def package_folder(source: TargetSource) -> Path | None:
    """The target's vllm/ folder, without importing vLLM."""
    if source.python_path is not None:
        return source.python_path / "vllm"
    spec = importlib.util.find_spec("vllm")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def locate(outcome: Outcome | None, under_test: list[Location]) -> list[Location]:
    """The line that raised, else the functions under test (from `functions_under_test`)."""
    if outcome is not None and outcome.error_file and outcome.error_line:
        return [Location(f"vllm/{outcome.error_file}", outcome.error_line, None, outcome.error_function)]
    return list(under_test)


def functions_under_test(package: Path | None) -> list[Location]:
    """The view builders the target's tree defines, in FUNCTIONS_UNDER_TEST order."""
    found = dict(_definitions(package, FUNCTIONS_UNDER_TEST)) if package is not None and package.is_dir() else {}
    return [found[name] for name in FUNCTIONS_UNDER_TEST if name in found]


def _definitions(package: Path, names: tuple[str, ...]) -> list[tuple[str, Location]]:
    """Top-level and method definitions of `names` in the package's Python files: (name, region)."""
    needles = tuple(f"def {name}(" for name in names)
    found = []
    for path in sorted(package.rglob("*.py")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if not any(needle in text for needle in needles):
            continue
        relative = "vllm/" + path.relative_to(package).as_posix()
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
                found.append((node.name, Location(relative, node.lineno, node.end_lineno, node.name)))
    return found
