"""Template: a spec must size its page as its cache dtype's definition does (`spec-mismatch` in `kv_cache_spec`: the
page before padding of a spec built for a quantized cache)."""

from __future__ import annotations

import textwrap

from fuzz.export import runner_steps
from fuzz.export.code import Module, NoTemplate, docstring, indent, one_group, spec_call, spec_names
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach
from oracles import pages


def spec_page_test(finding: FindingFile, reach: Reach | None) -> Module:
    case = finding.case
    synthetic = len(case.groups) == 1 and case.groups[0].synthetic_backend is not None
    group = case.groups[0] if synthetic else one_group(case)  # a synthetic backend publishes the spec as it is given
    spec = group.spec
    definition = pages.dtype_definition(spec)
    expected = pages.defined_unpadded_bytes(spec)
    if definition is None or expected is None or spec.registered_cache_dtype or spec.page_size_padded is not None:
        raise NoTemplate("the spec-page exporter covers unpadded specs of the cache dtypes the oracle defines")
    call = spec_call(spec, placed=finding.layout_placed)
    cls = call.split("(")[0]
    mode = spec.kv_quant_mode.upper()
    heads, states = pages.heads(spec), pages.states(spec, spec.block_size)
    content = pages.defined_content_bytes(spec)
    module = Module(title=f"{cls} sizes pages of cache dtype {spec.cache_dtype} otherwise than the dtype stores them")
    module.add(docstring(finding, reach, f"a {cls} of cache dtype {spec.cache_dtype} must size its page as the dtype stores it."))
    module.add(f'''
        BACKEND = "{group.backend or 'a platform plugin'}"
        CACHE_DTYPE = "{spec.cache_dtype}"
        # What a page before padding holds by the cache dtype's layout.
        EXPECTED_PAGE_BYTES = {expected}
    ''')
    rule = textwrap.wrap(f"The rule (the cache dtype's layout as kvfuzz's oracle defines it): {definition.source}; so one token "
                         f"of one KV head takes {content} bytes, and a block of {spec.block_size} tokens x {heads} KV head(s) "
                         f"({states} states) takes {expected}.", 104)
    body = [f'if "{mode}" not in KVQuantMode.__members__:', f'    pytest.skip("this vLLM has no KVQuantMode.{mode}")',
            *([] if synthetic else runner_steps.shipped_backend("backend", "BACKEND", group.backend, module)),
            *(['if hasattr(AttentionBackend, "customize_spec"):',
               '    pytest.skip("from vLLM 0.28 a backend publishes its quantized page (customize_spec), a plugin\'s own code")',
               "# The spec as the layer builds it (a plugin backend that keeps it publishes it so).", f"spec = {call}"] if synthetic else
              ["# The spec as the layer builds it, then as its backend publishes it (customize_spec, vLLM 0.28+).",
               f"spec = customize_attention_spec(backend, {call})"]),
            *(f"# {line}" for line in rule),
            'page = getattr(spec, "unpadded_page_size_bytes", None)  # vLLM 0.28+; page_size_bytes before',
            "page = spec.page_size_bytes if page is None else page",
            f'assert page == EXPECTED_PAGE_BYTES, f"a {{CACHE_DTYPE}} page of {cls} is {{page}} bytes before padding, '
            f'not {{EXPECTED_PAGE_BYTES}}"']
    name = f"test_{spec.kind}_spec_sizes_its_page_as_the_cache_dtype_stores_it"
    publisher = "AttentionBackend" if synthetic else "customize_attention_spec"
    module.add(f"def {name}():\n" + indent("\n".join(body)), "KVQuantMode", publisher, *spec_names(call))
    return module
