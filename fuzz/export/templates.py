"""Which template exports which finding: by the finding's kind and the vLLM function it names."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from fuzz.checks.registry import CHECKS
from fuzz.export import layer_spec, placed_views, quant_mode, shaped_views, spec_page, walks
from fuzz.export.code import HELD_BY_HELPER, REQUIRED_FIELDS_HELPER, Module, NoTemplate
from fuzz.export.expected import INVALID_KINDS, VALID_KINDS
from fuzz.export.finding import FindingFile
from fuzz.export.imports import import_block
from fuzz.export.reach import Reach

STDLIB = ("copy", "dataclasses", "importlib", "inspect", "os", "sys", "types")  # what a module may use, imported where it does
Template = Callable[[FindingFile, "Reach | None"], Module]

# (kinds, function) -> template, the view path's; then each deeper check's own (its `exports`). The first match wins.
TEMPLATES: tuple[tuple[tuple[str, ...], str, Template], ...] = (
    (("spec-mismatch",), "get_kv_quant_mode", quant_mode.quant_mode_test),
    (("spec-mismatch",), "kv_cache_spec", spec_page.spec_page_test),
    (layer_spec.KINDS, "MLAAttention.get_kv_cache_spec", layer_spec.layer_spec_test),
)
# The functions of the view path (and the planner ahead of it), where a finding's test checks the views or the refusal.
VIEW_FUNCTIONS = ("reshape", "_reshape_kv_cache", "_reshape_attention_kv_cache", "_update_hybrid_attention_layout",
                  "_align_mixed_attention_kv_cache_views", "_restride_blocks_first_kv_cache_to_kv_first_storage",
                  "_update_hybrid_attention_mamba_layout", "_reshape_kv_cache_tensors", "create_kv_cache_views",
                  "compute_layout_strides", "allocate_kv_cache", "round_up", "map_kv_cache_to_kernel_blocks",
                  "map_kv_caches_to_kernel_blocks", "get_kv_cache_config_from_groups")


def view_test(finding: FindingFile, reach: Reach | None) -> Module:
    if finding.layout_placed:
        return placed_views.placed_views_test(finding, reach)
    return shaped_views.shaped_views_test(finding, reach)


# Templates that write one model runner walk (fuzz/export/walks.py): a finding affecting releases on both sides of 0.29,
# where the allocation changed, gets a module per walk, each skipping the other's releases.
ONE_WALK = ("fuzz.export.block_copy:block_copy_test", "fuzz.export.connector:connector_test")


@dataclass(frozen=True)
class Exported:
    finding: FindingFile
    source: str  # the test module's text
    title: str  # what the test checks, one sentence
    part: str = ""  # the walk's generation, where the finding needs a module per walk

    @property
    def file_name(self) -> str:
        return self.finding.module_name + (f"_{self.part}" if self.part else "") + ".py"


def template_for(finding: FindingFile) -> Template:
    return _template(finding)[0]


def _template(finding: FindingFile) -> tuple[Template, str]:
    """The template for the finding and where it lives ("module:function"; "" for the view path's)."""
    for kinds, function, template in TEMPLATES:
        if finding.kind in kinds and finding.function == function:
            return template, ""
    named = finding.case.touches.consumers if finding.case.touches else ()
    for check in CHECKS:
        if check.drawn and check.name not in named:
            continue  # a check the case does not name found nothing in it
        for export in check.exports:
            if finding.kind in export.kinds and finding.function == export.function:
                module, name = export.template.split(":")
                found = getattr(importlib.import_module(module), name)
                return functools.partial(found, check=check), export.template
    if finding.kind in INVALID_KINDS + VALID_KINDS and finding.function in VIEW_FUNCTIONS:
        return view_test, ""
    raise NoTemplate(f"no exporter for {finding.kind} in {finding.function} yet")


def export_all(finding: FindingFile, reach: Reach | None) -> list[Exported]:
    """The finding's standalone test modules, oldest walk first: one, or one per walk (ONE_WALK); NoTemplate (one line)
    where kvfuzz cannot write them yet."""
    parts = walks.by_generation(finding) if _template(finding)[1] in ONE_WALK else [("", finding)]
    return [dataclasses.replace(export(part, reach), finding=finding, part=name) for name, part in parts]


def export(finding: FindingFile, reach: Reach | None) -> Exported:
    """The finding's standalone test module; NoTemplate (one line) where kvfuzz cannot write one yet."""
    module = template_for(finding)(finding, reach)
    for call, helper in (("**held_by(", HELD_BY_HELPER), ("**fields_of(", REQUIRED_FIELDS_HELPER)):
        if any(call in part for part in module.parts):
            module.parts.insert(1, textwrap.dedent(helper).strip("\n"))
    head, *rest = module.parts
    body = "\n".join(rest)
    stdlib = tuple(name for name in STDLIB if re.search(rf"(?<![\w.]){name}\.", body))
    source = "\n\n".join([head, import_block(module.names, stdlib), *rest[:1]]) + "\n\n\n" + "\n\n\n".join(rest[1:]) + "\n"
    ast.parse(source)  # a template that writes broken Python is kvfuzz's bug: fail here, not in a maintainer's suite
    return Exported(finding, source, module.title)
