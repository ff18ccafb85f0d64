"""offload: the offloading connector's register_kv_caches (vllm/distributed/kv_transfer/kv_connector/v1/offloading), the
per-block regions it hands its transfer worker (captured; no transport started). The region of block b must hold every
byte block b owns in each layer the connector moves, and nothing outside block b (`region-mismatch`)."""

from __future__ import annotations

import contextlib
import importlib
import types
from typing import TYPE_CHECKING, Any
from unittest import mock

from fuzz.case import Touches
from fuzz.checks.protocol import Export, Judging, Record, Run, TouchCheck, Unusable
from fuzz.verdict.findings import Finding
from fuzz.verdict.touch import judge_consumer

if TYPE_CHECKING:
    from fuzz.targets.entry_points import Probe
    from fuzz.targets.walk import Walk


class Offload(TouchCheck):
    name = "offload"
    exports = (Export(("region-mismatch", "refused-valid", "crash-on-valid"), "register_kv_caches", "fuzz.export.connector:connector_test"),)
    setting = "--kv-transfer-config '{\"kv_connector\": \"OffloadingConnector\", \"kv_role\": \"kv_both\"}'"
    required_layout = "LBHNC"  # its get_required_kvcache_layout (0.29+): vLLM takes it when the backends accept it

    def offer(self, probe: Probe) -> Run | None:
        found = probe.find("offloading worker")
        if found is None:
            return None
        from fuzz.targets import consumers  # torch and vLLM: the worker's, never the coordinator's

        cls = found.obj
        module = importlib.import_module(cls.__module__)
        group_ids = getattr(module, "get_offloading_group_ids", None)

        def regions(walk: Walk, touches: Touches) -> Record:
            captured: list[Any] = []
            worker = object.__new__(cls)
            worker.kv_cache_config, worker.vllm_config = walk.config, walk.vllm_config
            worker.spec = types.SimpleNamespace(vllm_config=walk.vllm_config, kv_cache_config=walk.config, get_worker=captured.append,
                                                get_handlers=lambda caches: captured.append(caches) or [])
            worker.worker = types.SimpleNamespace(register_handler=lambda *args: None)
            worker._init_worker = captured.append  # 0.25+ hands its regions over here
            worker._register_handlers = captured.append  # 0.19-0.24 here
            with contextlib.ExitStack() as stack:
                stack.enter_context(consumers.layers_in_config(walk))
                if hasattr(module, "derive_canonical_mappings"):
                    # Canonical pages for tensor-parallel peers: no part of the regions, and it needs a model config.
                    stack.enter_context(mock.patch.object(module, "derive_canonical_mappings", lambda *args, **kwargs: {}))
                worker.register_kv_caches(consumers.with_sharers(walk))
            if len(captured) != 1:
                raise Unusable(f"{found.where}.register_kv_caches handed over {len(captured)} sets of regions, kvfuzz expects one")
            selected = group_ids(walk.config) if group_ids is not None else range(len(walk.config.kv_cache_groups))
            layers = [name for index in selected for name in walk.config.kv_cache_groups[index].layer_names]
            return {"layers": layers, "blocks": consumers.region_rows(captured[0], walk, touches.blocks)}

        users = consumers.runners_calling(r"\bregister_kv_caches\(")
        return consumers.consumer_run("mapping", found.where + ".register_kv_caches", users, regions)

    def judge(self, judging: Judging, record: Record) -> Finding | None:
        assert judging.expected is not None
        return judge_consumer(judging.case, judging.expected, judging.outcome, record)


CHECK = Offload()
