"""The modules a zygote imported the slow way, and the variables vLLM's import set: written once by the first zygote of an
interpreter (`record_modules`), read by the base standby that preloads them (fuzz/campaign/preload.py)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from fuzz.campaign import standby

OWN_PACKAGES = ("vllm", "fuzz", "oracles", "tests", "__main__", "__mp_main__")


def modules_file() -> Path:
    """The module list of this interpreter (one per interpreter: the dependencies installed beside it)."""
    return standby.folder() / f"modules-{hashlib.blake2b(sys.executable.encode(), digest_size=8).hexdigest()}.txt"


def overrides_file() -> Path:
    """The variables vLLM's import sets, as a zygote of this interpreter saw them (`record_modules`)."""
    return modules_file().with_suffix(".overrides.json")


def record_modules(overrides: Mapping[str, str]) -> None:
    """Called by a zygote that imported its target the slow way: the modules it imported that are neither vLLM's nor
    kvfuzz's, in import order, and the environment variables the import set (`overrides`); each written once (the first
    target's lists serve every other)."""
    if not overrides_file().exists():
        write_whole(overrides_file(), json.dumps(dict(overrides), sort_keys=True))
    path = modules_file()
    if path.exists():
        return
    names = [name for name, module in list(sys.modules.items()) if module is not None and not name.startswith(OWN_PACKAGES)]
    write_whole(path, "\n".join(names) + "\n")


def write_whole(path: Path, text: str) -> None:
    """`text` in `path`, which a reader finds whole or not at all."""
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    partial.write_text(text)
    partial.replace(path)


def recorded_overrides() -> dict[str, str]:
    try:
        return dict(json.loads(overrides_file().read_text()))
    except (OSError, ValueError):
        return {}
