"""Template: a backend's own cache write must put token t of block b where the layer's view puts it
(`kernel-crash` / `kernel-write` in `do_kv_cache_update`), or vLLM must refuse the layout up front."""

from __future__ import annotations

import textwrap

from fuzz.checks.protocol import Check
from fuzz.export import runner_steps
from fuzz.export.code import CONFIG_FIXTURE, Module, NoTemplate, docstring, indent
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach

# MLA backends whose cache write runs on a CPU: (latent rank, rope dims) of the 576-wide cache they store.
MLA_WRITERS = {"CPU_MLA": (512, 64)}


def kernel_write_test(finding: FindingFile, reach: Reach | None, check: Check) -> Module:
    case = finding.case
    if not any(group.spec.kind == "mla" for group in case.groups):
        from fuzz.export.cache_write import cache_write_test  # an attention layer's write: (key, value) of one head size

        return cache_write_test(finding, reach, check)
    group = runner_steps.check_case(finding)
    if group.backend not in MLA_WRITERS or group.spec.kind != "mla" or group.spec.cache_dtype != "auto":
        raise NoTemplate(f"the cache-write exporter covers {', '.join(MLA_WRITERS)} with unquantized caches only")
    tokens = case.touches.tokens if case.touches else ()
    if not tokens:
        raise NoTemplate("the case names no token to write")
    block, position = tokens[0]
    position %= group.spec.block_size
    rank, rope = MLA_WRITERS[group.backend]
    if rank + rope != group.spec.head_size:
        raise NoTemplate(f"{group.backend} stores {rank + rope}-wide latent heads; the case has {group.spec.head_size}")
    module = Module(title=f"{group.backend}'s cache write breaks on the {case.layout} layout vLLM accepts for it")
    module.add(docstring(finding, reach, f"{group.backend}'s cache write must put token {position} of block {block} where the "
                                         "layer's view puts it (or vLLM must refuse the layout)."))
    module.add(runner_steps.constants(finding, [group]) + f"\nBLOCK, POSITION = {block}, {position}  # the token written"
               f"\nKV_LORA_RANK, ROPE_DIM = {rank}, {rope}")
    module.add(CONFIG_FIXTURE, "VllmConfig", "set_current_vllm_config", "current_platform")
    body = runner_steps.steps(finding, reach, module, refusal_ok=True)
    check = f'''
        # An MLA layer binds its cache without the head axis (one latent head per token).
        kv_cache = kv_caches[LAYERS[0]].squeeze(1)
        before = [view.clone() for view in kv_caches.values()]
        latent = torch.randn(1, KV_LORA_RANK).to(torch.{group.spec.dtype})
        rope = torch.randn(1, 1, ROPE_DIM).to(torch.{group.spec.dtype})
        slot_mapping = torch.tensor([BLOCK * {group.spec.block_size} + POSITION])
        # do_kv_cache_update reads nothing of the impl it is called on.
        impl = object.__new__(backend.get_impl_cls())
        impl.do_kv_cache_update(latent, rope, kv_cache, slot_mapping, "auto", torch.ones(()))

        # The rule (kvfuzz contract): the kernel is handed the view vLLM built for the layer, so token t of block b lives
        # where that view puts it, whatever its strides; a kernel that needs a dense cache must refuse other strides.
        assert torch.equal(kv_cache[BLOCK, POSITION], torch.cat([latent[0], rope[0, 0]])), "the token is not where the view puts it"
        kv_cache[BLOCK, POSITION] = 0
        before[0].squeeze(1)[BLOCK, POSITION] = 0
        changed = [name for name, view, old in zip(kv_caches, kv_caches.values(), before) if not torch.equal(view, old)]
        assert not changed, f"the write changed other bytes of {{changed}}"
    '''
    name = f"test_{group.backend.lower()}_cache_write_lands_where_the_view_puts_it"
    module.add(f"def {name}(vllm_config, monkeypatch):\n{body}\n\n" + indent(textwrap.dedent(check).strip("\n")))
    return module
