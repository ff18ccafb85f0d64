"""Trees of vLLM for mutants: where the target's `vllm/` package lives, and a copy of it with one
file edited.

A copy is made of hard links (symbolic links across file systems), so it costs metadata only,
and the edited file is written as a new file: the original tree is never touched.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from fuzz.errors import TargetError
from fuzz.mutate.operators import Mutant, apply
from fuzz.targets.releases import TargetSource


def tree_root(source: TargetSource) -> Path:
    """The folder holding the target's `vllm/` package."""
    if source.python_path is not None:
        return source.python_path
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise TargetError("--vllm installed: no vLLM is installed in this Python")
    return Path(spec.origin).resolve().parent.parent


def mutant_tree(root: Path, mutant: Mutant, destination: Path) -> TargetSource:
    """A copy of `root`'s vllm/ package at `destination` with the mutant's edit, as a target."""
    copy_package(root / "vllm", destination / "vllm")
    edited = destination / mutant.path
    text = apply((root / mutant.path).read_text(), mutant)
    edited.unlink()
    edited.write_text(text)
    return TargetSource(spec=str(destination), kind="checkout", version=None, python_path=destination)


def copy_package(source: Path, destination: Path) -> None:
    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            os.symlink(os.path.abspath(src), dst)

    shutil.copytree(source, destination, copy_function=link, ignore=shutil.ignore_patterns("__pycache__"))
