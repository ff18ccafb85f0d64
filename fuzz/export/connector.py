"""Template: a KV connector's transfer regions for block b (the offloading connector's `register_kv_caches`):
`region-mismatch`, and `refused-valid` / `crash-on-valid` where it raises on a model vLLM runs."""

from __future__ import annotations

from fuzz.checks.protocol import Check
from fuzz.export import view_rules, walks
from fuzz.export.code import BYTE_HELPERS, Module, NoTemplate, docstring
from fuzz.export.expected import expected_literal
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach

RECORDING_SPEC = '''
    class RecordingOffloadingSpec:
        """Stands in for an OffloadingSpec: keeps the caches the connector worker registers, starts no transfers."""

        replicated_layout = False

        def __init__(self, vllm_config, kv_cache_config):
            self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config
            self.config = types.SimpleNamespace(canonical_layout=False, parallel=types.SimpleNamespace(rank=0))
            self.registered = []

        def get_worker(self, kv_caches):  # vLLM 0.25+
            self.registered.append(kv_caches)

        def get_handlers(self, kv_caches):  # vLLM 0.19 - 0.24
            self.registered.append(kv_caches)
            return []


    def offloading_worker(spec, vllm_config, kv_cache_config):
        """The connector's worker side, in the signature this release takes (before 0.25 the spec carries the configs)."""
        if "kv_cache_config" in inspect.signature(OffloadingConnectorWorker).parameters:
            return OffloadingConnectorWorker(spec, vllm_config, kv_cache_config)
        return OffloadingConnectorWorker(spec)
'''

# Connectors ask the layers of the config's forward context for their attention backends (the offloading connector on
# 0.19 - 0.22, NIXL's worker).
FORWARD_CONTEXT_LAYERS = '''
    def layers_in_forward_context(vllm_config, backends):
        """Put the model's layers in the config's forward context, each answering with its attention backend, as a connector
        that asks them expects."""
        for name, backend in backends.items():
            layer = type("ModelLayer", (AttentionLayerBase,), {"get_attn_backend": lambda self, backend=backend: backend,
                                                               "get_kv_cache_spec": lambda self, vllm_config: None,
                                                               "__abstractmethods__": frozenset()})
            vllm_config.compilation_config.static_forward_context[name] = object.__new__(layer)
'''

AS_LIST = '''
    def as_list(cache):
        """A layer's cache as its tensors (a Mamba layer has several)."""
        return list(cache) if isinstance(cache, (list, tuple)) else [cache]
'''

REGISTER = '''
    spec = RecordingOffloadingSpec(vllm_config, kv_cache_config)
    connector = offloading_worker(spec, vllm_config, kv_cache_config)
    # Canonical pages for tensor-parallel peers need a model config and play no part in the regions.
    monkeypatch.setattr(sys.modules[OffloadingConnectorWorker.__module__], "derive_canonical_mappings",
                        lambda *args, **kwargs: {}, raising=False)
'''

RULE = '''
    # The rule (kvfuzz contract, block_owns_its_row): the region a connector moves for block b holds every byte the
    # layers' views give block b and no byte of another block. A KV-sharing layer has its target's cache, so its
    # region is its target's.
    (registered,) = spec.registered
'''

# Where vLLM 0.29+ places every layer's blocks along its views' first axis, the views say which bytes block b owns.
PLACED_CHECK = '''
    for block in BLOCKS:
        region = set().union(*(byte_offsets(entry.tensor[block]) for entry in registered.tensors))
        own = set().union(*(byte_offsets(block_rows(view, block)) for view in kv_caches.values()))
        others = set().union(*(byte_offsets(block_rows(view, other)) for view in kv_caches.values()
                               for other in range(NUM_BLOCKS) if other != block))
        assert not region & others, f"block {block}: the region holds bytes {runs(region & others)} of other blocks"
        assert own <= region, f"block {block}: the region misses bytes {runs(own - region)} of it (region: {runs(region)})"
'''

