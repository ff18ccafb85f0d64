"""Template: the CPU model runner zeroing block b (`CPUModelRunner._zero_block_ids` on vLLM 0.29 - 0.33's views, 0.34's
`CPUKVBlockZeroer`, where the fix shows) must clear every byte block b owns in each full-attention layer and change no
byte outside block b (`zero-miss` / `zero-escape`)."""

from __future__ import annotations

from fuzz.export import runner_steps, view_rules
from fuzz.export.code import BOUND_LAYER, CONFIG_FIXTURE, Module, NoTemplate, docstring, indent
from fuzz.export.expected import contracts, expectation
from fuzz.export.finding import FindingFile
from fuzz.export.placed_views import PROBE
from fuzz.export.reach import Reach
from oracles import touch

KINDS = ("zero-miss", "zero-escape")

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


    def backing_bytes(kv_caches):
        """The one backing buffer every view lies in, as bytes."""
        view = next(iter(kv_caches.values()))
        view = view[0] if isinstance(view, (list, tuple)) else view
        raw = torch.empty(0, dtype=torch.uint8)
        raw.set_(view.untyped_storage())
        return raw


    def offsets(byte_runs):
        return torch.cat([torch.arange(start, end) for start, end in byte_runs]) if byte_runs else torch.zeros(0, dtype=torch.long)
'''

RULE = ("The rule (kvfuzz contract): block ids are the KV-cache manager's, one id for the same block of every layer (a "
        "block split into kernel blocks is all of them), and the zeroer exists so a freed block starts clean: zeroing "
        "block {block} clears every byte block {block} owns in each full-attention layer (ZEROING's must_clear) and changes "
        "no byte outside block {block}'s pages and their alignment tails (may_change; under a block-outermost layout, "
        "block {block}'s whole row).")


def cpu_zero_test(finding: FindingFile, reach: Reach | None) -> Module:
    case = finding.case
    if not case.touches or "cpu-zero" not in case.touches.consumers or not case.touches.blocks:
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
    module.add(zeroing_literal(finding, block))
    body = runner_steps.steps(finding, reach, module, kernel_map=True)
    module.names.update(("CPUModelRunner", "CPUKVBlockZeroer"))
    check = "\n".join([
        "if not getattr(kv_cache_config, \"needs_kv_cache_zeroing\", True):",
        "    pytest.skip(\"vLLM zeroes no block of this model (KVCacheConfig.needs_kv_cache_zeroing is False)\")",
        "raw = backing_bytes(kv_caches)",
        "raw.copy_(torch.randint(1, 256, (raw.numel(),), generator=torch.Generator().manual_seed(0), dtype=torch.uint8))",
        "before = raw.clone()",
        "zero_block(kv_cache_config, kv_caches, attn_groups, kernel_block_sizes, BLOCK)",
        "",
        view_rules.comment(RULE.format(block=block)),
        "want = ZEROING[release_contract()]",
        "changed = (raw != before).nonzero().flatten()",
        "allowed = torch.zeros(raw.numel(), dtype=torch.bool)",
        "allowed[offsets(want[\"may_change\"])] = True",
        "outside = changed[~allowed[changed]].tolist()",
        "assert not outside, f\"zeroing block {BLOCK} changed {len(outside)} bytes outside it, the first at byte {outside[0]}\"",
        "must_clear = offsets(want[\"must_clear\"])",
        "left = must_clear[raw[must_clear] != 0].tolist()",
        "assert not left, f\"zeroing block {BLOCK} left {len(left)} of its bytes uncleared, the first at byte {left[0]}\""])
    gate = view_rules.add_contract_gate(module, finding, PROBE)
    name = f"test_zeroing_block_{block}_clears_it_in_every_full_attention_layer_and_nothing_else"
    module.add(f"def {name}(vllm_config, monkeypatch):\n{gate}{body}\n\n{indent(check)}")
    return module


def zeroing_literal(finding: FindingFile, block: int) -> str:
    """`ZEROING = {...}`: per contract, the byte runs of the backing buffer zeroing `block` must clear and may change."""
    lines = ["# What zeroing the block must do (kvfuzz's oracle for this case), under each contract: the [start, end) byte",
             "# runs of the one backing buffer it must clear and those it may change.", "ZEROING = {"]
    for contract in contracts(finding):
        expected = expectation(finding, contract)
        if not expected.accepted:
            raise NoTemplate(f"the oracle rejects the case under {contract} ({expected.reject_reason}): nothing to zero")
        layers = touch.zeroed_layers(finding.case, expected, "cpu-zero")
        if layers != touch.zeroed_layers(finding.case, expected, "cpu-zeroer"):
            raise NoTemplate("0.34's CPUKVBlockZeroer clears other layers than the CPU runner before it, for this case")
        must = touch.owned(expected, layers, block)
        may = touch.tile(finding.case, expected, block)
        if set(must) | set(may) != {0}:
            raise NoTemplate("the zeroing exporter expects one backing buffer (vLLM 0.29+)")
        lines.append(f'    "{contract}": {{"must_clear": {_runs(must[0])}, "may_change": {_runs(may[0])}}},')
    return "\n".join(lines + ["}"])


def _runs(spans: touch.Spans) -> list[tuple[int, int]]:
    return [(int(start), int(end)) for start, end in zip(spans.starts, spans.ends, strict=True)]
