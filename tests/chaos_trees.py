"""Misbehaving vLLM trees for the chaos tests: a real vLLM with one function wrapped to fail.

`make_tree` writes a folder holding a `vllm/` package whose `__init__.py` executes a real vLLM's
(the installed one, or a release tree such as ~/.cache/kvfuzz/vllm/0.23.0) and then replaces one
function (dotted path) by a wrapper that may misbehave before it calls the real function. What it
does is decided per call from facts of the call:

- `size`: bytes of the raw KV-cache buffers the call works on (from a KVCacheConfig's tensors or a
  dict of raw tensors), `bucket`: a hash of `size` in 0..99 (a stable "some buffer sizes");
- `head`, `blocks`: the first group's head size and the block count (0 where the call has none);
- `shape`: the groups' spec classes, head and block sizes, and the block count, as one string;
- `repeated`: the call's groups equal the previous call's in this process: consecutive fuzzing
  draws rarely repeat, the shrinking candidates of one case do.

Static `rules` (Python expressions over the facts, first match wins) are fixed when the tree is
written. A `control` file (JSON, read at every call, so one target process serves many tests) adds:
`{"all": ACTION}` every call; `{"cases": {SHAPE: ACTION}}` calls of those shapes; `{"repeated":
ACTION}` repeated calls; `{"witness": PATH}` appends every call's shape to PATH.

Actions: segfault, abort, hang, exit (SystemExit), os-exit (os._exit(7)), memory (allocate without
end). `at_import` does one as vLLM's import begins (in the zygote); `wraps=False` writes the wrapper
without functools.wraps, so its signature is (*args, **kwargs); `define` replaces the wrapper by
source of its own (a function named `_chaos_wrapper`, with `_real` the real function).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from fuzz.targets.releases import MODEL_INFO_SOURCES

ACTIONS = {
    "segfault": "__import__('ctypes').string_at(0)",
    "abort": "_os.abort()",
    "hang": "__import__('time').sleep(3600)",
    "exit": "raise SystemExit(3)",
    "os-exit": "_os._exit(7)",
    "memory": "_hoard()",
}

HEAD = '''
import os as _os


def _hoard():
    hoard = []
    while True:
        hoard.append(bytearray(64 << 20))


def _act(action):
{actions}
'''

REAL = '''
_REAL = {real!r}
__path__ = [_REAL]
__file__ = _os.path.join(_REAL, "__init__.py")
exec(compile(open(__file__).read(), __file__, "exec"))
'''

PRELUDE = '''
import importlib as _importlib

_module = _importlib.import_module({module!r})
_real = getattr(_module, {name!r})
'''

WRAPPER = '''
import functools as _functools
import json as _json
import zlib as _zlib

_CONTROL = {control!r}
_last = [None]


def _facts(args, kwargs):
    values = [*args, *kwargs.values()]
    config = next((v for v in values if hasattr(v, "kv_cache_groups")), None)
    raw = next((v for v in values if isinstance(v, dict) and v and all(hasattr(t, "untyped_storage") for t in v.values())), None)
    specs = [g.kv_cache_spec for g in config.kv_cache_groups] if config is not None else [
        g.kv_cache_spec for v in values if isinstance(v, (list, tuple)) for g in v if hasattr(g, "kv_cache_spec")]
    if config is not None:
        size = sum(t.size for t in config.kv_cache_tensors)
    else:
        size = sum({{t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (raw or {{}}).values()}}.values())
    blocks = getattr(config, "num_blocks", 0)
    groups = [f"{{type(s).__name__}}/{{getattr(s, 'head_size', 0)}}/{{s.block_size}}" for s in specs]
    repeated, _last[0] = groups == _last[0], groups
    return {{"size": size, "bucket": _zlib.crc32(str(size).encode()) % 100, "head": getattr(specs[0], "head_size", 0) if specs else 0,
            "blocks": blocks, "shape": "+".join(groups) + f"x{{blocks}}", "repeated": repeated}}


def _controlled(facts):
    if _CONTROL is None or not _os.path.exists(_CONTROL):
        return None
    with open(_CONTROL) as handle:
        control = _json.load(handle)
    if control.get("witness"):
        with open(control["witness"], "a") as witness:
            witness.write(facts["shape"] + "\\n")
    # A repeat misbehaves only for the groups of a chosen case (its shrinking candidates), not for a case that two
    # model runners view one after the other.
    chosen = {{shape.rsplit("x", 1)[0] for shape in control.get("cases", {{}})}}
    repeat = facts["repeated"] and (not chosen or facts["shape"].rsplit("x", 1)[0] in chosen)
    return control.get("all") or control.get("cases", {{}}).get(facts["shape"]) or (control.get("repeated") if repeat else None)


{decorator}
def _chaos_wrapper(*args, **kwargs):
    facts = _facts(args, kwargs)
{rules}
    action = _controlled(facts)
    if action:
        _act(action)
    return _real(*args, **kwargs)
'''

TAIL = '''

setattr(_module, {name!r}, _chaos_wrapper)
'''


def installed_vllm() -> Path:
    """The folder holding the installed `vllm` package."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent.parent


def make_tree(folder: Path, function: str, rules: list[tuple[str, str]] | None = None, *, base: Path | None = None,
              control: Path | None = None, at_import: str | None = None, wraps: bool = True, define: str | None = None) -> Path:
    """A checkout folder (for --vllm) whose vLLM is `base`'s with `function` misbehaving."""
    real = (base or installed_vllm()) / "vllm"
    assert (real / "__init__.py").is_file(), real
    module, name = function.rsplit(".", 1)
    actions = "\n".join(f"    if action == {action!r}:\n        {code}" for action, code in ACTIONS.items())
    text = HEAD.format(actions=actions)
    if at_import is not None:
        text += f"\n_act({at_import!r})\n"
    text += REAL.format(real=str(real))
    checks = [f"    if eval({when!r}, {{}}, facts):\n        _act({action!r})" for when, action in rules or ()]
    text += PRELUDE.format(module=module, name=name)
    text += define if define is not None else WRAPPER.format(control=None if control is None else str(control), rules="\n".join(checks),
                                                             decorator="@_functools.wraps(_real)" if wraps else "")
    text += TAIL.format(name=name)
    package = folder / "vllm"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(text)
    # Copies of the wrapped vLLM's model registry and model module where kvfuzz reads them to name vLLM's cache folder
    # (releases.vllm_state_folder), so wrappers share the wrapped vLLM's model-info cache instead of each inspecting the
    # model in a subprocess; Python never imports them (the package's __path__ is the real one). Copies, not links: a
    # tree shipped to Ray nodes may hold no link out of itself.
    for relative in MODEL_INFO_SOURCES:
        copy = package / relative
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes((real / relative).read_bytes())
    return folder


def set_control(control: Path, **settings: object) -> None:
    """What the tree's wrapper does from its next call on (written whole, then renamed into place)."""
    partial = control.with_suffix(".partial")
    partial.write_text(json.dumps(settings))
    partial.replace(control)
