"""The KV-cache surface of a vLLM tree, found by reading its source (no vLLM import).

The search rules are written once here and run unchanged on every release:

1. Where: the subtrees that hold the KV-cache code (SCOPE): the v1 worker, core, attention backends and
   model runners (all of vllm/v1), the KV connectors (vllm/distributed/kv_transfer) and the attention
   layers (vllm/model_executor/layers/attention*).
2. What is a KV-cache value: a name or attribute spelled like one (TENSOR_NAME: kv_caches, kv_cache,
   raw_tensor, key_cache, kv_cache_raw_tensors, kv_cache_config.kv_cache_tensors, ...), and, inside one
   function, every local assigned from, unpacked from or iterated out of one (a small taint pass).
3. Seed: a function that applies a tensor operation to a KV-cache value (views, reshapes, re-strides,
   zeroes, copies, data pointers, storages: OPS), allocates a tensor sized from one (ALLOCATORS),
   calls a cache-write or block-copy kernel with one (KERNELS), binds one to an attribute spelled like
   a KV cache, or describes byte regions (constructs KVCacheTensor).
4. Closure: a function that passes a KV-cache value or a KV cache config (CONFIG_NAME) to a function
   found so far (matched by its bare name) is found too, to a fixed point.

A function's nested functions and lambdas are part of it; methods are Class.method (nested classes
Outer.Inner.method).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

SCOPE: tuple[str, ...] = ("vllm/v1/", "vllm/distributed/kv_transfer/", "vllm/model_executor/layers/attention")
# One optional word before the name (gpu_kv_caches, self_kv_cache), but not a flag or a count (has_kv_cache, num_kv_cache).
_PREFIX = r"(?!(?:has|use|uses|is|num|enable|enabled|skip|with|need|needs|for|init|max|min|total|free|available|per|can|should)_)([a-z0-9]+_)?"
TENSOR_NAME = re.compile(rf"^{_PREFIX}kv_caches?$|^kv_cache_(raw_)?tensors?$|^raw_tensors?$|^{_PREFIX}(key|value)_caches?$"
                         rf"|^kv_c_and_k_pe_cache$|^{_PREFIX}kv_buffers?$")
CONFIG_NAME = re.compile(r"^(\w+_)?kv_cache_configs?$|^KVCacheTensor$")
OPS: dict[str, str] = {
    **dict.fromkeys(("view", "view_as", "as_strided", "unflatten", "flatten", "narrow", "unbind", "chunk", "movedim", "select"), "views"),
    **dict.fromkeys(("reshape", "reshape_as"), "reshapes"),
    **dict.fromkeys(("permute", "transpose", "contiguous"), "re-strides"),
    **dict.fromkeys(("zero_", "fill_", "masked_fill_", "index_fill_"), "zeroes"),
    **dict.fromkeys(("copy_", "index_copy_", "index_put_", "scatter_", "index_select"), "copies"),
    **dict.fromkeys(("data_ptr", "untyped_storage", "storage", "set_"), "byte regions"),
}
ALLOCATORS = frozenset(("empty", "zeros", "ones", "full", "empty_strided", "empty_like", "zeros_like", "tensor", "frombuffer"))
# Cache-write, block-copy and block-zeroing kernels: their names say they touch KV blocks, whatever the arguments are called.
KERNELS = re.compile(r"reshape_and_cache|concat_and_cache|swap_blocks|copy_blocks|zero_kv|copy_kv|swap_kv|kv_cache_copy")
ALL_VERBS = ("allocates", "views", "reshapes", "re-strides", "zeroes", "copies", "byte regions", "binds", "describes regions", "passes on")


@dataclass(frozen=True)
class Function:
    path: str  # relative to the tree root: vllm/v1/worker/utils.py
    qualname: str  # Class.method or function
    start: int  # first line, decorators included (the code object's co_firstlineno)
    end: int
    verbs: tuple[str, ...]  # what it does to a KV cache (ALL_VERBS); "passes on" for a closure member
    calls: tuple[str, ...] = ()  # the found functions it passes a KV cache to (bare names), closure members only

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")

    @property
    def name(self) -> str:
        return f"{self.module}:{self.qualname}"

    @property
    def bare(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


@dataclass
class _Candidate:
    path: str
    qualname: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    verbs: set[str] = field(default_factory=set)
    passes: dict[str, ast.Call] = field(default_factory=dict)  # callee bare name -> a call handing it a KV value


def in_scope(relative: str) -> bool:
    return relative.startswith(SCOPE)


def source_files(root: Path) -> Iterator[tuple[str, Path]]:
    """(path relative to root, path) of every Python file of the tree under SCOPE."""
    package = root / "vllm"
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if in_scope(relative):
            yield relative, path


def find(root: Path) -> list[Function]:
    """The KV-cache surface of the tree at `root` (the folder holding vllm/), sorted by path and line."""
    candidates = [c for relative, path in source_files(root) for c in _candidates(relative, path)]
    found = {id(c): c for c in candidates if c.verbs}
    while True:
        owners = _owners(found)
        added = [c for c in candidates if id(c) not in found and _callees(c, owners)]
        if not added:
            break
        found.update((id(c), c) for c in added)
    owners = _owners(found)
    functions = []
    for c in found.values():
        verbs = tuple(v for v in ALL_VERBS if v in c.verbs) or ("passes on",)
        calls = _callees(c, owners)
        functions.append(Function(c.path, c.qualname, _first_line(c.node), c.node.end_lineno or c.node.lineno, verbs,
                                  calls if verbs == ("passes on",) else ()))
    return sorted(functions, key=lambda f: (f.path, f.start))


def _owners(found: dict[int, _Candidate]) -> dict[str, set[int]]:
    """Bare name -> the found functions of that name."""
    owners: dict[str, set[int]] = {}
    for key, c in found.items():
        owners.setdefault(c.qualname.rsplit(".", 1)[-1], set()).add(key)
    return owners


def _callees(candidate: _Candidate, owners: dict[str, set[int]]) -> tuple[str, ...]:
    """The bare names of found functions (other than itself) that `candidate` hands a KV cache to."""
    return tuple(sorted(n for n in candidate.passes if owners.get(n, set()) - {id(candidate)}))


def _called_name(func: ast.expr) -> str:
    """f(...) -> f, x.f(...) -> f, and a Triton launch f[grid](...) -> f."""
    if isinstance(func, ast.Subscript):
        func = func.value
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _candidates(relative: str, path: Path) -> Iterator[_Candidate]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return
    for qualname, node in definitions(tree.body, ""):
        candidate = _Candidate(relative, qualname, node)
        _read(candidate)
        if candidate.verbs or candidate.passes:
            yield candidate


def definitions(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Top-level functions and methods of a module body, named Class.method (nested classes as Outer.Inner.method)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef):
            yield from definitions(node.body, f"{prefix}{node.name}.")
        elif isinstance(node, (ast.If, ast.Try)):  # definitions under `if TYPE_CHECKING:` / `try: import`
            for part in (node.body, node.orelse, *(getattr(node, "handlers", ()) and [h.body for h in node.handlers])):
                yield from definitions(part, prefix)


def _first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def _read(candidate: _Candidate) -> None:
    node = candidate.node
    tainted = _tainted(node)

    def kv(expr: ast.AST | None) -> bool:
        return expr is not None and _mentions(expr, tainted)

    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            arguments = [*sub.args, *(k.value for k in sub.keywords)]
            name = _called_name(func)
            if isinstance(func, ast.Attribute) and name in OPS and kv(func.value) and not _is_module(func.value):
                candidate.verbs.add(OPS[name])
            elif name in ALLOCATORS and _is_torch(func) and any(kv(a) for a in arguments):
                candidate.verbs.add("allocates")
            elif KERNELS.search(name):
                candidate.verbs.add("zeroes" if "zero" in name else "copies")
            elif name == "KVCacheTensor":
                candidate.verbs.add("describes regions")
            hands_on = any(kv(a) or _mentions_config(a) for a in arguments) or (isinstance(func, ast.Attribute) and kv(func.value))
            if name and not _dunder(name) and hands_on:
                candidate.passes.setdefault(name, sub)
        elif isinstance(sub, (ast.Assign, ast.AnnAssign)) and sub.value is not None:
            targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and TENSOR_NAME.match(target.attr) and kv(sub.value):
                    candidate.verbs.add("binds")
                if _allocation(sub.value) and (_mentions(target, tainted)):
                    candidate.verbs.add("allocates")


def _tainted(node: ast.AST) -> set[str]:
    """Local names holding a KV-cache value: spelled like one, or assigned / unpacked / iterated from one."""
    tainted: set[str] = set()
    for _ in range(3):
        before = len(tainted)
        for sub in ast.walk(node):
            if isinstance(sub, ast.arg) and TENSOR_NAME.match(sub.arg):
                tainted.add(sub.arg)
            elif isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and sub.value is not None:
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                if _mentions(sub.value, tainted):
                    tainted.update(n for t in targets for n in _stored_names(t))
            elif isinstance(sub, (ast.For, ast.AsyncFor, ast.comprehension)) and _mentions(sub.iter, tainted):
                tainted.update(_stored_names(sub.target))
            elif isinstance(sub, ast.withitem) and sub.optional_vars is not None and _mentions(sub.context_expr, tainted):
                tainted.update(_stored_names(sub.optional_vars))
        if len(tainted) == before:
            break
    return tainted


def _mentions(expr: ast.AST, tainted: set[str]) -> bool:
    for sub in ast.walk(expr):
        if isinstance(sub, ast.Name) and (sub.id in tainted or TENSOR_NAME.match(sub.id)):
            return True
        if isinstance(sub, ast.Attribute) and TENSOR_NAME.match(sub.attr):
            return True
    return False


def _mentions_config(expr: ast.AST) -> bool:
    return any((isinstance(s, ast.Name) and CONFIG_NAME.match(s.id)) or (isinstance(s, ast.Attribute) and CONFIG_NAME.match(s.attr))
               for s in ast.walk(expr))


def _stored_names(target: ast.AST) -> Iterable[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


def _is_torch(func: ast.expr) -> bool:
    """torch.zeros(...) and friends (any module path ending in torch), not a method of some object."""
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "torch"


def _is_module(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Name) and expr.id in ("torch", "np", "numpy", "ops", "os")


def _allocation(value: ast.expr) -> bool:
    return any(isinstance(s, ast.Call) and isinstance(s.func, ast.Attribute) and s.func.attr in ALLOCATORS and _is_torch(s.func)
               for s in ast.walk(value))
