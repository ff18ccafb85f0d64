"""The V2 model runner's walk up to the allocation (vLLM 0.29+), written out for one exported case: the backend's
specs, the layout vLLM resolves, the planner's KVCacheConfig, KV-sharing layers, attention groups, kernel block sizes,
`allocate_kv_cache`'s views and (vLLM 0.32+, with `kernel_map`) the kernel-block views layers are bound to."""

from __future__ import annotations

import json
import textwrap

from fuzz.case import Case, GroupCase, SyntheticBackend
from fuzz.export.code import Module, NoTemplate, indent, layer_names, layout_lines, one_group, spec_call, spec_names
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach
from fuzz.targets.synthetic import published_state

# What the steps use from vLLM.
NAMES = ("AttentionBackendEnum", "customize_attention_spec", "get_supported_kv_cache_layouts", "resolve_kv_cache_layout",
         "get_kv_cache_config_from_groups", "KVCacheGroupSpec", "AttentionGroup", "prepare_kernel_block_sizes", "allocate_kv_cache")


def layout_override(reach: Reach | None, case: Case) -> str | None:
    """The VLLM_KV_CACHE_LAYOUT value the reach says the case needs (None: vLLM's own choice). A platform's own
    (synthetic) backend runs with the case's layout, whatever vLLM would pick for it."""
    for override in reach.overrides if reach else ():
        if override.startswith("VLLM_KV_CACHE_LAYOUT="):
            return override.split("=", 1)[1]
    return case.layout if any(g.synthetic_backend is not None for g in case.groups) else None


def quoted(text: str) -> str:
    return json.dumps(text)


def check_groups(finding: FindingFile, synthetic: bool = False) -> list[GroupCase]:
    """The case's KV-cache groups; NoTemplate where no exporter writes the case. Each group has a shipped backend or is a
    Mamba group; `synthetic`: one group may instead have a synthetic backend, which the template writes as a platform's
    own backend class in the module."""
    case = finding.case
    if not finding.layout_placed:
        raise NoTemplate("exporters drive the allocation of vLLM 0.29+ (KVCacheLayout) only; this finding is older")
    if case.packing not in ("none", "uniform_type") or case.runner != "v2" or case.platform != "cuda" or case.spec_source != "case":
        raise NoTemplate(f"no exporter writes {case.describe()} yet (runner, packing, platform or vLLM-built specs)")
    if synthetic and len(case.groups) == 1 and case.groups[0].synthetic_backend is not None:
        return list(case.groups)
    if len(case.groups) == 1:
        return [one_group(case)]
    for group in case.groups:
        if group.synthetic_backend is not None and not synthetic:
            raise NoTemplate("this exporter writes no synthetic backend beside other KV-cache groups")
        if group.synthetic_backend is None and group.backend is None and group.spec.kind != "mamba":
            raise NoTemplate("an attention group without a backend")
        if group.differs_per_layer:
            raise NoTemplate("no exporter builds a model of several KV-cache groups whose layers differ in size yet")
    if case.kv_sharing or case.packing != "none":
        raise NoTemplate("no exporter builds KV-sharing layers or UniformTypeKVCacheSpecs groups in a model of several "
                         "KV-cache groups yet")
    return list(case.groups)


def check_case(finding: FindingFile, synthetic: bool = False) -> GroupCase:
    """The case's one KV-cache group (check_groups)."""
    groups = check_groups(finding, synthetic)
    if len(groups) != 1:
        raise NoTemplate("this exporter writes models of one KV-cache group only")
    return groups[0]


def kernel_sizes(sizes: tuple[int | str, ...]) -> str:
    """A synthetic backend's kernel block sizes as vLLM declares them ("x16": any multiple of 16)."""
    return "[" + ", ".join(f"MultipleOf({size[1:]})" if isinstance(size, str) else str(size) for size in sizes) + "]"


