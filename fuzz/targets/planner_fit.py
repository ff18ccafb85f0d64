"""The planner's memory arithmetic, which the block-count override hides (planners that take memory, <= 0.28).

kvfuzz plans every case with `num_gpu_blocks_override` set to the case's block count, so the views
have the case's blocks whatever the planner computes from memory. Here the same groups are planned
once more with the override unset and a memory of the case's blocks at the bytes per block the
override's plan spends (one byte short for an odd block count): the planner must give the blocks
that memory holds and tensors of that many blocks (oracles/contract.py `fitted_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fuzz.targets.base import Outcome


def memory_for(num_blocks: int, bytes_per_block: int) -> int:
    """Exactly the case's blocks for an even block count; one byte short of them for an odd one (the edge of a block)."""
    return num_blocks * bytes_per_block - num_blocks % 2


def backing_bytes(tensors: list[Any]) -> int:
    """Bytes of memory a plan's KVCacheTensors take: each unpacked tensor its own, and the packed ones (a block stride,
    0.24 - 0.28) together one backing allocation ("Each emitted tensor aliases one physical backing allocation")."""
    packed = [int(t.size) for t in tensors if getattr(t, "block_stride", 0)]
    return sum(int(t.size) for t in tensors if not getattr(t, "block_stride", 0)) + max(packed, default=0)


def fit(plan: Callable[[int], Any], config: Any, num_blocks: int,
        describe: Callable[[BaseException], Outcome | None]) -> dict[str, Any] | None:
    """What the planner gives without the override (plan: memory -> KVCacheConfig, override unset; describe: a vLLM
    error's Outcome, None for kvfuzz's own); None when the override's plan spends no whole number of bytes per block (the
    views' check judges that plan)."""
    total = backing_bytes(config.kv_cache_tensors)
    if num_blocks <= 0 or total <= 0 or total % num_blocks:
        return None
    per_block = total // num_blocks
    memory = memory_for(num_blocks, per_block)
    facts: dict[str, Any] = {"memory": memory, "bytes_per_block": per_block}
    try:
        fitted = plan(memory)
    except Exception as error:  # noqa: BLE001 - judged: the planner refusing memory it was given
        failure = describe(error)
        if failure is None:
            raise
        return {**facts, "error": f"{failure.error_type}: {failure.error_message}", "function": failure.error_function}
    return {**facts, "num_blocks": int(fitted.num_blocks), "tensor_bytes": backing_bytes(fitted.kv_cache_tensors)}
