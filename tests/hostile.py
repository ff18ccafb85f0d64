"""A hostile vLLM checkout: the installed vLLM, with allocate_kv_cache misbehaving on some cases.

By the first group's head size and block count: 80 with 1 block segfaults, 96 with 2 blocks
aborts, 32 with 3 blocks hangs, 16 with 4 blocks raises SystemExit, 128 with 2 blocks allocates
without end; anything else is the real function. Used to show a campaign survives every way a
target process can fail (tests/chaos_trees.py builds it, and the chaos suite's other trees).
"""

from __future__ import annotations

from pathlib import Path

from tests.chaos_trees import make_tree

RULES = [
    ("head == 80 and blocks == 1", "segfault"),
    ("head == 96 and blocks == 2", "abort"),
    ("head == 32 and blocks == 3", "hang"),
    ("head == 16 and blocks == 4", "exit"),
    ("head == 128 and blocks == 2", "memory"),
]


def make_hostile_checkout(folder: Path) -> Path:
    return make_tree(folder, "vllm.v1.worker.utils.allocate_kv_cache", RULES)
