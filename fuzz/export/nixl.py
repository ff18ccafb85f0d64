"""Templates: NIXL's worker on the caches of a model vLLM runs. The module walks to the runner's views as the runner does,
builds `NixlConnectorWorker` as the connector builds it for a worker of TP size 1, and registers the views: the nixl
agent (which moves the bytes) and the NUMA query are stood in, NIXL's own arithmetic is not.

- `nixl_test`: the registration raises (`crash-on-valid` / `refused-valid` in `register_kv_caches`);
- `nixl_receive_test`: a played transfer into a decode instance of larger blocks leaves other bytes than the prefill's
  (`transfer-wrong`), where the receive's post-processing is at fault: the module registers the decode instance's caches
  and runs `post_process_device_kv_on_receive` on a last block that received one of its sub-blocks, as `get_finished`
  runs it, and asserts every head of the received tokens is kept and the rest cleared."""

from __future__ import annotations

import dataclasses

from fuzz.case import MLA_KINDS
from fuzz.checks.protocol import Check
from fuzz.export import walks
from fuzz.export.code import Module, NoTemplate, docstring
from fuzz.export.connector import BACKENDS, FORWARD_CONTEXT_LAYERS
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach

STAND_INS = '''
    class RecordingNixlAgent:
        """Stands in for the nixl package's agent (nixl._api.nixl_agent, which vLLM reaches as NixlWrapper): it takes the
        memory and descriptor lists the worker registers and moves nothing."""

        def __init__(self, name, config=None):
            self.name = name

        def get_reg_descs(self, ranges, mem_type):
            return list(ranges), mem_type

        def get_xfer_descs(self, blocks, mem_type):
            return blocks, mem_type

        def prep_xfer_dlist(self, agent, descs, *args, **kwargs):
            return 1

        def get_agent_metadata(self):
            return b"regression-test"

        def __getattr__(self, name):  # register_memory and the rest: nothing to move in this test
            return lambda *args, **kwargs: None


    class ModelDescription:
        """What NIXL's worker reads of the model's config: its KV heads, head size and layers (a ModelConfig needs the model)."""

        def __init__(self, kv_heads, head_size, layers, dtype, mla):
            self.model, self.dtype, self.use_mla, self.enable_sleep_mode = "regression-test", dtype, mla, False
            self.shape = (kv_heads, head_size, layers)

        def get_total_num_kv_heads(self):
            return self.shape[0]

        def get_head_size(self):
            return self.shape[1]

        def get_total_num_hidden_layers(self):
            return self.shape[2]

        def get_layers_start_end_indices(self, parallel_config):
            return 0, self.shape[2]


    def nixl_worker(vllm_config, kv_cache_config, monkeypatch):
        """NixlConnectorWorker as the connector builds it on a worker of TP size 1, the nixl agent and NUMA query stood in."""
        for cls in NixlConnectorWorker.__mro__:
            module = sys.modules[cls.__module__]
            if hasattr(module, "NixlWrapper"):
                monkeypatch.setattr(module, "NixlWrapper", RecordingNixlAgent)
                monkeypatch.setattr(module, "nixl_agent_config", lambda **settings: settings, raising=False)
                monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: 0, raising=False)
                monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: 1, raising=False)
                platform = getattr(module, "current_platform", None)
                if hasattr(platform, "discover_numa_topology"):
                    monkeypatch.setattr(platform, "discover_numa_topology", lambda: [])
        vllm_config.kv_transfer_config = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both", engine_id="regression")
        return NixlConnectorWorker(vllm_config, "regression", kv_cache_config)
'''

RULE = '''
    # The rule (kvfuzz contract): a KV connector registers the caches vLLM builds for a model it runs; vLLM builds these
    # views (its own allocation, above) for this model, so registering them must not raise.
    worker = nixl_worker(vllm_config, kv_cache_config, monkeypatch)
    try:
        worker.register_kv_caches(kv_caches)
    finally:
        executor = getattr(worker, "_handshake_initiation_executor", None)
        if executor is not None:
            executor.shutdown(wait=False)
'''


RECEIVE_RULE = '''
    # The rule (kvfuzz contract: a block's tokens are its own, every head of them): the decode instance's blocks hold
    # RATIO of the prefill's, and its last block received the first of them. The receive's post-processing (run by
    # get_finished) must keep every head of the received tokens and clear the tokens that were not received.
    worker = nixl_worker(vllm_config, kv_cache_config, monkeypatch)
    try:
        worker.register_kv_caches(kv_caches)
        block = NUM_BLOCKS - 1
        for cache in kv_caches.values():
            cache[block].fill_(1)
        shape = str(inspect.signature(worker.post_process_device_kv_on_receive).parameters["block_ids_list"].annotation)
        if "range" in shape:  # 0.34: (group, blocks, the sub-blocks received)
            received = (0, [block], range(0, 1))
        elif shape.startswith("list[tuple[int"):  # 0.32 - 0.33: (group, blocks, how many sub-blocks were received)
            received = (0, [block], 1)
        else:  # 0.29 - 0.31: (blocks, how many sub-blocks were received)
            received = ([block], 1)
        worker.post_process_device_kv_on_receive(RATIO, [received], convert=False)
    finally:
        executor = getattr(worker, "_handshake_initiation_executor", None)
        if executor is not None:
            executor.shutdown(wait=False)
    for layer, cache in kv_caches.items():
        tokens = cache.shape[2] // RATIO  # a (block, head, token, K and V) view
        kept = cache[block, :, :tokens].float()
        assert (kept == 1).all(), f"{layer}: heads {sorted(set((kept != 1).nonzero()[:, 0].tolist()))} of the received tokens were cleared"
        assert (cache[block, :, tokens:].float() == 0).all(), f"{layer}: tokens that were not received were kept"
'''


