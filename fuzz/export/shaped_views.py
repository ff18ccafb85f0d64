"""Template: the views vLLM 0.19 - 0.28's model runners give each layer (the V2 runner's `_reshape_kv_cache`, its
`_reshape_attention_kv_cache` and `_update_hybrid_attention_layout`; the V1 runner's `_reshape_kv_cache_tensors`): valid
cases must get the oracle's views, invalid ones a refusal."""

from __future__ import annotations

from fuzz.export import shaped_steps, view_rules
from fuzz.export.code import Module, docstring
from fuzz.export.expected import INVALID_KINDS
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach


def shaped_views_test(finding: FindingFile, reach: Reach | None) -> Module:
    case = finding.case
    shaped_steps.check_case(finding)
    kinds = list(dict.fromkeys(g.spec.kind for g in case.groups))
    where = "the V1 model runner's _reshape_kv_cache_tensors" if case.runner == "v1" else "_reshape_kv_cache"
    module = Module(title=view_rules.title(finding, f"{where} ({'+'.join(kinds)}, {case.layout})"))
    module.add(docstring(finding, reach, view_rules.what(finding)))
    module.add(shaped_steps.constants(finding))
    body = shaped_steps.walk(finding, module)
    verb = "refuses" if finding.kind in INVALID_KINDS else "views"
    runner = "v1_runner" if case.runner == "v1" else "reshape_kv_cache"
    view_rules.add_check(module, finding, f"test_{runner}_{verb}_{'_'.join(kinds)}_caches", body, shaped_steps.PROBE)
    return module
