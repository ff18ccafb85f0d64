"""What the checks that address KV blocks by bytes share (fuzz/checks: the zeroers, the block copy, the connectors,
the kernel probe): which model runner calls a function, the layers a runner binds, and a consumer's run turned into a
record the comparator reads (fuzz/verdict/touch.py).

A consumer runs in the worker process on the walk of the model runner that owns it (a zeroer fed another runner's views
writes wherever those views' strides send it: on 0.19 that corrupted the heap). Zeroers and the block copy run on buffers
filled with a known pattern and report the bytes that changed; connectors report their regions.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fuzz.case import MLA_KINDS, Touches
from fuzz.checks.protocol import Record, Run, Unusable
from fuzz.checks.when import ZEROING_RULE
from fuzz.targets import readback, triton_interp
from fuzz.targets.entry_points import Probe
from fuzz.targets.walk import Walk
from fuzz.tracebacks import vllm_failure

# Where each model runner keeps the code that calls a consumer (read as source, never imported for this).
RUNNER_MODULES: dict[str, tuple[str, ...]] = {
    "v1": ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.cpu_model_runner"),
    "v2": ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu.kv_connector"),
    "cpu": ("vllm.v1.worker.cpu.standalone_model_runner", "vllm.v1.worker.cpu.kv_connector"),
}
# Where each runner's own KV-cache initialisation lives, for `walk_runners`.
RUNNER_INIT: dict[str, str] = {"v1": "vllm.v1.worker.gpu_model_runner", "cpu": "vllm.v1.worker.cpu.attn_utils"}


# ---------------------------------------------------------------------------------------------- runners


def source_text(module: str) -> str:
    """A module's source, read without importing it ('' when it does not exist)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return ""
    return Path(spec.origin).read_text(errors="replace")


def runners_calling(pattern: str) -> tuple[str, ...]:
    """The model runners whose modules call `pattern` (a regular expression)."""
    found = re.compile(pattern)
    return tuple(runner for runner, modules in RUNNER_MODULES.items() if any(found.search(source_text(m)) for m in modules))


def walk_runners(layout_placed: bool, functions: tuple[str, ...]) -> tuple[str, ...]:
    """The model runners that build the adapter's views: the V2 runner's walk is the adapter's own; from 0.29 another
    runner builds the same views when its KV-cache initialisation calls the same allocation (and kernel-block mapping)."""
    runners = ["v2"]
    if layout_placed:
        for runner, module in RUNNER_INIT.items():
            text = source_text(module)
            if text and all(re.search(rf"\b{name}\(", text) for name in functions):
                runners.append(runner)
    return tuple(runners)


def consumer_run(kind: str, where: str, users: tuple[str, ...], body: Callable[[Walk, Touches], Record]) -> Run:
    """A consumer's run as a check's (fuzz/checks/protocol.py): its record says what it is (`kind`: "zeroing", "copying" or
    "mapping", what the comparator checks) and where it lives, and holds its body's report, or the error vLLM raised in it,
    or why it was skipped; only on the walk of a model runner that calls it (`users`)."""

    def run(walk: Walk) -> Record:
        if not set(users) & set(walk.runners):
            return {"skipped": f"{where} is called by the {'/'.join(users) or 'no'} runner, "
                               f"whose views are not this walk's ({'/'.join(walk.runners)})"}
        touches = walk.case.touches
        assert touches is not None
        try:
            return {"kind": kind, "where": where, **body(walk, touches)}
        except Unusable as why:
            return {"skipped": str(why)}
        except Exception as error:  # noqa: BLE001 - vLLM raising inside a consumer is data; kvfuzz's own errors propagate
            failure = vllm_failure(error)
            if failure is None:
                raise
            return {"kind": kind, "where": where, "error": {"type": failure.error_type, "message": failure.error_message,
                                                            "function": failure.error_function, "file": failure.error_file,
                                                            "line": failure.error_line}}

    return run


# ---------------------------------------------------------------------------------------------- layers


class LayerStub:
    """What the forward context holds for a layer: the cache it bound."""

    def __init__(self, kv_cache: Any) -> None:
        self.kv_cache = kv_cache


def forward_context(walk: Walk, mla_layer: type | None, backends: dict[str, type]) -> dict[str, Any]:
    """Layers as the runner leaves them after binding: each holds the view it was given, MLA layers as
    MLAAttention.bind_kv_cache binds it where that class binds (0.30+: it drops the head axis)."""
    sharing = dict(walk.case.kv_sharing)
    layers: dict[str, Any] = {}
    for name, view in walk.bound_views.items():
        group = walk.case.groups[walk.case.group_of(sharing.get(name, name))]
        binds = mla_layer is not None and "bind_kv_cache" in vars(mla_layer)
        if group.spec.kind in MLA_KINDS and binds and isinstance(view, torch.Tensor):
            layer = object.__new__(mla_layer)  # type: ignore[arg-type]
            torch.nn.Module.__init__(layer)
            layer._vllm_config = walk.vllm_config
            layer.attn_backend = backends.get(name)
            layer.kv_cache_dtype = group.spec.cache_dtype
            mla_layer.bind_kv_cache(layer, view)  # type: ignore[union-attr]
            layers[name] = layer
        else:
            layers[name] = LayerStub(view)
    return layers


def layer_backends(walk: Walk) -> dict[str, type]:
    return {name: group.backend for groups in walk.attn_groups for group in groups for name in group.layer_names}