# Before 0.29 a backend's views may put K and V (or layers) ahead of the block axis, and layers may lie in buffers of
# their own: EXPECTED says which bytes of its layer's buffer block b owns.
SHAPED_CHECK = '''
    def in_buffer(tensor, offsets):
        pointer = tensor.untyped_storage().data_ptr()
        return {(pointer, offset) for offset in offsets}

    expected = EXPECTED[release_contract()]
    owned = {block: set().union(*(in_buffer(view, (byte for start, end in want["blocks"][block] for byte in range(start, end)))
                                  for layer, tensors in expected.items() for view, want in zip(as_list(kv_caches[layer]), tensors)))
             for block in range(NUM_BLOCKS)}
    for block in BLOCKS:
        region = set().union(*(in_buffer(entry.tensor, byte_offsets(entry.tensor[block])) for entry in registered.tensors))
        others = set().union(*(owned[other] for other in range(NUM_BLOCKS) if other != block))
        foreign = sorted(byte for _, byte in region & others)
        assert not foreign, f"block {block}: the region holds bytes {runs(foreign)} of other blocks"
        missed = sorted(byte for _, byte in owned[block] - region)
        assert not missed, f"block {block}: the region misses bytes {runs(missed)} of it"
'''


# Each layer's attention backend, as the module's attention groups hold them.
BACKENDS = "{name: group.backend for per_group in attn_groups for group in per_group for name in group.layer_names}"


def connector_test(finding: FindingFile, reach: Reach | None, check: Check) -> Module:
    case = finding.case
    if check.name not in (case.touches.consumers if case.touches else ()):
        raise NoTemplate("the connector exporter covers the offloading connector only")
    groups = walks.checked_groups(finding)
    titles = {"region-mismatch": f"the offloading connector's region for a block is not that block's bytes ({case.layout})",
              "refused-valid": "the offloading connector raises on the caches of a model vLLM runs",
              "crash-on-valid": "the offloading connector crashes on the caches of a model vLLM runs"}
    module = Module(title=titles[finding.kind])
    what = {"region-mismatch": "the offloading connector's region for a block must be exactly that block's bytes.",
            "refused-valid": "the offloading connector must register the caches of a model vLLM runs (it raises instead).",
            "crash-on-valid": "the offloading connector must register the caches of a model vLLM runs (it crashes instead)."}
    module.add(docstring(finding, reach, what[finding.kind]))
    blocks = list(case.touches.blocks) if case.touches and case.touches.blocks else list(range(case.num_blocks))
    module.add(walks.constants(finding, groups) + f"\nBLOCKS = {blocks}  # the blocks whose regions are checked")
    module.add(BYTE_HELPERS)
    module.add(RECORDING_SPEC, "OffloadingConnectorWorker")
    module.add(FORWARD_CONTEXT_LAYERS, "AttentionLayerBase")
    if groups is None:
        module.add(AS_LIST)
    name = "test_offloading_connector_registers_each_block_exactly"
    body, probe = walks.steps(finding, reach, module, groups)
    if groups is not None:
        check, gate = PLACED_CHECK, ""
    else:
        module.add(expected_literal(finding, blocks=list(range(case.num_blocks))))
        check, gate = SHAPED_CHECK, view_rules.add_contract_gate(module, finding, probe)
    register = REGISTER.strip("\n") + f"\n    layers_in_forward_context(vllm_config, {BACKENDS})\n"
    register += "    connector.register_kv_caches(kv_caches)" if not case.kv_sharing else (
        "    # The runner hands connectors each KV-sharing layer with its target's cache.\n"
        "    connector.register_kv_caches({**kv_caches, **{layer: kv_caches[target] for layer, target in SHARED_LAYERS.items()}})")
    module.add(f"def {name}(vllm_config, monkeypatch):\n{gate}{body}\n\n{register}\n\n{RULE.strip(chr(10))}\n{check.strip(chr(10))}")
    return module
