"""Where the oracle says each element of a token lives (oracles/touch.py `token_map`), against the same rule applied one
element at a time, on drawn layout-placed cases with every token the kernel probe would write to the layers it writes."""

from __future__ import annotations

import oracles
from fuzz.space import Rejected, draw_indexed
from fuzz.targets.kernel_probe import _not_probed, tokens
from oracles import touch


def one_element_at_a_time(view, axes, row, state, mla, heads, head_size, value_size) -> list[int]:
    if mla:
        parts = [(0, 0, dim) for dim in range(head_size)]
    else:
        order = oracles.contract.content_order(False)
        parts = [(order.index("K"), head, dim) for head in range(heads) for dim in range(head_size)]
        parts += [(order.index("V"), head, dim) for head in range(heads) for dim in range(value_size)]
    offsets = []
    for kv, head, dim in parts:
        values = {"B": row, "T": state, "H": head, "KV": kv, "D": dim, "C": kv * head_size + dim, "1": 0}
        index = [values[axis] for axis in axes]
        assert all(0 <= i < size for i, size in zip(index, view.shape, strict=True))
        offsets.append(view.byte_offset + sum(i * stride for i, stride in zip(index, view.byte_strides, strict=True)))
    return offsets


def test_token_map_offsets_are_the_elements_the_rule_names(placed_info):
    info = placed_info
    checked = 0
    for index in range(400):
        try:
            case = draw_indexed(info, 5, index, touches=True)
        except Rejected:
            continue
        expected = oracles.expect(case, info.contract)
        if not expected.accepted or case.touches is None:
            continue
        for layer, want in expected.layers.items():
            group = case.groups[want.group]
            if group.differs_per_layer or not want.views or _not_probed(group) is not None:
                continue  # as the kernel probe: a layer it writes tokens to
            spec, view = group.spec, want.views[0]
            axes = touch._axes(group, len(view.shape))
            for block, position in tokens(group, case.num_blocks, case.touches):
                mapped = touch.token_map(case, expected, layer, block, position, spec.is_mla)
                if mapped is None or mapped.offsets is None:
                    continue
                kernel = spec.block_size // view.kernel_ratio
                row, state = divmod(block * spec.block_size + position, kernel)
                value_size = spec.head_size_v if spec.head_size_v is not None else spec.head_size
                assert mapped.offsets.tolist() == one_element_at_a_time(view, axes, row, state, spec.is_mla, spec.num_kv_heads,
                                                                        spec.head_size, value_size)
                checked += 1
    assert checked > 50
