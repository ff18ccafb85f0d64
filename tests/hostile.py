"""A hostile vLLM checkout: the installed vLLM, with allocate_kv_cache misbehaving on some cases.

By the first group's head size and block count: 80 with 1 block segfaults, 96 with 2 blocks
aborts, 32 with 3 blocks hangs, 16 with 4 blocks raises SystemExit, 128 with 2 blocks allocates
without end; anything else is the real function. Used to show a campaign survives every way a target process can fail.
"""

from __future__ import annotations

from pathlib import Path

INIT = '''
import os as _os
_REAL = {real!r}
__path__ = [_REAL]
__file__ = _os.path.join(_REAL, "__init__.py")
exec(compile(open(__file__).read(), __file__, "exec"))

from vllm.v1.worker import utils as _utils

_real_allocate = _utils.allocate_kv_cache


def _hostile_allocate(kv_cache_config, *args, **kwargs):
    import ctypes
    import time

    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    head, blocks = getattr(spec, "head_size", 0), kv_cache_config.num_blocks
    if head == 80 and blocks == 1:
        ctypes.string_at(0)
    if head == 96 and blocks == 2:
        _os.abort()
    if head == 32 and blocks == 3:
        time.sleep(3600)
    if head == 16 and blocks == 4:
        raise SystemExit(3)
    if head == 128 and blocks == 2:
        hoard = []
        while True:
            hoard.append(bytearray(64 << 20))
    return _real_allocate(kv_cache_config, *args, **kwargs)


_utils.allocate_kv_cache = _hostile_allocate
'''


def make_hostile_checkout(folder: Path) -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    package = folder / "vllm"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(INIT.format(real=str(Path(spec.origin).parent)))
    return folder