def synthetic_class(group: GroupCase, module: Module) -> str:
    """A group's synthetic backend as the class a platform would register: the kernel block sizes and layouts it
    declares; it keeps the spec it is given, publishing the state bytes of a packed or scaled cache as a backend of its
    release must (fuzz/targets/synthetic.py), where the release's spec class has the field."""
    backend = group.synthetic_backend
    assert backend is not None
    module.names.update(("AttentionBackend", "MultipleOf"))
    if backend.layouts is None:
        layouts = "None  # no preference: vLLM's default order"
    else:
        module.names.add("KVCacheLayout")
        layouts = "(" + "".join(f"KVCacheLayout.{name}, " for name in backend.layouts).rstrip(" ") + ")"
    content = published_state(group.spec).state_content_bytes if group.spec.state_content_bytes is None else None
    if content is None:
        customize = "return spec"
    else:
        customize = (f"# The bytes one state (token) of the {group.spec.cache_dtype} cache holds, published as its backend must.\n"
                     f"        return dataclasses.replace(spec, **held_by(type(spec), state_content_bytes={content}))")
    return class_head(backend, "the kernel block sizes and KV-cache layouts it declares; its spec is the model's") + f'''
    @classmethod
    def supported_kv_cache_layouts(cls):
        return {layouts}

    @classmethod
    def customize_spec(cls, spec):
        {customize}
'''


BACKEND_LOOKUP = '''
    def backend_class(name, paths):
        """The attention backend vLLM registers as `name`, or (a backend a model brings, outside the registry) the
        class at the first of `paths` this vLLM has. Skips where there is none, or where its module cannot be imported
        on this machine (a dependency or a device it lacks: importing a backend runs none of the code under test)."""
        if name in AttentionBackendEnum.__members__:
            try:
                return AttentionBackendEnum[name].get_class()
            except Exception as error:
                pytest.skip(f"{name} cannot be imported here: {type(error).__name__}: {error}")
        for path in paths:
            module, _, cls = path.rpartition(".")
            try:
                return getattr(importlib.import_module(module), cls)
            except (ImportError, AttributeError):
                continue
            except Exception as error:
                pytest.skip(f"{name} cannot be imported here: {type(error).__name__}: {error}")
        pytest.skip(f"this vLLM has no {name} backend")
'''


def shipped_backend(variable: str, name: str, backend: str, module: Module) -> list[str]:
    """`variable = ` the shipped backend `backend` (its name in the module's constant `name`), by the module's
    backend_class helper."""
    from fuzz.targets.catalog import BACKEND_CLASSES  # imports torch: only when a module is written

    paths = tuple(".".join((m if m.startswith("vllm.") else "vllm.v1.attention.backends." + m, c))
                  for m, c in (path.split(":") for path in BACKEND_CLASSES.get(backend, ())))
    if textwrap.dedent(BACKEND_LOOKUP).strip("\n") not in module.parts:
        module.add(BACKEND_LOOKUP, "AttentionBackendEnum")
    if len(paths) < 2:
        return [f"{variable} = backend_class({name}, ({''.join(quoted(path) + ',' for path in paths)}))"]
    return [f"{variable} = backend_class({name}, (", *(f"    {quoted(path)}," for path in paths), "))"]


def class_head(backend: SyntheticBackend, declares: str) -> str:
    """The start of a synthetic backend's class as a platform would register it: its name and kernel block sizes."""
    return f'''
class {backend_class_name(backend)}(AttentionBackend):
    """A platform's own attention backend (kvfuzz's synthetic `{backend.name}`):
    {declares}."""

    @staticmethod
    def get_name():
        return "{backend.registered_name}"

    @classmethod
    def get_supported_kernel_block_sizes(cls, spec=None):
        return {kernel_sizes(backend.kernel_block_sizes)}
'''


def backend_class_name(backend: SyntheticBackend) -> str:
    return "Synthetic" + backend.name.title().replace("_", "") + "Backend"


