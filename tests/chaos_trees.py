"""Misbehaving vLLM trees for the chaos tests: a real vLLM with one function wrapped to fail.

`make_tree` writes a folder holding a `vllm/` package whose `__init__.py` executes a real vLLM's
(the installed one, or a release tree such as ~/.cache/kvfuzz/vllm/0.23.0) and then replaces one
function (dotted path) by a wrapper that, before calling the real function, checks rules in order
and does the first matching one's action. Rules are Python expressions over facts of the call:

- `size`: bytes of the raw KV-cache buffers the call works on (from a KVCacheConfig's tensors or a
  dict of raw tensors), `bucket`: a hash of `size` in 0..99 (a stable "some buffer sizes");
- `head`, `blocks`: the first group's head size and the block count (0 where the call has none);
- `repeated`: the call's groups (kind, head size, block size) equal the previous call's in this
  process: consecutive fuzzing draws rarely repeat, shrinking candidates of one case do;
- `calls`: calls of the function in this process so far, this one included.

Actions: segfault, abort, hang, exit (SystemExit), os-exit (os._exit), memory (allocate without end).
`at_import` does an action while vLLM is imported (in the zygote); `wraps=False` writes the
wrapper without functools.wraps, so its signature is (*args, **kwargs).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
_REAL = {real!r}
__path__ = [_REAL]
__file__ = _os.path.join(_REAL, "__init__.py")
exec(compile(open(__file__).read(), __file__, "exec"))


def _hoard():
    hoard = []
    while True:
        hoard.append(bytearray(64 << 20))
'''

WRAPPER = '''
import functools as _functools
import importlib as _importlib
import zlib as _zlib

_module = _importlib.import_module({module!r})
_real = getattr(_module, {name!r})
_last = [None, 0]


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
    key = sorted(repr((type(s).__name__, getattr(s, "head_size", 0), s.block_size)) for s in specs)
    repeated, _last[0] = key == _last[0], key
    _last[1] += 1
    return {{"size": size, "bucket": _zlib.crc32(str(size).encode()) % 100, "head": getattr(specs[0], "head_size", 0) if specs else 0,
            "blocks": getattr(config, "num_blocks", 0), "repeated": repeated, "calls": _last[1]}}


{decorator}
def _chaos_wrapper(*args, **kwargs):
    facts = _facts(args, kwargs)
{rules}
    return _real(*args, **kwargs)


setattr(_module, {name!r}, _chaos_wrapper)
'''


def installed_vllm() -> Path:
    """The folder holding the installed `vllm` package."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent.parent


def make_tree(folder: Path, function: str, rules: list[tuple[str, str]] = (), *, base: Path | None = None,  # type: ignore[assignment]
              at_import: str | None = None, wraps: bool = True) -> Path:
    """A checkout folder (for --vllm) whose vLLM is `base`'s with `function` misbehaving by `rules`."""
    real = (base or installed_vllm()) / "vllm"
    assert (real / "__init__.py").is_file(), real
    module, name = function.rsplit(".", 1)
    lines = [f"    if eval({when!r}, {{}}, facts):\n        {ACTIONS[action]}" for when, action in rules]
    text = HEAD.format(real=str(real))
    if at_import is not None:
        text += f"\n{ACTIONS[at_import]}\n"
    text += WRAPPER.format(module=module, name=name, rules="\n".join(lines),
                           decorator="@_functools.wraps(_real)" if wraps else "")
    package = folder / "vllm"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(text)
    return folder
