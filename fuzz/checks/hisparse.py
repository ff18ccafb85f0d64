"""HiSparse caches (vllm/v1/hisparse, 0.30+): vLLM lays out a sparse-MLA model's host pool and device pool, allocates both
and binds each layer's resident, hot and host views, and every view's blocks are held against the bytes they must own.

What runs is vLLM's: the engine core's `get_kv_cache_groups`, which asks `get_hisparse_kv_cache_groups` (the host source
group of the sparse-MLA layers, the indexer group, the resident and hot groups it derives),
`get_hisparse_host_pool_bytes`, `get_hisparse_kv_cache_config` (which calls `create_hisparse_layout` and
`_build_hisparse_kv_cache_tensors`), then `init_hisparse_kv_cache` (binding.py), which allocates with
`allocate_hisparse_kv_caches` (the device pool through `allocate_kv_cache`, the host pool through `HiSparseHostPool`)
and binds with `bind_hisparse_kv_caches` each layer's `HiSparseCacheHandle` and `HiSparseRuntime` (vLLM's own classes,
built by their constructors). This is what the V2 runner's `init_kv_cache` (vllm/v1/worker/gpu/attn_utils.py) calls
when `attention_config.hisparse_config` is set. What is stood in is outside that code:

- the model: a DeepSeek V3.2-style model of the case's sparse-MLA layers (`model.layers.<i>.self_attn.attn`), each with
  its indexer cache (`...self_attn.indexer.k_cache`, DeepseekV32IndexerCache's spec), its `max_model_len` and `index_topk`
  (a ModelConfig stand-in); the HiSparseConnector setting (`host_pool_gib`) and `hisparse_config` are real configs;
- the CUDA host-memory registration and kernels: `cudaHostRegister` (`pin_tensor`, recorded: the pinned pool is a plain
  CPU tensor), the compiled `_C_cache_ops` check, and from 0.34 the platform's HiSparse device backend (a `HiSparseBackend`
  subclass whose only work is that recording); the GPU index-resolution group a runtime joins (streams, pinned counters);
- the attention layers in the forward context (each holds its handle, as MLAAttention's `hisparse_cache`) and the V2
  runner's block tables and slot mappings (zeroed tensors of their shapes).

The judgement (oracles/hisparse.py): every layer has a source (host), indexer, resident and hot view; a block of each holds
exactly one page of its spec; every view lies in its pool; no two blocks that can be live at once share a byte (one block
id of two device groups may: a block id is one group's at a time); the host pool holds its blocks' pages exactly; each
runtime's host cache is its layer's source view, and a KV-sharing layer (bound by 0.34+) reads its target's views.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import itertools
import math
import types
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from fuzz.case import Case, GroupCase
from fuzz.checks.protocol import Judging, Off, Record, Run, TouchCheck, Unusable
from fuzz.verdict.findings import Finding, observed
from oracles import contract
from oracles import hisparse as oracle

PACKAGE = "vllm.v1.hisparse"
# Where the engine core groups a model's specs (get_kv_cache_groups, which asks get_hisparse_kv_cache_groups first; 0.30's
# answers only for models with layers besides MLA, and the uniform-type grouping serves the rest): newest first.
PLANNERS = ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils")
NEEDED = {
    "layout": ("get_hisparse_kv_cache_groups", "get_hisparse_kv_cache_config", "get_hisparse_host_pool_bytes",
               "HISPARSE_HOT_SUFFIX", "HISPARSE_RESIDENT_SUFFIX"),
    "binding": ("init_hisparse_kv_cache",),
    "runtime": ("HiSparseCacheHandle", "HiSparseRuntime", "ResolvedHiSparseConfig"),
}
# Sparse-MLA backends HiSparse binds to on NVIDIA (flashmla_sparse.py and flashinfer_mla_sparse.py build its index groups);
# DeepSeek V4's are refused ("HiSparse does not support DeepSeek V4.").
SPARSE_BACKENDS = ("FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM90", "FLASHINFER_MLA_SPARSE_SM120")
BACKEND_MODULES = tuple(f"vllm.v1.attention.backends.mla.{name}"
                        for name in ("flashmla_sparse", "flashinfer_mla_sparse", "flashinfer_mla_sparse_sm90"))
INDEXER_BACKEND = ("vllm.v1.attention.backends.mla.indexer", "DeepseekV32IndexerBackend")
# How a release resolves the sparse-MLA specs' block size: 0.31+ returns the specs with the resident and hot specs added,
# 0.30 changes them in place.
RESOLVERS = ("resolve_hisparse_specs", "resolve_hisparse_block_size")
FP8_DS_MLA_ROW = 656  # index_group.py FP8_DS_MLA_ROW_BYTES: an fp8_ds_mla row, stored as uint8
CACHE_DTYPES = ("auto", "bfloat16", "fp8_ds_mla")
MAX_MODEL_PAGES = 4  # the stood-in model's max_model_len, in HiSparse blocks
SPARE_HOST_BLOCKS = 3  # host blocks past the ones max_model_len needs
HOST_BUDGET_REMAINDER = 7  # bytes past whole host blocks in the budget: the pool must round them off
INDEX_TOPK = 64
_INSTANCES = itertools.count()


class HiSparseCheck(TouchCheck):
    name = "hisparse-caches"  # "hisparse" alone is a surface rule's pattern (fuzz/surface/reasons.py)
    drawn = False  # not yet run on generated cases
    reads_buffers = False
    needs_views = False  # HiSparse plans its own pools: the view path's are not its
    kinds = {
        "hisparse-page": "a HiSparse view's block holds other than one page of its spec, or a layer lacks one of its views",
        "hisparse-outside": "a HiSparse view reaches past its pool",
        "hisparse-overlap": "two HiSparse blocks that can be live at once share a byte",
        "hisparse-host-pool": "the HiSparse host pool holds other than its blocks' pages",
        "hisparse-binding": "a HiSparse runtime reads another layer's buffers than its own (or its KV-sharing target's)",
    }
    setting = ("--attention-config '{\"hisparse_config\": {}}' --kv-transfer-config "
               "'{\"kv_connector\": \"HiSparseConnector\", \"kv_connector_extra_config\": {\"host_pool_gib\": ...}}'")

    def offer(self, probe: Any) -> Run | Off | None:
        try:
            modules = {part: importlib.import_module(f"{PACKAGE}.{part}") for part in NEEDED}
        except ModuleNotFoundError as error:
            if error.name is not None and (error.name == PACKAGE or error.name.startswith(f"{PACKAGE}.")):
                return None
            return Off(f"vLLM's HiSparse modules do not import here: {error}")
        missing = [f"{part}.{name}" for part, names in NEEDED.items() for name in names if not hasattr(modules[part], name)]
        if missing:
            return Off(f"this release's HiSparse lacks {', '.join(missing)}")
        planner = next((module for module in map(_imported, PLANNERS) if hasattr(module, "get_kv_cache_groups")), None)
        if planner is None:
            return Off("no get_kv_cache_groups in " + " or ".join(PLANNERS))
        modules["planner"] = planner
        if not any(hasattr(modules["binding"], name) for name in RESOLVERS):
            return Off(f"this release's HiSparse has neither of {', '.join(RESOLVERS)}")
        return lambda walk: run(modules, walk.case, walk.vllm_config)

    def unrealistic(self, case: Case) -> str | None:
        if len(case.groups) != 1 or case.groups[0].spec.kind != "mla":
            return "kvfuzz drives HiSparse on a model of one group of sparse-MLA layers"
        group = case.groups[0]
        spec = group.spec
        if group.backend not in SPARSE_BACKENDS:
            return "HiSparse binds to NVIDIA's sparse-MLA backends' index groups (FlashMLA and FlashInfer sparse MLA)"
        if case.platform != "cuda":
            return "HiSparse is NVIDIA's (its host pool and kernels are CUDA's)"
        if spec.model_version is not None or spec.compress_ratio != 1 or spec.page_size_padded or spec.alignment:
            return "HiSparse does not support DeepSeek V4's caches"
        if spec.block_size % contract.hisparse_block_tokens():
            return f"HiSparse's backends share no block size dividing {spec.block_size} tokens"
        if spec.cache_dtype not in CACHE_DTYPES or (spec.cache_dtype != "fp8_ds_mla" and spec.dtype != "bfloat16"):
            return "sparse MLA stores bfloat16 or fp8_ds_mla caches"
        if spec.cache_dtype == "fp8_ds_mla" and (spec.state_content_bytes, spec.dtype) != (FP8_DS_MLA_ROW, "uint8"):
            return f"DeepSeek V3.2's fp8_ds_mla record is {FP8_DS_MLA_ROW} bytes"
        if group.differs_per_layer or case.packing != "none":
            return "a sparse-MLA model's layers share one spec and pack no layers"
        if (why := oracle.refused(case.layout, row_of(spec)[0] * row_of(spec)[1].itemsize)) is not None:
            return why
        return None

    def judge(self, judging: Judging, record: Record) -> Finding | None:
        if "skipped" in record:
            return None
        case = judging.case
        model = oracle.expect(case, record["host_budget"])
        views = [oracle.View(**view) for view in record["views"]]
        readers = {reader: [oracle.View(**view) for view in read] for reader, read in record["readers"].items()}
        problem = oracle.judge(model, views, record["pool_bytes"], readers)
        if problem is None and record["strays"]:
            problem = oracle.Problem("binding", record["strays"][0])
        if problem is None:
            return None
        kind = "binding" if problem.kind == "sharing" else problem.kind
        function = {"host-pool": "get_hisparse_kv_cache_config", "binding": "bind_hisparse_kv_caches"}.get(
            kind, "init_hisparse_kv_cache")
        return observed(case, f"hisparse-{kind}", function, problem.message)


def _imported(name: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None


def row_of(spec: Any) -> tuple[int, torch.dtype]:
    """A layer's row as HiSparse's index group registers it: its width and element type."""
    if spec.cache_dtype == "fp8_ds_mla":
        return FP8_DS_MLA_ROW, torch.uint8
    return spec.head_size, getattr(torch, spec.dtype)


def vllm_names(case: Case) -> dict[str, str]:
    """The case's layers (and KV-sharing layers) under DeepSeek's module names, one index each."""
    names = [*case.layer_names, *(sharer for sharer, _ in case.kv_sharing if sharer not in case.layer_names)]
    return {name: f"model.layers.{index}.self_attn.attn" for index, name in enumerate(names)}


def indexer_name(layer: str) -> str:
    return layer.rsplit(".", 1)[0] + ".indexer.k_cache"


# ------------------------------------------------------------------------------------------------ the run


def run(modules: dict[str, types.ModuleType], case: Case, base_config: Any) -> Record:
    why = CHECK.unrealistic(case)
    if why is not None:
        raise Unusable(why)
    layout, binding, runtime = modules["layout"], modules["binding"], modules["runtime"]
    if case.kv_sharing and not hasattr(binding, "get_kv_sharing_readers"):
        # Before 0.34 MLAAttention builds its implementation with kv_sharing_target_layer_name=None: no MLA layer shares.
        raise Unusable("this release's MLA layers share no KV (HiSparse binds KV-sharing layers from 0.34)")
    names = vllm_names(case)
    group = case.groups[0]
    budget = host_budget(case)
    config = hisparse_config(base_config, case, budget)
    backends = layer_backends(group, names)
    specs = layer_specs(group, names, backends)
    pinned: list[tuple[int, int]] = []
    with stand_ins(runtime, binding, pinned):
        specs = resolved(binding, config, specs, backends)
        groups = modules["planner"].get_kv_cache_groups(config, specs)
        kv_config = layout.get_hisparse_kv_cache_config(config, groups, 1 << 30, layout.get_hisparse_host_pool_bytes(config))
        forward_context = layers_in_context(runtime, config, case, group, names)
        tables = block_tables(config, kv_config)
        kernel_block_sizes = [g.kv_cache_spec.block_size for g in kv_config.kv_cache_groups]
        try:
            caches = binding.init_hisparse_kv_cache(kv_config, torch.device("cpu"), kernel_block_sizes, config,
                                                    forward_context, tables)
            return record_of(layout, case, names, kv_config, caches, forward_context, budget, pinned)
        finally:
            drop = getattr(runtime, "drop_hisparse_host_pool", None)
            if drop is not None:
                drop(config)


def host_budget(case: Case) -> int:
    """Host bytes for the stood-in model: the blocks its max_model_len needs, spares, and a remainder to round off."""
    model = oracle.expect(case, 0)
    needed = MAX_MODEL_PAGES + 2 + SPARE_HOST_BLOCKS  # create_hisparse_layout: cdiv(max_model_len, block) + 2 at least
    return needed * sum(model.source_pages.values()) + HOST_BUDGET_REMAINDER


def hisparse_config(base: Any, case: Case, budget: int) -> Any:
    """The target's VllmConfig with HiSparse switched on, the case's layout and blocks, and the stood-in model."""
    from vllm.config.attention import HiSparseConfig
    from vllm.config.kv_transfer import KVTransferConfig

    config = copy.copy(base)
    config.attention_config = copy.copy(base.attention_config)
    config.attention_config.hisparse_config = HiSparseConfig()
    config.kv_transfer_config = KVTransferConfig(kv_connector="HiSparseConnector", kv_role="kv_both",
                                                 kv_connector_extra_config={"host_pool_gib": budget / 2**30})
    config.cache_config = copy.copy(base.cache_config)
    config.cache_config.kv_cache_layout = case.layout
    config.cache_config.num_gpu_blocks_override = case.num_blocks
    hf_config = types.SimpleNamespace(index_topk=INDEX_TOPK, model_type="deepseek_v32")
    config.model_config = types.SimpleNamespace(max_model_len=MAX_MODEL_PAGES * contract.hisparse_block_tokens(),
                                                hf_config=hf_config, hf_text_config=hf_config, dtype=torch.bfloat16)
    config.speculative_config = None
    with contextlib.suppress(AttributeError, TypeError, ValueError):
        config.instance_id = f"kvfuzz-hisparse-{next(_INSTANCES)}"  # 0.34 keeps a host pool per instance
    return config


def layer_backends(group: GroupCase, names: dict[str, str]) -> dict[str, type]:
    """Each layer's attention backend: the case's sparse-MLA backend, and DeepSeek V3.2's indexer backend."""
    sparse = backend_class(group.backend or "")
    indexer = getattr(importlib.import_module(INDEXER_BACKEND[0]), INDEXER_BACKEND[1])
    backends = {names[layer]: sparse for layer in group.layers}
    return backends | {indexer_name(names[layer]): indexer for layer in group.layers}


