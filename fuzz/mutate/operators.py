"""Single-edit mutation operators over one function's source, and the Mutant records they make.

Each operator names one kind of slip a refactor of layout code makes: a size name swapped for its
neighbour, an off-by-one, `//` for `*`, a term dropped from a stride or offset sum, `min` for
`max`, a dropped `raise`, a permuted order tuple, a flipped comparison. An edit replaces exactly
the source span of one AST node and keeps the file's line count, so tracebacks and SARIF lines of
a mutant point at the same lines as the original.

Code no caller can observe is left alone: f-strings, the message of a `raise` or `assert`, and
logger calls.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

# Names a refactor confuses with each other (the sizes of vLLM's layout code).
SIZE_FAMILIES: tuple[frozenset[str], ...] = (
    frozenset({"block_size", "storage_block_size", "kernel_block_size"}),
    frozenset({"page_size_bytes", "page_size_padded", "real_page_size_bytes", "unpadded_page_size_bytes", "padded_page_size",
               "dense_page_size", "page_size"}),
    frozenset({"num_blocks", "kernel_num_blocks", "num_kernel_blocks"}),
    frozenset({"layer_stride", "block_stride", "head_stride", "state_stride", "kernel_block_stride", "page_stride"}),
    frozenset({"num_heads", "num_kv_heads", "num_head_slots"}),
    frozenset({"head_size", "head_size_v"}),
)
_NEGATED: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}


@dataclass(frozen=True)
class Mutant:
    """One edit of one function: `original` (the source of a node at `line`) becomes `replacement`."""

    path: str  # relative to the tree root, e.g. vllm/v1/kv_cache_interface.py
    function: str  # qualified name, e.g. AttentionGroup.map_kv_cache_to_kernel_blocks
    operator: str
    line: int
    offset: int  # line - the function's first line: stable when code above the function moves
    original: str
    replacement: str
    occurrence: int  # among identical (offset, original, replacement) edits of the function

    @property
    def id(self) -> str:
        key = "\0".join((self.path, self.function, self.operator, str(self.offset), self.original, self.replacement, str(self.occurrence)))
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    @property
    def edit(self) -> str:
        return f"{self.path}:{self.line}: {_one_line(self.original)}  ->  {_one_line(self.replacement)}"

    def to_dict(self) -> dict[str, object]:
        return {"id": self.id, "path": self.path, "function": self.function, "operator": self.operator, "line": self.line,
                "offset": self.offset, "original": self.original, "replacement": self.replacement, "occurrence": self.occurrence}


@dataclass(frozen=True)
class _Edit:
    node: ast.AST
    operator: str
    replacement: str  # source text for the node's span


def find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The (possibly nested in classes) function with this qualified name."""
    scope: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            return None
        scope = node.body  # type: ignore[attr-defined]
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def mutants_of(source: str, path: str, qualname: str) -> list[Mutant]:
    """Every single-edit mutant of function `qualname` in `source` (the text of file `path`)."""
    return [mutant for _, mutant in _located(source, path, qualname)]


def apply(source: str, mutant: Mutant) -> str:
    """`source` with the mutant's edit made (the same number of lines)."""
    lines = source.splitlines(keepends=True)
    for node, candidate in _located(source, mutant.path, mutant.function):
        if candidate == mutant:
            return splice(lines, node, mutant.replacement)
    raise LookupError(f"the edit {mutant.edit} no longer matches the source")


def _located(source: str, path: str, qualname: str) -> Iterator[tuple[ast.AST, Mutant]]:
    tree = ast.parse(source)
    function = find_function(tree, qualname)
    if function is None:
        raise LookupError(f"{path} has no function {qualname}")
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names = {n.id for n in ast.walk(function) if isinstance(n, ast.Name)} | {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}
    lines = source.splitlines(keepends=True)
    seen: dict[tuple[int, str, str], int] = {}
    for edit in _edits(function, names, attributes):
        original = segment(lines, edit.node)
        if original is None or original == edit.replacement:
            continue
        line = edit.node.lineno  # type: ignore[attr-defined]
        key = (line - function.lineno, original, edit.replacement)
        occurrence = seen.get(key, 0)
        seen[key] = occurrence + 1
        yield edit.node, Mutant(path, qualname, edit.operator, line, key[0], original, edit.replacement, occurrence)


def segment(lines: list[str], node: ast.AST) -> str | None:
    """The exact source text of `node` (column offsets are UTF-8 byte offsets)."""
    start, end = getattr(node, "lineno", None), getattr(node, "end_lineno", None)
    if start is None or end is None:
        return None
    first, last = lines[start - 1].encode(), lines[end - 1].encode()
    begin, stop = node.col_offset, node.end_col_offset  # type: ignore[attr-defined]
    if start == end:
        return first[begin:stop].decode()
    middle = "".join(lines[start:end - 1])
    return first[begin:].decode() + middle + last[:stop].decode()


