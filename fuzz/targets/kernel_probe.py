"""`--probe kernel`: tokens written through each backend's own cache-write path into the views vLLM built.

For every attention layer whose backend has a writer here, each token the case names (manager
block b, position p) is written alone, as vLLM's forward pass writes it: the backend's impl
(`get_impl_cls()`, made without its constructor, which wants a whole model) runs
`do_kv_cache_update` on the cache the layer bound (`fuzz.targets.consumers.forward_context`),
with slot b * block_size + p (a token's slot counts tokens of whole manager blocks; kernel blocks
split them in place). What runs below it is vLLM's own: a compiled op where the build has one
(`torch.ops._C.cpu_attn_reshape_and_cache`, `concat_and_cache_mla_cpu`; on CUDA `reshape_and_cache_flash`
and kin), a Triton kernel (natively, or under Triton's interpreter on the CPU), or torch indexing.

Every element of the token carries a unique value (an id in the element's bit pattern), the raw
buffers start as a canary, and the readback says where each id landed (buffer, byte) and which
changed bytes no id explains. The comparator (fuzz/verdict/touch.py) holds that against where the
oracle puts token t of block b. Probed: plain caches (cache dtype auto) of float16, bfloat16 or
float32, uncompressed; other layers say why they were not.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fuzz.case import GroupCase, Touches
from fuzz.checks.protocol import Unusable
from fuzz.targets import byte_runs, readback, triton_interp
from fuzz.targets.base import encode_bytes
from fuzz.targets.consumers import forward_context, layer_backends
from fuzz.targets.walk import Walk
from fuzz.tracebacks import vllm_failure

KERNEL_CANARY = 0xA5  # as a 16- or 32-bit word a negative number, so never an id (ids are positive)
# Bit patterns of positive normal numbers, one per element: float16 from 0x0400, bfloat16 and float32 from their
# smallest normal number.
ID_BASE = {torch.float16: 0x0400, torch.bfloat16: 0x0080, torch.float32: 0x0080_0000}
ID_LIMIT = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80, torch.float32: 0x7F80_0000}
INT_OF = {2: torch.int16, 4: torch.int32}
PLAIN_CACHE = ("auto", "float16", "bfloat16", "float32")
ROPE_DIMS = 64  # an MLA latent's rope part, as DeepSeek's models have it (the rest is the compressed latent)


@dataclass(frozen=True)
class Writer:
    mla: bool
    write: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]  # (layer, cache, key, value, slots)
    where: str
    impl: Any


def run(walk: Walk, touches: Touches | None, mla_layer: type | None) -> dict[str, Any]:
    """Per layer: the writer, and for each token where each element landed; or why the layer was not probed."""
    backends = layer_backends(walk)
    layers = forward_context(walk, mla_layer, backends)
    sharers = {sharer for sharer, _ in walk.case.kv_sharing}
    records: dict[str, Any] = {}
    for index, group in enumerate(walk.case.groups):
        reason = _not_probed(group)
        for position, name in enumerate(group.layers):
            if name in sharers:
                continue
            if reason is not None:
                records[name] = {"skipped": reason}
                continue
            own = group.of_layer(position)
            try:
                writer = _writer(backends[name], own, walk)
            except Unusable as why:
                records[name] = {"skipped": str(why)}
                continue
            records[name] = _probe_layer(walk, own, index, layers[name], writer, tokens(own, walk.case.num_blocks, touches))
    return records



def tokens(group: GroupCase, num_blocks: int, touches: Touches | None) -> list[tuple[int, int]]:
    """The case's tokens (positions taken modulo the group's block size), else the first and last token of every block."""
    size = group.spec.block_size
    if touches is not None and touches.tokens:
        return sorted({(block, position % size) for block, position in touches.tokens})
    return sorted({(block, position) for block in range(num_blocks) for position in (0, size - 1)})


def _not_probed(group: GroupCase) -> str | None:
    spec = group.spec
    if not spec.is_attention or spec.kind == "encoder_only":
        return f"{spec.kind} layers have no cache writer"
    if spec.cache_dtype not in PLAIN_CACHE or spec.registered_cache_dtype or spec.state_content_bytes is not None:
        return f"cache dtype {spec.cache_dtype}: the kernel probe carries ids in plain elements only"
    if spec.dtype not in ("float16", "bfloat16", "float32"):
        return f"dtype {spec.dtype}: the kernel probe carries ids in float16, bfloat16 or float32 elements"
    if spec.compress_ratio > 1:
        return "a compressed cache is written by its model's compressor, not by the backend's cache write"
    if group.synthetic_backend is not None:
        return "a synthetic backend has no cache writer"
    return None


def _writer(backend: type, group: GroupCase, walk: Walk) -> Writer:
    spec = group.spec
    sizes = declared_head_sizes(backend)
    if sizes and spec.head_size not in sizes:
        raise Unusable(f"{backend.get_name()} declares no head size {spec.head_size}")
    try:
        impl_cls = backend.get_impl_cls()
    except Exception as error:  # noqa: BLE001 - a backend whose implementation does not import here has no writer here
        raise Unusable(f"{backend.get_name()}: its implementation does not import here ({type(error).__name__})") from None
    update = getattr(impl_cls, "do_kv_cache_update", None)
    if update is None:
        raise Unusable(f"{impl_cls.__name__} has no do_kv_cache_update (its cache write is inside forward)")
    if spec.head_size_v not in (None, spec.head_size) and "head_size_v" not in _source(update):
        # TRITON_ATTN, FLASH_ATTN and FLEX_ATTENTION split the cache by head_size; the DiffKV backends write K and V apart.
        raise Unusable(f"{impl_cls.__name__}.do_kv_cache_update never names head_size_v: K and V heads of different sizes "
                       "are not a cache it writes")
    for module in _globals_modules(update):
        if module.startswith("vllm.") and triton_interp.kernels_of(sys.modules[module]):
            try:
                triton_interp.runnable(module)  # the Triton kernels its launchers run
            except triton_interp.Unavailable as why:
                raise Unusable(f"{impl_cls.__name__}.do_kv_cache_update: {why}") from None
    params = list(inspect.signature(update).parameters)[1:]
    impl = _impl(impl_cls, group, walk)
    where = f"{impl_cls.__module__}.{impl_cls.__qualname__}.do_kv_cache_update"
    if params[:3] == ["layer", "key", "value"]:
        return Writer(False, lambda layer, cache, key, value, slots: impl.do_kv_cache_update(layer, key, value, cache, slots), where, impl)
    if params[:2] == ["kv_c_normed", "k_pe"]:
        scale = torch.ones((), dtype=torch.float32, device=walk.device)
        return Writer(True, lambda layer, cache, key, value, slots: impl.do_kv_cache_update(key, value, cache, slots, spec.cache_dtype, scale),
                      where, impl)
    raise Unusable(f"{where} takes ({', '.join(params)}), which kvfuzz does not know how to call")


def _source(code: Any) -> str:
    try:
        return inspect.getsource(code)
    except (OSError, TypeError):
        return "head_size_v"  # no source to read: the write itself shows whether it can
    

def declared_head_sizes(backend: type) -> list[int]:
    try:
        return list(backend.get_supported_head_sizes())
    except Exception:  # noqa: BLE001 - a backend that declares none takes any
        return []


def _globals_modules(function: Any) -> set[str]:
    """Modules whose names `function` uses (the modules of the functions it calls by global name)."""
    names = set(function.__code__.co_names)
    return {getattr(value, "__module__", "") for name, value in function.__globals__.items() if name in names}


def _impl(impl_cls: type, group: GroupCase, walk: Walk) -> Any:
    """The backend's impl as a layer of this group has it: from its constructor with the layer's arguments, or where the
    constructor wants more of a model than kvfuzz builds (MLA impls, CPU attention), without it, with the attributes the
    constructor sets from those arguments (an attribute the write then misses makes the layer a skip, see _probe_layer)."""
    spec = group.spec
    names = getattr(sys.modules.get(impl_cls.__module__), "AttentionType", None)  # the release's own, as the impl compares them
    cross = spec.kind == "cross"
    attn_type = ("encoder_decoder" if cross else "decoder") if names is None else (names.ENCODER_DECODER if cross else names.DECODER)
    arguments = {"num_heads": spec.num_kv_heads, "head_size": spec.head_size, "scale": spec.head_size ** -0.5, "num_kv_heads": spec.num_kv_heads,
                 "alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": spec.cache_dtype, "logits_soft_cap": None,
                 "attn_type": attn_type, "kv_sharing_target_layer_name": None}
    try:
        parameters = inspect.signature(impl_cls).parameters
        return impl_cls(**{name: value for name, value in arguments.items() if name in parameters})
    except Exception:  # noqa: BLE001 - the constructor is not under test; the write is
        impl = object.__new__(impl_cls)
    for name in ("num_heads", "num_kv_heads", "head_size", "kv_cache_dtype", "attn_type", "sliding_window", "kv_sharing_target_layer_name"):
        setattr(impl, name, arguments[name])
    impl._is_per_token_head_quant = False
    return impl


def _layer_attributes(layer: Any, backend: type, group: GroupCase, walk: Walk, kernel_block_size: int) -> None:
    """What a layer carries for its writer: unit scales, and (CPU attention) the instruction set its metadata builder picks."""
    device = walk.device
    for name in ("_k_scale", "_v_scale"):
        setattr(layer, name, torch.ones((), dtype=torch.float32, device=device))
    layer._k_scale_float = layer._v_scale_float = 1.0
    module = inspect.getmodule(backend)
    pick = getattr(module, "_get_attn_isa", None)
    if pick is not None:
        arguments = {"dtype": getattr(torch, group.spec.dtype), "block_size": kernel_block_size, "head_size": group.spec.head_size,
                     "kv_cache_dtype": group.spec.cache_dtype}
        layer.isa = pick(**{k: v for k, v in arguments.items() if k in inspect.signature(pick).parameters})


def _probe_layer(walk: Walk, group: GroupCase, index: int, layer: Any, writer: Writer, chosen: list[tuple[int, int]]) -> dict[str, Any]:
    spec = group.spec
    cache = layer.kv_cache
    dtype = cache.dtype
    if dtype not in ID_BASE:
        return {"skipped": f"the layer binds a {dtype} cache"}
    kernel = walk.kernel_block_sizes[index] if index < len(walk.kernel_block_sizes) else spec.block_size
    backend = layer_backends(walk)[group.layers[0]]
    _layer_attributes(layer, backend, group, walk, kernel)
    shapes = _element_shapes(spec, writer.mla)
    count = sum(math.prod(s) for s in shapes)
    if ID_BASE[dtype] + count > ID_LIMIT[dtype]:
        return {"skipped": f"{count} elements per token do not fit the ids a {dtype} element carries"}
    written = []
    for block, position in chosen:
        slot = block * spec.block_size + position
        readback.fill(walk.raw, KERNEL_CANARY)
        before = readback.snapshot(walk.raw)
        parts = _inputs(shapes, dtype, walk.device)
        try:
            with triton_interp.launching(walk.device):
                writer.write(layer, cache, *parts, torch.tensor([slot], dtype=torch.int64, device=walk.device))
        except Exception as error:  # noqa: BLE001 - vLLM's writer raising is data; kvfuzz's own errors propagate
            if isinstance(error, AttributeError) and any(error.obj is stand_in for stand_in in (writer.impl, layer)):
                return {"skipped": f"{writer.where} reads {error.name}, which kvfuzz's stand-in for the impl or layer does not have"}
            missing = _not_here(error)
            if missing is not None:
                return {"skipped": f"{writer.where}: {missing}"}
            failure = vllm_failure(error)
            if failure is None:
                raise
            return {"writer": writer.where, "error": {"type": failure.error_type, "message": failure.error_message,
                                                      "function": failure.error_function, "file": failure.error_file,
                                                      "line": failure.error_line, "block": block, "position": position}}
        landed, stray = _landed(walk.raw, before, dtype, count)
        written.append({"block": block, "position": position, "slot": slot, "landed": encode_bytes(landed.view(np.uint8)),
                        "stray": stray})
    return {"writer": writer.where, "mla": writer.mla, "tokens": written}


def _not_here(error: Exception) -> str | None:
    """Why a write cannot run on this build (an op it has no compiled kernel for, a name only another platform
    imports), or None when the error is the write's own."""
    if isinstance(error, AttributeError) and type(getattr(error, "obj", None)).__name__ == "_OpNamespace":
        return f"the op {error.name} is not compiled into this build"
    if isinstance(error, NameError):
        return f"{error.name} is not imported on this platform"
    if isinstance(error, ImportError):
        return f"{error.name or error} does not import here"
    if isinstance(error, TypeError) and str(error) == "'function' object is not subscriptable":
        return "it launches a Triton kernel that is neither compiled nor interpretable here"
    return None


