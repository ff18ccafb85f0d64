"""vLLM's KV-cache specs for a case, built as a model's layers build them: storage dtype and quant mode from the release's
own tables, synthetic backends as real backend classes, and what vLLM's specs say of their pages (for the spec check)."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch

from fuzz.case import MLA_KINDS, Case, GroupCase, SpecCase, SyntheticBackend, replace
from fuzz.targets.base import Outcome
from fuzz.targets.catalog import DTYPE_NAMES, SPEC_FACT_FIELDS, TORCH_DTYPES
from fuzz.tracebacks import vllm_failure

SYNTHETIC_CLASSES = 256  # synthetic backend classes kept for reuse: drawn backends rarely repeat, and each class costs memory


class SpecMaking:
    """The part of an adapter that builds vLLM's spec objects and backend classes for a case."""

    spec_classes: dict[str, type]
    dtype_table: dict[str, Any]
    quant_enum: Any
    quant_lookup: Any
    registry: Any
    multiple_of: Any
    base_backend: type
    backend_classes: dict[str, type]
    uniform_specs: Any
    _synthetic: collections.OrderedDict[SyntheticBackend, type]
    _spec_fields: dict[type, frozenset[str]]
    _registered: set[str]

    def declare_group(self, group: GroupCase, layout: str) -> GroupCase:
        """The group with the fields its backend publishes filled in."""
        return group

    def synthetic_namespace(self, backend: SyntheticBackend) -> dict[str, Any]:
        return {}

    def backend_class(self, group: GroupCase) -> type | None:
        if group.synthetic_backend is not None:
            key = group.synthetic_backend
            if key in self._synthetic:
                self._synthetic.move_to_end(key)
            else:
                if len(self._synthetic) >= SYNTHETIC_CLASSES:
                    self._synthetic.popitem(last=False)
                sizes = [self.multiple_of(int(s[1:])) if isinstance(s, str) else s for s in key.kernel_block_sizes]
                namespace = {
                    "get_name": staticmethod(lambda: key.registered_name),
                    "get_supported_kernel_block_sizes": classmethod(lambda cls, spec=None: list(sizes)),
                    **self.synthetic_namespace(key),
                }
                self._synthetic[key] = type("Synthetic" + key.name.title().replace("_", ""), (self.base_backend,), namespace)
            return self._synthetic[key]
        return self.backend_classes.get(group.backend) if group.backend else None

    def spec_fields(self, cls: type) -> frozenset[str]:
        fields = self._spec_fields.get(cls)
        if fields is None:
            fields = self._spec_fields[cls] = frozenset(f.name for f in dataclasses.fields(cls))
        return fields

    def build_spec(self, spec: SpecCase) -> Any:
        """vLLM's spec for the case's spec, built as a layer builds it: storage dtype and quant mode
        come from the release's own tables for the cache dtype."""
        cls = self.spec_classes[spec.kind]
        fields = self.spec_fields(cls)
        if spec.kind == "mamba":
            values: dict[str, Any] = {
                "block_size": spec.block_size,
                "shapes": tuple(spec.mamba_shapes),
                "dtypes": tuple(TORCH_DTYPES[d] for d in spec.mamba_dtypes),
                "page_size_padded": spec.page_size_padded,
                "state_alignment": spec.state_alignment if spec.state_alignment != 1 else None,
                "block_stride_alignment": self._block_stride_alignment(spec),
            }
            return cls(**{k: v for k, v in values.items() if k in fields and (v is not None or k == "page_size_padded")})
        self.register_cache_dtype(spec)
        values = {
            "block_size": spec.block_size,
            "num_kv_heads": spec.num_kv_heads,
            "head_size": spec.head_size,
            "dtype": self.storage_dtype(spec),
            "page_size_padded": spec.page_size_padded,
            "compress_ratio": spec.compress_ratio,
            "tokens_per_state": spec.compress_ratio,
            "num_head_slots": spec.num_head_slots,
            "state_content_bytes": spec.state_content_bytes,
            "sliding_window": spec.sliding_window,
            "attention_chunk_size": spec.attention_chunk_size,
            "sink_len": spec.sink_len,
            "alignment": spec.alignment,
            "model_version": spec.model_version,
            "topk_buffer_width": spec.topk_buffer_width,
            "is_draft": spec.is_draft or None,
        }
        if "kv_quant_mode" in fields:
            values["kv_quant_mode"] = self.quant_mode(spec)
        if spec.head_size_v is not None:
            values["head_size_v"] = spec.head_size_v
        if spec.kind in MLA_KINDS:
            values["cache_dtype_str"] = spec.cache_dtype
        values["block_stride_alignment"] = self._block_stride_alignment(spec)
        return cls(**{k: v for k, v in values.items() if k in fields and (v is not None or k == "page_size_padded")})

    def _block_stride_alignment(self, spec: SpecCase) -> Any:
        if spec.block_stride_multiple_of is not None:
            return self.multiple_of(spec.block_stride_multiple_of)
        return spec.block_stride_alignment

    def storage_dtype(self, spec: SpecCase) -> torch.dtype:
        """The torch dtype the release stores the cache dtype as (the model dtype for "auto")."""
        stored = self.dtype_table.get(spec.cache_dtype) if spec.cache_dtype != "auto" else None
        return stored if isinstance(stored, torch.dtype) else TORCH_DTYPES[spec.dtype]

    def quant_mode(self, spec: SpecCase) -> Any:
        """The KVQuantMode the release gives the cache dtype (its own lookup, as a layer asks it)."""
        if self.quant_lookup is not None:
            return self.quant_lookup(spec.cache_dtype)
        return self.quant_enum[spec.kv_quant_mode.upper()]  # type: ignore[index]

    def register_cache_dtype(self, spec: SpecCase) -> None:
        """Registers a case's own cache dtype with the release's handler registry, once."""
        if not spec.registered_cache_dtype or spec.cache_dtype in self._registered or self.registry is None:
            return
        storage, mode = TORCH_DTYPES[spec.dtype], self.quant_enum[spec.kv_quant_mode.upper()]  # type: ignore[index]
        handler = type("KvfuzzDTypeHandler", (), {"name": spec.cache_dtype, "torch_dtype": lambda self: storage,
                                                   "quant_mode": lambda self: mode})
        self.registry(spec.cache_dtype)(handler)
        self._registered.add(spec.cache_dtype)

    def declare(self, case: Case) -> Case:
        """Declaring is idempotent, so cases that already carry their backends' fields may be re-run."""
        return replace(case, groups=tuple(self.declare_group(g, case.layout) for g in case.groups))

    def _with_spec_facts(self, outcome: Outcome, specs: list[tuple[Any, str | None]]) -> Outcome:
        """The outcome with what vLLM's specs say about their pages. Reading them runs vLLM's own properties: one that
        raises is vLLM failing on the case (the first such failure, where the walk itself did not fail first)."""
        try:
            facts = {i: self.spec_facts(spec, layer) for i, (spec, layer) in enumerate(specs)}
        except Exception as error:  # noqa: BLE001 - judged like any vLLM error; kvfuzz's own errors are raised again
            failure = vllm_failure(error)
            if failure is None:
                raise
            return outcome if outcome.raised else failure
        return replace(outcome, specs=facts)

    def spec_facts(self, spec: Any, layer: str | None = None) -> dict[str, Any]:
        """What vLLM's spec says about the page: its quant mode and its page before padding; for a spec vLLM built from a
        layer, also that layer's class, the spec's classes and the fields a case states."""
        mode = getattr(spec, "kv_quant_mode", None) if self.quant_lookup is not None else None
        if hasattr(spec, "unpadded_page_size_bytes"):
            page = spec.unpadded_page_size_bytes
        else:
            page = spec.page_size_bytes if getattr(spec, "page_size_padded", None) is None else None
        facts: dict[str, Any] = {"kv_quant_mode": None if mode is None else mode.name.lower(), "page_bytes": page}
        if layer is not None:
            fields = {}
            for name in SPEC_FACT_FIELDS:
                value = getattr(spec, name, None)
                fields[name] = DTYPE_NAMES.get(value, str(value)) if isinstance(value, torch.dtype) else value
            facts.update(layer=layer, classes=[cls.__name__ for cls in type(spec).__mro__], fields=fields)
        return facts

    def group_level_spec(self, case: Case, group: GroupCase, spec: Any) -> Any:
        """The spec a KV-cache group carries: the layer spec, or (case packing "uniform_type", DeepSeek V4) the layers'
        specs in a UniformTypeKVCacheSpecs."""
        if case.packing != "uniform_type" or self.uniform_specs is None:
            return spec
        return self.uniform_specs(block_size=spec.block_size, kv_cache_specs=self.layer_spec_objects(group, spec))

    def layer_spec_objects(self, group: GroupCase, spec: Any) -> dict[str, Any]:
        """Each layer's vLLM spec: the group's for layers like the group's spec, one built for each other size (equal specs
        are equal objects, as vLLM's layers give them)."""
        built: dict[SpecCase, Any] = {group.spec: spec}
        for layer in group.layer_specs:
            if layer not in built:
                built[layer] = self.build_spec(layer)
        return {name: built[layer] for name, layer in zip(group.layers, group.layer_specs, strict=True)}
