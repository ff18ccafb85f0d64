"""The attention read-back: what a backend's own forward reads back from the cache its own write filled, against attention
computed directly from the keys and values written (oracles/attention.py).

For each attention group of a case (its first layer that owns its cache), a batch is drawn from the case alone: a decode
request and a prefill request with context already in the cache, on distinct manager blocks of the case's pool. Their
keys and values are written through the backend's own cache write (`do_kv_cache_update` of the impl that then reads
them, on the conditions fuzz/targets/kernel_probe.py's writer sets) into the view the layer bound; the block table
(manager blocks) is split into kernel blocks by vLLM's own AttentionGroup (`create_metadata_builders`,
`map_to_kernel_block_table`), the metadata built by the backend's own builder (`get_builder_cls()(...).build`) from a
CommonAttentionMetadata, and the backend's impl (`get_impl_cls()`) runs `forward` on drawn queries. The run records the
forward's output; the judge redraws the batch from the case and holds the output against softmax(q k^T * scale) v
(never through vLLM).

Stand-ins, each for what lies outside the code under test: the model config (a model's head counts, dtype and length,
which kvfuzz's cases carry and vLLM reads from a HuggingFace config); where a builder takes facts from the model's
registered layers rather than from its arguments (CPU_ATTN's sliding window and ISA), those facts set on the builder and
the layer; the block count the runner records once it allocates (cache_config.num_gpu_blocks, FLEX_ATTENTION's builder
reads it); and on a build without the compiled `_C_cache_ops.reshape_and_cache_flash` (FLEX_ATTENTION's write), vLLM's
Triton kernel of the same contract. Each record lists the stand-ins its run used. Block 0 is never handed to a request
(vLLM's block pool keeps it as the null block; FLEX_ATTENTION's builder uses page 0 as its "no page" entry). Every raw
buffer is first filled with a constant finite bit pattern (0x3C bytes), so a read from a place no token was written
reads a value no key or value was drawn as.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import inspect
import os
import sys
import time
import types
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any
from unittest import mock

import numpy as np

from fuzz.case import Case, GroupCase, Touches, replace
from fuzz.checks.protocol import Judging, Off, Record, Run, TouchCheck, Unusable
from fuzz.targets.base import decode_bytes, encode_bytes
from fuzz.tracebacks import vllm_failure

if TYPE_CHECKING:
    import torch

    from oracles import attention as oracle

NAME = "attention"
MISMATCH = "readback-mismatch"
ERROR = "readback-error"
# Kinds whose forward reads plain causal attention (and a window) from the cache; the others read otherwise or not at all.
READ_KINDS = ("full", "sliding_window")
PLAIN_CACHE = ("auto", "float16", "bfloat16", "float32")
DRIVEN = ("CPU_ATTN", "FLEX_ATTENTION", "TRITON_ATTN")
# From 0.32 AttentionGroup maps a manager block table into kernel blocks and builds the metadata itself; before, the runner's
# BlockTable maps the ids (`map_to_kernel_blocks`) and the runner calls the group's builder on the kernel-block table.
GROUP_API = ("map_to_kernel_block_table", "build_metadata")
RUNNER_API = ("vllm.v1.worker.block_table", "BlockTable", "map_to_kernel_blocks")
# FLEX_ATTENTION's module compiles flex_attention and create_block_mask with torch.compile; on the CPU Inductor takes 8 -
# 60 s per new shape. The check calls them uncompiled (`eager_compiled`): the same functions on the same cache and block
# table, without the code Inductor generates, which is no layout code of vLLM's (about 1 s a case). Campaigns still
# leave it out until its two candidates (FINDINGS.md, #30's notes) are triaged; it is read where this variable is set.
COMPILED_FORWARDS = {"FLEX_ATTENTION": "KVFUZZ_READ_FLEX"}


def driven(backend: str) -> bool:
    """Whether the check reads this backend's forward in this process."""
    switch = COMPILED_FORWARDS.get(backend)
    return backend in DRIVEN and (switch is None or os.environ.get(switch) == "1")
