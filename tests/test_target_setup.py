"""What a target process needs from kvfuzz before it can fuzz: vLLM's compiled ops loaded once, and vLLM's config kept set."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

SETUP = textwrap.dedent("""
    import gc
    from fuzz.targets import load_local

    target = load_local()
    gc.collect()
    from vllm.config.vllm import get_current_vllm_config
    assert get_current_vllm_config() is target.config, "the target's config is no longer the current one"
    import vllm._C  # ROCm's platform module does this; on CPUs without AVX512-BF16 the ops came from _C_AVX2
    print("ready")
""")


def test_a_target_process_survives_vllm_c_imports_and_keeps_its_config():
    """Without the alias, torch aborts the process (the `_C` namespace registered twice) on x86 CPUs without AVX512-BF16,
    as CI's machines are; without holding the config context, backends that read the config (FlashAttention's kernel
    block sizes before 0.29) fail and drop out of the case space."""
    result = subprocess.run([sys.executable, "-c", SETUP], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ready" in result.stdout, result.stderr[-2000:]
