"""What a target process needs from kvfuzz before it can fuzz: vLLM's compiled ops loaded once, and vLLM's config kept set."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

SETUP = textwrap.dedent("""
    import gc
    from fuzz.targets.loader import load_local

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


def test_a_vllm_spec_property_that_raises_when_kvfuzz_reads_it_is_vllm_failing():
    """kvfuzz reads each spec's page size after the walk; an exception there comes from vLLM's property (a mutant of
    `real_page_size_bytes` that names a field the spec class lacks, say) and is judged as vLLM's, never an internal error."""
    import os

    import vllm

    from fuzz.targets.base import Outcome
    from fuzz.targets.loader import load_local

    target = load_local()
    interface = os.path.join(os.path.dirname(vllm.__file__), "v1", "kv_cache_interface.py")
    namespace: dict = {}
    source = "class Spec:\n    @property\n    def page_size_bytes(self):\n        return self.head_size_v\n"
    exec(compile(source, interface, "exec"), namespace)  # a property whose frame lies in vLLM's package
    walked = Outcome()
    failed = target._with_spec_facts(walked, [(namespace["Spec"](), None)])
    assert (failed.error_type, failed.error_function) == ("AttributeError", "page_size_bytes")
    earlier = Outcome(error_type="RuntimeError", error_message="the walk failed first", error_function="allocate_kv_cache")
    assert target._with_spec_facts(earlier, [(namespace["Spec"](), None)]) is earlier
    with pytest.raises(AttributeError):  # a property outside vLLM failing is kvfuzz's own error
        target._with_spec_facts(walked, [(type("Own", (), {"page_size_bytes": property(lambda self: self.missing)})(), None)])
