"""`kvfuzz report`: a finding as a Markdown issue draft for vLLM (title, releases, reach, configuration in vLLM's
terms, expected against actual, a proposed fix where kvfuzz has one, and the exported test inline)."""

from __future__ import annotations

from dataclasses import dataclass

from fuzz.case import Case
from fuzz.export.finding import FindingFile
from fuzz.export.fixes import fix_for
from fuzz.export.reach import Reach
from fuzz.export.templates import Exported


@dataclass(frozen=True)
class Evidence:
    """What running the finding on one release showed."""

    release: str
    explain: str  # `kvfuzz explain`'s text
    test_outcome: str | None = None  # the exported test's outcome there ("fail", "pass", ...)
    test_errors: tuple[str, ...] = ()  # the `E ` lines pytest printed


def configuration(case: Case, reach: Reach) -> list[str]:
    """The case in vLLM's terms: model layers, backend, options and environment, cache size."""
    lines = []
    for index, group in enumerate(case.groups):
        spec = group.spec
        heads = f"{', '.join(map(str, group.layer_heads))} KV heads (one per layer)" if group.layer_heads else f"{spec.num_kv_heads} KV head(s)"
        kind = {"full": "full-attention", "mla": "MLA", "sliding_window": f"sliding-window ({spec.sliding_window})"}.get(spec.kind, spec.kind)
        dtype = spec.dtype if spec.cache_dtype == "auto" else f"{spec.cache_dtype} (stored as {spec.dtype})"
        if group.layer_cache_dtypes:
            skipped = [str(i) for i, d in enumerate(group.layer_cache_dtypes) if d != spec.cache_dtype]
            dtype += f", layers {', '.join(skipped)} skipped (`--kv-cache-dtype-skip-layers {','.join(skipped)}`)"
        packed = ", one KV-cache group of layers that differ in size (`UniformTypeKVCacheSpecs`)" if case.packing == "uniform_type" else ""
        sizes = (f"head sizes {', '.join(map(str, group.layer_head_sizes))} (one per layer)" if group.layer_head_sizes
                 else f"head size {spec.head_size}")
        lines.append(f"- Model: {len(group.layers)} {kind} layer(s), {heads}, {sizes}, KV cache {dtype}, "
                     f"`--block-size {spec.block_size}`{packed} (group {index})")
        backend = f"`{group.backend}`" if group.backend else (
            f"a platform's own backend (kvfuzz's synthetic `{group.synthetic_backend.name}`)" if group.synthetic_backend else "any")
        lines.append(f"- Attention backend: {backend}")
    for sharer, target in case.kv_sharing:
        lines.append(f"- KV sharing: layer {sharer} reads layer {target}'s cache (`kv_sharing_target_layer_name`)")
    for setting in reach.settings:
        lines.append(f"- Option: `{setting}`")
    lines += [f"- Environment: `{override}`" for override in reach.overrides if override.startswith("VLLM_")]
    lines += [f"- Option: {override}" for override in reach.overrides if not override.startswith("VLLM_")]
    if not any(o.startswith("VLLM_KV_CACHE_LAYOUT") for o in reach.overrides):
        lines.append(f"- KV-cache layout: {case.layout} (the one vLLM resolves for the backend)")
    lines.append(f"- Cache size: {case.num_blocks} block(s) (`--num-gpu-blocks-override {case.num_blocks}`)")
    return lines


def draft(finding: FindingFile, reach: Reach, exported: Exported | None, title: str, evidence: Evidence | None) -> str:
    affected = finding.affected
    fix = fix_for(finding.signature_id)
    parts = [f"# [Bug]: {title}", ""]
    parts += ["## Releases affected", "",
              f"{', '.join(affected)}. kvfuzz replayed the minimal case on every release it knows (`kvfuzz bisect`); these are "
              f"the ones it fails on{'' if fix is None else ', and no release fixes it yet'}.", ""]
    parts += ["## Reach", "", f"**{reach.kind}**: {reach.why}.", "",
              "(`deployment`: a real model's configuration with vLLM's own choices; `flag`: also needs a setting that "
              "overrides a choice vLLM makes itself; `latent`: only a backend no release ships, or a configuration vLLM "
              "refuses before this code runs.)", ""]
    parts += ["## Configuration", "", *configuration(finding.case, reach), ""]
    parts += ["## Expected and actual", "", f"kvfuzz's finding: `{finding.kind}` in `{finding.function}`: {finding.message}", ""]
    if evidence is not None:
        if evidence.test_errors:
            parts += [f"The regression test below on {evidence.release} ({evidence.test_outcome}):", "", "```",
                      *evidence.test_errors, "```", ""]
        parts += [f"`kvfuzz explain` on {evidence.release} (the oracle's views against vLLM's):", "", "```", evidence.explain.rstrip(),
                  "```", ""]
    if fix is not None:
        parts += ["## Proposed fix", "", f"{fix.note[0].upper()}{fix.note[1:]} ({fix.release}); with it the test below passes:", "",
                  "```diff", fix.diff(), "```", ""]
    if exported is not None:
        parts += ["## Regression test", "",
                  "Standalone (vllm, torch and pytest only); fails while the bug is there. "
                  f"Drop it into `tests/` as `{exported.file_name}`.", "",
                  "```python", exported.source.rstrip(), "```", ""]
    parts += ["## Reproduce with kvfuzz", "", "```", f"kvfuzz replay {finding.path.as_posix()} --vllm {finding.newest_affected}",
              f"kvfuzz explain {finding.path.as_posix()} --vllm {finding.newest_affected}", "```", ""]
    return "\n".join(parts)
