"""cpu-zeroer: CPUKVBlockZeroer.zero_block_ids (0.34's vllm/v1/worker/cpu/utils.py), which zeroes through tensor views on
the CPU platform: judged as the zeroer is (fuzz/checks/zeroer.py), any byte granule."""

from __future__ import annotations

from fuzz.case import Case
from fuzz.checks import when
from fuzz.checks.zeroer import Zeroer


class CpuZeroer(Zeroer):
    name = "cpu-zeroer"
    clears_words = False
    role = "CPU block zeroer"
    called_as = r"\bCPUKVBlockZeroer\("
    kernel = None  # it zeroes through tensor views
    exports = ()  # its findings are exported by the CPU runner's module (fuzz/checks/cpu_zero.py), which runs either zeroer

    def unrealistic(self, case: Case) -> str | None:
        if not when.on_cpu(case):
            return when.CPU_RULE
        return super().unrealistic(case)


CHECK = CpuZeroer()