def backend_class(name: str) -> type:
    for module in filter(None, map(_imported, BACKEND_MODULES)):
        for value in vars(module).values():
            if isinstance(value, type) and callable(getattr(value, "get_name", None)) and value.__module__ == module.__name__:
                with contextlib.suppress(Exception):
                    if value.get_name() == name:
                        return value
    raise Unusable(f"this release has no {name} backend class")


def layer_specs(group: GroupCase, names: dict[str, str], backends: dict[str, type]) -> dict[str, Any]:
    """vLLM's specs of the stood-in model's layers at the case's block size, as the layers state them (MLAAttention,
    DeepseekV32IndexerCache) and their backends customize them: each sparse-MLA layer (an index-group leader, as every
    DeepSeek V3.2 layer with an indexer is) and its indexer cache."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    block = group.spec.block_size
    fields = set(MLAAttentionSpec.__dataclass_fields__)
    width, dtype = row_of(group.spec)
    sparse: dict[str, Any] = {"block_size": block, "num_kv_heads": 1, "head_size": group.spec.head_size, "dtype": dtype,
                              "is_index_group_leader": True, "max_tp_shards": 1}
    if group.spec.cache_dtype == "fp8_ds_mla":
        sparse.update(cache_dtype_str="fp8_ds_mla", state_content_bytes=width, kv_quant_mode=quant_mode("fp8_ds_mla"))
    indexer = oracle.indexer_spec()
    specs: dict[str, Any] = {}
    for layer in group.layers:
        specs[names[layer]] = MLAAttentionSpec(**{k: v for k, v in sparse.items() if k in fields})
        specs[indexer_name(names[layer])] = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=indexer.head_size,
                                                             dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER)
    customize = getattr(_imported("vllm.v1.worker.utils"), "customize_attention_spec", None)  # 0.32+
    if customize is None:
        return specs
    return {name: customize(backends[name], spec) for name, spec in specs.items()}


def resolved(binding: types.ModuleType, config: Any, specs: dict[str, Any], backends: dict[str, type]) -> dict[str, Any]:
    """The specs after HiSparse resolved their block size for every backend (the V2 runner's get_kv_cache_spec)."""
    layers = {name: types.SimpleNamespace(get_attn_backend=lambda backend=backend: backend) for name, backend in backends.items()}
    resolve = getattr(binding, RESOLVERS[0], None)
    if resolve is not None:
        return resolve(config, specs, layers)
    getattr(binding, RESOLVERS[1])(config, specs, layers)
    return specs


def quant_mode(cache_dtype: str) -> Any:
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    return get_kv_quant_mode(cache_dtype)


class IndexGroupStandIn:
    """Stands in for the GPU index-resolution group a runtime joins (CUDA streams, pinned counters): what binding reads."""

    def __init__(self) -> None:
        self.followers: list[Any] = []
        self.stats_row_bytes = 0
        self.device_global_indices: torch.Tensor | None = None
        self.lru_slots: torch.Tensor | None = None
        self.swap_stats: torch.Tensor | None = None


def layers_in_context(runtime: types.ModuleType, config: Any, case: Case, group: GroupCase,
                      names: dict[str, str]) -> dict[str, Any]:
    """The attention layers HiSparse binds to, each with its own handle (as MLAAttention builds it), sharers included."""
    width, dtype = row_of(group.spec)
    resolved = runtime.ResolvedHiSparseConfig.from_vllm_config(config, INDEX_TOPK, contract.hisparse_block_tokens())

    def layer(target: str | None) -> Any:
        handle_runtime = runtime.HiSparseRuntime(config=resolved, max_num_reqs=config.scheduler_config.max_num_seqs,
                                                 row_width=width, kv_dtype=dtype, device="cpu",
                                                 index_group=IndexGroupStandIn())
        # Each layer leads its own index group (DeepSeek V3.2: one indexer a layer), as if built with none given.
        handle_runtime.is_group_leader = True
        handle_runtime.index_group.followers.clear()
        return types.SimpleNamespace(hisparse_cache=runtime.HiSparseCacheHandle(handle_runtime), is_draft_layer=False,
                                     kv_sharing_target_layer_name=None if target is None else names[target])

    context = {names[name]: layer(None) for name in group.layers}
    for sharer, target in case.kv_sharing:
        context[names[sharer]] = layer(target)
    return context


def block_tables(config: Any, kv_config: Any) -> Any:
    """The V2 runner's block tables and slot mappings for HiSparse's groups, zeroed."""
    requests = config.scheduler_config.max_num_seqs
    pages = MAX_MODEL_PAGES
    groups = len(kv_config.kv_cache_groups)
    tokens = config.scheduler_config.max_num_batched_tokens
    return types.SimpleNamespace(input_block_tables=[torch.zeros(requests, pages, dtype=torch.int32) for _ in range(groups)],
                                 slot_mappings=[torch.zeros(tokens, dtype=torch.int64) for _ in range(groups)])


class DeviceBackendStandIn:
    """Stands in for the platform's HiSparse device backend (0.34+): pinning is recorded, kernels are said to be there."""

    supports_shared_host_pool = False
    stats_dtype = torch.uint64

    def __init__(self, pinned: list[tuple[int, int]]) -> None:
        self.pinned = pinned

    def check_available(self) -> None:
        return None

    def pin_tensor(self, tensor: torch.Tensor) -> None:
        self.pinned.append((tensor.data_ptr(), tensor.numel() * tensor.element_size()))

    def unpin_tensor(self, tensor: torch.Tensor) -> None:
        return None

    def create_cache_ops(self, runtime: Any) -> Any:
        return types.SimpleNamespace()  # the compiled _C_cache_ops: binding only keeps them

    def validate_kv_cache_config(self, kv_cache_config: Any) -> None:
        return None

    def prepare_kv_cache_views(self, kv_cache_config: Any, kv_caches: dict[str, Any], forward_context: dict[str, Any]) -> None:
        return None


@contextlib.contextmanager
def stand_ins(runtime: types.ModuleType, binding: types.ModuleType, pinned: list[tuple[int, int]]) -> Iterator[None]:
    """The CUDA host registration and kernels, where this release reaches them."""
    with contextlib.ExitStack() as stack:
        if hasattr(runtime, "get_hisparse_backend"):  # 0.34+: one device backend behind every device operation
            base = importlib.import_module(f"{PACKAGE}.backend").HiSparseBackend
            backend_class = type("DeviceBackendStandIn", (DeviceBackendStandIn, base), {})
            backend = backend_class(pinned)
            for module in (runtime, binding):
                if hasattr(module, "get_hisparse_backend"):
                    stack.enter_context(mock.patch.object(module, "get_hisparse_backend", lambda: backend))
        else:
            stack.enter_context(mock.patch.object(runtime, "_has_hisparse_ops", lambda: True))
            stack.enter_context(mock.patch.object(
                runtime, "pin_tensor", lambda tensor: pinned.append((tensor.data_ptr(), tensor.numel() * tensor.element_size()))))
        yield


# ------------------------------------------------------------------------------------------------ the record


def record_of(layout: types.ModuleType, case: Case, names: dict[str, str], kv_config: Any, caches: dict[str, Any],
              forward_context: dict[str, Any], budget: int, pinned: list[tuple[int, int]]) -> Record:
    """Each layer's views as byte spans of their pools, and what each runtime reads."""
    group_of = {name: index for index, g in enumerate(kv_config.kv_cache_groups) for name in g.layer_names}
    host_sizes = {tensor.size for tensor in kv_config.kv_cache_tensors if tensor.host_resident}
    (host_size,) = host_sizes
    pools = Pools(host_size)
    hot, resident = layout.HISPARSE_HOT_SUFFIX, layout.HISPARSE_RESIDENT_SUFFIX
    views: list[dict[str, Any]] = []
    strays: list[str] = []
    readers: dict[str, list[dict[str, Any]]] = {}
    for layer in case.groups[0].layers:
        name = names[layer]
        handle = forward_context[name].hisparse_cache
        source = caches[name]
        views.append(pools.view(source, name, layer, oracle.SOURCE, group_of[name], host=True, host_start=host_start(pinned)))
        views.append(pools.view(caches[indexer_name(name)], indexer_name(name), layer, oracle.INDEXER,
                                group_of[indexer_name(name)]))
        views.append(pools.view(handle.view.cache, name + resident, layer, oracle.RESIDENT, group_of[name + resident]))
        views.append(pools.view(handle.runtime.hot.cache, name + hot, layer, oracle.HOT, group_of[name + hot]))
        if not same_bytes(handle.runtime.host_cache, source):
            strays.append(f"layer {name}'s runtime host cache is not its source view")
    for sharer, target in case.kv_sharing:
        handle = forward_context[names[sharer]].hisparse_cache
        if handle.view is None or not hasattr(handle.runtime, "hot"):
            strays.append(f"KV-sharing layer {names[sharer]} was bound to no resident or hot view")
            continue
        target_name = names[target]
        readers[sharer] = [
            pools.view(handle.view.cache, names[sharer] + resident, target, oracle.RESIDENT, group_of[target_name + resident]),
            pools.view(handle.runtime.hot.cache, names[sharer] + hot, target, oracle.HOT, group_of[target_name + hot])]
        if not same_bytes(handle.runtime.host_cache, caches[target_name]):
            strays.append(f"KV-sharing layer {names[sharer]}'s host cache is not its target {target_name}'s source view")
    return {"host_budget": budget, "views": views, "readers": readers, "pool_bytes": pools.sizes(), "strays": strays,
            "pinned": pinned, "host_blocks": kv_config.hisparse_host_num_blocks, "device_blocks": kv_config.num_blocks}


def host_start(pinned: list[tuple[int, int]]) -> int:
    """The host pool's first byte: the start of the one range vLLM registered (allocate_pinned_host_pool)."""
    if len(pinned) != 1:
        raise Unusable(f"HiSparse registered {len(pinned)} host ranges; kvfuzz reads one private pool")
    return pinned[0][0]


def same_bytes(first: torch.Tensor, second: torch.Tensor) -> bool:
    return (first.data_ptr() == second.data_ptr()
            and first.numel() * first.element_size() == second.numel() * second.element_size())


class Pools:
    """The pools the views lie in: the host pool (from its registered start) and each device storage (from its start)."""

    def __init__(self, host_size: int) -> None:
        self.host_size = host_size
        self.devices: dict[int, int] = {}  # storage address -> its bytes

    def view(self, tensor: torch.Tensor, name: str, layer: str, role: str, group: int, *, host: bool = False,
             host_start: int = 0) -> dict[str, Any]:
        size = tensor.element_size()
        shape, strides = tensor.shape, tensor.stride()
        if host:
            pool, base = oracle.HOST, host_start
        else:
            storage = tensor.untyped_storage()
            self.devices.setdefault(storage.data_ptr(), storage.nbytes())
            pool, base = self.device_name(storage.data_ptr()), storage.data_ptr()
        extent = (sum((n - 1) * s for n, s in zip(shape[1:], strides[1:], strict=True)) + 1) * size
        return {"name": name, "layer": layer, "role": role, "group": group, "pool": pool, "first": tensor.data_ptr() - base,
                "stride": strides[0] * size, "extent": extent, "content": math.prod(shape[1:]) * size, "blocks": shape[0]}

    def device_name(self, address: int) -> str:
        index = list(self.devices).index(address)
        return oracle.DEVICE if index == 0 else f"{oracle.DEVICE}{index}"

    def sizes(self) -> dict[str, int]:
        return {oracle.HOST: self.host_size, **{self.device_name(address): size for address, size in self.devices.items()}}


CHECK = HiSparseCheck()
