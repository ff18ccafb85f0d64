"""A mutant in a process that has imported the unmutated tree: the mutated function's code swapped in place.

A mutant is one edit inside one function. Importing its whole tree again costs seconds; a fork of the unmutated tree's
standby (fuzz/campaign/standby.py) costs milliseconds, and the function object every caller, table and wrapper of vLLM
already holds can take the mutated body: its `__code__`, defaults and keyword defaults are replaced by those of the
same definition compiled from the mutant's file (decorators left off: the original's wrappers stay and call it). Caches
vLLM keeps with `functools.lru_cache` are emptied, since they may hold what the unmutated code returned. The target kvfuzz
loaded from the unmutated tree is kept: its catalog and case space are the baseline campaign's, so case i is the same
case on both trees (a second load in one process can see backends the first imported on the way).

What a fresh import would do differently is what runs when a module is imported, or when kvfuzz loads the target: a
mutated function called then. The swap refuses (and the mutant's own tree is imported instead) where the compiled body
does not fit the function: another set of free variables.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import types
from typing import Any

from fuzz.mutate.reach import defined_function, module_name


def swap_function(path: str, qualname: str, source: str) -> None:
    """Give the function `qualname` of the module at `path` (relative to the tree) the body it has in `source`, the
    mutated text of that file."""
    module = importlib.import_module(module_name(path))
    function = defined_function(module, qualname)
    compiled = _compiled(source, qualname, module)
    if compiled.__code__.co_freevars != function.__code__.co_freevars:
        raise ValueError(f"{qualname}: the mutated body has free variables {compiled.__code__.co_freevars}, "
                         f"the imported one {function.__code__.co_freevars}")
    function.__code__ = compiled.__code__
    function.__defaults__ = compiled.__defaults__
    function.__kwdefaults__ = compiled.__kwdefaults__
    _clear_caches()


def _compiled(source: str, qualname: str, module: types.ModuleType) -> types.FunctionType:
    """The definition of `qualname` in `source`, compiled where it stands (a method inside a class of the same name, so
    that `super()` and `__class__` compile as they do there) with the file's name and line numbers, undecorated."""
    tree = ast.parse(source)
    parts = qualname.split(".")
    body: list[ast.stmt] = tree.body
    classes: list[ast.ClassDef] = []
    for part in parts[:-1]:
        found = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == part), None)
        if found is None:
            raise LookupError(f"no class {part} on the way to {qualname}")
        classes.append(found)
        body = found.body
    definition = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == parts[-1]), None)
    if definition is None:
        raise LookupError(f"no definition of {qualname}")
    definition.decorator_list = []
    node: ast.stmt = definition
    for cls in reversed(classes):
        node = ast.ClassDef(name=cls.name, bases=[], keywords=[], body=[node], decorator_list=[])
        ast.copy_location(node, cls)
    holder = ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[]))
    scratch = dict(vars(module))  # the module's names, never rebound by this
    exec(compile(holder, module.__file__ or module.__name__, "exec"), scratch)  # noqa: S102 - the mutant's own source
    value: Any = scratch[parts[0]]
    for part in parts[1:]:
        value = inspect.getattr_static(value, part)
    return value


def _clear_caches() -> None:
    for name, module in list(sys.modules.items()):
        if not name.startswith("vllm") or module is None:
            continue
        for value in list(vars(module).values()):
            # Asked of the type: some module-level objects answer any attribute (ctypes' library loaders load one).
            if hasattr(type(value), "cache_clear") and hasattr(type(value), "cache_info"):
                value.cache_clear()