def splice(lines: list[str], node: ast.AST, replacement: str) -> str:
    """The source with `node`'s span replaced, padded with newlines to keep the line count."""
    start, end = node.lineno, node.end_lineno  # type: ignore[attr-defined]
    first, last = lines[start - 1].encode(), lines[end - 1].encode()
    head = first[: node.col_offset].decode()  # type: ignore[attr-defined]
    tail = last[node.end_col_offset:].decode()  # type: ignore[attr-defined]
    padding = "\n" * (end - start)
    if isinstance(node, ast.expr):
        body = f"({replacement}{padding})"
    else:
        body = replacement + padding
    return "".join(lines[: start - 1]) + head + body + tail + "".join(lines[end:])


# ------------------------------------------------------------------ the operators


def _edits(function: ast.AST, names: set[str], attributes: set[str]) -> Iterator[_Edit]:
    for node in _observable_nodes(function):
        yield from _swap_name(node, names, attributes)
        yield from _off_by_one(node)
        yield from _floordiv_mul(node)
        yield from _drop_term(node)
        yield from _min_max(node)
        yield from _drop_raise(node)
        yield from _permute_order(node)
        yield from _flip_compare(node)


def _observable_nodes(function: ast.AST) -> Iterator[ast.AST]:
    """Nodes of the function body whose edit a caller could observe."""
    body = function.body  # type: ignore[attr-defined]
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]  # the docstring
    stack: list[ast.AST] = list(reversed(body))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.JoinedStr) or _is_logging(node):
            continue
        yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.Raise):
            children = []  # the exception's text is not behaviour; dropping the raise is
        elif isinstance(node, ast.Assert):
            children = [node.test]
        stack.extend(reversed(children))


def _is_logging(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in ("logger", "logging", "log")


def _family(name: str) -> frozenset[str]:
    return next((f for f in SIZE_FAMILIES if name in f), frozenset())


def _swap_name(node: ast.AST, names: set[str], attributes: set[str]) -> Iterator[_Edit]:
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
        for other in sorted(_family(node.id) & names - {node.id}):
            yield _Edit(node, "swap-name", other)
    elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        for other in sorted(_family(node.attr) & attributes - {node.attr}):
            yield _Edit(node, "swap-name", ast.unparse(ast.Attribute(node.value, other, ast.Load())))


def _off_by_one(node: ast.AST) -> Iterator[_Edit]:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        yield _Edit(node, "off-by-one", str(node.value + 1))
        yield _Edit(node, "off-by-one", str(node.value - 1))


def _floordiv_mul(node: ast.AST) -> Iterator[_Edit]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.FloorDiv, ast.Mult)):
        op = ast.Mult() if isinstance(node.op, ast.FloorDiv) else ast.FloorDiv()
        yield _Edit(node, "floordiv-mul", ast.unparse(ast.BinOp(node.left, op, node.right)))


def _drop_term(node: ast.AST) -> Iterator[_Edit]:
    if not isinstance(node, ast.BinOp) or not isinstance(node.op, (ast.Add, ast.Sub)):
        return
    if any(isinstance(side, (ast.JoinedStr, ast.Constant)) and isinstance(getattr(side, "value", None), str)
           for side in (node.left, node.right)):
        return  # string building
    yield _Edit(node, "drop-term", ast.unparse(node.left))
    if isinstance(node.op, ast.Add):
        yield _Edit(node, "drop-term", ast.unparse(node.right))


def _min_max(node: ast.AST) -> Iterator[_Edit]:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
        other = "max" if node.func.id == "min" else "min"
        yield _Edit(node, "min-max", ast.unparse(ast.Call(ast.Name(other, ast.Load()), node.args, node.keywords)))


def _drop_raise(node: ast.AST) -> Iterator[_Edit]:
    if isinstance(node, ast.Raise):
        yield _Edit(node, "drop-raise", "pass")


def _permute_order(node: ast.AST) -> Iterator[_Edit]:
    if isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) >= 2 and all(
            isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts):
        values = [e.value for e in node.elts]  # type: ignore[attr-defined]
        for i in range(len(values) - 1):
            if values[i] == values[i + 1]:
                continue
            swapped = values[:i] + [values[i + 1], values[i]] + values[i + 2:]
            text = ", ".join(map(str, swapped))
            yield _Edit(node, "permute-order", f"({text})" if isinstance(node, ast.Tuple) else f"[{text}]")


def _flip_compare(node: ast.AST) -> Iterator[_Edit]:
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            flipped = _NEGATED.get(type(op))
            if flipped is not None:
                ops = list(node.ops)
                ops[i] = flipped()
                yield _Edit(node, "flip-compare", ast.unparse(ast.Compare(node.left, ops, node.comparators)))


def _one_line(text: str) -> str:
    return " ".join(text.split())
