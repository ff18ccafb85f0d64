"""zeroer: KVBlockZeroer.zero_block_ids (vllm/v1/worker/utils.py), its Triton kernel run where Triton compiles or under
Triton's interpreter (fuzz/targets/triton_interp.py). Zeroing block b must clear every byte block b owns in each attention
layer that allocates a cache, and no byte outside block b (`zero-escape`, `zero-miss`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fuzz.case import Case, Touches
from fuzz.checks import when
from fuzz.checks.protocol import Export, Judging, Record, Run, TouchCheck, Unusable
from fuzz.verdict.findings import Finding
from fuzz.verdict.touch import judge_consumer

if TYPE_CHECKING:
    from fuzz.targets.entry_points import Probe
    from fuzz.targets.walk import Walk


class Zeroer(TouchCheck):
    name = "zeroer"
    reads_buffers = False  # it fills every buffer with its pattern first
    full_attention_only = False  # the layers it clears: every attention layer that allocates a cache
    clears_words = True  # its kernel stores 4-byte words
    exports = (Export(("crash-on-valid", "refused-valid"), "__init__", "fuzz.export.zeroer_init:zeroer_init_test"),
               Export(("zero-miss", "zero-escape"), "zero_block_ids", "fuzz.export.triton_zero:triton_zero_test"))

    role = "block zeroer"  # its entry point (fuzz/targets/entry_points.py)
    called_as = r"(?<![A-Za-z])KVBlockZeroer\("  # how a model runner's code builds it
    kernel: str | None = "_zero_kv_blocks_kernel"  # the Triton kernel it launches

    def offer(self, probe: Probe) -> Run | None:
        found = probe.find(self.role)
        if found is None:
            return None
        from fuzz.targets import consumers, triton_interp  # torch and vLLM: the worker's, never the coordinator's

        cls, mla = found.obj, consumers.mla_layer_class(probe)

        def zero(walk: Walk, touches: Touches) -> Record:
            consumers.zeroing_needed(walk)
            if self.kernel is not None:
                try:
                    triton_interp.runnable(found.module, (self.kernel,))
                except triton_interp.Unavailable as why:
                    raise Unusable(f"{found.where}: its kernel cannot run here ({why})") from None
            zeroer = consumers.build_zeroer(cls, walk, consumers.forward_context(walk, mla, consumers.layer_backends(walk)))
            return consumers.zero_records(walk, touches, zeroer.zero_block_ids)

        return consumers.consumer_run("zeroing", found.where + ".zero_block_ids", consumers.runners_calling(self.called_as), zero)

    def unrealistic(self, case: Case) -> str | None:
        return None if when.zeroes(case) else when.ZEROING_RULE

    def exported_with(self) -> tuple[Zeroer, ...]:
        """The zeroers an exported test of this one's finding may run (they must clear the same layers)."""
        return (self,)

    def judge(self, judging: Judging, record: Record) -> Finding | None:
        assert judging.expected is not None
        return judge_consumer(judging.case, judging.expected, judging.outcome, record, full_attention_only=self.full_attention_only,
                              clears_words=self.clears_words)


CHECK = Zeroer()
