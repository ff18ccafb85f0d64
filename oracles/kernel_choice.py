"""Which kernel block size a backend's blocks are split into (oracles/contract.py `kernel_block_size`), and whether a size
vLLM picked breaks that rule: a size the backend declares and that divides the block, but not the rule's."""

from __future__ import annotations

from collections.abc import Sequence

from oracles import contract as rules


def picked_against_rule(block_size: int, declared: Sequence[int | str], picked: int) -> int | None:
    """The rule's size where `picked` is another size the backend declares that divides the block; None where `picked`
    is the rule's, or breaks the declaration or the block (the views built at it are judged instead)."""
    if block_size % picked or not rules.declares(declared, picked):
        return None
    wanted = rules.kernel_block_size(block_size, declared)
    return wanted if wanted is not None and wanted != picked else None
