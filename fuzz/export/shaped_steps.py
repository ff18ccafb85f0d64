"""The model runners' walk up to the views before vLLM 0.29, written out for one exported case: the groups' specs, the
planner's KVCacheConfig, attention groups, kernel block sizes, then the V2 runner's `_allocate_kv_cache` and
`_reshape_kv_cache` (vllm/v1/worker/gpu/attn_utils.py, generations G1-G4) in the signature the release has, or the V1
runner's `initialize_kv_cache_tensors` (vllm/v1/worker/gpu_model_runner.py) on a runner built as vLLM's worker tests
build one."""

from __future__ import annotations

from fuzz.case import GroupCase, SyntheticBackend, parse_shape_entry
from fuzz.export.code import CONFIG_FIXTURE, Module, NoTemplate, indent, layer_names, spec_call, spec_names
from fuzz.export.finding import FindingFile
from fuzz.export.runner_steps import backend_class_name, class_head, quoted, shipped_backend
from oracles import dtypes

NAMES = ("AttentionBackendEnum", "AttentionBackend", "AttentionSpec", "get_kv_cache_config_from_groups", "KVCacheGroupSpec",
         "AttentionGroup", "prepare_kernel_block_sizes", "_allocate_kv_cache", "_reshape_kv_cache", "KVCacheSpec", "KVCacheTensor")
SYMBOLS = {"B": "num_blocks", "T": "block_size", "H": "num_kv_heads", "D": "head_size"}

PROBE = '''
    def release_contract():
        """The kvfuzz contract this vLLM's _reshape_kv_cache follows, told apart as kvfuzz tells it (by what the release
        offers: kernel block sizes, the hybrid-layout pass, packed tensors, page-size buckets, storage block sizes)."""
        hybrid_pass = hasattr(sys.modules[_reshape_kv_cache.__module__], "_update_hybrid_attention_layout")
        if "kernel_block_sizes" in inspect.signature(_reshape_kv_cache).parameters:
            if not hybrid_pass:
                return "shaped-0.27"
            if "block_stride" in {field.name for field in dataclasses.fields(KVCacheTensor)}:
                return "shaped-0.24"
            buckets = hasattr(sys.modules[get_kv_cache_config_from_groups.__module__], "_bucket_layers_by_page_size")
            return "shaped-0.23" if buckets else "shaped-0.22"
        if not hasattr(KVCacheSpec, "storage_block_size"):
            return "shaped-0.19"
        return "shaped-0.21" if hybrid_pass else "shaped-0.20"
'''

RESHAPE = '''
    def reshape_kv_cache(kv_cache_config, attn_groups, kernel_block_sizes, cache_dtype):
        """The V2 model runner's init_kv_cache up to the views (vllm/v1/worker/gpu/attn_utils.py), in the signature this
        release's _allocate_kv_cache and _reshape_kv_cache take (they changed in 0.22, 0.23 and 0.24)."""
        shared = dict(SHARED_LAYERS)
        if "shared_layers" in inspect.signature(_allocate_kv_cache).parameters:
            raw = _allocate_kv_cache(kv_cache_config, shared, torch.device("cpu"))
        else:
            raw = _allocate_kv_cache(kv_cache_config, torch.device("cpu"))
        params = inspect.signature(_reshape_kv_cache).parameters
        groups = [group for per_group in attn_groups for group in per_group]
        if "attn_groups" in params:
            extra = {"kv_cache_config": kv_cache_config} if "kv_cache_config" in params else {}
            return _reshape_kv_cache(attn_groups=groups, kv_cache_raw_tensors=raw, cache_dtype=cache_dtype,
                                     kernel_block_sizes=kernel_block_sizes, shared_kv_cache_layers=shared, **extra)
        backends = {name: group.backend for group in groups for name in group.layer_names
                    if isinstance(group.kv_cache_spec, AttentionSpec)}
        extra = (kernel_block_sizes, shared) if "kernel_block_sizes" in params else ()
        return _reshape_kv_cache(kv_cache_config, raw, backends, cache_dtype, *extra)
'''