FILL_BYTE = 0x3C  # 0x3C3C as bfloat16 is 0.0115, as float16 1.06; as float32 0.0115: finite, and no drawn key or value
MAX_MODEL_LEN = 4096
# TRITON_ATTN's int8 / fp8 per-token-head caches: the oracle holds their values (oracles/attention.py `stored`), and the
# write runs under Triton's interpreter, but the interpreted forward fails at its first tl call after that write
# (kvfuzz's interpreter harness, fuzz/targets/triton_interp.py); on until a compiled Triton or a fixed harness runs it.
QUANTIZED_READ = False
COMPILER_MODULES = ("torch._inductor", "torch._dynamo")
# What Triton's interpreter says when a kernel calls a device function that runs uninterpreted (kvfuzz's gap, not vLLM's).
INTERPRETER_GAP = "Did you forget to add @triton.jit"
NOTHING_READ = (f"the read-back drives {', '.join(DRIVEN)} forwards of {', '.join(READ_KINDS)} layers on plain caches, with a "
                "block besides the null block")
# Triton 3.x's interpreter keeps bfloat16 tensors as uint16 and computes tl.dot on them as integers: outputs of 1e8.
INTERPRETER_BF16 = "a bfloat16 forward under Triton's interpreter, which computes tl.dot on bfloat16 as uint16 integers"


@dataclasses.dataclass(frozen=True)
class ModelStandIn:
    """What the backends' builders and impls read of vLLM's ModelConfig (which a HuggingFace model config fills)."""

    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_model_len: int = MAX_MODEL_LEN
    rswa_window: int | None = None

    def get_num_attention_heads(self, parallel_config: Any = None) -> int:
        return self.num_heads

    def get_num_kv_heads(self, parallel_config: Any = None) -> int:
        return self.num_kv_heads

    def get_head_size(self) -> int:
        return self.head_size

    def get_sliding_window(self) -> int | None:
        return None


class AttentionReadback(TouchCheck):
    name = NAME
    reads_buffers = False  # it fills every buffer with FILL_BYTE first
    kinds = {
        MISMATCH: "a backend's forward read back, from the cache its own write filled, other attention than the keys and "
                  "values written give",
        ERROR: "a backend raised while reading back a cache its own write filled (its impl, metadata builder, write or "
               "forward; the record names the stage)",
    }

    def offer(self, probe: Any) -> Run | Off | None:
        try:
            from vllm.v1.worker.utils import AttentionGroup
        except ImportError:
            return Off("this vLLM has no AttentionGroup in vllm.v1.worker.utils to split block tables into kernel blocks")
        if not all(hasattr(AttentionGroup, name) for name in GROUP_API) and runner_mapping() is None:
            return Off(f"this vLLM's AttentionGroup lacks {' and '.join(GROUP_API)} (from 0.32) and its runner has no "
                       f"{'.'.join(RUNNER_API[1:])}, through which the check maps kernel blocks as the runner does")
        return run

    def unrealistic(self, case: Case) -> str | None:
        """Why the check reads nothing on the case (drawn only where it reads some group's forward), or None."""
        return None if any(reads(case, index) for index in range(len(case.groups))) else NOTHING_READ

    def key(self, case: Case) -> Hashable:
        return keyed(case)

    def judge(self, judging: Judging, record: Record) -> Any:
        return judge(judging.case, record)


def keyed(case: Case) -> Case:
    """What the run reads of the case: everything but the other checks' touches (the batch is drawn from this)."""
    return replace(case, touches=Touches(consumers=(NAME,)), device=None, runner="v2")


# ---------------------------------------------------------------------------------------------- run


