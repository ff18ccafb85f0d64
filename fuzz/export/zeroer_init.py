"""Template: the block zeroer the model runner builds at start-up (`KVBlockZeroer.__init__` over vLLM 0.23 - 0.28's
views) must build for a model vLLM runs (`crash-on-valid` / `refused-valid` in `__init__`). Only the constructor
runs: its tables are plain Python, so no Triton kernel is needed."""

from __future__ import annotations

from fuzz.checks.protocol import Check
from fuzz.export import shaped_steps, view_rules
from fuzz.export.code import BOUND_LAYER, Module, NoTemplate, docstring, indent
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach

ZEROER = '''
    def build_zeroer(kv_caches, attn_groups, kernel_block_sizes, cache_dtype):
        """The block zeroer as the model runner builds it once its layers hold their views (_init_kv_zero_meta), with
        the arguments this release's KVBlockZeroer takes."""
        values = {
            "attn_groups_iter": (group for groups in attn_groups for group in groups),
            "kernel_block_sizes": kernel_block_sizes, "cache_dtype": cache_dtype,
            "static_forward_context": {name: BoundLayer(view) for name, view in kv_caches.items()},
            "runner_only_attn_layers": set(SHARED_LAYERS), "num_blocks": NUM_BLOCKS, "pin_memory": False,
        }
        parameters = inspect.signature(KVBlockZeroer).parameters
        if "attn_groups_iter" not in parameters:
            pytest.skip("this release's KVBlockZeroer builds its tables apart (init_meta, vLLM 0.19 - 0.22)")
        return KVBlockZeroer(torch.device("cpu"), **{name: value for name, value in values.items() if name in parameters})
'''

RULE = ("The rule (kvfuzz contract): vLLM runs this model, and its runner builds the block zeroer at start-up whenever the "
        "planned KV cache needs zeroing; the zeroer must take the views the runner gives the layers (one manager block is "
        "its kernel blocks, however the views lay them out) and build.")


def zeroer_init_test(finding: FindingFile, reach: Reach | None, check: Check) -> Module:
    case = finding.case
    if not case.touches or check.name not in case.touches.consumers:
        raise NoTemplate("the zeroer-constructor exporter covers KVBlockZeroer only")
    if finding.layout_placed:
        raise NoTemplate("the zeroer-constructor exporter writes vLLM 0.23 - 0.28's views only")
    kinds = "+".join(dict.fromkeys(group.spec.kind for group in case.groups))
    module = Module(title=f"KVBlockZeroer fails to build for {kinds} caches ({case.layout}) of a model vLLM runs")
    module.add(docstring(finding, reach, "the block zeroer the model runner builds at start-up must build."))
    module.add(shaped_steps.constants(finding))
    body = shaped_steps.walk(finding, module)
    module.add(BOUND_LAYER)
    module.add(ZEROER, "KVBlockZeroer")
    cache_dtype = next((g.spec.cache_dtype for g in case.groups if g.spec.kind != "mamba"), "auto")
    check = "\n".join([
        'if not getattr(kv_cache_config, "needs_kv_cache_zeroing", True):',
        '    pytest.skip("vLLM zeroes no block of this model (KVCacheConfig.needs_kv_cache_zeroing is False)")',
        view_rules.comment(RULE),
        f'build_zeroer(kv_caches, attn_groups, kernel_block_sizes, "{cache_dtype}")'])
    gate = view_rules.add_contract_gate(module, finding, shaped_steps.PROBE)
    module.add(f"def test_the_runners_block_zeroer_builds(vllm_config, monkeypatch):\n{gate}{body}\n\n{indent(check)}")
    return module
