"""Template: the views vLLM 0.29+ gives each layer (`allocate_kv_cache` / `create_kv_cache_views` /
`compute_layout_strides`, and 0.32+'s kernel-block views): valid cases must get the oracle's views, invalid ones a
refusal."""

from __future__ import annotations

from fuzz.export import runner_steps, view_rules
from fuzz.export.code import CONFIG_FIXTURE, Module, docstring
from fuzz.export.expected import INVALID_KINDS
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach

PROBE = '''
    def release_contract():
        """The kvfuzz contract this vLLM's allocation follows, told apart as kvfuzz tells it: from 0.32 the runner binds
        kernel-block views to layers (AttentionGroup.map_kv_cache_to_kernel_blocks)."""
        return "placed-0.32" if hasattr(AttentionGroup, "map_kv_cache_to_kernel_blocks") else "placed-0.29"
'''


def placed_views_test(finding: FindingFile, reach: Reach | None) -> Module:
    case = finding.case
    groups = runner_steps.check_groups(finding, synthetic=True)
    module = Module(title=view_rules.title(finding, f"vLLM's KV-cache allocation ({case.layout})"))
    module.add(docstring(finding, reach, view_rules.what(finding)))
    module.add(runner_steps.constants(finding, groups))
    module.add(CONFIG_FIXTURE, "VllmConfig", "set_current_vllm_config", "current_platform")
    for group in groups:
        if group.synthetic_backend is not None:
            module.add(runner_steps.synthetic_class(group, module))
    body = runner_steps.steps(finding, reach, module, kernel_map=True)
    verb = "refuses" if finding.kind in INVALID_KINDS else "places"
    kinds = "_".join(dict.fromkeys(group.spec.kind for group in groups))
    view_rules.add_check(module, finding, f"test_allocation_{verb}_{case.layout.lower()}_{kinds}_caches", body, PROBE)
    return module
