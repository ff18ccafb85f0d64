"""cpu-zero: CPUModelRunner._zero_block_ids (vllm/v1/worker/cpu_model_runner.py, the releases where it zeroes: 0.25+),
which clears the full-attention layers it says it zeroes: judged as the zeroer is (fuzz/checks/zeroer.py)."""

from __future__ import annotations

import inspect
import re
import types
from typing import TYPE_CHECKING

from fuzz.case import Case, Touches
from fuzz.checks import cpu_zeroer, when
from fuzz.checks.protocol import Export, Off, Record, Run
from fuzz.checks.zeroer import Zeroer

if TYPE_CHECKING:
    from fuzz.targets.entry_points import Probe
    from fuzz.targets.walk import Walk

# What _zero_block_ids may read of the runner; kvfuzz sets these on a runner made without its constructor.
RUNNER_FIELDS = {"kv_cache_config", "compilation_config"}


class CpuZero(Zeroer):
    name = "cpu-zero"
    full_attention_only = True
    clears_words = False
    exports = (Export(("zero-miss", "zero-escape"), "_zero_block_ids", "fuzz.export.cpu_zero:cpu_zero_test"),)

    def offer(self, probe: Probe) -> Run | Off | None:
        found = probe.find("CPU model runner")
        if found is None:
            return None
        from fuzz.targets import consumers  # torch and vLLM: the worker's, never the coordinator's

        cls, mla = found.obj, consumers.mla_layer_class(probe)
        method = vars(cls).get("_zero_block_ids")
        if method is None or consumers.does_nothing(method):
            return None  # 0.19-0.24: the CPU runner zeroes nothing
        reads = set(re.findall(r"self\.(\w+)", inspect.getsource(method)))
        if not reads <= RUNNER_FIELDS | {"_zero_block_ids"}:
            return Off(f"{found.where}._zero_block_ids reads self.{', self.'.join(sorted(reads - RUNNER_FIELDS))}, which kvfuzz does not set")

        def zero(walk: Walk, touches: Touches) -> Record:
            consumers.zeroing_needed(walk)
            runner = object.__new__(cls)
            runner.kv_cache_config = walk.config
            layers = consumers.forward_context(walk, mla, consumers.layer_backends(walk))
            runner.compilation_config = types.SimpleNamespace(static_forward_context=layers)
            return consumers.zero_records(walk, touches, runner._zero_block_ids)

        return consumers.consumer_run("zeroing", found.where + "._zero_block_ids", ("v1",), zero)

    def exported_with(self) -> tuple[Zeroer, ...]:
        """The exported test runs the CPU runner's _zero_block_ids where the release has it, else 0.34's CPUKVBlockZeroer."""
        return (self, cpu_zeroer.CHECK)

    def unrealistic(self, case: Case) -> str | None:
        if not when.on_cpu(case):
            return when.CPU_RULE
        return super().unrealistic(case)


CHECK = CpuZero()
