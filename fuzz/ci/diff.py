"""The change under test, located: the lines a branch changed or added in the KV-cache folders, by function.

Two trees (each a folder holding `vllm/`) are compared file by file over the folders fuzz.surface.find
scans (SCOPE: vllm/v1, the KV connectors, the attention layers): `git diff` when both are worktrees of one
repository (the branch's uncommitted edits included), a file compare with difflib otherwise. Every changed
or added line of the branch is mapped, with Python's ast, to the function or method holding it (nested
functions and lambdas belong to it, as in fuzz.surface.find); a deleted line counts as a change to the line
that now stands in its place. Only lines that run count: a comment, a blank line or a docstring changes
nothing a case can execute. Lines outside any function (a spec class's field defaults, a module constant)
run when vLLM is imported, not per case: they are kept as import-time regions.
"""

from __future__ import annotations

import ast
import difflib
import re
import subprocess
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fuzz.surface.find import SCOPE, definitions, in_scope

IMPORT_TIME = "<import>"  # the qualname of a file's lines outside every function
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass(frozen=True)
class ChangedFunction:
    """One function (or a file's import-time code) of the branch, and the lines of it that the change touched."""

    path: str  # relative to the tree root: vllm/v1/worker/utils.py
    qualname: str  # Class.method, function, or IMPORT_TIME
    start: int  # first line, decorators included (the code object's co_firstlineno)
    end: int
    lines: tuple[int, ...]  # changed lines that run (sorted)
    header: tuple[int, ...] = ()  # of `lines`, those of its signature: they count as executed when the function is called

    @property
    def import_time(self) -> bool:
        return self.qualname == IMPORT_TIME

    @property
    def name(self) -> str:
        return f"{self.path}:{self.qualname}"

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "qualname": self.qualname, "start": self.start, "end": self.end, "lines": list(self.lines),
                "header": list(self.header)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ChangedFunction:
        return cls(str(data["path"]), str(data["qualname"]), int(data["start"]), int(data["end"]),  # type: ignore[call-overload]
                   tuple(data["lines"]), tuple(data.get("header", ())))  # type: ignore[arg-type]


def locate_change(base: Path, head: Path) -> list[ChangedFunction]:
    """The functions of `head` whose running lines differ from `base` (both folders holding vllm/), by path and line."""
    changed = changed_lines(base, head)
    found = []
    for path, lines in sorted(changed.items()):
        found += map_to_functions(path, (head / path).read_text(encoding="utf-8", errors="replace"), lines)
    return found


def changed_lines(base: Path, head: Path) -> dict[str, set[int]]:
    """Per Python file under SCOPE (relative to the tree root), the lines of `head` that changed, were added, or
    stand where lines were deleted."""
    by_git = _git_changed(base, head)
    return by_git if by_git is not None else _compare(base, head)


def _compare(base: Path, head: Path) -> dict[str, set[int]]:
    changed: dict[str, set[int]] = {}
    for relative in sorted(set(_python_files(base)) | set(_python_files(head))):
        new_path = head / relative
        if not new_path.exists():
            continue  # a removed file: nothing of the branch to run
        old_path = base / relative
        new = new_path.read_text(encoding="utf-8", errors="replace").splitlines()
        old = old_path.read_text(encoding="utf-8", errors="replace").splitlines() if old_path.exists() else []
        if old == new:
            continue
        lines = diff_lines(old, new)
        if lines:
            changed[relative] = lines
    return changed


def diff_lines(old: list[str], new: list[str]) -> set[int]:
    """1-based lines of `new` that replace or add to `old`; a pure deletion marks the line after it (else the one before)."""
    lines: set[int] = set()
    for tag, _, _, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag in ("replace", "insert"):
            lines.update(range(j1 + 1, j2 + 1))
        elif tag == "delete" and new:
            lines.add(min(j1 + 1, len(new)))
    return lines


def _python_files(root: Path) -> Iterator[str]:
    package = root / "vllm"
    if not package.is_dir():
        return
    for path in package.rglob("*.py"):
        relative = path.relative_to(root).as_posix()
        if in_scope(relative):
            yield relative


