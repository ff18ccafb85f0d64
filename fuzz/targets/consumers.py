"""Code that addresses KV blocks by bytes beyond the views, asked which bytes it touches for block b.

Each consumer runs in the worker process on the walk of the model runner that owns it (a zeroer
fed another runner's views writes wherever those views' strides send it: on 0.19 that corrupted
the heap). What it reports is plain data for the comparator (fuzz/verdict/touch.py), which
holds it against the bytes the oracle gives block b (oracles/touch.py):

- `zeroer`      KVBlockZeroer.zero_block_ids (vllm/v1/worker/utils.py), its Triton kernel run where
                Triton compiles or under Triton's interpreter (fuzz/targets/triton_interp.py);
- `cpu-zero`    CPUModelRunner._zero_block_ids (cpu_model_runner.py, the releases where it zeroes);
- `cpu-zeroer`  CPUKVBlockZeroer.zero_block_ids (0.34's vllm/v1/worker/cpu/utils.py);
- `copy`        copy_kv_cache_blocks_inplace (vllm/v1/worker/utils.py, copy-on-write block copies);
- `offload`     the offloading connector's register_kv_caches: the per-block regions it hands its
                transfer worker (captured, no transport started).
Zeroers and the block copy run on buffers filled with a known pattern and report the bytes that
changed; the connector reports its regions. NIXL's register_kv_caches is not driven: its worker
object is set up by a constructor that needs a tensor-parallel group and about thirty fields of
transfer state, which would all have to be faked. The three zeroers run only where the config vLLM
planned asks for zeroing, as vLLM runs them (fuzz/space.py ZEROING_RULE); elsewhere they are skipped
with that reason.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from fuzz.case import MLA_KINDS, Touches
from fuzz.checks import consumers as consumer_check
from fuzz.checks.timing import timed
from fuzz.space import ZEROING_RULE
from fuzz.targets import readback, triton_interp
from fuzz.targets.entry_points import Probe
from fuzz.targets.walk import Walk

# Where each model runner keeps the code that calls a consumer (read as source, never imported for this).
RUNNER_MODULES: dict[str, tuple[str, ...]] = {
    "v1": ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.cpu_model_runner"),
    "v2": ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu.kv_connector"),
    "cpu": ("vllm.v1.worker.cpu.standalone_model_runner", "vllm.v1.worker.cpu.kv_connector"),
}
# Where each runner's own KV-cache initialisation lives, for `walk_runners`.
RUNNER_INIT: dict[str, str] = {"v1": "vllm.v1.worker.gpu_model_runner", "cpu": "vllm.v1.worker.cpu.attn_utils"}


@dataclass(frozen=True)
class Consumer:
    name: str
    kind: str  # "zero", "copy" or "region": what the comparator checks
    where: str  # the vLLM function, module.qualname
    users: tuple[str, ...]  # the model runners that call it
    run: Callable[[Walk, Touches], dict[str, Any]]


# Kinds of consumer whose run fills every raw buffer with its own bytes before vLLM's code or kvfuzz reads one (the
# kernel probe does too): their buffers need not come zeroed. A region consumer reads none itself, but the vLLM code it
# drives may.
FILLS_FIRST = frozenset({"zero", "copy"})


def fill_first(consumers: dict[str, Consumer], names: tuple[str, ...]) -> bool:
    """Whether every consumer named that this vLLM has fills the buffers before anything reads them."""
    return all(consumers[name].kind in FILLS_FIRST for name in names if name in consumers)


class Unusable(Exception):
    """The consumer cannot run on this walk: why, one line (a skip, never a finding)."""


# ---------------------------------------------------------------------------------------------- discovery


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


def discover(probe: Probe) -> tuple[dict[str, Consumer], dict[str, str]]:
    """The consumers this vLLM has, and those it has that kvfuzz cannot drive (name -> why)."""
    found: dict[str, Consumer] = {}
    off: dict[str, str] = {}
    makers = (_zeroer, _cpu_zero, _cpu_zeroer, _copy, _offload)
    for maker in makers:
        try:
            consumer = maker(probe)
        except Unusable as why:
            off[maker.__name__.strip("_").replace("_", "-")] = str(why)
            continue
        if consumer is not None:
            found[consumer.name] = consumer
    return found, off


def run(consumers: dict[str, Consumer], walk: Walk, touches: Touches) -> dict[str, Any]:
    """Each consumer the case names, on this walk: its record, or why it was skipped."""
    from fuzz.targets.common import vllm_failure

    records: dict[str, Any] = {}
    for name in touches.consumers:
        consumer = consumers.get(name)
        if consumer is None:
            records[name] = {"skipped": f"vLLM has no {name} consumer kvfuzz can drive"}
            continue
        if not set(consumer.users) & set(walk.runners):
            records[name] = {"skipped": f"{consumer.where} is called by the {'/'.join(consumer.users) or 'no'} runner, "
                                        f"whose views are not this walk's ({'/'.join(walk.runners)})"}
            continue
        try:
            with timed(consumer_check.name(name)):
                records[name] = {"kind": consumer.kind, "where": consumer.where, **consumer.run(walk, touches)}
        except Unusable as why:
            records[name] = {"skipped": str(why)}
        except Exception as error:  # noqa: BLE001 - vLLM raising inside a consumer is data; kvfuzz's own errors propagate
            failure = vllm_failure(error)
            if failure is None:
                raise
            records[name] = {"kind": consumer.kind, "where": consumer.where,
                             "error": {"type": failure.error_type, "message": failure.error_message, "function": failure.error_function,
                                       "file": failure.error_file, "line": failure.error_line}}
    return records


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


def _zero_records(walk: Walk, touches: Touches, zero: Callable[[list[int]], None]) -> dict[str, Any]:
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


def _build_zeroer(cls: type, walk: Walk, layers: dict[str, Any]) -> Any:
    kwargs = _zeroer_kwargs(cls, walk, layers)
    zeroer = cls(walk.device, **kwargs)
    init_meta = getattr(zeroer, "init_meta", None)
    if init_meta is not None and "attn_groups_iter" not in kwargs:  # 0.19-0.22: the groups come in a second call
        init_meta(**_zeroer_kwargs(init_meta, walk, layers))  # type: ignore[arg-type]
    return zeroer


def _zeroer(probe: Probe) -> Consumer | None:
    found = probe.find("block zeroer")
    if found is None:
        return None
    cls, mla = found.obj, mla_layer_class(probe)

    def run_zeroer(walk: Walk, touches: Touches) -> dict[str, Any]:
        zeroing_needed(walk)
        try:
            triton_interp.runnable(found.module, ("_zero_kv_blocks_kernel",))
        except triton_interp.Unavailable as why:
            raise Unusable(f"{found.where}: its kernel cannot run here ({why})") from None
        zeroer = _build_zeroer(cls, walk, forward_context(walk, mla, layer_backends(walk)))
        return _zero_records(walk, touches, zeroer.zero_block_ids)

    return Consumer("zeroer", "zero", found.where + ".zero_block_ids", runners_calling(r"(?<![A-Za-z])KVBlockZeroer\("), run_zeroer)


def _cpu_zeroer(probe: Probe) -> Consumer | None:
    found = probe.find("CPU block zeroer")
    if found is None:
        return None
    cls, mla = found.obj, mla_layer_class(probe)

    def run_cpu_zeroer(walk: Walk, touches: Touches) -> dict[str, Any]:
        zeroing_needed(walk)
        zeroer = _build_zeroer(cls, walk, forward_context(walk, mla, layer_backends(walk)))
        return _zero_records(walk, touches, zeroer.zero_block_ids)

    return Consumer("cpu-zeroer", "zero", found.where + ".zero_block_ids", runners_calling(r"\bCPUKVBlockZeroer\("), run_cpu_zeroer)


def _cpu_zero(probe: Probe) -> Consumer | None:
    found = probe.find("CPU model runner")
    if found is None:
        return None
    cls, mla = found.obj, mla_layer_class(probe)
    method = vars(cls).get("_zero_block_ids")
    if method is None or _does_nothing(method):
        return None  # 0.19-0.24: the CPU runner zeroes nothing
    needs = {"kv_cache_config", "compilation_config"}
    reads = set(re.findall(r"self\.(\w+)", inspect.getsource(method)))
    if not reads <= needs | {"_zero_block_ids"}:
        raise Unusable(f"{found.where}._zero_block_ids reads self.{', self.'.join(sorted(reads - needs))}, which kvfuzz does not set")

    def run_cpu_zero(walk: Walk, touches: Touches) -> dict[str, Any]:
        zeroing_needed(walk)
        runner = object.__new__(cls)
        runner.kv_cache_config = walk.config
        runner.compilation_config = types.SimpleNamespace(static_forward_context=forward_context(walk, mla, layer_backends(walk)))
        return _zero_records(walk, touches, runner._zero_block_ids)

    return Consumer("cpu-zero", "zero", found.where + "._zero_block_ids", ("v1",), run_cpu_zero)


def _does_nothing(function: Any) -> bool:
    """A method whose body is only a docstring and `pass` (or `return`)."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    return all(isinstance(s, ast.Pass | ast.Return) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)) for s in body)


