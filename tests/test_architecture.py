"""How kvfuzz's modules depend on each other: no import cycle, and every deeper check in one module under fuzz/checks/.

Imports are read with `ast`, those inside functions included (a lazy import is still a dependency); only imports under
`if TYPE_CHECKING:` are left out, since they never run. `from package import name` depends on the package's __init__ too,
except from inside that package: Python initialises a module's packages before the module whatever it imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

from fuzz.checks.registry import CHECKS
from fuzz.verdict.findings import KINDS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fuzz", "oracles")
# String literals equal to a check's name that mean something else where they stand.
OTHER_MEANINGS = {("fuzz/export/templates.py", "copy"): "the standard library's copy module, which an exported test may import"}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node, leaving out the bodies of `if TYPE_CHECKING:` blocks."""
    kept: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        kept.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return kept


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _runtime_nodes(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_and_only_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_kvfuzz_modules():
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def _string_constants(path: Path) -> set[str]:
    """String literals of a module, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings}


def test_no_module_outside_fuzz_checks_names_a_check():
    """A check's name stands only in its module (a finding kind that a check shares its name with is the kind's)."""
    names = {check.name for check in CHECKS} - set(KINDS)
    checks_folder = ROOT / "fuzz" / "checks"
    naming = {}
    for path in modules().values():
        where = str(path.relative_to(ROOT))
        found = sorted(name for name in names & _string_constants(path) if (where, name) not in OTHER_MEANINGS)
        if checks_folder not in path.parents and found:
            naming[where] = found
    assert naming == {}


def test_every_check_is_registered_once_under_its_own_name():
    names = [check.name for check in CHECKS]
    assert len(names) == len(set(names))
    modules_with_a_check = {path.stem for path in (ROOT / "fuzz" / "checks").glob("*.py")
                            if "\nCHECK = " in path.read_text()}
    assert modules_with_a_check == {type(check).__module__.rpartition(".")[2] for check in CHECKS}
