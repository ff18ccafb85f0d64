"""Generator reach on the newest release: a fixed-seed sample draws every cache dtype, quant mode,
layout and backend the release defines (the backends whose classes import on this machine),
from the release's own tables, including what 0.32.0 did not have."""

from collections import Counter

import pytest

from fuzz.space import Rejected, draw_indexed
from fuzz.targets.base import BackendInfo, TargetInfo
from oracles import pages
from tests.conftest import release_target

ZEROERS = ("zeroer", "cpu-zero", "cpu-zeroer")

pytestmark = [pytest.mark.releases, pytest.mark.slow]
SAMPLE = 4000
PLAIN_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")


def release_info(version: str) -> TargetInfo:
    with release_target(version) as target:
        return target.info


def counts(info: TargetInfo, sample: int = SAMPLE, seed: int = 1) -> Counter[str]:
    drawn: Counter[str] = Counter()
    for index in range(sample):
        try:
            case = draw_indexed(info, seed, index)
        except Rejected:
            continue
        drawn["layout=" + case.layout] += 1
        for group in case.groups:
            spec = group.spec
            if spec.kind == "mamba":
                continue
            drawn["backend=" + (group.backend or "synthetic")] += 1
            drawn["cache=" + ("registered" if spec.registered_cache_dtype else spec.cache_dtype)] += 1
            drawn["quant=" + spec.kv_quant_mode] += 1
            drawn["topk_buffer_width"] += spec.topk_buffer_width is not None
            drawn["is_draft"] += spec.is_draft
    return drawn


def test_every_option_of_0_33_is_drawn():
    newest, previous = release_info("0.33.0"), release_info("0.32.0")
    drawn = counts(newest)
    wanted = (["cache=" + name for name in newest.cache_dtypes] + ["quant=" + mode for mode in newest.quant_modes]
              + ["layout=" + name for name in newest.layouts] + ["backend=" + b.name for b in newest.backends] + ["cache=registered"]
              + ["topk_buffer_width", "is_draft"])  # the spec fields 0.33 added
    print("\n".join(f"{option:40} {drawn[option]}" for option in sorted(wanted)))
    assert not [option for option in wanted if drawn[option] == 0], {option: drawn[option] for option in wanted}
    added = (set(newest.cache_dtypes) - set(previous.cache_dtypes)) | (set(newest.quant_modes) - set(previous.quant_modes))
    assert {"octave_k3v4", "octave_k3v3", "octave_k3v3_compact", "custom"} <= added
    assert {b.name for b in newest.backends} - {b.name for b in previous.backends} >= {"ROCM_OCTAVE"}


# The case-space dimensions issue 46 added, counted per model runner as well ("mamba@v1": cases with Mamba layers the V1
# runner builds).
PER_RUNNER = ("backends_differ", "mamba", "mamba_only", "layers_differ", "precisions_differ", "head_sizes_differ", "latents_differ")


def surface_counts(info: TargetInfo, sample: int = SAMPLE, seed: int = 1) -> Counter[str]:
    """How often a fixed-seed sample reaches each part of the wider surface: specs built by vLLM's layers, packed slabs,
    the V1 runner, each consumer, and each quantized cache dtype (cases as a campaign draws them, consumers included)."""
    drawn: Counter[str] = Counter()
    for index in range(sample):
        try:
            case = draw_indexed(info, seed, index, touches=True)
        except Rejected:
            continue
        before = Counter({dimension: drawn[dimension] for dimension in PER_RUNNER})
        drawn["spec_source=" + case.spec_source] += 1
        drawn["packing=" + case.packing] += 1
        drawn["runner=" + case.runner] += 1
        drawn["platform=" + case.platform] += 1
        drawn["attention_free"] += not case.groups
        mamba = any(g.spec.kind == "mamba" for g in case.groups)
        drawn["mamba"] += mamba
        drawn["mamba_only"] += mamba and all(g.spec.kind == "mamba" for g in case.groups)
        drawn["mamba_runner=" + case.runner] += mamba
        drawn["layers_differ"] += any(len(set(g.layer_specs)) > 1 for g in case.groups)
        drawn["precisions_differ"] += any(len({s.dtype for s in g.layer_specs}) > 1 for g in case.groups)
        sizes_differ = [g for g in case.groups if len({s.head_size for s in g.layer_specs}) > 1]
        drawn["head_sizes_differ"] += any(not g.spec.is_mla for g in sizes_differ)
        drawn["latents_differ"] += any(g.spec.is_mla for g in sizes_differ)
        drawn["value_heads_differ"] += any(g.spec.head_size_v not in (None, g.spec.head_size) for g in case.groups)
        drawn["backends_differ"] += len({g.backend for g in case.groups if g.spec.is_attention and g.backend}) > 1
        for dimension in PER_RUNNER:  # a case run by both runners counts for each
            for runner in (("v1", "v2") if case.runner == "both" else (case.runner,)):
                drawn[f"{dimension}@{runner}"] += drawn[dimension] > before[dimension]
        several_uniform = case.packing == "uniform_type" and len(case.groups) > 1
        drawn["page_buckets"] += several_uniform and len({pages.page(g.spec).page_bytes for g in case.groups}) > 1
        for consumer in case.touches.consumers if case.touches is not None else ():
            drawn["consumer=" + consumer] += 1
        for group in case.groups:
            if group.spec.kind != "mamba" and group.spec.cache_dtype not in PLAIN_CACHE_DTYPES:
                drawn["quantized=" + group.spec.cache_dtype] += 1
    return drawn


