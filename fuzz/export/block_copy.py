"""Template: copying block s to block d (`copy_kv_cache_blocks_inplace`, on vLLM 0.26 - 0.28's or 0.29+'s views) must give every
layer's block d the bytes its block s held, and change nothing else (`copy-escape` / `copy-wrong`)."""

from __future__ import annotations

from fuzz.export import view_rules, walks
from fuzz.export.code import Module, NoTemplate, docstring, indent
from fuzz.export.expected import expected_literal
from fuzz.export.finding import FindingFile, version_key
from fuzz.export.reach import Reach

KINDS = ("copy-escape", "copy-wrong")

COPY_HELPERS = '''
    def buffer_bytes(view):
        """The whole buffer a view lies in, as bytes."""
        raw = torch.empty(0, dtype=torch.uint8)
        raw.set_(view.untyped_storage())
        return raw


    def after_copy(kv_caches, expected, before, src, dst):
        """Each buffer as it must be after copying block `src` to `dst`: every layer's tensors' block `dst` bytes hold
        what their block `src` bytes held, in order; every other byte as it was."""
        wanted = {pointer: raw.clone() for pointer, raw in before.items()}
        for layer, tensors in expected.items():
            views = kv_caches[layer] if isinstance(kv_caches[layer], (list, tuple)) else [kv_caches[layer]]
            for view, want in zip(views, tensors):
                pointer = view.untyped_storage().data_ptr()
                source = torch.cat([before[pointer][start:end] for start, end in want["blocks"][src]])
                target = torch.cat([torch.arange(start, end) for start, end in want["blocks"][dst]])
                wanted[pointer][target] = source
        return wanted
'''

COPY_RULE = ("The rule (kvfuzz contract): block ids are the KV-cache manager's, one id for the same block of every layer, "
             "so copying block {src} to {dst} gives each layer's block {dst} exactly the bytes its block {src} held (the "
             "runs EXPECTED lists) and leaves every other byte of every buffer as it was.")


def block_copy_test(finding: FindingFile, reach: Reach | None) -> Module:
    case = finding.case
    copies = case.touches.copies if case.touches else ()
    if not copies:
        raise NoTemplate("the case names no block copy")
    placed = [version for version in finding.affected if version_key(version) >= version_key("0.29.0")]
    if case.runner != "v2" or (placed and not finding.layout_placed):
        raise NoTemplate("the block-copy exporter writes one walk, the V2 runner's of vLLM 0.26 - 0.28 or of 0.29+; this "
                         f"finding affects {', '.join(placed)} too")
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
        "wanted = after_copy(kv_caches, EXPECTED[release_contract()], before, SRC, DST)",
        "for index, (pointer, raw) in enumerate(buffers.items()):",
        "    wrong = (raw != wanted[pointer]).nonzero().flatten().tolist()",
        '    assert not wrong, (f"after copying block {SRC} to {DST}, {len(wrong)} bytes of buffer {index} are not what the "',
        '                       f"copy must leave there, the first at byte {wrong[0]}")'])
    gate = view_rules.add_contract_gate(module, finding, probe)
    name = f"test_copying_block_{src}_to_{dst}_copies_each_layers_block_and_nothing_else"
    module.add(f"def {name}(vllm_config, monkeypatch):\n{gate}{body}\n\n{indent(check)}")
    return module
