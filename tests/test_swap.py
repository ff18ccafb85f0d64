"""fuzz/mutate/swap.py: a mutant's body swapped into the function objects an imported tree already holds, as if its file
had been imported instead."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from fuzz.mutate.swap import swap_function

ORIGINAL = textwrap.dedent('''
    import functools

    SCALE = 3


    def wrapped(f):
        @functools.wraps(f)
        def inner(*args, **kwargs):
            return ("wrapped", f(*args, **kwargs))
        return inner


    def page_bytes(blocks, block=16, *, heads=2):
        return blocks * block * heads * SCALE


    @functools.lru_cache
    def cached(blocks):
        return page_bytes(blocks)


    @wrapped
    def decorated(blocks):
        return blocks + 1


    class Base:
        def shape(self, blocks):
            return (blocks,)


    class Spec(Base):
        def shape(self, blocks):
            return super().shape(blocks) + (16,)

        @property
        def size(self):
            return 16

    TABLE = {"page": page_bytes}
''')


@pytest.fixture
def tree(tmp_path, monkeypatch):
    package = tmp_path / "vllm_swaptest"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "layout.py").write_text(ORIGINAL)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("vllm_swaptest.layout")
    for name in [n for n in sys.modules if n.startswith("vllm_swaptest")]:
        del sys.modules[name]


def mutated(old: str, new: str) -> str:
    assert ORIGINAL.count(old) == 1
    return ORIGINAL.replace(old, new)


def test_a_swapped_function_runs_the_mutated_body_wherever_it_is_held(tree):
    held = tree.TABLE["page"]
    assert held(2) == 2 * 16 * 2 * 3
    swap_function("vllm_swaptest/layout.py", "page_bytes", mutated("blocks * block * heads * SCALE", "blocks * block * heads"))
    assert held is tree.page_bytes and held(2) == 2 * 16 * 2  # the object a table took at import, and the module's name
    assert tree.page_bytes(2, block=8, heads=1) == 16  # still the module's globals, defaults and keyword defaults


def test_mutated_defaults_and_an_emptied_cache(tree):
    assert tree.cached(1) == 96
    swap_function("vllm_swaptest/layout.py", "page_bytes", mutated("block=16, *, heads=2", "block=8, *, heads=1"))
    assert tree.page_bytes(1) == 24
    assert tree.cached(1) == 24, "a cache that held the unmutated answer is emptied"


def test_decorated_functions_keep_their_wrappers_and_methods_their_class(tree):
    swap_function("vllm_swaptest/layout.py", "decorated", mutated("return blocks + 1", "return blocks - 1"))
    assert tree.decorated(5) == ("wrapped", 4)
    swap_function("vllm_swaptest/layout.py", "Spec.shape", mutated("+ (16,)", "+ (8,)"))
    assert tree.Spec().shape(2) == (2, 8)  # super() still finds Base: the method compiled inside its class
    swap_function("vllm_swaptest/layout.py", "Spec.size", mutated("return 16\n\nTABLE", "return 15\n\nTABLE"))
    assert tree.Spec().size == 15


def test_a_body_that_does_not_fit_the_function_is_refused(tree):
    closure = mutated("def decorated(blocks):\n    return blocks + 1", "def decorated(blocks):\n    return (lambda: blocks)()")
    swap_function("vllm_swaptest/layout.py", "decorated", closure)  # a new nested function is fine
    assert tree.decorated(3) == ("wrapped", 3)
    # A body that needs a cell the imported function lacks (here: __class__, for super()) cannot be swapped in.
    with pytest.raises(ValueError, match="free variables"):
        swap_function("vllm_swaptest/layout.py", "Base.shape", mutated("return (blocks,)", "return super().__init__() or (blocks,)"))
    assert tree.Base().shape(2) == (2,)
    with pytest.raises(LookupError, match="no definition of nowhere"):
        swap_function("vllm_swaptest/layout.py", "nowhere", ORIGINAL)
