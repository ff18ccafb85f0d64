"""The V1 model runner's KV-cache code: GPUModelRunner.initialize_kv_cache_tensors on a minimal runner.

Up to 0.28 the V1 runner (vllm/v1/worker/gpu_model_runner.py; CPUModelRunner subclasses it and overrides
no KV-cache method) allocates and reshapes with code of its own (`_allocate_kv_cache_tensors`,
`_reshape_kv_cache_tensors`, `_update_hybrid_attention_mamba_layout`); from 0.29 it calls
allocate_kv_cache as the V2 runner does and differs around it (KV-sharing aliases, binding, the
kernel-block views it binds). kvfuzz builds the runner the way vLLM's own worker tests build one
(`object.__new__` and only the attributes the method reads) and hands it what the V2 runner's walk
prepared: the plan, the shared-layer wiring, the attention groups and the kernel block sizes, which the
V1 runner computes with the same functions (`initialize_kv_cache`).

Two things are V1's own and set as V1 sets them: the cache dtype is the global one
(`cache_config.cache_dtype`; the V2 runner takes it as an argument), and KV-sharing layers are
runner-only layers (`add_kv_sharing_layers_to_kv_cache_groups(..., runner_only_attn_layers)`). Binding
(`bind_kv_cache`) reads a layer index out of every layer name, so the runner sees the case's layers as
`model.layers.<i>.kvfuzz` and the results are mapped back; renaming changes no tensor or its sharing.
The views recorded are the ones bound to the layers (from 0.32 the kernel-block views).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from types import SimpleNamespace
from typing import Any

import torch

from fuzz.case import Case, replace
from fuzz.errors import TargetError
from fuzz.targets.base import Outcome
from fuzz.targets.entry_points import Found
from fuzz.targets.probe import storage_key


class LayerStub:
    """A forward-context entry as bind_kv_cache fills it (`.kv_cache` up to 0.26, `.bind_kv_cache()` from 0.27)."""

    def __init__(self) -> None:
        self.kv_cache: Any = torch.tensor([])

    def bind_kv_cache(self, kv_cache: Any) -> None:
        self.kv_cache = kv_cache


class V1Runner:
    """Drives GPUModelRunner.initialize_kv_cache_tensors on what the adapter prepared for a case."""

    def __init__(self, found: Found) -> None:
        self.cls = found.obj
        self.where = found.where
        # The names the runner saw for the case's layers in the last call, mapped back (restore()).
        self.names: dict[str, str] = {}

    def views(self, case: Case, config: Any, attn_groups: list[list[Any]], kernel_block_sizes: list[int], cache_config: Any,
              vllm_config: Any, device: torch.device) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The views the runner binds to each layer (by the case's names) and the raw buffers they lie on."""
        sharing = dict(case.kv_sharing)
        names = {name: f"model.layers.{index}.kvfuzz" for index, name in enumerate([*case.layer_names, *sharing])}
        back = self.names = {renamed: name for name, renamed in names.items()}
        config, attn_groups = _renamed(config, names), _renamed(attn_groups, names)
        stubs = {renamed: LayerStub() for renamed in back}
        runner = self._runner(case, config, attn_groups, kernel_block_sizes, cache_config, vllm_config, device, names, stubs)
        try:
            manager = runner.initialize_kv_cache_tensors(config, kernel_block_sizes)
        except AttributeError as error:
            if getattr(error, "obj", None) is runner or getattr(error, "obj", None) in stubs.values():
                raise TargetError(f"kvfuzz's minimal V1 runner lacks {getattr(error, 'name', '?')!r}, which {self.where} reads: "
                                  f"{error}".splitlines()[0]) from None
            raise
        bound = {back[renamed]: stub.kv_cache for renamed, stub in stubs.items()}
        order = [layer for tensor in config.kv_cache_tensors for layer in _tensor_layers(tensor)]
        buffers: dict[int, torch.Tensor] = {}
        for renamed in order:
            for tensor in _tensors(manager.get(renamed)):
                key = storage_key(tensor)
                if key not in buffers:
                    buffers[key] = torch.empty(0, dtype=torch.int8, device=tensor.device).set_(tensor.untyped_storage())
        return bound, list(buffers.values())

    def _runner(self, case: Case, config: Any, attn_groups: list[list[Any]], kernel_block_sizes: list[int], cache_config: Any,
                vllm_config: Any, device: torch.device, names: dict[str, str], stubs: dict[str, LayerStub]) -> Any:
        runner = object.__new__(self.cls)
        cache_config = copy.copy(cache_config)
        # The V1 runner asks backends for the global cache dtype; a model has one (backend-shaped cases hold one).
        cache_config.cache_dtype = next((g.spec.cache_dtype for g in case.groups if g.spec.is_attention), "auto")
        sharers = {names[sharer]: names[target] for sharer, target in case.kv_sharing}
        attributes = {
            "vllm_config": vllm_config,
            "cache_config": cache_config,
            "compilation_config": SimpleNamespace(static_forward_context=stubs),
            "model_config": SimpleNamespace(hf_config=SimpleNamespace(model_type="kvfuzz")),
            "device": device,
            "pin_memory": False,
            "attn_groups": attn_groups,
            "kv_cache_config": config,
            # add_kv_sharing_layers_to_kv_cache_groups puts sharing layers in their target's group and here.
            "runner_only_attn_layers": set(sharers),
            "shared_kv_cache_layers": sharers,
            "kv_caches": [],
            "speculative_config": None,
            "drafter": None,
            "cross_layers_kv_cache": None,
            "cross_layers_attn_backend": None,
            "_kernel_block_sizes": kernel_block_sizes,
        }
        for name, value in attributes.items():
            setattr(runner, name, value)
        return runner


    def restore(self, outcome: Outcome) -> Outcome:
        """An outcome of the last call in the case's layer names (vLLM's error may name a layer as the runner saw it)."""
        if not outcome.raised or not self.names:
            return outcome
        message = outcome.error_message or ""
        for renamed in sorted(self.names, key=len, reverse=True):
            message = message.replace(renamed, self.names[renamed])
        return replace(outcome, error_message=message, error_layer=self.names.get(outcome.error_layer or "", outcome.error_layer))


