"""Template: the CPU model runner zeroing block b (`CPUModelRunner._zero_block_ids` on vLLM 0.29 - 0.33's views, 0.34's
`CPUKVBlockZeroer`, where the fix shows) must clear every byte block b owns in each full-attention layer and change no
byte outside block b (`zero-miss` / `zero-escape`)."""

from __future__ import annotations

from fuzz.checks.protocol import Check
from fuzz.export import runner_steps, view_rules, zeroing
from fuzz.export.code import BOUND_LAYER, CONFIG_FIXTURE, Module, NoTemplate, docstring, indent
from fuzz.export.finding import FindingFile
from fuzz.export.placed_views import PROBE
from fuzz.export.reach import Reach

RUNNER = '''
    def zero_block(kv_cache_config, kv_caches, attn_groups, kernel_block_sizes, block):
        """The CPU runner of this release zeroing `block`, its layers bound to `kv_caches`: CPUModelRunner._zero_block_ids
        on a runner built as vLLM's worker tests build one (object.__new__ and only what the method reads), or, from
        0.34, the CPUKVBlockZeroer the runner builds."""
        layers = {name: BoundLayer(view) for name, view in kv_caches.items()}
        if CPUModelRunner is not None:
            runner = object.__new__(CPUModelRunner)
            runner.kv_cache_config = kv_cache_config
            runner.compilation_config = types.SimpleNamespace(static_forward_context=layers)
            runner._zero_block_ids([block])
        elif CPUKVBlockZeroer is not None:
            zeroer = CPUKVBlockZeroer(torch.device("cpu"), attn_groups_iter=(group for groups in attn_groups for group in groups),
                                      kernel_block_sizes=kernel_block_sizes, static_forward_context=layers,
                                      num_blocks=kv_cache_config.num_blocks)
            zeroer.zero_block_ids([block])
        else:
            pytest.skip("this vLLM has no CPU block zeroer kvfuzz knows")
'''

def cpu_zero_test(finding: FindingFile, reach: Reach | None, check: Check) -> Module:
    case = finding.case
    if not case.touches or check.name not in case.touches.consumers or not case.touches.blocks:
        raise NoTemplate("the zeroing exporter covers the CPU model runner's _zero_block_ids only")
    groups = runner_steps.check_groups(finding)
    block = case.touches.blocks[0]
    kinds = "+".join(dict.fromkeys(group.spec.kind for group in groups))
    module = Module(title=f"CPUModelRunner._zero_block_ids zeroing block {block} of {kinds} caches ({case.layout}) "
                          f"{'leaves bytes of the block uncleared' if finding.kind == 'zero-miss' else 'clears bytes of another block'}")
    module.add(docstring(finding, reach, f"zeroing block {block} must clear all of block {block} in every full-attention "
                                         "layer and nothing else."))
    module.add(runner_steps.constants(finding, groups) + f"\nBLOCK = {block}  # the block the scheduler asks to zero")
    module.add(CONFIG_FIXTURE, "VllmConfig", "set_current_vllm_config", "current_platform")
    module.add(BOUND_LAYER)
    module.add(RUNNER)
    module.add(zeroing.CHECK)
    module.add(zeroing.zeroing_literal(finding, block, check.exported_with()))  # type: ignore[attr-defined]
    body = runner_steps.steps(finding, reach, module, kernel_map=True)
    module.names.update(("CPUModelRunner", "CPUKVBlockZeroer"))
    check = "\n".join([
        "if not getattr(kv_cache_config, \"needs_kv_cache_zeroing\", True):",
        "    pytest.skip(\"vLLM zeroes no block of this model (KVCacheConfig.needs_kv_cache_zeroing is False)\")",
        view_rules.comment(zeroing.RULE.format(block=block, layers="full-attention layer")),
        "check_zeroing(kv_caches, ZEROING[release_contract()], BLOCK,",
        "              lambda: zero_block(kv_cache_config, kv_caches, attn_groups, kernel_block_sizes, BLOCK))"])
    gate = view_rules.add_contract_gate(module, finding, PROBE)
    name = f"test_zeroing_block_{block}_clears_it_in_every_full_attention_layer_and_nothing_else"
    module.add(f"def {name}(vllm_config, monkeypatch):\n{gate}{body}\n\n{indent(check)}")
    return module
