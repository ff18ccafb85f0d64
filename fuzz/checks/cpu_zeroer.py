"""cpu-zeroer: CPUKVBlockZeroer.zero_block_ids (0.34's vllm/v1/worker/cpu/utils.py), which zeroes through tensor views on
the CPU platform: judged as the zeroer is (fuzz/checks/zeroer.py), any byte granule."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fuzz.case import Case, Touches
from fuzz.checks import when
from fuzz.checks.protocol import Record, Run
from fuzz.checks.zeroer import Zeroer

if TYPE_CHECKING:
    from fuzz.targets.entry_points import Probe
    from fuzz.targets.walk import Walk


class CpuZeroer(Zeroer):
    name = "cpu-zeroer"
    clears_words = False
    exports = ()  # its findings are exported by the CPU runner's module (fuzz/checks/cpu_zero.py), which runs either zeroer

    def offer(self, probe: Probe) -> Run | None:
        found = probe.find("CPU block zeroer")
        if found is None:
            return None
        from fuzz.targets import consumers  # torch and vLLM: the worker's, never the coordinator's

        cls, mla = found.obj, consumers.mla_layer_class(probe)

        def zero(walk: Walk, touches: Touches) -> Record:
            consumers.zeroing_needed(walk)
            zeroer = consumers.build_zeroer(cls, walk, consumers.forward_context(walk, mla, consumers.layer_backends(walk)))
            return consumers.zero_records(walk, touches, zeroer.zero_block_ids)

        users = consumers.runners_calling(r"\bCPUKVBlockZeroer\(")
        return consumers.consumer_run("zeroing", found.where + ".zero_block_ids", users, zero)

    def unrealistic(self, case: Case) -> str | None:
        if not when.on_cpu(case):
            return when.CPU_RULE
        return super().unrealistic(case)


CHECK = CpuZeroer()
