"""Which template exports which finding: by the finding's kind and the vLLM function it names."""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

from fuzz.export import connector, kernel_write, quant_mode
from fuzz.export.code import Module, NoTemplate
from fuzz.export.finding import FindingFile
from fuzz.export.imports import import_block
from fuzz.export.reach import Reach

Template = Callable[[FindingFile, "Reach | None"], Module]

# (kinds, function) -> template; the first match wins.
TEMPLATES: tuple[tuple[tuple[str, ...], str, Template], ...] = (
    (("spec-mismatch",), "get_kv_quant_mode", quant_mode.quant_mode_test),
    (connector.KINDS, "register_kv_caches", connector.connector_test),
    (kernel_write.KINDS, "do_kv_cache_update", kernel_write.kernel_write_test),
)


@dataclass(frozen=True)
class Exported:
    finding: FindingFile
    source: str  # the test module's text
    title: str  # what the test checks, one sentence

    @property
    def file_name(self) -> str:
        return self.finding.module_name + ".py"


def template_for(finding: FindingFile) -> Template:
    for kinds, function, template in TEMPLATES:
        if finding.kind in kinds and finding.function == function:
            return template
    raise NoTemplate(f"no exporter for {finding.kind} in {finding.function} yet")


def export(finding: FindingFile, reach: Reach | None) -> Exported:
    """The finding's standalone test module; NoTemplate (one line) where kvfuzz cannot write one yet."""
    module = template_for(finding)(finding, reach)
    head, *rest = module.parts
    body = "\n".join(rest)
    stdlib = tuple(name for name in ("sys", "types") if f"{name}." in body)
    source = "\n\n".join([head, import_block(module.names, stdlib), *rest[:1]]) + "\n\n\n" + "\n\n\n".join(rest[1:]) + "\n"
    ast.parse(source)  # a template that writes broken Python is kvfuzz's bug: fail here, not in a maintainer's suite
    return Exported(finding, source, module.title)
