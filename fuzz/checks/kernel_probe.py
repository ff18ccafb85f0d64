"""kernel-probe: tokens written through each backend's own cache write (fuzz/targets/kernel_probe.py) into the V2 walk's
views. Each element of token t of block b must land where the oracle puts it, and nothing else may change
(`kernel-escape`, `kernel-miss`, `kernel-order`); a write that raises on views vLLM built for it is `kernel-crash`."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from fuzz.case import Case, replace
from fuzz.checks.protocol import Export, Judging, Record, Run
from fuzz.verdict.findings import Finding
from fuzz.verdict.touch import judge_kernel

if TYPE_CHECKING:
    from fuzz.targets.entry_points import Probe
    from fuzz.targets.walk import Walk


class KernelProbe:
    name = "kernel-probe"
    drawn = False
    reads_buffers = False  # it fills every buffer with its canary first
    needs_views = True
    probe = "kernel"  # `--probe kernel` asks for it on every case
    kinds: dict[str, str] = {}  # noqa: RUF012 - its kinds are the comparator's (fuzz/verdict/findings.py)
    warnings = ()
    exports = (Export(("kernel-crash",), "do_kv_cache_update", "fuzz.export.kernel_write:kernel_write_test"),
               Export(("kernel-crash",), "triton_reshape_and_cache_flash", "fuzz.export.cache_write:cache_write_test"),
               Export(("kernel-crash",), "triton_reshape_and_cache_flash_diffkv", "fuzz.export.cache_write:cache_write_test"))
    setting = None
    required_layout = None

    def offer(self, probe: Probe) -> Run:
        from fuzz.targets import consumers, kernel_probe  # torch and vLLM: the worker's, never the coordinator's

        mla = consumers.mla_layer_class(probe)

        def write(walk: Walk) -> Record:
            return kernel_probe.run(walk, walk.case.touches, mla)

        return write

    def unrealistic(self, case: Case) -> str | None:
        return None

    def applies(self, case: Case) -> bool:
        return case.touches is not None and bool(case.touches.tokens)

    def key(self, case: Case) -> Hashable:
        assert case.touches is not None
        mine = replace(case.touches, consumers=(), blocks=(), copies=())
        return replace(case, touches=mine, device=None, runner="v2")

    def without(self, case: Case) -> Case:
        touches = case.touches
        assert touches is not None
        kept = replace(touches, tokens=())
        return replace(case, touches=kept if kept.size else None)

    def judge(self, judging: Judging, record: Record) -> Finding | None:
        assert judging.expected is not None
        return judge_kernel(judging.case, judging.expected, judging.outcome, record)


CHECK = KernelProbe()
