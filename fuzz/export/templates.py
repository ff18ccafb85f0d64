"""Which template exports which finding: by the finding's kind and the vLLM function it names."""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from fuzz.export import (
    block_copy,
    connector,
    cpu_zero,
    kernel_write,
    layer_spec,
    placed_views,
    quant_mode,
    runner_compare,
    shaped_views,
    spec_page,
    triton_zero,
    walks,
    zeroer_init,
)
from fuzz.export.code import HELD_BY_HELPER, REQUIRED_FIELDS_HELPER, Module, NoTemplate
from fuzz.export.expected import INVALID_KINDS, VALID_KINDS
from fuzz.export.finding import FindingFile
from fuzz.export.imports import import_block
from fuzz.export.reach import Reach

STDLIB = ("copy", "dataclasses", "importlib", "inspect", "os", "sys", "types")  # what a module may use, imported where it does
Template = Callable[[FindingFile, "Reach | None"], Module]

# (kinds, function) -> template; the first match wins.
TEMPLATES: tuple[tuple[tuple[str, ...], str, Template], ...] = (
    (("spec-mismatch",), "get_kv_quant_mode", quant_mode.quant_mode_test),
    (("spec-mismatch",), "kv_cache_spec", spec_page.spec_page_test),
    (layer_spec.KINDS, "MLAAttention.get_kv_cache_spec", layer_spec.layer_spec_test),
    (connector.KINDS, "register_kv_caches", connector.connector_test),
    (kernel_write.KINDS, "do_kv_cache_update", kernel_write.kernel_write_test),
    (block_copy.KINDS, "copy_kv_cache_blocks_inplace", block_copy.block_copy_test),
    (cpu_zero.KINDS, "_zero_block_ids", cpu_zero.cpu_zero_test),
    (zeroer_init.KINDS, "__init__", zeroer_init.zeroer_init_test),
    (triton_zero.KINDS, "zero_block_ids", triton_zero.triton_zero_test),
    (runner_compare.KINDS, "GPUModelRunner.initialize_kv_cache_tensors", runner_compare.runner_compare_test),
)
# The functions of the view path (and the planner ahead of it), where a finding's test checks the views or the refusal.
VIEW_FUNCTIONS = ("reshape", "_reshape_kv_cache", "_reshape_attention_kv_cache", "_update_hybrid_attention_layout",
                  "_update_hybrid_attention_mamba_layout", "_reshape_kv_cache_tensors", "create_kv_cache_views",
                  "compute_layout_strides", "allocate_kv_cache", "round_up", "map_kv_cache_to_kernel_blocks",
                  "map_kv_caches_to_kernel_blocks", "get_kv_cache_config_from_groups")


def view_test(finding: FindingFile, reach: Reach | None) -> Module:
    if finding.layout_placed:
        return placed_views.placed_views_test(finding, reach)
    return shaped_views.shaped_views_test(finding, reach)


# Templates that write one model runner walk (fuzz/export/walks.py): a finding affecting releases on both sides of 0.29,
# where the allocation changed, gets a module per walk, each skipping the other's releases.
ONE_WALK: tuple[Template, ...] = (block_copy.block_copy_test, connector.connector_test)


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
    for kinds, function, template in TEMPLATES:
        if finding.kind in kinds and finding.function == function:
            return template
    if finding.kind in INVALID_KINDS + VALID_KINDS and finding.function in VIEW_FUNCTIONS:
        return view_test
    raise NoTemplate(f"no exporter for {finding.kind} in {finding.function} yet")


def export_all(finding: FindingFile, reach: Reach | None) -> list[Exported]:
    """The finding's standalone test modules, oldest walk first: one, or one per walk (ONE_WALK); NoTemplate (one line)
    where kvfuzz cannot write them yet."""
    parts = walks.by_generation(finding) if template_for(finding) in ONE_WALK else [("", finding)]
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
