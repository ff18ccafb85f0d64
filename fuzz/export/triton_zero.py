"""Template: the block zeroer the model runner builds (`KVBlockZeroer` over vLLM 0.23 - 0.28's views) zeroing block b must
clear every byte block b owns in each attention layer that allocates a cache and change no byte outside block b
(`zero-miss` / `zero-escape`). Its `zero_block_ids` launches a Triton kernel: compiled where Triton has a GPU, else run
under Triton's interpreter (the module re-jits vLLM's kernel when TRITON_INTERPRET=1, and skips without either)."""

from __future__ import annotations

from fuzz.checks.protocol import Check
from fuzz.export import shaped_steps, view_rules, zeroing
from fuzz.export.code import BOUND_LAYER, Module, NoTemplate, docstring, indent
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach
from fuzz.export.zeroer_init import ZEROER

KERNEL = "_zero_kv_blocks_kernel"

RUNNABLE = '''
    def kernel_runnable_here(monkeypatch, module, name):
        """vLLM's Triton kernel `name` of `module`, runnable on this machine: left as it is where Triton compiled it (a
        GPU); a CPU build's `@triton.jit` is a placeholder that returns the plain function, which is jitted again for
        Triton's interpreter when the test runs with TRITON_INTERPRET=1 (set before Triton is first imported)."""
        kernel = getattr(module, name)
        if not isinstance(kernel, types.FunctionType):
            return
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip(f"{name} needs a GPU, or Triton's interpreter (TRITON_INTERPRET=1)")
        triton = pytest.importorskip("triton")
        import triton.language as tl

        clone = types.FunctionType(kernel.__code__, {**kernel.__globals__, "triton": triton, "tl": tl}, kernel.__name__,
                                   kernel.__defaults__, kernel.__closure__)
        clone.__module__, clone.__qualname__ = kernel.__module__, kernel.__qualname__
        monkeypatch.setattr(module, name, triton.jit(clone))
'''


STORES_INSIDE = '''
    def guard_stores(monkeypatch, kv_caches):
        """Under Triton's interpreter a kernel writes this process's memory: a store aimed outside every buffer of the cache
        is dropped (it would corrupt the heap) and its bytes counted in the list returned. Where Triton compiled the kernel
        (a GPU) nothing is guarded: such a store is the GPU's illegal memory access."""
        stray = [0]
        if os.environ.get("TRITON_INTERPRET") != "1":
            return stray
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

        bounds = set()
        for view in kv_caches.values():
            for tensor in view if isinstance(view, (list, tuple)) else [view]:
                storage = tensor.untyped_storage()
                bounds.add((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        store = InterpreterBuilder.create_masked_store

        def kept_inside(self, ptrs, value, mask, cache_policy):
            size = value.data.dtype.itemsize
            wanted = mask.data.astype(bool)
            addresses = ptrs.data[wanted]
            inside = None
            for start, end in bounds:
                here = (addresses >= start) & (addresses + size <= end)
                inside = here if inside is None else inside | here
            stray[0] += int((~inside).sum()) * size
            kept = wanted.copy()
            kept[wanted] = inside
            return store(self, ptrs, value, TensorHandle(kept, mask.dtype), cache_policy)

        monkeypatch.setattr(InterpreterBuilder, "create_masked_store", kept_inside)
        return stray
'''


def triton_zero_test(finding: FindingFile, reach: Reach | None, check: Check) -> Module:
    case = finding.case
    if not case.touches or check.name not in case.touches.consumers or not case.touches.blocks:
        raise NoTemplate("the Triton zeroing exporter covers KVBlockZeroer.zero_block_ids only")
    if finding.layout_placed:
        raise NoTemplate("the Triton zeroing exporter writes vLLM 0.23 - 0.28's views only")
    block = case.touches.blocks[0]
    kinds = "+".join(dict.fromkeys(group.spec.kind for group in case.groups))
    outcome = "leaves bytes of the block uncleared" if finding.kind == "zero-miss" else "clears bytes of another block"
    module = Module(title=f"KVBlockZeroer zeroing block {block} of {kinds} caches ({case.layout}) {outcome}")
    module.add(docstring(finding, reach, f"zeroing block {block} must clear all of block {block} in every attention layer "
                                         "that allocates a cache, and nothing else."))
    module.add(shaped_steps.constants(finding) + f"\nBLOCK = {block}  # the block the scheduler asks to zero")
    body = shaped_steps.walk(finding, module)
    module.add(BOUND_LAYER)
    module.add(ZEROER, "KVBlockZeroer")
    module.add(RUNNABLE)
    module.add(STORES_INSIDE)
    module.add(zeroing.CHECK)
    module.add(zeroing.zeroing_literal(finding, block, check.exported_with()))  # type: ignore[attr-defined]
    cache_dtype = next((g.spec.cache_dtype for g in case.groups if g.spec.kind != "mamba"), "auto")
    check = "\n".join([
        'if not getattr(kv_cache_config, "needs_kv_cache_zeroing", True):',
        '    pytest.skip("vLLM zeroes no block of this model (KVCacheConfig.needs_kv_cache_zeroing is False)")',
        f'zeroer = build_zeroer(kv_caches, attn_groups, kernel_block_sizes, "{cache_dtype}")',
        f'kernel_runnable_here(monkeypatch, sys.modules[KVBlockZeroer.__module__], "{KERNEL}")',
        "stray = guard_stores(monkeypatch, kv_caches)",
        "",
        "def zero():",
        "    zeroer.zero_block_ids([BLOCK])",
        '    assert not stray[0], f"zeroing block {BLOCK} stores {stray[0]} bytes outside every buffer of the cache"',
        "",
        view_rules.comment(zeroing.RULE.format(block=block, layers="attention layer that allocates a cache")),
        "check_zeroing(kv_caches, ZEROING[release_contract()], BLOCK, zero)"])
    gate = view_rules.add_contract_gate(module, finding, shaped_steps.PROBE)
    name = f"test_zeroing_block_{block}_clears_it_in_every_attention_layer_and_nothing_else"
    module.add(f"def {name}(vllm_config, monkeypatch):\n{gate}{body}\n\n{indent(check)}")
    return module