def constants(finding: FindingFile, groups: list[GroupCase]) -> str:
    case = finding.case
    names = layer_names(case)
    if len(groups) == 1:
        (group,) = groups
        backend = group.backend if group.synthetic_backend is None else group.synthetic_backend.registered_name
        lines = [f'BACKEND = "{backend}"', f"NUM_BLOCKS = {case.num_blocks}",
                 f"LAYERS = [{', '.join(quoted(names[n]) for n in group.layers)}]"]
    else:
        lines = [f"NUM_BLOCKS = {case.num_blocks}"]
        for index, group in enumerate(groups):
            lines.append(f"LAYERS_{index} = [{', '.join(quoted(names[n]) for n in group.layers)}]  # KV-cache group {index}: {group.spec.kind}")
            if group.backend is not None and group.synthetic_backend is None:
                lines.append(f"BACKEND_{index} = {quoted(group.backend)}")
    if case.kv_sharing:
        lines += ["# Each KV-sharing layer and the layer whose cache it reads.",
                  "SHARED_LAYERS = {" + ", ".join(f"{quoted(names[s])}: {quoted(names[t])}" for s, t in case.kv_sharing) + "}"]
    return "\n".join(lines)


def steps(finding: FindingFile, reach: Reach | None, module: Module, refusal_ok: bool = False, kernel_map: bool = False) -> str:
    """The test body up to `kv_caches`, the views layers are given (sharing layers alias their target's).
    With `refusal_ok`, vLLM refusing the layout up front ends the test as a pass. With `kernel_map`, the views are the
    kernel-block views the runner binds to layers where vLLM maps them (0.32+: map_kv_caches_to_kernel_blocks), and the
    manager views elsewhere. A synthetic backend is the module's class of synthetic_class."""
    case = finding.case
    groups = check_groups(finding, synthetic=True)
    module.names.update(NAMES)
    if len(groups) == 1:
        lines, backends, group_specs = _one_group_specs(groups[0], module)
    else:
        lines, backends, group_specs = _group_specs(groups, module)
    override = layout_override(reach, case)
    resolve = layout_lines(backends, "layer_specs.values()", override)
    if refusal_ok:
        resolve_lines = resolve.splitlines()
        lines += resolve_lines[:-1] + ["try:", "    " + resolve_lines[-1], "except ValueError:",
                                       "    return  # vLLM refuses the layout for this backend up front: nothing reaches the code below"]
    else:
        lines += resolve.splitlines()
    lines += [f"kv_cache_config = get_kv_cache_config_from_groups(vllm_config, {group_specs}, 1 << 30)",
              "assert kv_cache_config.num_blocks == NUM_BLOCKS", "",
              "# The model runner's steps (init_attn_backend and init_kv_cache, vllm/v1/worker/gpu/attn_utils.py)."]
    if len(groups) == 1:
        lines += _one_group_attention(case, module)
    else:
        lines += ["attn_groups = ["]
        lines += [f"    [AttentionGroup(backend=backend_{i}, layer_names=LAYERS_{i}, kv_cache_spec=spec_{i}, kv_cache_group_id={i})],"
                  if group.spec.kind != "mamba" else "    [],  # a Mamba group: no attention backend takes part in its views"
                  for i, group in enumerate(groups)]
        lines += ["]"]
    lines += ["kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, attn_groups)",
              'kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, kernel_block_sizes)']
    if case.kv_sharing:
        lines += ["for layer, target in SHARED_LAYERS.items():", "    kv_caches[layer] = kv_caches[target]"]
    if kernel_map:
        module.names.update(("map_kv_caches_to_kernel_blocks", "select_common_block_size"))
        lines += ["if map_kv_caches_to_kernel_blocks is not None:",
                  "    # Each attention group's kernel block size, as create_metadata_builders picks it, then the views layers bind.",
                  "    for group_id, per_group in enumerate(attn_groups):",
                  "        for group in per_group:",
                  "            size = select_common_block_size(kernel_block_sizes[group_id], [group.backend], [group.kv_cache_spec])",
                  "            if size != group.kv_cache_spec.block_size:",
                  "                group.kernel_block_size = size",
                  "    kv_caches = map_kv_caches_to_kernel_blocks(kv_caches, [group for per_group in attn_groups for group in per_group])"]
    return indent("\n".join(lines))