# ---------------------------------------------------------------------------------------------- block copy


def _copy(probe: Probe) -> Consumer | None:
    found = probe.find("block copy")
    if found is None:
        return None

    def run_copy(walk: Walk, touches: Touches) -> dict[str, Any]:
        copies = []
        caches = [view for view in walk.manager_views.values() if isinstance(view, torch.Tensor)]
        for src, dst in touches.copies:
            readback.fill_pattern(walk.raw)
            before = readback.snapshot(walk.raw)
            found.obj(caches, walk.case.num_blocks, [(src, dst)])
            changed = readback.changed(walk.raw, before)
            copies.append({"src": src, "dst": dst, "changed": changed, "values": readback.values(walk.raw, changed)})
        return {"copies": copies}

    return Consumer("copy", "copy", found.where, runners_calling(r"\bcopy_kv_cache_blocks_inplace\("), run_copy)


# ---------------------------------------------------------------------------------------------- connector regions


def _offload(probe: Probe) -> Consumer | None:
    found = probe.find("offloading worker")
    if found is None:
        return None
    cls = found.obj
    module = importlib.import_module(cls.__module__)
    group_ids = getattr(module, "get_offloading_group_ids", None)

    def run_offload(walk: Walk, touches: Touches) -> dict[str, Any]:
        captured: list[Any] = []
        worker = object.__new__(cls)
        worker.kv_cache_config, worker.vllm_config = walk.config, walk.vllm_config
        worker.spec = types.SimpleNamespace(vllm_config=walk.vllm_config, kv_cache_config=walk.config,
                                            get_worker=captured.append, get_handlers=lambda caches: captured.append(caches) or [])
        worker.worker = types.SimpleNamespace(register_handler=lambda *args: None)
        worker._init_worker = captured.append  # 0.25+ hands its regions over here
        worker._register_handlers = captured.append  # 0.19-0.24 here
        with contextlib.ExitStack() as stack:
            stack.enter_context(_layers_in_config(walk))
            if hasattr(module, "derive_canonical_mappings"):
                # Canonical pages for tensor-parallel peers: no part of the regions, and it needs a model config.
                stack.enter_context(mock.patch.object(module, "derive_canonical_mappings", lambda *args, **kwargs: {}))
            worker.register_kv_caches(with_sharers(walk))
        if len(captured) != 1:
            raise Unusable(f"{found.where}.register_kv_caches handed over {len(captured)} sets of regions, kvfuzz expects one")
        selected = group_ids(walk.config) if group_ids is not None else range(len(walk.config.kv_cache_groups))
        layers = [name for index in selected for name in walk.config.kv_cache_groups[index].layer_names]
        return {"layers": layers, "blocks": _region_rows(captured[0], walk, touches.blocks)}

    return Consumer("offload", "region", found.where + ".register_kv_caches", runners_calling(r"\bregister_kv_caches\("), run_offload)


def with_sharers(walk: Walk) -> dict[str, Any]:
    """The runner's caches as connectors get them: a KV-sharing layer maps to its target's cache (vllm/v1/worker/gpu/attn_utils.py
    and GPUModelRunner.initialize_kv_cache_tensors: `kv_caches[layer_name] = kv_caches[target_layer_name]`)."""
    caches = dict(walk.manager_views)
    for sharer, target in walk.case.kv_sharing:
        if target in caches:
            caches.setdefault(sharer, caches[target])
    return caches


def _region_rows(canonical: Any, walk: Walk, blocks: tuple[int, ...]) -> list[dict[str, Any]]:
    """Row b of every (num_blocks, bytes) tensor handed over: the bytes the connector moves for block b."""
    addresses = readback.Addresses(walk.raw)
    tensors = [entry.tensor for entry in canonical.tensors]
    return [{"block": block, "region": [part for tensor in tensors for part in readback.region_of(tensor, block, addresses)]}
            for block in blocks]


class _layers_in_config:  # noqa: N801
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
