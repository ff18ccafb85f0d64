"""What a planner that sizes the cache from memory must give for it (the block-count override unset): the blocks and
the tensor bytes (oracles/contract.py `fitted_blocks`)."""

from __future__ import annotations

from oracles import contract as rules


def fitted(available_memory: int, bytes_per_block: int) -> tuple[int, int]:
    """(blocks, bytes of tensors) planned from `available_memory` at `bytes_per_block` bytes a block."""
    blocks = rules.fitted_blocks(available_memory, bytes_per_block)
    return blocks, blocks * bytes_per_block
