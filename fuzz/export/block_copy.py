"""Template: copying block s to block d (`copy_kv_cache_blocks_inplace`, on vLLM 0.26 - 0.28's or 0.29+'s views) must give every
layer's block d the bytes its block s held, and change nothing else (`copy-escape` / `copy-wrong`)."""

from __future__ import annotations

from fuzz.checks.protocol import Check
from fuzz.export import view_rules, walks
from fuzz.export.code import Module, NoTemplate, docstring, indent
from fuzz.export.expected import expected_literal
from fuzz.export.finding import FindingFile, version_key
from fuzz.export.reach import Reach

COPY_HELPERS = '''
    def buffer_bytes(view):
        """The whole buffer a view lies in, as bytes."""
        raw = torch.empty(0, dtype=torch.uint8)
        raw.set_(view.untyped_storage())
        return raw


    def copy_faults(kv_caches, expected, before, buffers, src, dst):
        """What copying block `src` to `dst` left wrong: per layer tensor, how many bytes of its block `dst` do not hold
        what its block `src` held (and the first, as buffer and byte); and how many bytes outside every layer's block
        `dst` changed (and the first)."""
        wrong, targets = {}, {}
        for layer, tensors in expected.items():
            views = kv_caches[layer] if isinstance(kv_caches[layer], (list, tuple)) else [kv_caches[layer]]
            for index, (view, want) in enumerate(zip(views, tensors)):
                pointer = view.untyped_storage().data_ptr()
                source = torch.cat([before[pointer][start:end] for start, end in want["blocks"][src]])
                target = torch.cat([torch.arange(start, end) for start, end in want["blocks"][dst]])
                targets.setdefault(pointer, []).append(target)
                differ = (buffers[pointer][target] != source).nonzero().flatten()
                if differ.numel():
                    first = (list(buffers).index(pointer), int(target[differ[0]]))
                    wrong[f"{layer} (tensor {index})"] = (differ.numel(), first)
        escaped = None
        for number, (pointer, raw) in enumerate(buffers.items()):
            outside = torch.ones(raw.numel(), dtype=torch.bool)
            for target in targets.get(pointer, []):
                outside[target] = False
            changed = ((raw != before[pointer]) & outside).nonzero().flatten()
            if changed.numel() and escaped is None:
                escaped = (changed.numel(), (number, int(changed[0])))
        return wrong, escaped
'''

COPY_RULE = ("The rule (kvfuzz contract): block ids are the KV-cache manager's, one id for the same block of every layer, "
             "so copying block {src} to {dst} gives each layer's block {dst} exactly the bytes its block {src} held (the "
             "runs EXPECTED lists) and leaves every byte outside the layers' blocks {dst} as it was.")


def block_copy_test(finding: FindingFile, reach: Reach | None, check: Check) -> Module:
    case = finding.case
    copies = case.touches.copies if case.touches else ()
    if not copies:
        raise NoTemplate("the case names no block copy")
    placed = [version for version in finding.affected if version_key(version) >= version_key(walks.PLACED_FROM)]
    if case.runner != "v2" or (placed and not finding.layout_placed):
        raise NoTemplate("a block-copy module writes one walk, the V2 runner's of vLLM 0.26 - 0.28 or of 0.29+; this "
                         f"finding affects {', '.join(placed)} too (export_all writes one module per walk)")
    groups = walks.checked_groups(finding)
    src, dst = copies[0]
    kinds = list(dict.fromkeys(g.spec.kind for g in case.groups))
    module = Module(title=f"copy_kv_cache_blocks_inplace copying block {src} to {dst} of {'+'.join(kinds)} caches "
                          f"({case.layout}) writes other bytes than block {dst}'s")
    module.add(docstring(finding, reach, f"copying block {src} to {dst} must give every layer's block {dst} the bytes of its "
                                         f"block {src} and change nothing else."))
    module.add(walks.constants(finding, groups) + f"\nSRC, DST = {src}, {dst}  # the block copy")
    body, probe = walks.steps(finding, reach, module, groups)  # the runner copies in the views it keeps
    module.add(expected_literal(finding, blocks=sorted({src, dst})))
    module.add(COPY_HELPERS, "copy_kv_cache_blocks_inplace")
    check = "\n".join([
        "buffers = {}",
        "for view in kv_caches.values():",
        "    for tensor in view if isinstance(view, (list, tuple)) else [view]:",
        "        buffers.setdefault(tensor.untyped_storage().data_ptr(), buffer_bytes(tensor))",
        "generator = torch.Generator().manual_seed(0)",
        "for raw in buffers.values():",
        "    raw.copy_(torch.randint(0, 256, (raw.numel(),), generator=generator, dtype=torch.uint8))",
        "before = {pointer: raw.clone() for pointer, raw in buffers.items()}",
        "# The model runner hands over its layers' cache tensors (a Mamba layer's list of states is not one).",
        "copy_kv_cache_blocks_inplace([view for view in kv_caches.values() if isinstance(view, torch.Tensor)], NUM_BLOCKS,",
        "                             [(SRC, DST)])",
        "",
        view_rules.comment(COPY_RULE.format(src=src, dst=dst)),
        "wrong, escaped = copy_faults(kv_caches, EXPECTED[release_contract()], before, buffers, SRC, DST)",
        'assert escaped is None, (f"copying block {SRC} to {DST} changed {escaped[0]} bytes outside every layer\'s block {DST}, "',
        '                         f"the first at byte {escaped[1][1]} of buffer {escaped[1][0]}")',
        'assert not wrong, "; ".join(f"after copying block {SRC} to {DST}, {count} bytes of {layer}\'s block {DST} do not hold "',
        '                            f"its block {SRC}\'s, the first at byte {byte} of buffer {buffer}"',
        "                            for layer, (count, (buffer, byte)) in wrong.items())"])
    gate = view_rules.add_contract_gate(module, finding, probe)
    name = f"test_copying_block_{src}_to_{dst}_copies_each_layers_block_and_nothing_else"
    module.add(f"def {name}(vllm_config, monkeypatch):\n{gate}{body}\n\n{indent(check)}")
    return module