V1_RUNNER = '''
    class BoundLayer:
        """A layer in the forward context, as bind_kv_cache fills it (`.kv_cache` up to 0.26, `.bind_kv_cache()` from 0.27)."""

        def __init__(self):
            self.kv_cache = torch.tensor([])

        def bind_kv_cache(self, kv_cache):
            self.kv_cache = kv_cache


    def v1_kv_caches(vllm_config, kv_cache_config, attn_groups, kernel_block_sizes, cache_dtype):
        """The V1 model runner's initialize_kv_cache_tensors on a runner built as vLLM's worker tests build one
        (object.__new__ and only the attributes the method reads): the views it binds to each layer."""
        layers = {name: BoundLayer() for group in kv_cache_config.kv_cache_groups for name in group.layer_names}
        runner = object.__new__(GPUModelRunner)
        cache_config = copy.copy(vllm_config.cache_config)
        cache_config.cache_dtype = cache_dtype  # the V1 runner asks backends for the one global cache dtype
        attributes = {
            "vllm_config": vllm_config, "cache_config": cache_config, "device": torch.device("cpu"), "pin_memory": False,
            "compilation_config": types.SimpleNamespace(static_forward_context=layers),
            "model_config": types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type="test")),
            "attn_groups": attn_groups, "kv_cache_config": kv_cache_config, "runner_only_attn_layers": set(SHARED_LAYERS),
            "shared_kv_cache_layers": dict(SHARED_LAYERS), "kv_caches": [], "speculative_config": None, "drafter": None,
            "cross_layers_kv_cache": None, "cross_layers_attn_backend": None, "_kernel_block_sizes": kernel_block_sizes,
        }
        for name, value in attributes.items():
            setattr(runner, name, value)
        runner.initialize_kv_cache_tensors(kv_cache_config, kernel_block_sizes)
        return {name: layer.kv_cache for name, layer in layers.items()}
'''


FRESH_LAYOUT = '''
    @pytest.fixture(autouse=True)
    def fresh_kv_cache_layout():
        """vLLM reads VLLM_KV_CACHE_LAYOUT once per process (get_kv_cache_layout is cached): read afresh around the test."""
        get_kv_cache_layout.cache_clear()
        yield
        get_kv_cache_layout.cache_clear()
'''


def check_case(finding: FindingFile, both_runners: bool = False) -> None:
    """NoTemplate where the walk cannot be written for the case; `both_runners`: the template runs both model runners
    (a case of runner "both"), each other template one."""
    case = finding.case
    if finding.layout_placed:
        raise NoTemplate("the pre-0.29 view exporter writes vLLM 0.19 - 0.28's _reshape_kv_cache only")
    runners = ("both",) if both_runners else (None, "v1", "v2")
    if case.runner not in runners or case.platform != "cuda" or case.spec_source != "case":
        raise NoTemplate(f"no exporter writes {case.describe()} yet (both model runners, platform or vLLM-built specs)")
    if not case.groups:
        raise NoTemplate("an attention-free model has no views to check")
    for group in case.groups:
        if group.differs_per_layer:
            raise NoTemplate("the pre-0.29 view exporter writes no layers that differ in size yet")
        if group.spec.kind != "mamba" and group.backend is None and group.synthetic_backend is None:
            raise NoTemplate("an attention group without a backend")
        backend = group.synthetic_backend
        definition = dtypes.definition(group.spec.cache_dtype)
        if backend is not None and (backend.shape is None or definition is None or not definition.plain):
            raise NoTemplate("a synthetic backend without a declared shape, or with a packed or scaled cache")
        if group.backend is not None and case.layout not in ("NHD", "HND"):
            raise NoTemplate(f"a shipped backend asked for its {case.layout} declaration (the exporter sets NHD or HND)")


