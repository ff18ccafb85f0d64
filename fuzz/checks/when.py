"""When vLLM runs the code a block-addressing check drives: the zeroing rule and the CPU platform rule, with their sources.

The generator draws a check only on cases where vLLM would run its code (protocol.Check.unrealistic), and the minimizer
keeps it so; the checks themselves skip a walk where the config vLLM planned says otherwise.
"""

from __future__ import annotations

from fuzz.case import Case

# The block zeroers (fuzz/checks/zeroer.py, cpu_zero.py, cpu_zeroer.py) and when vLLM runs them: the worker builds its zeroer, and the scheduler
# hands out blocks to zero, only when the planned KVCacheConfig says needs_kv_cache_zeroing (gpu_worker.py, scheduler.py,
# 0.22 - 0.34). The consumers ask the config vLLM planned for the case; `zeroes` predicts it for the generator and the
# minimizer, so zeroers are drawn only on cases vLLM zeroes.
ZEROING_RULE = ("vLLM zeroes freed blocks only when KVCacheConfig.needs_kv_cache_zeroing holds: models with Mamba layers, "
                "and from 0.28 attention caches stored at more than one precision")


def zeroes(case: Case) -> bool:
    """Whether vLLM's plan for the case asks for zeroing (ZEROING_RULE): a Mamba group, or attention layers of more than one
    (storage dtype, quant mode). Releases before 0.28 count Mamba only; kvfuzz draws one precision per model there."""
    if any(group.spec.kind == "mamba" for group in case.groups):
        return True
    return len({(spec.dtype, spec.kv_quant_mode) for group in case.groups for spec in group.layer_specs}) > 1


# The CPU model runner's zeroers run only on the CPU platform, whose attention selector returns CPU_ATTN, CPU_MLA (from
# 0.28) or AMX_MLA (from 0.29) and nothing else (0.32.0 vllm/platforms/cpu.py get_attn_backend_cls: "if selected_backend and
# selected_backend != AttentionBackendEnum.CPU_ATTN: logger.info("Cannot use %s backend on CPU.", ...)", then
# "return AttentionBackendEnum.CPU_ATTN.get_path()"; MLA layers get AMX_MLA or CPU_MLA); from 0.30 DeepSeek V4's CPU model
# picks its own (models/deepseek_v4/cpu/cpu_mla.py: CPU_V4_MLA_SPARSE, CPU_V4_INDEXER). A synthetic backend is none of
# them: the selector never returns a backend of kernel block sizes and layouts kvfuzz made up, so the CPU runner never sees
# its views (a synthetic backend once stood for any, and drew the CPU zeroer over two full-attention groups of different
# pages at one pool position, which no CPU backend builds: tests/test_triage_fixes.py).
CPU_BACKENDS = ("CPU_ATTN", "CPU_MLA", "AMX_MLA", "CPU_V4_MLA_SPARSE", "CPU_V4_INDEXER")
CPU_RULE = "the CPU model runner runs only on the CPU platform, whose attention backends are " + ", ".join(CPU_BACKENDS)


def on_cpu(case: Case) -> bool:
    """Whether a CPU deployment could build the case (CPU_RULE): every attention group on a backend the CPU platform selects
    (no synthetic one), and no ROCm."""
    if case.platform == "rocm":
        return False
    return all(group.backend in CPU_BACKENDS for group in case.groups if group.spec.kind != "mamba")