def _element_shapes(spec: Any, mla: bool) -> list[tuple[int, ...]]:
    """What one token's write takes: K (heads, head size) and V (heads, V head size); for MLA the latent and its rope part."""
    if mla:
        rope = min(ROPE_DIMS, spec.head_size // 2)
        return [(1, spec.head_size - rope), (1, 1, rope)]
    value_head = spec.head_size_v if spec.head_size_v is not None else spec.head_size
    return [(1, spec.num_kv_heads, spec.head_size), (1, spec.num_kv_heads, value_head)]


def _inputs(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The write's inputs, element e of the token (K then V, row-major) carrying id e."""
    parts, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        ids = torch.arange(ID_BASE[dtype] + start, ID_BASE[dtype] + start + size, dtype=torch.int64)
        parts.append(ids.to(INT_OF[torch.finfo(dtype).bits // 8]).view(dtype).reshape(shape).to(device))
        start += size
    return parts


def _landed(raw: list[torch.Tensor], before: list[np.ndarray], dtype: torch.dtype, count: int) -> tuple[np.ndarray, byte_runs.Intervals]:
    """Where each id landed, as buffer << 40 | byte (-1: nowhere), and the changed bytes no id explains. An id found in
    several changed elements landed in the first (by buffer, then byte); the others are stray."""
    width = torch.finfo(dtype).bits // 8
    landed = np.full(count, -1, dtype=np.int64)
    stray: byte_runs.Intervals = []
    for index, (buffer, old) in enumerate(zip(raw, before, strict=True)):
        now = readback.host_bytes(buffer)
        changed = np.flatnonzero(now != old)
        if changed.size == 0:
            continue
        usable = now.size // width * width
        # Only the elements holding a changed byte can carry an id: read those, not the whole buffer.
        elements = np.unique(changed[changed < usable] // width)
        ids = now[:usable].view(np.uint16 if width == 2 else np.uint32)[elements].astype(np.int64) - ID_BASE[dtype]
        carrying = (ids >= 0) & (ids < count)
        elements, ids = elements[carrying], ids[carrying]
        found, first = np.unique(ids, return_index=True)
        new = landed[found] == -1
        placed = elements[first[new]]
        landed[found[new]] = (index << 40) | (placed * width)
        explained = (changed < usable) & np.isin(changed // width, placed)
        stray += [[index, start, end] for start, end in byte_runs.runs(changed[~explained])]
    return landed, stray
