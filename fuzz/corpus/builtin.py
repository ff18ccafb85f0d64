"""The corpus shipped with kvfuzz: seeds and kept findings, for `kvfuzz replay --builtin-corpus` and `kvfuzz ci`.

A source checkout has it at corpus/ beside fuzz/; a wheel carries the same files as package data
in fuzz/_corpus (pyproject.toml maps one onto the other).
"""

from __future__ import annotations

from pathlib import Path

from fuzz import SOURCE_ROOT
from fuzz.errors import UsageError

PACKAGED = Path(__file__).resolve().parent.parent / "_corpus"


def builtin_corpus() -> Path:
    for folder in (PACKAGED, SOURCE_ROOT / "corpus"):
        if (folder / "seeds").is_dir():
            return folder
    raise UsageError(f"this kvfuzz has no built-in corpus (looked in {PACKAGED} and {SOURCE_ROOT / 'corpus'})")