def run(walk: Any) -> Record:
    """Per attention group, its first layer owning a cache: the forward's output on the drawn batch, or why not."""
    from fuzz.targets import readback
    from fuzz.targets.consumers import forward_context, layer_backends

    started = time.perf_counter()
    readback.fill(walk.raw, FILL_BYTE)
    backends = layer_backends(walk)
    layers = forward_context(walk, None, backends)
    sharers = {sharer for sharer, _ in walk.case.kv_sharing}
    seed_hash = keyed(walk.case).content_hash()
    records: dict[str, Any] = {}
    for index, group in enumerate(walk.case.groups):
        own = [name for name in group.layers if name not in sharers]
        if not own:
            continue
        name = own[0]
        reason = not_read(group) if walk.case.num_blocks > 1 else "a pool of one block holds only the null block"
        if reason is None and not driven(backends[name].get_name()):
            backend = backends[name].get_name()
            switch = COMPILED_FORWARDS.get(backend)
            reason = (f"{backend}: its forward compiles per shape; set {switch}=1 to read it back" if switch
                      else f"{backend}: kvfuzz drives the forwards of {', '.join(DRIVEN)} only")
        if reason is not None:
            records[name] = {"skipped": reason}
            continue
        batch = batch_for(walk.case, index, seed_hash)
        try:
            records[name] = read_layer(walk, index, name, layers[name], backends[name], batch)
        except Unusable as why:
            records[name] = {"skipped": str(why)}
    if not any("output" in r or "error" in r for r in records.values()):
        raise Unusable("; ".join(f"{name}: {r['skipped']}" for name, r in records.items()) or "no attention layer")
    return {"layers": records, "ms": round((time.perf_counter() - started) * 1000, 1)}


def reads(case: Case, index: int) -> bool:
    group = case.groups[index]
    return case.num_blocks > 1 and group.backend is not None and driven(group.backend) and not_read(group) is None


def not_read(group: GroupCase) -> str | None:
    from oracles import attention as oracle
    spec = group.spec
    if spec.kind not in READ_KINDS:
        return f"{spec.kind} layers: the read-back covers {', '.join(READ_KINDS)}"
    quantized = spec.cache_dtype in oracle.QUANTIZED and group.backend == "TRITON_ATTN" and QUANTIZED_READ
    if (spec.cache_dtype not in PLAIN_CACHE and not quantized) or spec.registered_cache_dtype:
        return f"cache dtype {spec.cache_dtype}: the read-back covers plain caches"
    if spec.dtype not in oracle.ROUNDOFF:
        return f"dtype {spec.dtype}"
    if spec.compress_ratio > 1 or spec.sink_len or (spec.state_content_bytes is not None and not quantized):
        return "a compressed, sink or state cache"
    if group.synthetic_backend is not None:
        return "a synthetic backend has no forward"
    if group.differs_per_layer:
        return "layers of different sizes in one group"
    if spec.head_size_v not in (None, spec.head_size):
        return "K and V heads of different sizes"
    return None


def batch_for(case: Case, index: int, seed_hash: str) -> oracle.Batch:
    from oracles import attention as oracle
    spec = case.groups[index].spec
    window = spec.sliding_window if spec.kind == "sliding_window" else None
    return oracle.draw_batch(oracle.seed_of(seed_hash, index), case.num_blocks, spec.block_size, spec.num_kv_heads,
                             spec.head_size, spec.head_size_v, spec.dtype, window, spec.cache_dtype)