def _git_changed(base: Path, head: Path) -> dict[str, set[int]] | None:
    """`git diff` from base's commit to head's working tree, when both are worktrees of one repository and base
    has no edits of its own in SCOPE; None otherwise (the file compare decides)."""
    common = [_git(tree, "rev-parse", "--path-format=absolute", "--git-common-dir") for tree in (base, head)]
    if common[0] is None or common[0] != common[1]:
        return None
    tops = [_git(tree, "rev-parse", "--show-toplevel") for tree in (base, head)]
    if tops[0] is None or tops[1] is None or Path(tops[0]) != base.resolve() or Path(tops[1]) != head.resolve():
        return None  # a tree inside a repository, not a worktree's root: paths would not line up
    scope = [f"{folder.rstrip('/')}*" if not folder.endswith("/") else folder for folder in SCOPE]
    if _git(base, "status", "--porcelain", "--", *scope):  # the baseline's own edits are not in its commit
        return None
    commit = _git(base, "rev-parse", "HEAD")
    untracked = _git(head, "ls-files", "--others", "--exclude-standard", "--", *scope)
    text = _git(head, "diff", "-U0", "--no-color", "--no-ext-diff", "--no-renames", commit or "HEAD", "--", *scope)
    if commit is None or text is None or untracked is None:
        return None
    changed = {}
    for path, lines in parse_unified(text).items():
        if path.endswith(".py") and in_scope(path) and (head / path).exists():
            count = len((head / path).read_text(encoding="utf-8", errors="replace").splitlines())
            changed[path] = {min(line, count) for line in lines if count}  # a deletion at the end marks the last line
    for path in untracked.splitlines():
        if path.endswith(".py") and in_scope(path):
            count = len((head / path).read_text(encoding="utf-8", errors="replace").splitlines())
            changed[path] = set(range(1, count + 1))
    return {path: lines for path, lines in changed.items() if lines}


def parse_unified(text: str) -> dict[str, set[int]]:
    """Lines of the new side of a unified diff (-U0), per file: changed and added lines, and for a pure deletion the line after it."""
    changed: dict[str, set[int]] = {}
    current: set[int] | None = None
    for line in text.splitlines():
        if line.startswith("+++ "):
            name = line[4:].strip()
            current = None if name == "/dev/null" else changed.setdefault(name.removeprefix("b/"), set())
            continue
        match = _HUNK.match(line)
        if match and current is not None:
            start, count = int(match.group(3)), int(match.group(4) if match.group(4) is not None else 1)
            current.update(range(start, start + count) if count else [start + 1])
    return changed


def _git(tree: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


# ------------------------------------------------------------------ lines to functions


def map_to_functions(path: str, source: str, lines: Iterable[int]) -> list[ChangedFunction]:
    """The changed lines of one file that run, grouped by the outermost function or method holding them."""
    try:
        tree = ast.parse(source)
        code = compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return []
    running = _running_lines(code)
    functions = list(definitions(tree.body, ""))
    wanted = sorted(set(lines))
    found: list[ChangedFunction] = []
    claimed: set[int] = set()
    for qualname, node in functions:
        start, end = _first_line(node), node.end_lineno or node.lineno
        header = set(range(start, _signature_end(node) + 1))  # decorators and the signature
        inside = [line for line in wanted if start <= line <= end]
        claimed.update(inside)
        hits = [line for line in inside if line in running or line in header]
        if hits:
            found.append(ChangedFunction(path, qualname, start, end, tuple(hits), tuple(line for line in hits if line in header)))
    rest = [line for line in wanted if line not in claimed and line in running]
    if rest:
        found.append(ChangedFunction(path, IMPORT_TIME, 1, len(source.splitlines()), tuple(rest)))
    return sorted(found, key=lambda f: (f.start, f.qualname))


def _running_lines(code: types.CodeType) -> set[int]:
    """Lines that have bytecode in the module or any code nested in it."""
    found: set[int] = set()
    stack = [code]
    while stack:
        current = stack.pop()
        found.update(line for _, _, line in current.co_lines() if line is not None)
        stack.extend(const for const in current.co_consts if isinstance(const, types.CodeType))
    return found


def _signature_end(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The last line of the signature: the def line, its parameters and defaults, its return annotation."""
    parts = [node.args, *([node.returns] if node.returns is not None else [])]
    ends = [getattr(child, "end_lineno", None) for part in parts for child in ast.walk(part)]
    return max([node.lineno, *(end for end in ends if end is not None)])


def _first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def ranges(lines: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted lines as (first, last) runs: 3, 4, 5, 9 -> (3, 5), (9, 9)."""
    runs: list[tuple[int, int]] = []
    for line in sorted(set(lines)):
        if runs and line == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], line)
        else:
            runs.append((line, line))
    return runs


def ranges_text(path: str, lines: Iterable[int]) -> str:
    """`vllm/x.py:512-518, 530` for the given lines."""
    parts = [f"{a}-{b}" if a != b else str(a) for a, b in ranges(lines)]
    return f"{path}:{', '.join(parts)}" if parts else path
