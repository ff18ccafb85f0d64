"""Template: the spec vLLM's MLA layer builds for a quantized cache must carry the cache dtype's quant mode
(`spec-mismatch` in `MLAAttention.get_kv_cache_spec`, the `kv_quant_mode` field): the layer, built as its spec method needs
it, asked for its spec."""

from __future__ import annotations

import textwrap

from fuzz.export.code import CONFIG_FIXTURE, Module, NoTemplate, docstring, indent, one_group
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach
from oracles import dtypes

KINDS = ("spec-mismatch",)

MLA_LAYER = '''
    def mla_layer(name):
        """vLLM's MLAAttention with what its get_kv_cache_spec reads set as the constructor sets it. The constructor itself
        also builds the backend's implementation and the projection weights, which need a whole MLA model configuration
        and play no part in the spec."""
        layer = object.__new__(MLAAttention)
        torch.nn.Module.__init__(layer)
        values = {"layer_name": name, "head_size": HEAD_SIZE, "kv_cache_dtype": CACHE_DTYPE, "sliding_window": None,
                  "non_causal_multi_token_decode": False, "indexer": None, "topk_buffer_width": None}
        for attribute, value in values.items():
            setattr(layer, attribute, value)
        return layer
'''


def layer_spec_test(finding: FindingFile, reach: Reach | None) -> Module:
    group = one_group(finding.case)
    spec = group.spec
    definition = dtypes.definition(spec.cache_dtype)
    if (not spec.is_mla or finding.case.spec_source != "vllm" or not finding.message.startswith("kv_quant_mode")
            or definition is None or spec.kv_quant_mode == "none" or spec.sliding_window is not None):
        raise NoTemplate("the layer-spec exporter covers the quant mode of a full MLA layer's spec only")
    mode = spec.kv_quant_mode.upper()
    module = Module(title=f"MLAAttention.get_kv_cache_spec gives a {spec.cache_dtype} cache a spec without its quant mode")
    module.add(docstring(finding, reach, f"the spec an MLA layer builds for a {spec.cache_dtype} cache must carry "
                                         f"KVQuantMode.{mode}."))
    module.add(f'''
        NUM_BLOCKS = {finding.case.num_blocks}
        BLOCK_SIZE = {spec.block_size}
        HEAD_SIZE = {spec.head_size}
        CACHE_DTYPE = "{spec.cache_dtype}"
        EXPECTED_MODE = "{mode}"
    ''')
    module.add(CONFIG_FIXTURE, "VllmConfig", "set_current_vllm_config", "current_platform")
    module.add(MLA_LAYER, "MLAAttention")
    rule = textwrap.wrap(f"The rule (the cache dtype's layout as kvfuzz's oracle defines it): {spec.cache_dtype} holds "
                         f"{definition.source}, which is KVQuantMode.{mode}; a spec says how its page is quantized, as "
                         "get_kv_quant_mode says for the dtype and the Attention layer's spec for the same dtype carries.", 104)
    body = ['if EXPECTED_MODE not in KVQuantMode.__members__:', '    pytest.skip(f"this vLLM has no KVQuantMode.{EXPECTED_MODE}")',
            "vllm_config.cache_config.block_size = BLOCK_SIZE",
            "vllm_config.cache_config.cache_dtype = CACHE_DTYPE",
            'spec = mla_layer("model.layers.0.self_attn.attn").get_kv_cache_spec(vllm_config)',
            *(f"# {line}" for line in rule),
            'mode = getattr(getattr(spec, "kv_quant_mode", None), "name", None)',
            'assert mode == EXPECTED_MODE, f"the spec of an MLA layer with a {CACHE_DTYPE} cache has kv_quant_mode {mode}, not {EXPECTED_MODE}"']
    module.add("def test_an_mla_layers_spec_carries_its_cache_dtypes_quant_mode(vllm_config):\n" + indent("\n".join(body)),
               "KVQuantMode")
    return module
