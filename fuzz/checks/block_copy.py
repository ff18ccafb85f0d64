"""copy: copy_kv_cache_blocks_inplace (vllm/v1/worker/utils.py, copy-on-write block copies, 0.26+). Copying block src to
dst must leave dst holding src's bytes in every layer and change nothing outside dst (`copy-wrong`, `copy-escape`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fuzz.case import Touches
from fuzz.checks.protocol import Export, Judging, Record, Run, TouchCheck
from fuzz.verdict.findings import Finding
from fuzz.verdict.touch import judge_consumer

if TYPE_CHECKING:
    from fuzz.targets.entry_points import Probe
    from fuzz.targets.walk import Walk


class BlockCopy(TouchCheck):
    name = "copy"
    reads_buffers = False  # it fills every buffer with its pattern first
    exports = (Export(("copy-escape", "copy-wrong"), "copy_kv_cache_blocks_inplace", "fuzz.export.block_copy:block_copy_test"),)

    def offer(self, probe: Probe) -> Run | None:
        found = probe.find("block copy")
        if found is None:
            return None
        import torch  # the worker's, never the coordinator's

        from fuzz.targets import consumers, readback

        def copy(walk: Walk, touches: Touches) -> Record:
            copies = []
            caches = [view for view in walk.manager_views.values() if isinstance(view, torch.Tensor)]
            for src, dst in touches.copies:
                readback.fill_pattern(walk.raw)
                before = readback.snapshot(walk.raw)
                found.obj(caches, walk.case.num_blocks, [(src, dst)])
                changed = readback.changed(walk.raw, before)
                copies.append({"src": src, "dst": dst, "changed": changed, "values": readback.values(walk.raw, changed)})
            return {"copies": copies}

        users = consumers.runners_calling(r"\bcopy_kv_cache_blocks_inplace\(")
        return consumers.consumer_run("copying", found.where, users, copy)

    def judge(self, judging: Judging, record: Record) -> Finding | None:
        assert judging.expected is not None
        return judge_consumer(judging.case, judging.expected, judging.outcome, record)


CHECK = BlockCopy()
