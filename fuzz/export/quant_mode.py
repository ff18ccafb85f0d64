"""Template: a cache dtype must map to the quant mode it asks for (`spec-mismatch` in `get_kv_quant_mode`)."""

from __future__ import annotations

from fuzz.export.code import Module, NoTemplate, docstring
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach


def quant_mode_test(finding: FindingFile, reach: Reach | None) -> Module:
    spec = finding.case.groups[0].spec
    if not spec.registered_cache_dtype:
        raise NoTemplate("the quant-mode exporter covers cache dtypes registered with a dtype handler only")
    mode = spec.kv_quant_mode.upper()
    module = Module(title=f"a registered cache dtype asking for KVQuantMode.{mode} gets another mode")
    module.add(docstring(finding, reach, f"a registered cache dtype asking for KVQuantMode.{mode} must get {mode}."))
    module.add(f'''
        CACHE_DTYPE = "{spec.cache_dtype}"
        STORAGE_DTYPE = torch.{spec.dtype}


        @register_kv_cache_dtype(CACHE_DTYPE)
        class AsksFor{mode.title().replace("_", "")}:
            """A platform's own cache dtype whose backend picks its kernels itself."""

            name = CACHE_DTYPE

            def torch_dtype(self):
                return STORAGE_DTYPE

            def quant_mode(self):
                return KVQuantMode.{mode}
    ''', "register_kv_cache_dtype", "KVQuantMode")
    module.add(f'''
        def test_registered_cache_dtype_gets_the_mode_its_handler_returns():
            # The dtype-handler contract (KVCacheDTypeHandler.quant_mode in vllm/config/cache.py): the mode a handler
            # returns is the dtype's mode. {mode} is a mode of its own, so it must not read as any other member: a backend
            # branching on the mode (is_octave, is_turboquant, ...) would otherwise size and run the cache as that one.
            mode = get_kv_quant_mode(CACHE_DTYPE)
            assert mode.name == "{mode}", f"{{CACHE_DTYPE}} asked for KVQuantMode.{mode} and got KVQuantMode.{{mode.name}} ({{int(mode)}})"
            others = [name for name, member in KVQuantMode.__members__.items() if name != "{mode}" and member == KVQuantMode.{mode}]
            assert not others, f"KVQuantMode.{mode} shares its value with {{others}}, so the enum cannot tell them apart"
    ''', "get_kv_quant_mode")
    return module