def mla_layer_class(probe: Probe) -> type | None:
    found = probe.find("MLA layer")
    return None if found is None else found.obj


# ---------------------------------------------------------------------------------------------- zeroers


def zeroing_needed(walk: Walk) -> None:
    """Raises Unusable unless the config vLLM planned for the case asks for zeroing; a release whose KVCacheConfig has no
    needs_kv_cache_zeroing runs its zeroers as before."""
    if getattr(walk.config, "needs_kv_cache_zeroing", True) is False:
        raise Unusable(f"{ZEROING_RULE}; this model's KVCacheConfig.needs_kv_cache_zeroing is False")


def zero_records(walk: Walk, touches: Touches, zero: Callable[[list[int]], None]) -> dict[str, Any]:
    blocks = []
    for block in touches.blocks:
        readback.fill(walk.raw)
        before = readback.snapshot(walk.raw)
        with triton_interp.launching(walk.device), triton_interp.guarded(walk.raw) as outside:
            zero([block])
        zeroed, dirtied = readback.changed_to(walk.raw, before, 0)
        entry = {"block": block, "zeroed": zeroed, "dirtied": dirtied}
        if outside.count:
            entry["outside"] = {"bytes": outside.count, "first": outside.first}
        blocks.append(entry)
    return {"blocks": blocks}


def _zeroer_kwargs(cls: type, walk: Walk, layers: dict[str, Any]) -> dict[str, Any]:
    """The arguments a zeroer's constructor (and 0.19-0.22's init_meta) takes, by name, as the runner passes them."""
    spec = walk.case.groups[0].spec
    values = {
        "attn_groups_iter": lambda: iter([g for groups in walk.attn_groups for g in groups]),
        "kernel_block_sizes": lambda: list(walk.kernel_block_sizes),
        "cache_dtype": lambda: next((g.spec.cache_dtype for g in walk.case.groups if g.spec.is_attention), spec.cache_dtype),
        "static_forward_context": lambda: layers,
        "runner_only_attn_layers": lambda: {sharer for sharer, _ in walk.case.kv_sharing},
        "num_blocks": lambda: walk.case.num_blocks,
        "pin_memory": lambda: False,
    }
    return {name: make() for name, make in values.items() if name in inspect.signature(cls).parameters}


def build_zeroer(cls: type, walk: Walk, layers: dict[str, Any]) -> Any:
    kwargs = _zeroer_kwargs(cls, walk, layers)
    zeroer = cls(walk.device, **kwargs)
    init_meta = getattr(zeroer, "init_meta", None)
    if init_meta is not None and "attn_groups_iter" not in kwargs:  # 0.19-0.22: the groups come in a second call
        init_meta(**_zeroer_kwargs(init_meta, walk, layers))  # type: ignore[arg-type]
    return zeroer


def does_nothing(function: Any) -> bool:
    """A method whose body is only a docstring and `pass` (or `return`)."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    return all(isinstance(s, ast.Pass | ast.Return) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)) for s in body)


# ---------------------------------------------------------------------------------------------- connector regions


def with_sharers(walk: Walk) -> dict[str, Any]:
    """The runner's caches as connectors get them: a KV-sharing layer maps to its target's cache (vllm/v1/worker/gpu/attn_utils.py
    and GPUModelRunner.initialize_kv_cache_tensors: `kv_caches[layer_name] = kv_caches[target_layer_name]`)."""
    caches = dict(walk.manager_views)
    for sharer, target in walk.case.kv_sharing:
        if target in caches:
            caches.setdefault(sharer, caches[target])
    return caches


def region_rows(canonical: Any, walk: Walk, blocks: tuple[int, ...]) -> list[dict[str, Any]]:
    """Row b of every (num_blocks, bytes) tensor handed over: the bytes the connector moves for block b."""
    addresses = readback.Addresses(walk.raw)
    tensors = [entry.tensor for entry in canonical.tensors]
    return [{"block": block, "region": [part for tensor in tensors for part in readback.region_of(tensor, block, addresses)]}
            for block in blocks]


class layers_in_config:  # noqa: N801
    """0.19-0.22 connectors look layers up in the config's forward context (for their backends): put stand-ins there."""

    def __init__(self, walk: Walk) -> None:
        self.context = walk.vllm_config.compilation_config.static_forward_context
        self.added: list[str] = []
        self.walk = walk

    def __enter__(self) -> None:
        base = _attention_layer_base()
        if base is None:
            return
        backends = layer_backends(self.walk)
        for name in self.walk.manager_views:
            if name in self.context or name not in backends:
                continue
            stand_in = type("KvfuzzLayer", (base,), {"get_attn_backend": lambda self, b=backends[name]: b,
                                                     "get_kv_cache_spec": lambda self, vllm_config: None,
                                                     "__abstractmethods__": frozenset()})
            self.context[name] = object.__new__(stand_in)
            self.added.append(name)

    def __exit__(self, *exc: object) -> None:
        for name in self.added:
            self.context.pop(name, None)


def _attention_layer_base() -> type | None:
    for module in ("vllm.model_executor.layers.attention_layer_base", "vllm.attention.layer"):
        try:
            return getattr(importlib.import_module(module), "AttentionLayerBase")  # noqa: B009
        except (ImportError, AttributeError):
            continue
    return None