def shape_expression(pattern: tuple[int | str, ...]) -> str:
    entries = []
    for entry in pattern:
        factor, symbol = parse_shape_entry(entry)
        entries.append(str(factor) if symbol is None else SYMBOLS[symbol] if factor == 1 else f"{factor} * {SYMBOLS[symbol]}")
    return "(" + ", ".join(entries) + ("," if len(entries) == 1 else "") + ")"


def synthetic_class(backend: SyntheticBackend, module: Module) -> str:
    """A synthetic backend as the class a platform would register: its cache shape, stride order and kernel block sizes."""
    assert backend.shape is not None
    module.names.update(("AttentionBackend", "MultipleOf"))
    order = tuple(backend.stride_order) if backend.stride_order is not None else tuple(range(len(backend.shape)))
    return class_head(backend, "the cache shape, stride order and kernel block sizes it declares") + f'''
    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return {shape_expression(backend.shape)}

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension=False):
        return {order!r}
'''


def views_calls(finding: FindingFile, arguments: str) -> list[str]:
    """The lines that make the views: `kv_caches` from the case's model runner; for a case of both runners, the V2
    runner's `kv_caches` and the V1 runner's `v1_caches` (each on buffers of its own)."""
    v1 = f"v1_kv_caches(vllm_config, {arguments})"
    if finding.case.runner == "both":
        return [f"kv_caches = reshape_kv_cache({arguments})", f"v1_caches = {v1}"]
    return [f"kv_caches = {v1 if finding.case.runner == 'v1' else f'reshape_kv_cache({arguments})'}"]


def runner_helper(finding: FindingFile, module: Module) -> str:
    """The module's helpers that run the case's model runner(s) up to the views."""
    if finding.case.runner in ("v1", "both"):
        module.names.add("GPUModelRunner")
    if finding.case.runner == "both":
        return RESHAPE + "\n\n" + V1_RUNNER
    return V1_RUNNER if finding.case.runner == "v1" else RESHAPE


def constants(finding: FindingFile) -> str:
    case = finding.case
    names = layer_names(case)
    lines = [f"NUM_BLOCKS = {case.num_blocks}"]
    for index, group in enumerate(case.groups):
        lines.append(f"LAYERS_{index} = [{', '.join(quoted(names[n]) for n in group.layers)}]  # KV-cache group {index}: {group.spec.kind}")
        if group.backend is not None and group.synthetic_backend is None:
            lines.append(f"BACKEND_{index} = {quoted(group.backend)}")
    lines.append("# Each KV-sharing layer and the layer whose cache it reads.")
    lines.append("SHARED_LAYERS = {" + ", ".join(f"{quoted(names[s])}: {quoted(names[t])}" for s, t in case.kv_sharing) + "}")
    return "\n".join(lines)


def backend_line(index: int, group: GroupCase, module: Module) -> list[str]:
    if group.synthetic_backend is not None:
        return [f"backend_{index} = {backend_class_name(group.synthetic_backend)}"]
    if group.backend is None:
        return [f"backend_{index} = AttentionBackend  # a Mamba layer's backend plays no part in its views"]
    value_head = group.spec.head_size_v if group.spec.head_size_v is not None else group.spec.head_size
    return [*shipped_backend(f"backend_{index}", f"BACKEND_{index}", group.backend, module),
            f'if hasattr(backend_{index}, "set_head_size_v"):  # before 0.29 the model tells such a backend its V head size',
            f"    backend_{index}.set_head_size_v({value_head})"]


