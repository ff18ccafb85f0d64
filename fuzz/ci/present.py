"""What a reader of a `kvfuzz ci` report needs about one bug: its case in vLLM's terms, the rows of
`kvfuzz explain` that differ, the variants and origins it showed under, the exported test."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

from fuzz.case import LAYOUT_EQUIVALENTS, Case, GroupCase, SpecCase
from fuzz.ci.model import CAMPAIGN, CORPUS

MAX_ROWS = 6  # differing tensors of `kvfuzz explain` shown inline; the full text follows collapsed
# The spec fields every case names; the others are shown only when set.
ALWAYS = ("block_size", "num_kv_heads", "head_size", "dtype")


def vllm_terms(case: Case) -> str:
    """The case as the vLLM objects it builds: each group's spec class and fields, its backend and kernel
    block size, then the block count, layout and options."""
    twin = {**LAYOUT_EQUIVALENTS, **{placed: legacy for legacy, placed in LAYOUT_EQUIVALENTS.items()}}.get(case.layout)
    layout = f"layout {case.layout}" + (f" (= {twin})" if twin else "")
    lines = [f"num_blocks={case.num_blocks}, {layout}, model runner {case.runner}"]
    extras = [f"{name}={getattr(case, name)}" for name in ("packing", "spec_source", "platform") if getattr(case, name) != _default(name)]
    if extras:
        lines[0] += ", " + ", ".join(extras)
    for number, group in enumerate(case.groups):
        lines.append(f"group {number}: {_spec(group.spec)}")
        lines.append(f"  layers {', '.join(group.layers)}; {_backend(group)}")
        if group.layer_heads:
            lines.append(f"  per-layer num_kv_heads {list(group.layer_heads)} (UniformTypeKVCacheSpecs)")
        if group.layer_head_sizes:
            lines.append(f"  per-layer head_size {list(group.layer_head_sizes)} (UniformTypeKVCacheSpecs)")
        if group.layer_cache_dtypes:
            lines.append(f"  per-layer cache {list(group.layer_cache_dtypes)} (--kv-cache-dtype-skip-layers)")
    lines += [f"KV sharing: {sharer} reads {target}'s cache" for sharer, target in case.kv_sharing]
    if case.touches is not None and case.touches.size:
        lines.append(f"consumers: {', '.join(case.touches.consumers) or '-'}")
    return "\n".join(lines)


def _spec(spec: SpecCase) -> str:
    from fuzz.targets.catalog import SPEC_CLASSES  # imports torch: only when a report is written

    fields = [(f.name, getattr(spec, f.name)) for f in dataclasses.fields(spec) if f.name != "kind"]
    shown = [(name, value) for name, value in fields
             if name in ALWAYS or value != next(f for f in dataclasses.fields(SpecCase) if f.name == name).default]
    text = ", ".join(f"{name}=torch.{value}" if name == "dtype" else f"{name}={value!r}" for name, value in shown)
    return f"{SPEC_CLASSES.get(spec.kind, spec.kind)}({text})"


def _backend(group: GroupCase) -> str:
    size = f", kernel block size {group.kernel_block_size}" if group.kernel_block_size is not None else ""
    if group.synthetic_backend is not None:
        backend = group.synthetic_backend
        layouts = ", ".join(backend.layouts) if backend.layouts else "any"
        return (f"synthetic backend {backend.registered_name} (kvfuzz's: kernel block sizes {list(backend.kernel_block_sizes)}, "
                f"layouts {layouts}){size}")
    return f"backend {group.backend_name}{size}"


def _default(name: str) -> object:
    return next(f for f in dataclasses.fields(Case) if f.name == name).default


def differing_rows(explain: str, limit: int = MAX_ROWS) -> str:
    """`kvfuzz explain` text cut to what differs: its head (case, verdict, vLLM's error, buffer sizes), then only the
    tensors whose expected and actual rows differ, at most `limit`. A V1 model runner part is cut the same way."""
    main, marker, v1 = explain.partition("\n\nV1 model runner")
    text = _cut(main.splitlines(), limit)
    return text + (f"\n\nV1 model runner{_cut_tail(v1, limit)}" if marker else "")


def _cut_tail(v1: str, limit: int) -> str:
    title, _, rest = v1.partition("\n")
    return title + ("\n" + _cut(rest.splitlines(), limit) if rest else "")


def _cut(lines: list[str], limit: int) -> str:
    header = next((n for n, line in enumerate(lines) if line.split()[:3] == ["layer", "tensor", "side"]), None)
    if header is None:
        return "\n".join(lines)
    groups, others = _tensor_groups(lines[header + 1:])
    differ = [group for group in groups if _differs(group)]
    if not differ:  # the head says it all (vLLM's error, the oracle's reason)
        return "\n".join([*lines[:header], *others])
    if all(_row_fields(group[1]) == "-" for group in groups if len(group) > 1):
        return "\n".join([*lines[:header], f"(vLLM built no views: all {len(groups)} expected tensor(s) are in the full text)", *others])
    kept = [line for group in differ[:limit] for line in group]
    more = [f"... {len(differ) - limit} more differing tensor(s) in the full text"] if len(differ) > limit else []
    same = len(groups) - len(differ)
    tail = [f"({same} other tensor(s) as expected)"] if same else []
    return "\n".join([*lines[:header + 1], *kept, *more, *others, *tail])


def _tensor_groups(lines: list[str]) -> tuple[list[list[str]], list[str]]:
    """The rows of each tensor (expected, actual, the `->` byte comparison), and the KV-sharing lines that say a layer
    does not alias its target."""
    groups: list[list[str]] = []
    others = []
    for line in lines:
        words = line.split(None, 3)
        if len(words) >= 3 and words[2] == "expected":
            groups.append([line])
        elif (len(words) >= 3 and words[2] == "actual" or line.lstrip().startswith("->")) and groups:
            groups[-1].append(line)
        elif "do NOT alias" in line:
            others.append(line)
    return groups, others


def _differs(group: list[str]) -> bool:
    rows = [line for line in group if not line.lstrip().startswith("->")]
    compared = [line.strip() for line in group if line.lstrip().startswith("->")]
    geometry_differs = len(rows) != 2 or _row_fields(rows[0]) != _row_fields(rows[1])
    return geometry_differs or any(not line.startswith("-> same") for line in compared)


def _row_fields(row: str) -> str:
    words = row.split(None, 3)
    return words[3] if len(words) > 3 else "-"


def variants_text(variants: dict[str, list[str]]) -> str:
    """spec kinds / backends / layouts, each list joined."""
    return " / ".join(", ".join(variants.get(key, ())) or "-" for key in ("spec_kinds", "backends", "layouts"))


def origins_text(origins: Counter[str]) -> str:
    names = {CORPUS: "corpus", CAMPAIGN: "campaign"}
    return ", ".join(f"{names.get(origin, origin)} {count}" for origin, count in sorted(origins.items()))


def export_command(case_file: Path) -> str | None:
    """`kvfuzz export` for a case whose finding kvfuzz can write as a standalone pytest module (fuzz/export), else None."""
    try:
        from fuzz.export.finding import read_finding
        from fuzz.export.templates import export_all
    except ImportError:  # a kvfuzz without the exporter
        return None
    try:
        names = [exported.file_name for exported in export_all(read_finding(case_file), None)]
    except Exception:  # noqa: BLE001 - no template for this finding (NoTemplate), or a file it cannot read: no test to offer
        return None
    what = "a standalone test" if len(names) == 1 else "standalone tests, one per model runner walk"
    return f"kvfuzz export {case_file} --out tests/kvfuzz  # writes {' and '.join(names)}: {what}, vllm and torch only"