def _one_group_specs(group: GroupCase, module: Module) -> tuple[list[str], str, str]:
    """The lines that build one group's backend, layer specs and group spec; the backends and the groups' specs as code."""
    module.names.update(spec_names(spec_call(group.spec)))
    if group.synthetic_backend is not None:
        lines = [f"backend = {backend_class_name(group.synthetic_backend)}"]
    else:
        lines = shipped_backend("backend", "BACKEND", group.backend, module)
    if group.differs_per_layer:
        module.names.add("UniformTypeKVCacheSpecs")
        for spec in group.layer_specs:
            module.names.update(spec_names(spec_call(spec)))
        lines.append("layer_specs = {")
        lines += [f"    LAYERS[{i}]: customize_attention_spec(backend, {spec_call(spec)}),"
                  for i, spec in enumerate(group.layer_specs)]
        lines += ["}", f"group_spec = UniformTypeKVCacheSpecs(block_size={group.spec.block_size}, kv_cache_specs=layer_specs)"]
    else:
        lines += [f"spec = customize_attention_spec(backend, {spec_call(group.spec)})",
                  "layer_specs = dict.fromkeys(LAYERS, spec)", "group_spec = spec"]
    return lines, "[backend]", "[KVCacheGroupSpec(LAYERS, group_spec)]"


def _group_specs(groups: list[GroupCase], module: Module) -> tuple[list[str], str, str]:
    """_one_group_specs for several groups: each attention group's backend and spec, each Mamba group's spec."""
    lines: list[str] = []
    for index, group in enumerate(groups):
        call = spec_call(group.spec)
        module.names.update(spec_names(call))
        if group.synthetic_backend is not None:
            lines.append(f"backend_{index} = {backend_class_name(group.synthetic_backend)}")
        elif group.backend is not None:
            lines += shipped_backend(f"backend_{index}", f"BACKEND_{index}", group.backend, module)
        else:
            lines.append(f"spec_{index} = {call}")
            continue
        lines.append(f"spec_{index} = customize_attention_spec(backend_{index}, {call})")
    lines.append("layer_specs = {" + ", ".join(f"**dict.fromkeys(LAYERS_{i}, spec_{i})" for i in range(len(groups))) + "}")
    attention = [i for i, group in enumerate(groups) if group.backend is not None or group.synthetic_backend is not None]
    backends = "[" + ", ".join(f"backend_{i}" for i in attention) + "]"
    return lines, backends, "[" + ", ".join(f"KVCacheGroupSpec(LAYERS_{i}, spec_{i})" for i in range(len(groups))) + "]"


def _one_group_attention(case: Case, module: Module) -> list[str]:
    """The attention groups the runner forms for one KV-cache group: one per layer spec (KV-sharing layers join their target's)."""
    attention = "{}\nfor layer, spec_of_layer in layer_specs.items():\n    attention_layers.setdefault(spec_of_layer, []).append(layer)"
    if case.kv_sharing:
        module.names.add("add_kv_sharing_layers_to_kv_cache_groups")
        lines = ["add_kv_sharing_layers_to_kv_cache_groups(SHARED_LAYERS, kv_cache_config.kv_cache_groups)",
                 "attention_layers = " + attention,
                 "for layer, target in SHARED_LAYERS.items():  # a sharing layer joins its target's attention group",
                 "    attention_layers[layer_specs[target]].append(layer)"]
    else:
        lines = ["attention_layers = " + attention]
    return lines + ["attn_groups = [[AttentionGroup(backend=backend, layer_names=names, kv_cache_spec=spec_of_layer, kv_cache_group_id=0)",
                    "                for spec_of_layer, names in attention_layers.items()]]"]