def steps(finding: FindingFile, module: Module, both_runners: bool = False) -> str:
    """The test body up to `kv_caches`, the views the case's model runner gives the layers (and, `both_runners`, the V1
    runner's `v1_caches`)."""
    case = finding.case
    check_case(finding, both_runners)
    module.names.update(NAMES)
    lines: list[str] = []
    if case.layout != "NHD":
        module.add(FRESH_LAYOUT, "get_kv_cache_layout")
        lines += ["# The KV-cache layout the backends declare their stride order for (vLLM's default is NHD).",
                  f'monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "{case.layout}")']
    specs = []
    for index, group in enumerate(case.groups):
        call = spec_call(group.spec, placed=False)
        module.names.update(spec_names(call))
        lines += backend_line(index, group, module)
        lines.append(f"spec_{index} = {call}")
        specs.append(f"spec_{index}")
    if case.packing == "uniform_type":
        module.names.add("UniformTypeKVCacheSpecs")
        lines.append("# Each KV-cache group's layers in a UniformTypeKVCacheSpecs (as DeepSeek V4's model groups them).")
        lines += [f"group_spec_{i} = UniformTypeKVCacheSpecs(block_size={spec}.block_size, kv_cache_specs=dict.fromkeys(LAYERS_{i}, {spec}))"
                  for i, spec in enumerate(specs)]
        group_specs = [f"group_spec_{i}" for i in range(len(specs))]
    else:
        group_specs = specs
    lines.append("kv_cache_groups = [" + ", ".join(f"KVCacheGroupSpec(LAYERS_{i}, {spec})" for i, spec in enumerate(group_specs)) + "]")
    # A KV-sharing layer joins its target's KV-cache group (add_kv_sharing_layers_to_kv_cache_groups) and attention group.
    members = "list(kv_cache_config.kv_cache_groups[{i}].layer_names)" if case.kv_sharing else "LAYERS_{i}"
    groups = [f"[AttentionGroup(backend=backend_{i}, layer_names={members.format(i=i)}, kv_cache_spec={spec}, kv_cache_group_id={i})]"
              for i, spec in enumerate(specs)]
    if case.packing == "cross_layers":
        module.names.add("KVTransferConfig")
        lines += ["# Cross-layer blocks, as a KV connector asks for them (the planner packs each block's layers together).",
                  'vllm_config.kv_transfer_config = KVTransferConfig(kv_connector_extra_config={"enable_cross_layers_blocks": "true"})']
    elif case.packing not in ("none", "uniform_type"):
        raise NoTemplate(f"no exporter writes {case.packing} packing yet")
    cache_dtype = next((g.spec.cache_dtype for g in case.groups if g.spec.kind != "mamba"), "auto")
    lines += ["kv_cache_config = get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, 1 << 40)",
              "assert kv_cache_config.num_blocks == NUM_BLOCKS"]
    if case.packing == "cross_layers":  # a connector without a name: the views must not ask it for its layout
        lines += ["vllm_config.kv_transfer_config = None  # the planner alone reads the setting; no connector runs here"]
    if case.kv_sharing:
        module.names.add("add_kv_sharing_layers_to_kv_cache_groups")
        lines += ["add_kv_sharing_layers_to_kv_cache_groups(SHARED_LAYERS, kv_cache_config.kv_cache_groups)"]
    lines += ["",
              "# The model runner's steps " + ("(initialize_kv_cache, vllm/v1/worker/gpu_model_runner.py)." if case.runner == "v1" else
                                               "(init_attn_backend and init_kv_cache, vllm/v1/worker/gpu/attn_utils.py)."),
              "attn_groups = [", *(f"    {group}," for group in groups), "]",
              "kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attn_groups)",
              *views_calls(finding, f'kv_cache_config, attn_groups, kernel_block_sizes, "{cache_dtype}"')]
    return indent("\n".join(lines))


def walk(finding: FindingFile, module: Module, both_runners: bool = False) -> str:
    """The config fixture, the case's synthetic backend classes and its runners' helpers added to `module`; returns the
    test body up to `kv_caches` (steps)."""
    module.add(CONFIG_FIXTURE, "VllmConfig", "set_current_vllm_config", "current_platform")
    for group in finding.case.groups:
        if group.synthetic_backend is not None:
            module.add(synthetic_class(group.synthetic_backend, module))
    module.add(runner_helper(finding, module))
    return steps(finding, module, both_runners)
