"""What an exported view test expects, from kvfuzz's oracle at export time: each layer's tensors as plain numbers
(shape, dtype, the bytes each block owns, where each element starts), and the module-level helpers that check them.

The oracle sees the case as the finding stored it, with the declared cache shapes its release gave (fuzz/export/declared.py);
where it needs one nobody asked the release for, it has no views to give and the template says so (NoTemplate)."""

from __future__ import annotations

import numpy as np

import oracles
from fuzz.export.code import NoTemplate, layer_names
from fuzz.export.declared import declared_case, declared_for, next_contract
from fuzz.export.finding import FindingFile, contract_of
from oracles.expectation import Expectation, ViewExpectation

# The finding kinds whose test checks the views, and those whose test checks that vLLM refuses the case.
VALID_KINDS = ("crash-on-valid", "refused-valid", "shape", "order", "page-escape", "block-partition", "alias", "dtype", "share")
INVALID_KINDS = ("crash-on-invalid", "assert-on-invalid", "accepted-invalid")
MAX_RUNS = 64  # byte runs per block a module spells out; a view more scattered than that is no readable test
MAX_BLOCKS = 3  # blocks checked (the first ones and the last)

VIEW_HELPERS = '''
    def element_starts(shape, byte_strides, byte_offset):
        """The byte each element starts at, in row-major order, for a strided layout."""
        starts = torch.tensor(byte_offset)
        for size, stride in zip(shape, byte_strides):
            starts = starts[..., None] + torch.arange(size) * stride
        return starts.flatten().tolist()


    def block_part(view, axis, kernel_blocks, block):
        """Manager block `block` of a view: `kernel_blocks` = (how many, spacing) along the block axis."""
        count, spacing = kernel_blocks
        first = block * spacing
        return view.narrow(axis, first, max(0, min(count, view.shape[axis] - first)))


    def check_views(kv_caches, expected):
        """Every layer's tensors are `expected`'s: shape, dtype, the bytes each block owns, where each element starts."""
        for layer, tensors in expected.items():
            got = kv_caches[layer]
            got = list(got) if isinstance(got, (list, tuple)) else [got]
            assert len(got) == len(tensors), f"{layer}: {len(got)} tensors instead of {len(tensors)}"
            for index, (view, want) in enumerate(zip(got, tensors)):
                name = f"{layer} (tensor {index})"
                assert tuple(view.shape) == want["shape"], f"{name}: shape {tuple(view.shape)} instead of {want['shape']}"
                assert view.dtype == getattr(torch, want["dtype"]), f"{name}: dtype {view.dtype} instead of {want['dtype']}"
                for block, owned in want["blocks"].items():
                    actual = runs(byte_offsets(block_part(view, want["block_axis"], want["kernel_blocks"], block)))
                    assert actual == owned, f"{name}: block {block} owns bytes {actual}, not {owned}"
                size = view.element_size()
                actual = element_starts(view.shape, [stride * size for stride in view.stride()], view.storage_offset() * size)
                wanted = element_starts(want["shape"], want["byte_strides"], want["byte_offset"])
                assert actual == wanted, f"{name}: elements inside a block are not in the order the layout declares"
'''


def contracts(finding: FindingFile) -> list[str]:
    """The contracts the test's rule holds under: those of the releases the finding affects (where kvfuzz found it),
    and the next contract of the same family (where a fix would show) where the oracle judges the stored case as the
    finding's kind does (valid or invalid). A release of another contract skips the test."""
    names = list(dict.fromkeys(name for name in map(contract_of, finding.affected) if name is not None))
    if not names:
        raise NoTemplate(f"kvfuzz knows no contract for vLLM {', '.join(finding.affected) or '?'}")
    following = next_contract(finding)
    valid = finding.kind not in INVALID_KINDS
    # The next contract's expectation needs that release's own declarations, not an older release's (a backend's
    # declared shape changes between contracts).
    if following is not None and declared_for(finding, following) and expectation(finding, following).accepted == valid:
        names.append(following)
    return names


def expectation(finding: FindingFile, contract: str) -> Expectation:
    case = declared_case(finding, contract)
    return oracles.expect(case, oracles.CONTRACTS[contract], "v1" if case.runner == "v1" else "v2")


def _byte_runs(view: ViewExpectation, block: int) -> list[tuple[int, int]]:
    starts = view.element_offsets().reshape(view.shape)
    blocks = view.element_blocks().reshape(view.shape)
    mine = starts[blocks == block]
    addresses = np.unique((mine[:, None] + np.arange(view.element_size)[None, :]).reshape(-1))
    if addresses.size == 0:
        return []
    breaks = np.nonzero(np.diff(addresses) != 1)[0]
    firsts = np.concatenate(([addresses[0]], addresses[breaks + 1]))
    lasts = np.concatenate((addresses[breaks], [addresses[-1]]))
    return [(int(a), int(b) + 1) for a, b in zip(firsts, lasts, strict=True)]


def _checked_blocks(num_blocks: int) -> list[int]:
    if num_blocks <= MAX_BLOCKS:
        return list(range(num_blocks))
    return [*range(MAX_BLOCKS - 1), num_blocks - 1]


def expected_literal(finding: FindingFile, blocks: list[int] | None = None) -> str:
    """`EXPECTED = {...}`: per contract, every layer's tensors as the oracle says vLLM must build them (NoTemplate where
    it cannot say). `blocks`: the blocks whose bytes it spells out (None: the first ones and the last)."""
    names = layer_names(finding.case)
    lines = ["# What the views must be (kvfuzz's oracle for this case), under each contract: per layer, its tensors; per",
             "# tensor, its shape and dtype, the block axis and (count, spacing) of a block's kernel blocks along it, byte",
             "# strides and offset from the start of the buffer, and for blocks b the [start, end) byte runs block b owns.",
             "EXPECTED = {"]
    for contract in contracts(finding):
        lines.append(f'    "{contract}": {{')
        expected = expectation(finding, contract)
        if not expected.accepted:
            raise NoTemplate(f"the oracle rejects the case under {contract} ({expected.reject_reason}): no views to expect")
        for case_name, layer in expected.layers.items():
            if case_name in expected.kv_sharing:
                continue
            if not layer.views:
                raise NoTemplate("the oracle needs the backend's declared cache shape, which its release did not give "
                                 "(it could not run the case)")
            lines.append(f'        "{names[case_name]}": [')
            for view in layer.views:
                lines += _view_lines(view, _checked_blocks(finding.case.num_blocks) if blocks is None else blocks)
            lines.append("        ],")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def _view_lines(view: ViewExpectation, checked: list[int]) -> list[str]:
    blocks = {}
    for block in checked:
        owned = _byte_runs(view, block)
        if len(owned) > MAX_RUNS:
            raise NoTemplate(f"block {block} of a view is {len(owned)} byte runs: too scattered for a readable test")
        blocks[block] = owned
    return [f'            {{"shape": {tuple(view.shape)!r}, "dtype": "{view.dtype}", "block_axis": {view.block_axis}, '
            f'"kernel_blocks": ({view.kernel_ratio}, {view.kernel_stride}),',
            f'             "byte_strides": {tuple(view.byte_strides)!r}, "byte_offset": {view.byte_offset},',
            f'             "blocks": {blocks!r}}},']
