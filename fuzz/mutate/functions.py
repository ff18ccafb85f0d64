"""Which vLLM functions `kvfuzz mutate` edits: by default the release's layout functions.

The roles are the ones kvfuzz drives (planner, kernel-block choice, allocation, view creation,
kernel-block mapping, KV-sharing wiring); each is looked up by name in the modules that have held
it across releases, then in any module of `vllm/v1`, so a function that moved is still found.
A role's private helpers in the same module (functions it calls by name, transitively) are
included: `_reshape_kv_cache` and its helpers, `create_kv_cache_views` and its stride arithmetic, the planner and its stride arithmetic.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROLES: dict[str, tuple[str, ...]] = {
    "planner": ("get_kv_cache_config_from_groups",),
    "kernel-block choice": ("prepare_kernel_block_sizes", "select_common_block_size"),
    "allocation": ("allocate_kv_cache", "_allocate_kv_cache"),
    "view creation": ("create_kv_cache_views", "_reshape_kv_cache"),
    "kernel-block mapping": ("map_kv_caches_to_kernel_blocks", "AttentionGroup.map_kv_cache_to_kernel_blocks"),
    "kv-sharing wiring": ("add_kv_sharing_layers_to_kv_cache_groups",),
    "page size": ("page_size_bytes", "real_page_size_bytes", "unpadded_page_size_bytes", "storage_block_size", "get_num_kernel_states",
                  "get_block_stride_alignment", "_apply_alignment_padding"),
}
# Where these have lived (0.19 - 0.34); anything else under vllm/v1 is searched after them.
HOMES = ("vllm/v1/kv_cache_interface.py", "vllm/v1/worker/utils.py", "vllm/v1/worker/gpu/attn_utils.py",
         "vllm/v1/core/kv_cache_utils.py", "vllm/v1/core/kv_cache_planning.py")
HELPER_DEPTH = 2


@dataclass(frozen=True)
class Function:
    path: str  # relative to the tree root
    qualname: str
    role: str


def layout_functions(root: Path, names: Sequence[str] = ()) -> list[Function]:
    """The functions to mutate in the tree at `root` (the folder holding vllm/): `names` (bare or
    qualified) if given, else every role's functions and their same-module helpers.

    A name is looked for in the modules that have held it (HOMES) first; only a name found in none
    of them is looked for in the rest of vllm/v1 (the function moved)."""
    wanted = {name: "selected" for name in names} if names else {n: role for role, ns in ROLES.items() for n in ns}
    found: dict[tuple[str, str], Function] = {}
    missing = set(wanted)
    for homes_only in (True, False):
        for path, tree in _modules(root, homes_only):
            defined = dict(_defined(tree))
            for name in sorted(missing if not homes_only else wanted):
                matches = [q for q in defined if q == name or q.rsplit(".", 1)[-1] == name]
                for qualname in matches:
                    found.setdefault((path, qualname), Function(path, qualname, wanted[name]))
                    if not names:
                        for helper in _helpers(qualname, defined):
                            found.setdefault((path, helper), Function(path, helper, wanted[name]))
                if matches:
                    missing.discard(name)
        if not missing:
            break
    if names and missing:
        raise LookupError(f"no function named {', '.join(sorted(missing))} under {root / 'vllm'}")
    return sorted(found.values(), key=lambda f: (f.path, f.qualname))


def _modules(root: Path, homes_only: bool) -> Iterable[tuple[str, ast.Module]]:
    paths = [root / home for home in HOMES] if homes_only else sorted((root / "vllm" / "v1").rglob("*.py"))
    for path in paths:
        relative = path.relative_to(root).as_posix()
        if not path.is_file() or (not homes_only and relative in HOMES):
            continue
        try:
            yield relative, ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue


def _defined(tree: ast.Module) -> Iterable[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


def _helpers(qualname: str, defined: dict[str, ast.FunctionDef | ast.AsyncFunctionDef]) -> list[str]:
    """Module-level functions of the same module that `qualname` calls by name, up to HELPER_DEPTH calls deep."""
    found: list[str] = []
    frontier = [qualname]
    for _ in range(HELPER_DEPTH):
        calls = {n.func.id for q in frontier for n in ast.walk(defined[q]) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        frontier = sorted(c for c in calls if c in defined and c not in found and c != qualname)
        found += frontier
    return found
