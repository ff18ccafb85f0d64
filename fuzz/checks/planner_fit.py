"""planner-fit: the planner's memory arithmetic, which the block-count override hides (planners that take memory, <= 0.28).

kvfuzz plans every case with `num_gpu_blocks_override` set to the case's block count, so the views have the case's blocks
whatever the planner computes from memory. Here the same groups are planned once more with the override unset and a memory
of the case's blocks at the bytes per block the override's plan spends (one byte short for an odd block count): the
planner must give the blocks that memory holds and tensors of that many blocks (oracles/planner.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from fuzz.case import Case, replace
from fuzz.checks.protocol import Export, Judging, Record, Run
from fuzz.tracebacks import vllm_failure
from fuzz.verdict.compare import PLANNER
from fuzz.verdict.findings import Finding, observed
from oracles import planner

if TYPE_CHECKING:
    from fuzz.targets.entry_points import Probe
    from fuzz.targets.walk import Walk


class PlannerFit:
    name = "planner-fit"
    drawn = False
    reads_buffers = False
    needs_views = True
    probe = None
    kinds: dict[str, str] = {}  # noqa: RUF012 - planner-fit is one of the view path's kinds too (the attention-free plan)
    warnings = ()
    exports: tuple[Export, ...] = ()
    setting = None
    required_layout = None

    def offer(self, probe: Probe) -> Run | None:
        found = probe.find("planner")
        if found is None or found.takes("num_blocks"):
            return None  # planners from 0.29 take the block count, not memory
        return run

    def unrealistic(self, case: Case) -> str | None:
        return None

    def applies(self, case: Case) -> bool:
        return bool(case.groups)

    def key(self, case: Case) -> Hashable:
        # The planner sees the specs, layers, packing, platform and layout; not the runners, consumers or cache writes.
        return replace(case, touches=None, device=None, runner="v2")

    def without(self, case: Case) -> Case:
        return case

    def judge(self, judging: Judging, record: Record) -> Finding | None:
        if "skipped" in record:
            return None
        case = judging.case
        memory, per_block = record["memory"], record["bytes_per_block"]
        expected, expected_bytes = planner.fitted(memory, per_block)
        if "error" in record:
            if expected == 0 and record["error"].startswith("ValueError"):
                return None  # memory for no block at all: refusing it with a message is the planner's right
            return observed(case, "planner-fit", record.get("function") or PLANNER, f"planned from {memory} bytes: {record['error']}")
        if record["num_blocks"] != expected:
            return observed(case, "planner-fit", PLANNER, f"{memory} bytes of memory at {per_block} bytes per block give "
                                                          f"{record['num_blocks']} blocks instead of {expected}")
        if record["tensor_bytes"] != expected_bytes:
            return observed(case, "planner-fit", PLANNER, f"{record['num_blocks']} blocks planned from memory take "
                                                          f"{record['tensor_bytes']} bytes of tensors instead of {expected_bytes}")
        return None


def memory_for(num_blocks: int, bytes_per_block: int) -> int:
    """Exactly the case's blocks for an even block count; one byte short of them for an odd one (the edge of a block)."""
    return num_blocks * bytes_per_block - num_blocks % 2


def backing_bytes(tensors: list[Any]) -> int:
    """Bytes of memory a plan's KVCacheTensors take: each unpacked tensor its own, and the packed ones (a block stride,
    0.24 - 0.28) together one backing allocation ("Each emitted tensor aliases one physical backing allocation")."""
    packed = [int(t.size) for t in tensors if getattr(t, "block_stride", 0)]
    return sum(int(t.size) for t in tensors if not getattr(t, "block_stride", 0)) + max(packed, default=0)


def run(walk: Walk) -> Record:
    """What the planner gives without the override: memory, bytes per block of the override's plan, and the blocks and
    tensor bytes given (or the planner's error); skipped when the override's plan spends no whole number of bytes per
    block (the views' check judges that plan)."""
    total, num_blocks = backing_bytes(walk.config.kv_cache_tensors), walk.case.num_blocks
    if num_blocks <= 0 or total <= 0 or total % num_blocks:
        return {"skipped": "the plan spends no whole number of bytes per block"}
    per_block = total // num_blocks
    memory = memory_for(num_blocks, per_block)
    facts: Record = {"memory": memory, "bytes_per_block": per_block}
    try:
        fitted = walk.replan(memory)
    except Exception as error:  # noqa: BLE001 - judged: the planner refusing memory it was given
        failure = vllm_failure(error)
        if failure is None:
            raise
        return {**facts, "error": f"{failure.error_type}: {failure.error_message}", "function": failure.error_function}
    return {**facts, "num_blocks": int(fitted.num_blocks), "tensor_bytes": backing_bytes(fitted.kv_cache_tensors)}


CHECK = PlannerFit()
