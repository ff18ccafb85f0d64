"""Whether a target can run a case, and under which names: a case is one configuration whatever the release, and each
release gets it in its own terms (layout names, each real backend's kernel block size) or says which field it cannot
express (a skip, never a finding)."""

from __future__ import annotations

from typing import Any

from fuzz.case import Case, SpecCase, layout_as, replace
from fuzz.space import choose_kernel_block_size, layer_reason, layout_reason, packing_reason, record_reason, v1_only_mamba
from fuzz.targets.base import TargetInfo
from fuzz.targets.catalog import FIELD_DEFAULTS
from fuzz.targets.entry_points import Probe
from oracles import dtypes, pages


class Expressible:
    """The part of an adapter that translates a case into the release's terms and says why it cannot run one."""

    info: TargetInfo
    probe: Probe
    off: dict[str, str]
    backend_classes: dict[str, type]
    refused_on_gpus: dict[str, frozenset[str]]
    attention_spec: Any

    def skip_reason(self, case: Case) -> str | None:
        """Why this target cannot run a case because a check it needs is off."""
        if case.kv_sharing and "kv-sharing" in self.off:
            return f"check kv-sharing is off: {self.off['kv-sharing']}"
        return None

    def translate(self, case: Case) -> Case | str:
        """The case in this release's terms, or why the release cannot express it (naming the field):
        the layout under the name the release gives it, and each real backend's kernel block size
        as this release's backend declares it (vLLM's rule picks it from the backend's sizes)."""
        info: TargetInfo = self.info  # type: ignore[attr-defined]
        layout = layout_as(case.layout, info.layouts)
        if layout is None:
            return f"field layout: {case.layout} has no equivalent among this vLLM's ({', '.join(info.layouts)})"
        groups = []
        for group in case.groups:
            backend = info.backend(group.backend) if group.backend else None
            if backend is not None and group.spec.kind != "encoder_only":
                kernel = choose_kernel_block_size(group.spec.block_size, backend.kernel_block_sizes)
                if kernel is None:
                    return (f"field kernel_block_size: {backend.name} of vLLM {info.vllm_version} has none for "
                            f"{group.spec.block_size}-token blocks")
                group = replace(group, kernel_block_size=kernel)
            groups.append(group)
        return replace(case, layout=layout, groups=tuple(groups))

    def unsupported(self, case: Case) -> str | None:
        info: TargetInfo = self.info  # type: ignore[attr-defined]
        reason = self.skip_reason(case)
        if reason is not None:
            return reason
        if case.runner != "v2" and "v1" not in info.runners:
            return f"field runner: {self.probe.missing('V1 runner')}; cases for the V1 model runner are not drawn"
        if case.runner != "v1" and v1_only_mamba(case, info):
            return f"field runner: vLLM {info.vllm_version}'s V2 runner builds no Mamba views; its V1 runner does (runner v1)"
        if case.packing not in info.packings:
            return (f"field packing: vLLM {info.vllm_version} packs no {case.packing} slabs "
                    "(from 0.29 block-outermost layouts are the packed form)")
        if (why := packing_reason(case, info, case.packing)) is not None:
            return f"field packing: {why}"
        if case.platform not in info.platforms:
            return f"field platform: vLLM {info.vllm_version}'s allocation asks no {case.platform} question"
        if not case.groups and not info.attention_free:
            return "field groups: kvfuzz judges attention-free models from vLLM 0.29"
        if any(g.differs_per_layer for g in case.groups) and not info.contract.layout_placed:
            fields = ("layer_heads", "layer_head_sizes", "layer_cache_dtypes")
            field = next(name for name in fields if any(getattr(g, name) for g in case.groups))
            return f"field {field}: kvfuzz judges layers that differ in size from vLLM 0.29 (one page size a pool before)"
        if case.spec_source == "vllm":
            reason = layer_reason(case, info)
            if reason is not None:
                return reason
        if (reason := layout_reason(case, info)) is not None:
            return reason
        for group in case.groups:
            spec = group.spec
            if spec.kind not in info.spec_kinds:
                return f"field kind: {spec.kind} specs are not in vLLM {info.vllm_version}"
            if group.backend is not None and group.backend not in self.backend_classes:
                return f"field backend: {group.backend} is not importable here"
            if spec.cache_dtype in self.refused_on_gpus.get(group.backend or "", ()):
                return (f"field cache_dtype: no GPU {group.backend} supports accepts {spec.cache_dtype} "
                        "(its supports_combination)")
            for field, default in FIELD_DEFAULTS.items():
                if getattr(spec, field) != default and not info.can(spec.kind, field) and not self.implied(spec, field):
                    return f"field {field}: {spec.kind} specs of vLLM {info.vllm_version} have none"
            if spec.block_stride_multiple_of is not None and not info.can(spec.kind, "block_stride_alignment"):
                return f"field block_stride_alignment: {spec.kind} specs of vLLM {info.vllm_version} have none"
            if spec.block_stride_multiple_of is not None and not hasattr(self.attention_spec, "get_block_stride_alignment"):
                return f"field block_stride_alignment: vLLM {info.vllm_version} takes none in whole kernel blocks"
            reason = self._dtype_reason(spec, info) or record_reason(spec, info)
            if reason is not None:
                return reason
        return None

    def _dtype_reason(self, spec: SpecCase, info: TargetInfo) -> str | None:
        if spec.kind == "mamba":
            return None
        if spec.registered_cache_dtype:
            if not info.registers_dtypes:
                return f"field registered_cache_dtype: vLLM {info.vllm_version} has no cache dtype handler registry"
            if spec.cache_dtype in info.cache_dtypes:
                # Registering it would replace vLLM's own dtype for every later case of this process.
                return f"field cache_dtype: {spec.cache_dtype} is vLLM's own; a registered dtype needs a name of its own"
            if spec.kv_quant_mode not in info.quant_modes:
                return f"field kv_quant_mode: {spec.kv_quant_mode} is not a KVQuantMode of vLLM {info.vllm_version}"
            return None
        if spec.cache_dtype not in info.cache_dtypes:
            return f"field cache_dtype: vLLM {info.vllm_version} accepts no {spec.cache_dtype}"
        if spec.kv_quant_mode not in info.quant_modes:
            return f"field kv_quant_mode: {spec.kv_quant_mode} is not a KVQuantMode of vLLM {info.vllm_version}"
        definition = dtypes.definition(spec.cache_dtype)
        if spec.kv_quant_mode == "none" and info.can(spec.kind, "kv_quant_mode") and definition is not None \
                and "none" not in definition.quant_modes:
            # The generator stores the quant mode a release derives; "none" for a quantized cache is a case written where
            # specs had no quant mode (0.19), not one this release's layers could build.
            return (f"field kv_quant_mode: a {spec.cache_dtype} cache of quant mode none is a case of a vLLM whose {spec.kind} specs "
                    f"had no quant mode; vLLM {info.vllm_version} derives one")
        if pages.defined_content_bytes(spec) is None:
            return f"cache dtype {spec.cache_dtype}: the oracle has no definition of its page for this spec"
        return None

    def implied(self, spec: SpecCase, field: str) -> bool:
        """Whether a case field this vLLM's spec lacks is implied by the fields it has."""
        return False