def read_layer(walk: Any, index: int, name: str, layer: Any, backend: type, batch: oracle.Batch) -> Record:
    from fuzz.targets import kernel_probe, triton_interp
    from oracles import attention as oracle

    group = walk.case.groups[index]
    device = walk.device
    kernel_block_size = walk.kernel_block_sizes[index] if index < len(walk.kernel_block_sizes) else group.spec.block_size
    attention_group = next(g for g in walk.attn_groups[index] if name in g.layer_names)
    writer = writer_of(backend, group, walk)  # the kernel probe's conditions on the write (the forward's impl then runs it)
    if writer.mla:
        raise Unusable(f"{writer.where} writes an MLA latent")
    kernel_probe._layer_attributes(layer, backend, group, walk, kernel_block_size)
    if interpretable(backend.get_impl_cls().forward) and group.spec.dtype == "bfloat16":
        raise Unusable(INTERPRETER_BF16)
    drawn = oracle.tensors(batch)
    config = config_stand_in(walk.vllm_config, batch, int(walk.config.num_blocks))
    stand_ins = ["ModelConfig (head counts, dtype, max_model_len)"]
    stage = "impl constructor"
    try:
        with current_config(config), triton_interp.launching(device), flash_cache_op() as op_stand_in, \
                eager_compiled(backend.get_impl_cls(), backend.get_builder_cls()) as uncompiled:
            impl = forward_impl(backend, batch, group.spec.cache_dtype)
            stage = "metadata builder constructor"
            kernel_group = kernel_blocks(attention_group, config, device, kernel_block_size)
            manager = manager_table(batch, device)
            table = kernel_table(kernel_group, manager, kernel_block_size)
            slots = slot_mapping(batch, table, kernel_block_size)
            stage = "cache write"
            write(impl, layer, drawn, slots, device)
            stage = "metadata build"
            builder = kernel_group.metadata_builders[0]
            stand_ins += builder_stand_ins(builder, layer, batch)
            metadata = built_metadata(kernel_group, batch, manager, table, new_token_slots(batch, slots), device)
            stage = "forward"
            output = forward(impl, layer, drawn, batch, metadata, device)
        if op_stand_in.called:
            stand_ins.append(op_stand_in.what)
        stand_ins += uncompiled
    except Unusable:
        raise
    except Exception as error:  # noqa: BLE001 - vLLM's code raising is data; kvfuzz's own errors propagate
        missing = kernel_probe._not_here(error)
        if missing is not None:
            raise Unusable(f"{backend.get_name()}: {missing}") from None
        if type(error).__module__.startswith(COMPILER_MODULES):
            # FLEX_ATTENTION's forward compiled by torch Inductor for the CPU, which vLLM's CPU platform never selects.
            raise Unusable(f"{backend.get_name()} {stage}: torch.compile fails for this CPU ({type(error).__name__}: "
                           f"{str(error).strip().splitlines()[0][:200] if str(error).strip() else ''})") from None
        if INTERPRETER_GAP in str(error):
            raise Unusable(f"{backend.get_name()} {stage}: a Triton function kvfuzz did not make interpretable ({INTERPRETER_GAP})") from None
        failure = vllm_failure(error)
        if failure is None:
            raise
        return {"backend": backend.get_name(), "error": {"stage": stage, "type": failure.error_type, "message": failure.error_message,
                                                         "function": failure.error_function, "file": failure.error_file,
                                                         "line": failure.error_line}}
    return {"backend": backend.get_name(), "writer": writer.where, "forward": f"{type(impl).__module__}.{type(impl).__qualname__}.forward",
            "builder": f"{type(builder).__module__}.{type(builder).__qualname__}.build", "stand_ins": stand_ins,
            "kernel_block_size": kernel_block_size, "seed": batch.seed, "shape": list(output.shape),
            "output": encode_bytes(output.float().numpy().view(np.uint8))}


def writer_of(backend: type, group: GroupCase, walk: Any) -> Any:
    """The kernel probe's writer for the layer: the backend's cache write, or Unusable with why it cannot run here."""
    from fuzz.targets import kernel_probe

    return kernel_probe._writer(backend, group, walk)


def interpretable(function: Any) -> bool:
    """The Triton kernels of the vLLM modules `function` calls into, runnable here (compiled, or under the interpreter);
    whether any of them runs under the interpreter."""
    from fuzz.targets import kernel_probe, triton_interp

    interpreted = False
    for module in kernel_probe._globals_modules(function):
        if module.startswith("vllm.") and triton_interp.kernels_of(sys.modules[module]):
            try:
                with_imported_kernels(module, set())
            except triton_interp.Unavailable as why:
                raise Unusable(f"{function.__qualname__}: {why}") from None
            interpreted = interpreted or triton_interp.interpreting()
    return interpreted


def with_imported_kernels(module_name: str, seen: set[str]) -> None:
    """`triton_interp.runnable(module_name)`, after the Triton functions it imports from other vLLM modules (device
    functions its kernels call, e.g. triton_attention_helpers') are made runnable in their own module and bound again
    under its names: a re-jitted kernel keeps the globals it had, so it must see the runnable ones."""
    from fuzz.targets import triton_interp

    seen.add(module_name)
    module = importlib.import_module(module_name)
    for name, value in list(vars(module).items()):
        origin = getattr(value, "__module__", None) or ""
        if not isinstance(value, types.FunctionType) or origin == module_name or not origin.startswith("vllm."):
            continue
        if name not in triton_interp.kernels_of(sys.modules[origin]):
            continue
        if origin not in seen:
            with_imported_kernels(origin, seen)
        setattr(module, name, getattr(sys.modules[origin], name))
    triton_interp.runnable(module_name)


