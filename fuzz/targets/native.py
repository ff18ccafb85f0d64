"""vLLM's compiled kernels as a fuzzing process must see them: loaded once.

On an x86 CPU without AVX512-BF16, vLLM's CPU platform loads its kernels from `vllm/_C_AVX2` (or
`_C_AVX512`): the library registers torch's `_C` op namespace, but its import fails by design
(the module is named `_C`), so `vllm._C` stays unimported. Modules kvfuzz imports to find backends
(ROCm's platform, for one) then `import vllm._C`, which loads the AVX512-BF16 build on top, and
torch aborts the whole process on the namespace registered twice. On such machines no fuzzing
worker could start.
"""

from __future__ import annotations

import sys
from types import ModuleType


def _namespace_registered(namespace: str) -> bool:
    import torch

    prefix = f"{namespace}::"
    return any(name.startswith(prefix) for name in torch._C._dispatch_get_all_op_names())


def settle_kernel_library() -> bool:
    """Once the platform registered the `_C` ops from an ISA build, let `import vllm._C` find them
    instead of loading a second library. True when the alias was put in place."""
    if "vllm" not in sys.modules or "vllm._C" in sys.modules or not _namespace_registered("_C"):
        return False
    sys.modules["vllm._C"] = ModuleType("vllm._C", "vLLM's _C ops, registered by an ISA-specific build (see fuzz.targets.native)")
    return True
