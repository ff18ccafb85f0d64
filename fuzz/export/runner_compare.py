"""Template: both model runners lay one model's block out alike (`runner-mismatch` before vLLM 0.29, whose V1 runner
reshapes with code of its own): token t, head h and content c of manager block b lie at the same byte of their buffer
in the V1 runner's `initialize_kv_cache_tensors` views as in the V2 runner's `_reshape_kv_cache` views."""

from __future__ import annotations

from fuzz.case import GroupCase, parse_shape_entry
from fuzz.checks.protocol import Check
from fuzz.export import shaped_steps, view_rules
from fuzz.export.code import Module, NoTemplate, docstring, indent
from fuzz.export.finding import FindingFile
from fuzz.export.reach import Reach

LOGICAL = '''
    def element_starts(view):
        """The byte each element of `view` starts at, from the start of its buffer, in the view's shape."""
        size = view.element_size()
        starts = torch.tensor(view.storage_offset() * size)
        for extent, stride in zip(view.shape, view.stride()):
            starts = starts[..., None] + torch.arange(extent) * stride * size
        return starts


    def by_block_token_head(view, axes):
        """A view of the declared cache shape `axes` (B blocks, T tokens, H heads, the rest content) as the byte of each
        element indexed [manager block, token, head, *content]: kernel blocks b * k ... b * k + k - 1 along B make up
        manager block b, their tokens in order (the block table's slots)."""
        order = [axes.index("B"), axes.index("T"), axes.index("H")] + [i for i, axis in enumerate(axes) if axis not in ("B", "T", "H")]
        starts = element_starts(view).permute(order)
        kernel_blocks, kernel_tokens = starts.shape[:2]
        return starts.reshape(NUM_BLOCKS, kernel_blocks // NUM_BLOCKS * kernel_tokens, *starts.shape[2:])


    def first_difference(layer, v2_view, v1_view, axes):
        """Where the two runners put an element of `layer` apart, in words; None where they agree on every element."""
        v2, v1 = by_block_token_head(v2_view, axes), by_block_token_head(v1_view, axes)
        if v2.shape != v1.shape:
            return f"{layer}: the runners' views hold {tuple(v2.shape)} and {tuple(v1.shape)} elements (block, token, head, ...)"
        apart = (v2 != v1).nonzero()
        if not len(apart):
            return None
        where = tuple(apart[0].tolist())
        block, token, head, *content = where
        return (f"{layer}: token {token}, head {head}, content {content} of block {block} is at byte {int(v2[where])} under "
                f"the V2 runner, {int(v1[where])} under the V1 runner ({len(apart)} elements apart)")
'''

RULE = ("The rule (kvfuzz contract): a model's KV cache has one layout whichever model runner builds it. Block ids and "
        "slots are the scheduler's, and what moves a block's bytes between workers (a KV connector between a prefill "
        "and a decode worker, which may run different runners) addresses token t of block b alike on both, so every "
        "element lies at the same byte of its buffer under both runners.")


def axes_of(group: GroupCase) -> tuple[str, ...]:
    """The group's declared cache shape as axis names: B, T, H, D, or the literal size of an axis such as K/V's 2."""
    pattern = group.synthetic_backend.shape if group.synthetic_backend is not None else group.declared_shape
    if pattern is None:
        raise NoTemplate("the runner comparison needs the backend's declared cache shape")
    axes = []
    for entry in pattern:
        factor, symbol = parse_shape_entry(entry)
        axes.append(str(factor) if symbol is None else symbol)
    if not {"B", "T", "H"} <= set(axes) or len(set(axes)) != len(axes):
        raise NoTemplate("the runner comparison reads blocks, tokens and heads off one axis each of the declared shape")
    return tuple(axes)


def runner_compare_test(finding: FindingFile, reach: Reach | None, check: Check) -> Module:
    case = finding.case
    if case.runner != "both":
        raise NoTemplate("the runner comparison exporter needs a case both model runners run")
    attention = [(index, group) for index, group in enumerate(case.groups) if group.spec.kind != "mamba"]
    axes = {index: axes_of(group) for index, group in attention}
    module = Module(title=f"the V1 and V2 model runners lay out a block of a {case.groups[0].spec.kind} cache differently "
                          f"({case.layout})")
    module.add(docstring(finding, reach, "both model runners must put every element of a block at the same byte."))
    module.add(shaped_steps.constants(finding) + "\n" + "\n".join(
        f"AXES_{index} = {axes[index]!r}  # group {index}'s declared cache shape, axis by axis" for index, _ in attention))
    body = shaped_steps.walk(finding, module, both_runners=True)
    module.add(LOGICAL)
    compared = ", ".join(f"*((layer, AXES_{index}) for layer in LAYERS_{index})" for index, _ in attention)
    check = "\n".join([
        view_rules.comment(RULE),
        f"compared = [{compared}]  # (layer, its declared axes)",
        "apart = [first_difference(layer, kv_caches[layer], v1_caches[layer], axes) for layer, axes in compared]",
        "assert not any(apart), \"; \".join(filter(None, apart))"])
    gate = view_rules.add_contract_gate(module, finding, shaped_steps.PROBE)
    module.add(f"def test_both_model_runners_put_every_element_of_a_block_at_the_same_byte(vllm_config, monkeypatch):\n"
               f"{gate}{body}\n\n{indent(check)}")
    return module