@dataclasses.dataclass
class OpStandIn:
    """Whether the stand-in for an op this build lacks was called (then the record names it)."""

    what: str
    called: bool = False


@contextmanager
def eager_compiled(*classes: type) -> Iterator[list[str]]:
    """The `torch.compile` wrappers the classes' modules hold at module level, replaced by the functions they wrap while
    the check runs; yields what it replaced, for the record."""
    replaced: list[str] = []
    with contextlib.ExitStack() as patches:
        for module in {sys.modules[cls.__module__] for cls in classes}:
            for attribute, value in list(vars(module).items()):
                original = getattr(value, "_torchdynamo_orig_callable", None)
                if callable(original):
                    patches.enter_context(mock.patch.object(module, attribute, original))
                    replaced.append(f"{module.__name__}.{attribute} run uncompiled")
        yield replaced


@contextmanager
def flash_cache_op() -> Iterator[OpStandIn]:
    """Where this build has no compiled `_C_cache_ops.reshape_and_cache_flash` (the CPU build; FLEX_ATTENTION's writer
    calls it), vLLM's Triton kernel of the same signature and contract (`triton_reshape_and_cache_flash`) stands in for
    it, under the interpreter."""
    import torch  # the worker's, never the coordinator's

    from fuzz.targets import triton_interp

    stand_in = OpStandIn("torch.ops._C_cache_ops.reshape_and_cache_flash (not compiled here): vLLM's triton_reshape_and_cache_flash")
    namespace = torch.ops._C_cache_ops
    try:
        namespace.reshape_and_cache_flash  # noqa: B018 - resolving it is the question
        yield stand_in
        return
    except (AttributeError, RuntimeError):
        pass
    try:
        module = triton_interp.runnable("vllm.v1.attention.ops.triton_reshape_and_cache_flash")
    except (triton_interp.Unavailable, ImportError):
        yield stand_in  # a writer that calls the op then fails as not compiled here (a skip)
        return

    def write(*arguments: Any) -> None:
        stand_in.called = True
        module.triton_reshape_and_cache_flash(*arguments)

    with mock.patch.object(namespace, "reshape_and_cache_flash", write, create=True):
        yield stand_in


def config_stand_in(vllm_config: Any, batch: oracle.Batch, num_blocks: int) -> Any:
    """The walk's config with a model stand-in, and the block count the runner records once it allocates the cache."""
    import torch  # the worker's, never the coordinator's
    config = copy.copy(vllm_config)
    cache_config = copy.copy(vllm_config.cache_config)
    object.__setattr__(cache_config, "num_gpu_blocks", num_blocks)
    object.__setattr__(config, "cache_config", cache_config)
    model = ModelStandIn(getattr(torch, batch.dtype), batch.num_heads, batch.num_kv_heads, batch.head_size)
    object.__setattr__(config, "model_config", model)
    return config


@contextmanager
def current_config(config: Any) -> Iterator[None]:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        yield


def forward_impl(backend: type, batch: oracle.Batch, cache_dtype: str) -> Any:
    """The backend's impl as a layer with the batch's heads, scale and window has it, from its own constructor."""
    impl_cls = backend.get_impl_cls()
    arguments = {"num_heads": batch.num_heads, "head_size": batch.head_size, "scale": batch.scale, "num_kv_heads": batch.num_kv_heads,
                 "alibi_slopes": None, "sliding_window": batch.sliding_window, "kv_cache_dtype": cache_dtype,
                 "logits_soft_cap": None, "attn_type": "decoder", "kv_sharing_target_layer_name": None}
    parameters = inspect.signature(impl_cls).parameters
    return impl_cls(**{name: value for name, value in arguments.items() if name in parameters})


