"""What zeroing block b must do, for the exported zeroer tests: per buffer, the bytes it must clear and those it may change
(kvfuzz's oracle, oracles/touch.py), and the module helper that fills each buffer, zeroes and holds it to them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fuzz.export.code import NoTemplate, layer_names
from fuzz.export.expected import contracts, expectation
from fuzz.export.finding import FindingFile
from fuzz.verdict.touch import OUTSIDE_EVERY_BUFFER
from oracles import touch
from oracles.expectation import Expectation

RULE = ("The rule (kvfuzz contract): block ids are the KV-cache manager's, one id for the same block of every layer (a "
        "block split into kernel blocks is all of them), and the zeroer exists so a freed block starts clean: zeroing "
        "block {block} clears every byte block {block} owns in each {layers} and changes no byte outside block {block}'s "
        "pages and their alignment tails (under a block-outermost layout, block {block}'s whole row). ZEROING holds the "
        "half of the rule this finding breaks.")

CHECK = '''
    def backing_bytes(view):
        """The whole buffer a view lies in, as bytes."""
        raw = torch.empty(0, dtype=torch.uint8)
        raw.set_(view.untyped_storage())
        return raw


    def offsets(byte_runs):
        return torch.cat([torch.arange(start, end) for start, end in byte_runs]) if byte_runs else torch.zeros(0, dtype=torch.long)


    def check_zeroing(kv_caches, buffers, block, zero):
        """Fills each buffer `buffers` names (by a layer's tensor lying in it) with random non-zero bytes, runs `zero()`,
        then holds every buffer to the runs it lists: no byte changed outside may_change, every byte of must_clear zero."""
        raws = []
        for seed, want in enumerate(buffers):
            layer, index = want["buffer_of"]
            cache = kv_caches[layer]
            raw = backing_bytes(cache[index] if isinstance(cache, (list, tuple)) else cache)
            raw.copy_(torch.randint(1, 256, (raw.numel(),), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8))
            raws.append(raw)
        befores = [raw.clone() for raw in raws]
        zero()
        for number, (raw, before, want) in enumerate(zip(raws, befores, buffers)):
            where = f"buffer {number} (the one {want['buffer_of'][0]} lies in)" if len(buffers) > 1 else "the buffer"
            if "may_change" in want:
                changed = (raw != before).nonzero().flatten()
                allowed = torch.zeros(raw.numel(), dtype=torch.bool)
                allowed[offsets(want["may_change"])] = True
                outside = changed[~allowed[changed]].tolist()
                assert not outside, f"zeroing block {block} changed {len(outside)} bytes of {where} outside it, the first at byte {outside[0]}"
            if "must_clear" in want:
                must_clear = offsets(want["must_clear"])
                left = must_clear[raw[must_clear] != 0].tolist()
                assert not left, f"zeroing block {block} left {len(left)} of its bytes in {where} uncleared, the first at byte {left[0]}"
'''


# The half of the rule each finding kind breaks, and so the half its test holds vLLM to: a regression test of one bug
# stays green where the release has another (0.27's zeroer skips the very layer 0.28's clears too much of, #21 / #27).
HALVES = {"zero-miss": ("must_clear", "the [start, end) byte runs zeroing must clear"),
          "zero-escape": ("may_change", "the only [start, end) byte runs zeroing may change")}


def half_of(finding: FindingFile) -> tuple[str, str]:
    """The half of the rule the finding's module holds vLLM to (HALVES). A zeroer whose stores went past every buffer of
    the cache (#27 on 0.28) shows inside the buffers as block b left uncleared: its module checks what must be cleared."""
    if finding.kind == "zero-escape" and OUTSIDE_EVERY_BUFFER in finding.message:
        return HALVES["zero-miss"]
    return HALVES[finding.kind]


def zeroing_literal(finding: FindingFile, block: int, zeroers: Sequence[Any]) -> str:
    """`ZEROING = {...}`: per contract, per buffer the zeroer's layers lie in, the byte runs zeroing `block` must clear
    (`zero-miss`) or those it may change (`zero-escape`). `zeroers`: the zeroer checks whose code the module may run (they
    must agree on the layers; fuzz/checks/zeroer.py)."""
    names = layer_names(finding.case)
    if finding.kind not in HALVES:
        raise NoTemplate(f"the zeroing exporter checks zero-miss and zero-escape, not {finding.kind}")
    half, meaning = half_of(finding)
    lines = ["# What zeroing the block must do (kvfuzz's oracle for this case), under each contract: per buffer (named by a",
             f"# layer's tensor lying in it), {meaning}.", "ZEROING = {"]
    for contract in contracts(finding):
        expected = expectation(finding, contract)
        if not expected.accepted:
            raise NoTemplate(f"the oracle rejects the case under {contract} ({expected.reject_reason}): nothing to zero")
        layers = touch.zeroed_layers(finding.case, expected, zeroers[0].full_attention_only)
        if any(touch.zeroed_layers(finding.case, expected, other.full_attention_only) != layers for other in zeroers[1:]):
            raise NoTemplate(f"the zeroers {', '.join(z.name for z in zeroers)} clear different layers for this case")
        if not all(touch.zeroer_serves(finding.case, expected, z.full_attention_only, z.clears_words) for z in zeroers):
            raise NoTemplate(f"under {contract} the case's pages are off the zeroer's granule, which it refuses by design")
        runs = touch.owned(expected, layers, block) if half == "must_clear" else touch.tile(finding.case, expected, block)
        if not runs:
            raise NoTemplate(f"under {contract} the oracle gives zeroing block {block} no bytes (a shipped backend's declared "
                             "cache shape no release was asked for?)")
        lines.append(f'    "{contract}": [')
        for buffer in sorted(runs):
            layer, index = _tensor_in(expected, buffer)
            lines.append(f'        {{"buffer_of": ("{names[layer]}", {index}), "{half}": {_runs(runs[buffer])}}},')
        lines.append("    ],")
    return "\n".join(lines + ["}"])


def _tensor_in(expected: Expectation, buffer: int) -> tuple[str, int]:
    """A (layer, tensor index) whose view lies in `buffer`: how a module finds that buffer among vLLM's."""
    for name in touch.cache_layers(expected):
        for index, view in enumerate(expected.layers[name].views):
            if view.buffer == buffer:
                return name, index
    raise NoTemplate(f"no layer's view lies in buffer {buffer} of the oracle's layout")


def _runs(spans: touch.Spans) -> list[tuple[int, int]]:
    return [(int(start), int(end)) for start, end in zip(spans.starts, spans.ends, strict=True)]