def nixl_test(finding: FindingFile, reach: Reach | None, check: Check) -> Module:
    groups = _groups(finding, check)
    verb = "raises" if finding.kind == "refused-valid" else "crashes"
    module = Module(title=f"NIXL's worker {verb} registering the caches of a model vLLM runs ({finding.case.layout})")
    module.add(docstring(finding, reach, f"NIXL's worker must register the caches of a model vLLM runs (it {verb} instead)."))
    body, setup = _worker(finding, reach, module, groups)
    module.add(f"def test_nixl_registers_the_caches_of_a_model_vllm_runs(vllm_config, monkeypatch):\n{body}\n\n{setup}{RULE.strip(chr(10))}")
    return module


def nixl_receive_test(finding: FindingFile, reach: Reach | None, check: Check) -> Module:
    from fuzz.checks.nixl import peer_of

    how, receiver, _, _ = peer_of(finding.case)
    if how != "blocks-up":
        raise NoTemplate(f"the NIXL receive exporter covers transfers into larger blocks; this one's peer is {how!r}")
    if receiver.layout[0] != "L" and not (receiver.layout in ("BLHNC", "BLNHC") and len(receiver.layer_names) == 1):
        # Elsewhere a layer's block is no single run of bytes: a received sub-block lands across layers or heads before
        # any post-processing, a fault of the descriptors this module does not hold.
        raise NoTemplate(f"the NIXL receive exporter covers blocks that are one run per layer; {receiver.layout} with "
                         f"{len(receiver.layer_names)} layer(s) is not")
    if receiver.kv_sharing:
        # The receive post-processes each layer name's cache, a KV-sharing layer's too: the one tensor twice. This module
        # runs the post-processing's clearing only, which twice is once.
        raise NoTemplate("the NIXL receive exporter covers models without KV-sharing layers")
    ratio = receiver.groups[0].spec.block_size // finding.case.groups[0].spec.block_size
    decode = dataclasses.replace(finding, case=receiver)
    groups = _groups(decode, check)
    module = Module(title=f"NIXL's receive clears other bytes than the tokens a decode instance of {ratio}x larger blocks "
                          f"did not receive ({receiver.layout})")
    module.add(docstring(finding, reach, "A decode instance's receive must keep every head of the tokens it received (the "
                                         "walk below is the decode instance's: the case's blocks, twice as large)."))
    body, setup = _worker(decode, reach, module, groups)
    module.add(f"RATIO = {ratio}  # the decode instance's block size over the prefill's")
    module.add(f"def test_nixl_receive_keeps_the_received_tokens(vllm_config, monkeypatch):\n{body}\n\n{setup}"
               f"{RECEIVE_RULE.strip(chr(10))}")
    return module


def _groups(finding: FindingFile, check: Check) -> list:
    case = finding.case
    if check.name not in (case.touches.consumers if case.touches else ()):
        raise NoTemplate("the NIXL exporter covers findings of the NIXL check only")
    groups = walks.checked_groups(finding)
    if groups is None:
        raise NoTemplate("the NIXL exporter writes vLLM 0.29+'s walk (kvfuzz drives NIXL's worker from 0.30)")
    return groups


def _worker(finding: FindingFile, reach: Reach | None, module: Module, groups: list) -> tuple[str, str]:
    """The walk to the runner's views and what NIXL's worker reads of the model: the test body up to `kv_caches`, and the
    set-up lines after it."""
    case = finding.case
    spec = case.groups[0].spec
    cache_dtype = next((group.spec.cache_dtype for group in case.groups if group.spec.kind != "mamba"), "auto")
    module.add(walks.constants(finding, groups) + (f"\nMODEL = ({spec.num_kv_heads}, {spec.head_size}, {len(case.layer_names)}, "
                                                   f"{spec.dtype!r}, {spec.kind in MLA_KINDS})  # KV heads, head size, layers, "
                                                   f"dtype, MLA\nCACHE_DTYPE = {cache_dtype!r}"))
    module.add(STAND_INS, "NixlConnectorWorker", "KVTransferConfig")
    module.add(FORWARD_CONTEXT_LAYERS, "AttentionLayerBase")
    body, _ = walks.steps(finding, reach, module, groups)
    setup = (f"    layers_in_forward_context(vllm_config, {BACKENDS})\n"
             "    vllm_config.model_config = ModelDescription(*MODEL)\n"
             "    vllm_config.cache_config.cache_dtype = CACHE_DTYPE\n")
    if case.kv_sharing:
        setup += "    kv_caches = {**kv_caches, **{layer: kv_caches[target] for layer, target in SHARED_LAYERS.items()}}\n"
    return body, setup