def kernel_blocks(attention_group: Any, config: Any, device: torch.device, kernel_block_size: int) -> Any:
    """A copy of the layer's AttentionGroup with its builder made, as the runner makes it (kernel block size and all)."""
    fields = {f.name for f in dataclasses.fields(attention_group)}
    cleared = {name: value for name, value in (("metadata_builders", []), ("kernel_block_table", None), ("kernel_block_offsets", None))
               if name in fields}
    fresh = dataclasses.replace(attention_group, **cleared)
    fresh.create_metadata_builders(config, device, kernel_block_size if kernel_block_size != attention_group.kv_cache_spec.block_size
                                   else None)
    return fresh


def runner_mapping() -> Any:
    """The runner's own mapping of manager block ids into kernel block ids (BlockTable.map_to_kernel_blocks, up to 0.31)."""
    module_name, class_name, method = RUNNER_API
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    return getattr(getattr(module, class_name, None), method, None)


def kernel_table(kernel_group: Any, manager: torch.Tensor, kernel_block_size: int) -> torch.Tensor:
    """The batch's block table in kernel blocks: the group's own mapping (0.32+), else the runner's BlockTable's, row by
    row as the runner fills its table."""
    import torch  # the worker's, never the coordinator's

    spec_block_size = kernel_group.kv_cache_spec.block_size
    if hasattr(kernel_group, "map_to_kernel_block_table"):
        return kernel_group.map_to_kernel_block_table(manager) if kernel_group.kernel_block_size else manager
    ratio = spec_block_size // kernel_block_size
    if ratio == 1:
        return manager
    arange = np.arange(ratio).reshape(1, -1)
    rows = [runner_mapping()(row.cpu().numpy(), ratio, arange) for row in manager]
    return torch.tensor(np.stack(rows), dtype=manager.dtype).to(manager.device)


def built_metadata(kernel_group: Any, batch: oracle.Batch, manager: torch.Tensor, kernel: torch.Tensor, slots: torch.Tensor,
                   device: torch.device) -> Any:
    """The forward's metadata from the group's builder: the group maps the manager table itself (0.32+); before, the runner
    hands its builder the kernel-block table."""
    if hasattr(kernel_group, "build_metadata"):
        return kernel_group.build_metadata(common_metadata(batch, manager, slots, device))
    return kernel_group.get_metadata_builder().build(common_prefix_len=0, common_attn_metadata=common_metadata(batch, kernel, slots, device))


def builder_stand_ins(builder: Any, layer: Any, batch: oracle.Batch) -> list[str]:
    """What a builder takes from the model's registered layers (none here): CPU_ATTN's group window and instruction set."""
    found = []
    if hasattr(builder, "window_size"):
        builder.window_size = -1 if batch.sliding_window is None else batch.sliding_window
        found.append("CPUAttentionMetadataBuilder.window_size (from the group's layers)")
    if hasattr(builder, "isa"):
        layer.isa = builder.isa
        found.append("layer.isa (set on registered layers by the builder)")
    return found


def manager_table(batch: oracle.Batch, device: torch.device) -> torch.Tensor:
    import torch  # the worker's, never the coordinator's
    width = max(len(r.blocks) for r in batch.requests)
    table = torch.zeros((len(batch.requests), width), dtype=torch.int32)
    for row, request in enumerate(batch.requests):
        table[row, :len(request.blocks)] = torch.tensor(request.blocks, dtype=torch.int32)
    return table.to(device)