def _tensor_layers(tensor: Any) -> list[str]:
    return list(getattr(tensor, "shared_by", None) or getattr(tensor, "layers", None) or ())


def _tensors(value: Any) -> list[torch.Tensor]:
    if value is None:
        return []
    return [t for t in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(t, torch.Tensor)]


# Values that hold no layer name: _renamed returns them as they are without looking inside.
NAMELESS = (int, float, torch.dtype, torch.device, torch.Tensor)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(cls))


def _renamed(value: Any, names: dict[str, str]) -> Any:
    """`value` with every layer name in it replaced, leaving `value` as it was: strings, lists, sets and dicts anew, tuples
    and dataclasses anew where something in them changed (a dataclass that is not frozen always, since the runner may
    set its fields); what holds no name (frozen specs, classes, tensors) is shared."""
    if isinstance(value, str):
        return names.get(value, value)
    if value is None or isinstance(value, NAMELESS):
        return value
    if isinstance(value, list):
        return [_renamed(item, names) for item in value]
    if isinstance(value, tuple):
        items = tuple(_renamed(item, names) for item in value)
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        return items if type(value) is tuple else type(value)(*items)  # a named tuple takes its fields one by one
    if isinstance(value, set):
        return {_renamed(item, names) for item in value}
    if isinstance(value, dict):
        return {_renamed(key, names): _renamed(item, names) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {}
        for name in _field_names(type(value)):
            current = getattr(value, name, None)
            renamed = _renamed(current, names)
            if renamed is not current:
                changed[name] = renamed
        if not changed and value.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            return value
        clone = copy.copy(value)
        for name, renamed in changed.items():
            object.__setattr__(clone, name, renamed)
        return clone
    return value
