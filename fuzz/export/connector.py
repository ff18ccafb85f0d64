"""Template: a KV connector's transfer regions for block b (the offloading connector's `register_kv_caches`):
`region-mismatch`, and `refused-valid` / `crash-on-valid` where it raises on a model vLLM runs."""

from __future__ import annotations

from fuzz.export import runner_steps
from fuzz.export.code import BYTE_HELPERS, CONFIG_FIXTURE, Module, NoTemplate, docstring
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach

KINDS = ("region-mismatch", "refused-valid", "crash-on-valid")

RECORDING_SPEC = '''
    class RecordingOffloadingSpec:
        """Stands in for an OffloadingSpec: keeps the caches the connector worker registers, starts no transfers."""

        replicated_layout = False

        def __init__(self):
            self.config = types.SimpleNamespace(canonical_layout=False, parallel=types.SimpleNamespace(rank=0))
            self.registered = []

        def get_worker(self, kv_caches):
            self.registered.append(kv_caches)
'''

CHECK = '''
    spec = RecordingOffloadingSpec()
    connector = OffloadingConnectorWorker(spec, vllm_config, kv_cache_config)
    # Canonical pages for tensor-parallel peers need a model config and play no part in the regions.
    monkeypatch.setattr(sys.modules[OffloadingConnectorWorker.__module__], "derive_canonical_mappings",
                        lambda *args, **kwargs: {}, raising=False)
    connector.register_kv_caches(kv_caches)

    # The rule (kvfuzz contract, block_owns_its_row): the region a connector moves for block b holds every byte the
    # layers' views give block b and no byte of another block. A KV-sharing layer has its target's cache, so its
    # region is its target's.
    (registered,) = spec.registered
    for block in BLOCKS:
        region = set().union(*(byte_offsets(entry.tensor[block]) for entry in registered.tensors))
        own = set().union(*(byte_offsets(block_rows(view, block)) for view in kv_caches.values()))
        others = set().union(*(byte_offsets(block_rows(view, other)) for view in kv_caches.values()
                               for other in range(NUM_BLOCKS) if other != block))
        assert own <= region, f"block {block}: the region misses bytes {runs(own - region)} of it (region: {runs(region)})"
        assert not region & others, f"block {block}: the region holds bytes {runs(region & others)} of other blocks"
'''


def connector_test(finding: FindingFile, reach: Reach | None) -> Module:
    case = finding.case
    if "offload" not in (case.touches.consumers if case.touches else ()):
        raise NoTemplate("the connector exporter covers the offloading connector only")
    group = runner_steps.check_case(finding)
    titles = {"region-mismatch": f"the offloading connector's region for a block is not that block's bytes ({case.layout})",
              "refused-valid": "the offloading connector raises on the caches of a model vLLM runs",
              "crash-on-valid": "the offloading connector crashes on the caches of a model vLLM runs"}
    module = Module(title=titles[finding.kind])
    what = {"region-mismatch": "the offloading connector's region for a block must be exactly that block's bytes.",
            "refused-valid": "the offloading connector must register the caches of a model vLLM runs (it raises instead).",
            "crash-on-valid": "the offloading connector must register the caches of a model vLLM runs (it crashes instead)."}
    module.add(docstring(finding, reach, what[finding.kind]))
    blocks = list(case.touches.blocks) if case.touches and case.touches.blocks else list(range(case.num_blocks))
    module.add(runner_steps.constants(finding, group) + f"\nBLOCKS = {blocks}  # the blocks whose regions are checked")
    module.add(CONFIG_FIXTURE, "VllmConfig", "set_current_vllm_config", "current_platform")
    module.add(BYTE_HELPERS)
    module.add(RECORDING_SPEC)
    body = runner_steps.steps(finding, reach, module)
    name = "test_offloading_connector_registers_each_block_exactly"
    module.add(f"def {name}(vllm_config, monkeypatch):\n{body}\n\n" + CHECK.strip("\n"), "OffloadingConnectorWorker")
    return module