def takes_value_heads(info: TargetInfo, backend: BackendInfo) -> bool:
    return not backend.is_mla and (backend.asymmetric_kv if info.contract.layout_placed else backend.sets_value_heads)


@pytest.mark.parametrize("version", ["0.19.1", "0.22.0", "0.23.0", "0.25.0", "0.29.0", "0.32.0", "0.33.0", "0.34.0"])
def test_every_generation_reaches_the_whole_surface_it_has(version):
    """One release per generation (and 0.25, where the CPU runner's zeroer appears): each runner, packing, consumer,
    platform and quantized cache dtype the release has, vLLM-built specs where its layers build, attention-free models,
    K and V heads of different sizes where a backend takes them, several UniformTypeKVCacheSpecs groups of different page
    sizes where the planner buckets them (0.20 - 0.23), from 0.29 layers that differ in size, in precision
    (`--kv-cache-dtype-skip-layers`), in head size and in MLA latent size, and Mamba layers (0.19 - 0.20: on the V1
    runner), hybrid and alone, are drawn."""
    info = release_info(version)
    drawn = surface_counts(info, sample=3000)
    # The attention read-back is drawn only with a group on a backend whose forward it reads (CPU_ATTN, TRITON_ATTN), which a
    # uniform draw of backends seldom gives: the generator does not steer towards them yet (fuzz/checks/attention.py).
    consumers = [c for c in info.consumers if (c not in ZEROERS or "mamba" in info.spec_kinds) and c != "attention"]  # ZEROING_RULE
    wanted = (["runner=" + r for r in ("v1", "both") if "v1" in info.runners] + ["packing=" + p for p in info.packings]
              + ["consumer=" + c for c in consumers]
              + (["spec_source=vllm"] if info.layer_kinds else [])
              + ["platform=" + p for p in info.platforms] + (["attention_free"] if info.attention_free else [])
              + (["layers_differ", "precisions_differ", "head_sizes_differ", "latents_differ"]
                 if info.contract.layout_placed and "uniform_type" in info.packings else [])
              + (["page_buckets"] if info.contract.page_buckets and "uniform_type" in info.packings else [])
              + (["value_heads_differ"] if info.can("full", "head_size_v") and any(takes_value_heads(info, b) for b in info.backends) else [])
              + ["quantized=" + d for d in info.cache_dtypes if d not in PLAIN_CACHE_DTYPES
                 and any(d in b.cache_dtypes for b in info.backends)])
    # Two attention backends in one model's pools (encoder-decoders, drafters: fuzz/space.py MIXED_BACKEND_PAIRS).
    wanted += ["backends_differ"]
    v2_builds_mamba = info.contract.layout_placed or info.contract.mamba_views != "none"
    if "mamba" in info.spec_kinds:  # hybrid and Mamba-only models; on 0.19 - 0.20 on the V1 runner only, which builds their views
        wanted += ["mamba", "mamba_only"]
        if not v2_builds_mamba:
            assert drawn["mamba_runner=v2"] == drawn["mamba_runner=both"] == 0 < drawn["mamba_runner=v1"]
    runners = ["v2", *(["v1"] if "v1" in info.runners else [])]
    wanted += [f"{dimension}@{runner}" for dimension in PER_RUNNER if dimension in wanted for runner in runners
               if v2_builds_mamba or runner == "v1" or not dimension.startswith("mamba")]
    print(version, " ".join(f"{option}:{drawn[option]}" for option in sorted(wanted)))
    assert not [option for option in wanted if drawn[option] == 0], {option: drawn[option] for option in wanted}
