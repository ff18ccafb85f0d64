"""A hostile vLLM checkout: the installed vLLM, with allocate_kv_cache misbehaving on some cases.

By the first group's head size and block count (`TRIGGERS`: pairs the case space draws a few times
in 300 cases): 32 with 1 block segfaults, 8 with 1 aborts, 64 with 1 hangs, 8 with 2 raises
SystemExit, 16 with 1 allocates without end; anything else is the real function. Used to show a campaign survives every way a
target process can fail (tests/chaos_trees.py builds it, and the chaos suite's other trees).
"""

from __future__ import annotations

from pathlib import Path

from fuzz.targets.base import TargetInfo
from tests.chaos_trees import make_tree

TRIGGERS = {
    "segfault": (32, 1),
    "abort": (8, 1),
    "hang": (64, 1),
    "exit": (8, 2),
    "memory": (16, 1),
}
RULES = [(f"head == {head} and blocks == {blocks}", action) for action, (head, blocks) in TRIGGERS.items()]


def make_hostile_checkout(folder: Path) -> Path:
    return make_tree(folder, "vllm.v1.worker.utils.allocate_kv_cache", RULES)


def seed_meeting(info: TargetInfo, actions: tuple[str, ...], cases: int, seeds: int = 200) -> tuple[int, int]:
    """A campaign seed whose first `cases` draws meet the trigger of each action, and how many of its first draws
    it takes to meet them all once (a campaign that long meets each, and pays for no more hangs than it must).

    The case stream changes whenever the case space does, so the campaign tests pick their seed
    from it instead of hard-coding one that once worked.
    """
    from fuzz.space import Rejected, draw_indexed

    wanted = {TRIGGERS[action] for action in actions}
    for seed in range(seeds):
        met: set[tuple[int, int]] = set()
        for index in range(cases):
            try:
                case = draw_indexed(info, seed, index, touches=True)
            except Rejected:
                continue
            if case.groups:
                met.add((case.groups[0].spec.head_size, case.num_blocks))
            if wanted <= met:
                return seed, index + 1
    raise AssertionError(f"no seed below {seeds} meets {actions} within {cases} cases")