def slot_mapping(batch: oracle.Batch, table: torch.Tensor, kernel_block_size: int) -> list[torch.Tensor]:
    """Each request's tokens' slots, read off the (kernel-block) table as the runner computes them."""
    import torch  # the worker's, never the coordinator's
    host = table.cpu().long()
    slots = []
    for row, request in enumerate(batch.requests):
        positions = torch.arange(request.seq_len)
        slots.append(host[row, positions // kernel_block_size] * kernel_block_size + positions % kernel_block_size)
    return slots


def new_token_slots(batch: oracle.Batch, slots: list[torch.Tensor]) -> torch.Tensor:
    import torch  # the worker's, never the coordinator's
    return torch.cat([s[r.context:] for r, s in zip(batch.requests, slots, strict=True)])


def write(impl: Any, layer: Any, drawn: oracle.Drawn, slots: list[torch.Tensor], device: torch.device) -> None:
    """Every token of every request, context and new, through the backend's own cache write (as the steps that computed
    them wrote them), by the impl that then reads them (a quantized cache's impl keeps its scale views)."""
    for keys, values, request_slots in zip(drawn.keys, drawn.values, slots, strict=True):
        impl.do_kv_cache_update(layer, keys.to(device), values.to(device), layer.kv_cache, request_slots.to(device))


def common_metadata(batch: oracle.Batch, table: torch.Tensor, slots: torch.Tensor, device: torch.device) -> Any:
    import torch  # the worker's, never the coordinator's
    from vllm.v1.attention.backend import CommonAttentionMetadata

    query_lens = [r.queries for r in batch.requests]
    starts = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    seq_lens = torch.tensor([r.seq_len for r in batch.requests], dtype=torch.int32)
    positions = torch.cat([torch.arange(r.context, r.seq_len) for r in batch.requests])
    known = {"query_start_loc": starts.to(device), "query_start_loc_cpu": starts, "seq_lens": seq_lens.to(device),
             "seq_lens_cpu": seq_lens, "num_computed_tokens_cpu": seq_lens - torch.tensor(query_lens, dtype=torch.int32),
             "num_reqs": len(batch.requests), "num_actual_tokens": batch.num_tokens, "max_query_len": max(query_lens),
             "max_seq_len": int(seq_lens.max()), "block_table_tensor": table, "slot_mapping": slots.to(device), "causal": True,
             "positions": positions.to(device), "is_prefilling": torch.tensor([q > 1 for q in query_lens], device=device),
             "seq_lens_cpu_upper_bound": seq_lens}
    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{name: value for name, value in known.items() if name in fields})


def forward(impl: Any, layer: Any, drawn: oracle.Drawn, batch: oracle.Batch, metadata: Any, device: torch.device) -> torch.Tensor:
    import torch  # the worker's, never the coordinator's
    new_keys = torch.cat([k[r.context:] for r, k in zip(batch.requests, drawn.keys, strict=True)]).to(device)
    new_values = torch.cat([v[r.context:] for r, v in zip(batch.requests, drawn.values, strict=True)]).to(device)
    output = torch.zeros((batch.num_tokens, batch.num_heads, batch.head_size_v), dtype=drawn.queries.dtype, device=device)
    impl.forward(layer, drawn.queries.to(device), new_keys, new_values, layer.kv_cache, metadata, output)
    return output.cpu()


# ---------------------------------------------------------------------------------------------- judge


def judge(case: Case, record: Record) -> Any:
    from fuzz.verdict.findings import observed
    from oracles import attention as oracle

    seed_hash = keyed(case).content_hash()
    for name, layer in record.get("layers", {}).items():
        if "error" in layer:
            error = layer["error"]
            return observed(case, ERROR, error["function"], f"{layer['backend']} {error.get('stage', 'forward')}, reading back its "
                            f"own cache write: {error['type']}: {error['message']}", name)
        if "output" not in layer:
            continue
        index = case.group_of(name)
        batch = batch_for(case, index, seed_hash)
        got = decode_bytes(layer["output"]).view(np.float32).reshape(layer["shape"]).astype(np.float64)
        want = oracle.expected(batch, oracle.tensors(batch))
        mismatch = oracle.first_mismatch(batch, got, want, oracle.tolerance(batch.dtype))
        if mismatch is not None:
            return observed(case, MISMATCH, layer["forward"].rsplit(".", 2)[-2] + ".forward",
                            describe(mismatch, batch, layer["kernel_block_size"]), name)
    return None


def describe(mismatch: oracle.Mismatch, batch: oracle.Batch, kernel_block_size: int) -> str:
    from oracles import attention as oracle
    request = batch.requests[mismatch.request]
    role = "decode" if request.queries == 1 else "prefill"
    return (f"request {mismatch.request} ({role}, blocks {list(request.blocks)}, {request.seq_len} tokens), query token "
            f"{mismatch.query}, head {mismatch.head}: read back {mismatch.got:.4g}, the keys and values written give "
            f"{mismatch.want:.4g} ({mismatch.bad_elements} elements off by more than {oracle.tolerance(batch.dtype):.2g})"
            + mismatch.token_place(batch, kernel_block_size))


CHECK = AttentionReadback()
