"""Pieces every exported test module shares: the case's configuration as vLLM constructor calls, the
config fixture, byte-offset helpers and the module's docstring."""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field

from fuzz.case import Case, GroupCase, SpecCase
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach

SPEC_CLASSES = {"full": "FullAttentionSpec", "mla": "MLAAttentionSpec", "sliding_window": "SlidingWindowSpec",
                "sliding_window_mla": "SlidingWindowMLASpec", "chunked_local": "ChunkedLocalAttentionSpec",
                "sink": "SinkFullAttentionSpec", "cross": "CrossAttentionSpec", "mamba": "MambaSpec"}
MLA_KINDS = ("mla", "sliding_window_mla")
# Cache dtypes whose cache holds plain elements of the model's (or the named) dtype: no quant mode to carry.
PLAIN_CACHE_DTYPES = ("auto", "float16", "bfloat16")
# Case fields an exported spec carries as vLLM's constructor arguments of the same name, with their defaults.
CARRIED_DEFAULTS = {"head_size_v": None, "sliding_window": None, "attention_chunk_size": None, "sink_len": None,
                    "page_size_padded": None, "alignment": None, "model_version": None}
# Case fields no exporter carries yet, and their defaults (a field away from its default needs a template that knows it).
PLAIN_DEFAULTS = {"num_head_slots": None, "state_content_bytes": None, "block_stride_alignment": None, "block_stride_multiple_of": None,
                  "rope_dim": None, "topk_buffer_width": None, "is_draft": False, "state_alignment": 1}
# Case fields an exported spec carries where the release's spec class has them, and skips on a release without them (a
# release that cannot build the case): byte alignments of a block's stride and of a Mamba state (0.32+ / 0.34+).
REQUIRED = ("block_stride_alignment", "state_alignment")


# Spec fields a backend publishes for its spec (customize_spec, vLLM 0.28+); a release whose spec class lacks one
# sizes that cache by the cache dtype alone. HELD_BY_HELPER passes such fields (and an MLA cache's quant mode) only
# where the release's spec class has them.
PUBLISHED = ("state_content_bytes", "num_head_slots")
HELD_BY_HELPER = '''
    def held_by(cls, **fields):
        """The fields this release's spec class has: one it lacks the release derives from the cache dtype itself (the
        state bytes a backend publishes from 0.28, an MLA cache's quant mode)."""
        names = {field.name for field in dataclasses.fields(cls)}
        return {name: value for name, value in fields.items() if name in names}
'''


REQUIRED_FIELDS_HELPER = '''
    def fields_of(cls, **fields):
        """The case's fields that this release's spec class must have: a release without one cannot build the case."""
        missing = sorted(set(fields) - {field.name for field in dataclasses.fields(cls)})
        if missing:
            pytest.skip(f"{cls.__name__} of this vLLM has no {', '.join(missing)}")
        return fields
'''


class NoTemplate(Exception):
    """The finding has no exporter yet: why, one line."""


@dataclass
class Module:
    """An exported test module as it is assembled: the vLLM names it imports, then its parts in order."""

    names: set[str] = field(default_factory=set)
    parts: list[str] = field(default_factory=list)
    title: str = ""  # what the test checks, one sentence (an issue's title)

    def add(self, text: str, *names: str) -> None:
        self.parts.append(textwrap.dedent(text).strip("\n"))
        self.names.update(names)


def layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def layer_names(case: Case) -> dict[str, str]:
    """The case's layer names (sharing layers last) as vLLM names a model's attention layers."""
    ordered = case.layer_names + [sharer for sharer, _ in case.kv_sharing]
    return {name: layer_name(index) for index, name in enumerate(ordered)}


