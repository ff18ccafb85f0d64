"""Where vLLM keeps each name kvfuzz uses, release by release: the modules, newest first.

One table for the entry-point probe (fuzz/targets/entry_points.py looks a name up there first, then searches by source)
and for `kvfuzz export` (fuzz/export/imports.py writes an exported test's imports from it, trying the modules in order so
that one test runs on every release a finding affects). A name that moves gets its new module first here, and both follow.
"""

from __future__ import annotations

WORKER_UTILS = "vllm.v1.worker.utils"
ATTN_UTILS = "vllm.v1.worker.gpu.attn_utils"
INTERFACE = "vllm.v1.kv_cache_interface"
BACKEND_UTILS = "vllm.v1.attention.backends.utils"
BACKEND = "vllm.v1.attention.backend"
OLD_BACKEND = "vllm.v1.attention.backends.abstract"
CONNECTORS = "vllm.distributed.kv_transfer.kv_connector.v1"

HOMES: dict[str, tuple[str, ...]] = {
    "get_kv_cache_config_from_groups": ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"),
    "prepare_kernel_block_sizes": (WORKER_UTILS,),
    "select_common_block_size": (WORKER_UTILS,),
    "allocate_kv_cache": (WORKER_UTILS,),
    "create_kv_cache_views": (INTERFACE,),
    "map_kv_caches_to_kernel_blocks": (WORKER_UTILS,),
    "add_kv_sharing_layers_to_kv_cache_groups": (WORKER_UTILS,),
    "customize_attention_spec": (WORKER_UTILS,),
    "KVBlockZeroer": (WORKER_UTILS,),
    "CPUKVBlockZeroer": ("vllm.v1.worker.cpu.utils",),
    "CPUModelRunner": ("vllm.v1.worker.cpu_model_runner",),
    "copy_kv_cache_blocks_inplace": (WORKER_UTILS,),
    "NixlConnectorWorker": (f"{CONNECTORS}.nixl.worker", f"{CONNECTORS}.nixl_connector"),
    "OffloadingConnectorWorker": (f"{CONNECTORS}.offloading.worker", f"{CONNECTORS}.offloading_connector"),
    "_allocate_kv_cache": (ATTN_UTILS,),
    "_reshape_kv_cache": (ATTN_UTILS,),
    "set_kv_cache_layout": (BACKEND_UTILS,),
    "KVCacheLayout": ("vllm.v1.kv_cache_layout", INTERFACE),
    "AttentionGroup": (WORKER_UTILS,),
    "AttentionBackend": (BACKEND, OLD_BACKEND),
    "MultipleOf": (BACKEND, OLD_BACKEND),
    "VllmConfig": ("vllm.config", "vllm.config.vllm"),
    "set_current_vllm_config": ("vllm.config", "vllm.config.vllm"),
    "KVCacheConfig": (INTERFACE,),
    "KVCacheGroupSpec": (INTERFACE,),
    "KVCacheTensor": (INTERFACE,),
    "AttentionSpec": (INTERFACE,),
    "KVCacheSpec": (INTERFACE,),
    "KVQuantMode": (INTERFACE,),
    "get_kv_quant_mode": (INTERFACE,),
    "STR_DTYPE_TO_TORCH_DTYPE": ("vllm.utils.torch_utils", "vllm.utils"),
    "KV_CACHE_DTYPES": ("vllm.config.cache",),
    "CacheDType": ("vllm.config.cache",),
    "register_kv_cache_dtype": ("vllm.config.cache",),
    "register_rope_dim": ("vllm.v1.attention.ops.rocm_octave",),
    "init_hisparse_kv_cache": ("vllm.v1.hisparse.binding",),
    "GPUModelRunner": ("vllm.v1.worker.gpu_model_runner",),
    "UniformTypeKVCacheSpecs": (INTERFACE,),
    "KVTransferConfig": ("vllm.config", "vllm.config.kv_transfer"),
    "get_kv_cache_spec": (ATTN_UTILS,),
    "Attention": ("vllm.model_executor.layers.attention.attention", "vllm.attention.layer"),
    "MLAAttention": ("vllm.model_executor.layers.attention.mla_attention", "vllm.attention.layer"),
    "ModelConfig": ("vllm.config", "vllm.config.model"),
    "CacheConfig": ("vllm.config", "vllm.config.cache"),
    "current_platform": ("vllm.platforms",),
    "AttentionBackendEnum": ("vllm.v1.attention.backends.registry",),
    "get_supported_kv_cache_layouts": (BACKEND_UTILS,),
    "resolve_kv_cache_layout": (BACKEND_UTILS,),
    "FullAttentionSpec": (INTERFACE,),
    "MLAAttentionSpec": (INTERFACE,),
    "SlidingWindowSpec": (INTERFACE,),
    "SlidingWindowMLASpec": (INTERFACE,),
    "ChunkedLocalAttentionSpec": (INTERFACE,),
    "SinkFullAttentionSpec": (INTERFACE,),
    "CrossAttentionSpec": (INTERFACE,),
    "MambaSpec": (INTERFACE,),
    "get_kv_cache_layout": (BACKEND_UTILS,),
    "AttentionLayerBase": ("vllm.model_executor.layers.attention_layer_base",),
}


def homes(*names: str) -> tuple[str, ...]:
    """The modules any of `names` (one name's spellings, newest first) has lived in, newest first (none for a name the table
    does not list)."""
    return tuple(dict.fromkeys(module for name in names for module in HOMES.get(name, ())))
