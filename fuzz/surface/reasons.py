"""Why a surface function kvfuzz does not drive is not driven: rules over its path and name, each written once.

The first rule that matches gives the reason. A rule names what the function needs that a
CPU-only process with kvfuzz's cases does not have (a GPU, a transfer engine, a model's forward
pass, a scheduler step, a loaded model or engine), or says plainly that it is a gap: code that
could run here but no case reaches. A function matched by no rule is *unexplained*: the surface
test fails on it until it is driven or a rule says why not. A rule true only up to a release
(`until`) matches trees of that release or older (vllm/_version.py; a checkout without one is
taken as newer), so that where a later release's function is driven, a regression that stops
driving it is not hidden behind an old release's reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fuzz.surface.find import Function

KINDS: dict[str, str] = {
    "gpu": "needs a GPU (CUDA, ROCm or XPU kernels or memory)",
    "transfer-engine": "needs a KV transfer engine or store and its peers",
    "forward-pass": "runs inside a model's forward pass",
    "cache-write": "a backend's cache write (only --probe kernel runs any)",
    "scheduler-step": "runs in a scheduler step (needs scheduled requests)",
    "model": "needs a loaded model or engine around it",
    "delegates": "only hands the caches on to functions listed on their own",
    "gap": "could run here, no kvfuzz case reaches it",
}


@dataclass(frozen=True)
class Rule:
    kind: str  # a key of KINDS
    text: str
    path: str = ""  # regex searched in the path relative to the tree root; "" matches any
    name: str = ""  # regex searched in Class.method; "" matches any
    until: str = ""  # the last release it holds for, "0.28" (any 0.28.x) or "0.28.1"; "" every release

    def matches(self, function: Function, version: str = "") -> bool:
        return bool((not self.path or re.search(self.path, function.path)) and (not self.name or re.search(self.name, function.qualname))
                    and (not self.until or _at_most(version, self.until)))


def _release(version: str) -> tuple[int, ...] | None:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(part) for part in match.groups() if part is not None) if match else None


def _at_most(version: str, until: str) -> bool:
    """Whether `version` (vllm/_version.py's, e.g. 0.28.0) is release `until` or older; False for an unknown version."""
    release, last = _release(version), _release(until)
    return release is not None and last is not None and release[:len(last)] <= last


_CONNECTORS = "vllm/distributed/kv_transfer/"
_ATTENTION = r"^vllm/(v1/attention|model_executor/layers/attention)"
CACHE_WRITE = r"(^|\.)(do_\w*kv_?cache_update|write_to_paged_cache|\w*reshape_and_cache\w*|_store_kv|\w+_store|update_kv_cache)$"

RULES: tuple[Rule, ...] = (
    # KV connectors: each transfer engine once, then the front ends that hand the caches to their workers.
    Rule("transfer-engine", "NIXL: registers the KV regions with the NIXL agent for transfers to remote peers", _CONNECTORS + r".*nixl"),
    Rule("transfer-engine", "Mooncake: registers the KV regions with the Mooncake transfer engine or store", _CONNECTORS + r".*mooncake"),
    Rule("transfer-engine", "LMCache: hands the caches to an LMCache engine", _CONNECTORS + r".*lmcache"),
    Rule("transfer-engine", "MoRI-IO: registers memory with AMD's MoRI-IO engine (ROCm)", _CONNECTORS + r".*moriio"),
    Rule("transfer-engine", "FlexKV: hands the caches to a FlexKV server", _CONNECTORS + r".*flexkv"),
    Rule("transfer-engine", "UMBP: registers the KV regions with the UMBP store", _CONNECTORS + r".*umbp"),
    Rule("transfer-engine", "P2P NCCL: sends KV blocks over NCCL", _CONNECTORS + r".*(p2p|nccl)"),
    Rule("gpu", "HiSparse: host mirrors of the KV cache moved by CUDA DMA", r"hisparse"),
    Rule("gpu", "HiSparse: host mirrors of the KV cache moved by CUDA DMA", "", r"HiSparse"),
    Rule("scheduler-step", "an example / benchmark connector: loads, saves or fills KV blocks per request, from a scheduler's "
         "connector metadata", _CONNECTORS + r".*(example_connector|example_hidden_states_connector|decode_bench_connector)"),
    Rule("gap", "cross-layer KV blocks registered with the offloading connector: kvfuzz's offload consumer calls register_kv_caches only",
         _CONNECTORS + r".*offloading", r"register_cross_layers_kv_caches?$"),
    Rule("delegates", "MultiConnector: hands the caches to each connector it wraps", _CONNECTORS + r".*multi_connector"),
    Rule("delegates", "a connector's front end: hands the caches to its worker", _CONNECTORS,
         r"Connector(V1|Upstream)?\.register_\w*kv_caches?$"),
    # Platforms: whatever the function does, it does it with kernels or memory this machine has not.
    Rule("gpu", "ROCm / AITER kernels", r"(rocm|aiter)"),
    Rule("gpu", "Intel XPU kernels", r"xpu"),
    Rule("gpu", "CUDA attention kernels (FlashAttention, FlashInfer, FlashMLA, TRT-LLM, CUTLASS, b12x, FlyDSL)",
         _ATTENTION + r".*(flash_?attn|flashinfer|flashmla|trtllm|cutlass|b12x|hpc_attn|tokenspeed|sm90|sm100|sm120|flydsl)"),
    Rule("gpu", "CPU offloading: pinned host memory and CUDA streams (or DMA) copy blocks to and from the GPU",
         r"^vllm/v1/(kv_offload|simple_kv_offload)/(?!manager)"),
    Rule("gpu", "extensible KV cache: CUDA virtual memory (vmm_driver) reserves the buffer and commits pages", "", r"extensible|Extensible"),
    Rule("gpu", "extensible KV cache: CUDA virtual memory (vmm_driver) reserves the buffer and commits pages", r"extensible_kv_cache"),
    Rule("gpu", "decode context parallelism: a tensor-parallel group and CUDA FlashAttention", r"^vllm/v1/worker/cp_utils"),
    Rule("gpu", "CUDA graph capture: records the V2 runner's (or a speculator's) forward over dummy inputs on a CUDA stream",
         r"^vllm/v1/worker/gpu/", r"(^|\.)(capture|capture_model|prepare_inputs_to_capture)$"),
    Rule("gpu", "MLA layer constructor: builds the backend's implementation, which needs a GPU (kvfuzz builds a stand-in "
         "without it)", "", r"^MLAAttention\.__init__$"),
    # Attention: cache writes, then everything else of the forward pass.
    Rule("gap", "layer binding through the base class: kvfuzz's layers bind through their own classes", "",
         r"AttentionLayerBase\.bind_kv_cache$"),
    Rule("cache-write", "writes a step's keys and values into the cache; kvfuzz's --probe kernel runs the writers of plain float "
         "caches that run on this machine", _ATTENTION, CACHE_WRITE),
    Rule("model", "DeepSeek V4 sliding-window cache of the DeepSeek V4 model's own layers", "", r"DeepseekV4SWACache"),
    Rule("model", "a cross-attention backend class made for an encoder-decoder model's layers", "", r"create_cross_attention_backend"),
    Rule("scheduler-step", "an attention metadata builder: runs on each scheduled batch", _ATTENTION, r"MetadataBuilder\.build$"),
    Rule("forward-pass", "attention of a model's forward pass: needs the batch's queries, keys, values and attention metadata",
         _ATTENTION),
    # Model runners, workers and the engine.
    Rule("scheduler-step", "a model runner's step: needs a SchedulerOutput for a loaded model", "",
         r"(execute_model|_update_states\w*|update_requests|preprocess_\w+|postprocess_\w+)$"),
    Rule("scheduler-step", "Mamba state copies between blocks during steps (prefix-caching alignment, speculative decoding)",
         r"^vllm/v1/worker/mamba_utils"),
    Rule("model", "ReplaySSM state rings: set up from a loaded ReplaySSM model's layers", r"^vllm/v1/worker/replayssm_utils"),
    Rule("model", "engine or worker set-up: needs an executor with workers that loaded a model (kvfuzz calls the planner and "
         "runner code this leads to directly)", r"^vllm/v1/(engine|executor)/|worker_base|gpu_worker|cpu_worker"),
    Rule("model", "engine-level planning over every worker's specs and measured memory (kvfuzz drives the per-worker planner "
         "get_kv_cache_config_from_groups)", r"^vllm/v1/core/kv_cache_(planning|utils)", r"^(get_kv_cache_configs|shrink_kv_cache_configs)$"),
    Rule("model", "model state of the V2 runner: built from a loaded model's layers", r"^vllm/v1/worker/(gpu|cpu)/model_states/"),
    Rule("model", "a model runner's KV-cache set-up around a loaded model: builds backends and metadata builders from the model's "
         "layers, then runs the planner, allocation and view code kvfuzz drives", r"^vllm/v1/worker/", r"(^|\.)initialize_kv_cache$"),
    Rule("model", "after memory profiling or around fp8 scales: needs a loaded model's layers", "",
         r"(_cleanup_profiling_kv_cache|init_fp8_kv_scales)$"),
    Rule("gap", "kvfuzz runs this function's steps one by one (allocation, sharing aliases, kernel-block views, binding) rather than "
         "the function itself", r"^vllm/v1/worker/(gpu|cpu)/attn_utils", r"^(init_kv_cache|bind_kv_caches)$"),
    Rule("gap", "binds the views to a model's layers: where no runner kvfuzz drives calls it (0.34 has no V1 GPU runner), kvfuzz "
         "binds its own forward context instead (fuzz/targets/consumers.py)", r"^vllm/v1/worker/utils", r"^bind_kv_cache(_to_layers)?$"),
    Rule("gap", "frees the layers' caches (sleep mode, weight updates): no case asks for it", "", r"clear_layer_kv_caches$"),
    Rule("gap", "simple CPU offload's scheduler side: sizes a host KV cache from the config; not in the case space",
         r"^vllm/v1/simple_kv_offload/manager"),
    Rule("gap", "cross-layer KV blocks allocated for a connector: packing this release's case space does not draw",
         r"kv_connector_model_runner_mixin", r"allocate_uniform_kv_caches$"),
    # Before 0.29 the V1 runner (and the CPU runner built on it) allocates and views the caches its own way, and kvfuzz runs
    # the consumers on the V2 runner's views only (fuzz/targets/common.py, consumers.walk_runners): a zeroer that only the
    # V1 runner calls is skipped on every case (0.22's KVBlockZeroer, 0.25 - 0.28's CPUModelRunner._zero_block_ids).
    Rule("gap", "zeroes blocks of the V1 (or CPU) model runner's own views; kvfuzz runs its consumers on the V2 runner's walk only, "
         "whose views before 0.29 the V1 runner does not build, so this zeroer is skipped on every case",
         r"^vllm/v1/worker/(utils|cpu_model_runner)\.py$", r"^(KVBlockZeroer\.\w+|CPUModelRunner\._zero_block_ids)$", until="0.28"),
    Rule("gap", "DeepSeek V4's planner for several UniformTypeKVCacheSpecs groups (a full-MLA group holding every page size, then "
         "sliding-window MLA groups): kvfuzz's case space draws several such groups only where the planner buckets each group's "
         "pages (0.23) or packs slabs (0.24 - 0.28), not for this release's planner (fuzz/space.py packing_reason)",
         r"^vllm/v1/core/kv_cache_utils", r"^_get_kv_cache_config_deepseek_v4$", until="0.22"),
    Rule("gap", "re-strides blocks-first views onto K/V-first storage where one pool holds both (an encoder-decoder model's "
         "K/V-first ROCM_ATTN self-attention beside blocks-first cross-attention); kvfuzz's cases give every attention group of "
         "a case the first group's backend (one model, one backend), so no pool mixes block dimensions",
         r"^vllm/v1/worker/gpu/attn_utils", r"^_restride_blocks_first_kv_cache_to_kv_first_storage$"),
)


def reason(function: Function, version: str = "") -> Rule | None:
    """The first rule that matches the function of a tree of this version, or None (unexplained)."""
    return next((rule for rule in RULES if rule.matches(function, version)), None)