def spec_call(spec: SpecCase, num_kv_heads: int | None = None, placed: bool = True) -> str:
    """The case's spec as a vLLM spec constructor call with literal arguments. `placed`: vLLM 0.29+, where a compressed
    spec's ratio is `tokens_per_state` (`compress_ratio` before)."""
    cls = SPEC_CLASSES.get(spec.kind)
    if cls is None:
        raise NoTemplate(f"no exporter builds {spec.kind} specs yet")
    unusual = [name for name, default in PLAIN_DEFAULTS.items()
               if name not in PUBLISHED + REQUIRED and getattr(spec, name) != default]
    required = [f"{name}={getattr(spec, name)}" for name in REQUIRED if getattr(spec, name) != PLAIN_DEFAULTS[name]]
    required_call = f"**fields_of({cls}, {', '.join(required)})" if required else None
    quantized = spec.kind not in MLA_KINDS and spec.cache_dtype not in PLAIN_CACHE_DTYPES
    if unusual or (spec.kv_quant_mode != "none" and not quantized and spec.kind not in MLA_KINDS) or spec.registered_cache_dtype:
        raise NoTemplate(f"no exporter carries spec field(s) {', '.join(unusual) or 'kv_quant_mode'} yet")
    if spec.kind == "mamba":
        dtypes = ", ".join(f"torch.{dtype}" for dtype in spec.mamba_dtypes) + ("," if len(spec.mamba_dtypes) == 1 else "")
        args = [f"block_size={spec.block_size}", f"shapes={tuple(tuple(shape) for shape in spec.mamba_shapes)!r}", f"dtypes=({dtypes})"]
        if spec.page_size_padded is not None:
            args.append(f"page_size_padded={spec.page_size_padded}")
        return f"{cls}({', '.join(args + ([required_call] if required_call else []))})"
    args = [f"block_size={spec.block_size}", f"num_kv_heads={num_kv_heads or spec.num_kv_heads}", f"head_size={spec.head_size}",
            f"dtype=torch.{spec.dtype}"]
    args += [f"{name}={json.dumps(getattr(spec, name))}" for name, default in CARRIED_DEFAULTS.items() if getattr(spec, name) != default]
    if spec.compress_ratio != 1:
        args.append(f"{'tokens_per_state' if placed else 'compress_ratio'}={spec.compress_ratio}")
    where_held = [f"{name}={getattr(spec, name)}" for name in PUBLISHED if getattr(spec, name) is not None]
    if spec.kind in MLA_KINDS:
        args.append(f"cache_dtype_str={json.dumps(spec.cache_dtype)}")
        if spec.kv_quant_mode != "none":
            where_held.append(f"kv_quant_mode=get_kv_quant_mode({json.dumps(spec.cache_dtype)})")
    elif quantized:
        if spec.kv_quant_mode == "none":
            raise NoTemplate(f"no exporter stores cache dtype {spec.cache_dtype} yet (the case gives it no quant mode)")
        # A layer of a quantized cache: the storage dtype (the case's), the quant mode the release gives the cache dtype.
        args.append(f"kv_quant_mode=get_kv_quant_mode({json.dumps(spec.cache_dtype)})")
    if where_held:
        args.append(f"**held_by({cls}, {', '.join(where_held)})")
    if required_call:
        args.append(required_call)
    return f"{cls}({', '.join(args)})"


def spec_names(call: str) -> tuple[str, ...]:
    """The vLLM names a spec_call's text uses."""
    return (call.split("(")[0],) + (("get_kv_quant_mode",) if "get_kv_quant_mode(" in call else ())


def one_group(case: Case) -> GroupCase:
    if len(case.groups) != 1 or not case.groups[0].backend:
        raise NoTemplate("no exporter builds models of several KV-cache groups (or without a shipped backend) yet")
    return case.groups[0]


def docstring(finding: FindingFile, reach: Reach | None, what: str) -> str:
    affected = ", ".join(finding.affected) or "?"
    lines = [f"Regression test for kvfuzz finding {finding.signature_id}: {what}", "",
             f"kvfuzz signature: {finding.signature}", f"Releases affected: {affected}"]
    if reach is not None:
        lines.append(f"Reach: {reach.kind} ({reach.why})")
    lines += [f"Case: {finding.path.name} in kvfuzz's corpus", "",
              "Standalone: needs vllm, torch and pytest only. It fails while the bug is there."]
    wrapped = [textwrap.fill(line, 110, subsequent_indent="    " if line.startswith("kvfuzz") else "", break_long_words=False)
               for line in lines]
    return '"""' + "\n".join(wrapped) + '\n"""'


CONFIG_FIXTURE = '''
    @pytest.fixture
    def vllm_config(monkeypatch):
        # Only KV-cache bookkeeping runs here, no kernel of the platform's: keep a platform that lacks its kernels on
        # this machine (x86 CPUs without triton-cpu) from refusing the config.
        monkeypatch.setattr(type(current_platform), "check_and_update_config", classmethod(lambda cls, config: None))
        config = VllmConfig()
        config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
        with set_current_vllm_config(config):
            yield config
'''

BOUND_LAYER = '''
    class BoundLayer:
        """A layer in the forward context after binding, as a block zeroer reads it (`.kv_cache`). An MLA layer of 0.30+
        binds its view without the head axis of size 1 (squeeze(1)): the same bytes, so the same block rows."""

        def __init__(self, kv_cache):
            self.kv_cache = kv_cache
'''

BYTE_HELPERS = '''
    def byte_offsets(tensor):
        """The bytes the tensor's elements occupy, as offsets from the start of its storage."""
        size = tensor.element_size()
        elements = torch.arange(tensor.untyped_storage().nbytes() // size)
        index = elements.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
        return {i * size + k for i in index.flatten().tolist() for k in range(size)}


    def runs(offsets):
        """A set of byte offsets as [start, end) runs, for messages."""
        found = []
        for offset in sorted(offsets):
            if found and found[-1][1] == offset:
                found[-1][1] += 1
            else:
                found.append([offset, offset + 1])
        return [tuple(run) for run in found]


    def block_rows(view, block):
        """Manager block `block` of a view whose first axis counts blocks (kernel blocks, several per manager block)."""
        per_block = view.shape[0] // NUM_BLOCKS
        return view[block * per_block:(block + 1) * per_block]
'''


def layout_lines(backends: str, specs: str, override: str | None) -> str:
    """The layout as vLLM's engine core resolves it for the backends (with the override the reach names)."""
    lines = []
    if override:
        lines.append(f'monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "{override}")')
    lines += [f"supported = [layout.name for layout in get_supported_kv_cache_layouts({backends})]",
              f"layout = resolve_kv_cache_layout(vllm_config, [supported], {specs})"]
    return "\n".join(lines)


def indent(text: str, spaces: int = 4) -> str:
    return textwrap.indent(text, " " * spaces)
