"""The V2 model runner's walk up to the allocation (vLLM 0.29+), written out for one exported case: the backend's
specs, the layout vLLM resolves, the planner's KVCacheConfig, KV-sharing layers, attention groups, kernel block sizes
and `allocate_kv_cache`'s views."""

from __future__ import annotations

import json

from fuzz.case import Case, GroupCase
from fuzz.export.code import Module, NoTemplate, indent, layer_names, layout_lines, one_group, spec_call
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach

# What the steps use from vLLM.
NAMES = ("AttentionBackendEnum", "customize_attention_spec", "get_supported_kv_cache_layouts", "resolve_kv_cache_layout",
         "get_kv_cache_config_from_groups", "KVCacheGroupSpec", "AttentionGroup", "prepare_kernel_block_sizes", "allocate_kv_cache")


def layout_override(reach: Reach | None, case: Case) -> str | None:
    """The VLLM_KV_CACHE_LAYOUT value the reach says the case needs (None: vLLM's own choice)."""
    for override in reach.overrides if reach else ():
        if override.startswith("VLLM_KV_CACHE_LAYOUT="):
            return override.split("=", 1)[1]
    return None


def quoted(text: str) -> str:
    return json.dumps(text)


def check_case(finding: FindingFile) -> GroupCase:
    case = finding.case
    if not finding.layout_placed:
        raise NoTemplate("exporters drive the allocation of vLLM 0.29+ (KVCacheLayout) only; this finding is older")
    if case.packing not in ("none", "uniform_type") or case.runner != "v2" or case.platform != "cuda" or case.spec_source != "case":
        raise NoTemplate(f"no exporter writes {case.describe()} yet (runner, packing, platform or vLLM-built specs)")
    return one_group(case)


def constants(finding: FindingFile, group: GroupCase) -> str:
    case = finding.case
    names = layer_names(case)
    lines = [f'BACKEND = "{group.backend}"', f"NUM_BLOCKS = {case.num_blocks}",
             f"LAYERS = [{', '.join(quoted(names[n]) for n in group.layers)}]"]
    if case.kv_sharing:
        lines += ["# Each KV-sharing layer and the layer whose cache it reads.",
                  "SHARED_LAYERS = {" + ", ".join(f"{quoted(names[s])}: {quoted(names[t])}" for s, t in case.kv_sharing) + "}"]
    return "\n".join(lines)


def steps(finding: FindingFile, reach: Reach | None, module: Module, refusal_ok: bool = False) -> str:
    """The test body up to `kv_caches`, the views layers are given (sharing layers alias their target's).
    With `refusal_ok`, vLLM refusing the layout up front ends the test as a pass."""
    case = finding.case
    group = check_case(finding)
    spec_class = spec_call(group.spec).split("(")[0]
    module.names.update(NAMES + (spec_class,))
    lines = ["if BACKEND not in AttentionBackendEnum.__members__:",
             '    pytest.skip(f"this vLLM has no {BACKEND} backend")',
             "backend = AttentionBackendEnum[BACKEND].get_class()"]
    if group.layer_heads:
        module.names.add("UniformTypeKVCacheSpecs")
        lines.append("layer_specs = {")
        lines += [f"    LAYERS[{i}]: customize_attention_spec(backend, {spec_call(group.spec, heads)}),"
                  for i, heads in enumerate(group.layer_heads)]
        lines += ["}", f"group_spec = UniformTypeKVCacheSpecs(block_size={group.spec.block_size}, kv_cache_specs=layer_specs)"]
    else:
        lines += [f"spec = customize_attention_spec(backend, {spec_call(group.spec)})",
                  "layer_specs = dict.fromkeys(LAYERS, spec)", "group_spec = spec"]
    override = layout_override(reach, case)
    resolve = layout_lines("[backend]", "layer_specs.values()", override)
    if refusal_ok:
        resolve_lines = resolve.splitlines()
        lines += resolve_lines[:-1] + ["try:", "    " + resolve_lines[-1], "except ValueError:",
                                       "    return  # vLLM refuses the layout for this backend up front: nothing reaches the code below"]
    else:
        lines += resolve.splitlines()
    lines += ["kv_cache_config = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(LAYERS, group_spec)], 1 << 30)",
              "assert kv_cache_config.num_blocks == NUM_BLOCKS", "",
              "# The model runner's steps (init_attn_backend and init_kv_cache, vllm/v1/worker/gpu/attn_utils.py)."]
    attention = "{}\nfor layer, spec_of_layer in layer_specs.items():\n    attention_layers.setdefault(spec_of_layer, []).append(layer)"
    if case.kv_sharing:
        module.names.add("add_kv_sharing_layers_to_kv_cache_groups")
        lines += ["add_kv_sharing_layers_to_kv_cache_groups(SHARED_LAYERS, kv_cache_config.kv_cache_groups)",
                  "attention_layers = " + attention,
                  "for layer, target in SHARED_LAYERS.items():  # a sharing layer joins its target's attention group",
                  "    attention_layers[layer_specs[target]].append(layer)"]
    else:
        lines.append("attention_layers = " + attention)
    lines += ["attn_groups = [[AttentionGroup(backend=backend, layer_names=names, kv_cache_spec=spec_of_layer, kv_cache_group_id=0)",
              "                for spec_of_layer, names in attention_layers.items()]]",
              "kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attn_groups)",
              'kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, kernel_block_sizes)']
    if case.kv_sharing:
        lines += ["for layer, target in SHARED_LAYERS.items():", "    kv_caches[layer] = kv_caches[target]"]
    return indent("\n".join(lines))
