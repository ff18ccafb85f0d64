"""fuzz/verdict/touch.py: what consumers and cache writes report, judged against the oracle's block bytes.

The records are written by hand (what a correct or a wrong consumer would report on a two-layer
LBNHC cache of 8192-byte pages and 3 blocks: layer l's block b is [(3l + b) * 8192, (3l + b + 1) * 8192)),
so each test says what vLLM would have had to do for the verdict to come out that way.
"""

from __future__ import annotations

import numpy as np
import pytest

import oracles
from fuzz.case import Case, GroupCase, SpecCase
from fuzz.checks.protocol import Judging
from fuzz.checks.registry import BY_NAME
from fuzz.targets.base import BufferRecord, Outcome, ViewRecord, encode_bytes
from fuzz.targets.byte_runs import pattern_bytes
from fuzz.verdict import touch as verdict
from fuzz.verdict.compare import Verdict
from oracles.contract import LAYOUT_PLACED_KERNEL_MAP

PAGE = 8192
WHERE = "vllm.v1.worker.utils.Consumer.method"


def two_layers(kind: str = "full", backend: str = "TRITON_ATTN") -> Case:
    spec = SpecCase(kind=kind, block_size=16, num_kv_heads=2, head_size=64, sliding_window=8 if kind == "sliding_window" else None)
    return Case(groups=(GroupCase(spec=spec, layers=("l0", "l1"), backend=backend, kernel_block_size=16),), num_blocks=3, layout="LBNHC")


def judge(case: Case, touches: dict) -> verdict.Finding | None:
    expected = oracles.expect(case, LAYOUT_PLACED_KERNEL_MAP)
    views = {name: tuple(ViewRecord(v.shape, tuple(s // v.element_size for s in v.byte_strides), v.byte_offset, v.dtype, v.element_size, 0)
                         for v in layer.views) for name, layer in expected.layers.items()}
    outcome = Outcome(views=views, buffers=(BufferRecord(6 * PAGE, ("l0", "l1")),))
    records = {**touches.get("consumers", {}), **({"kernel-probe": touches["kernel"]} if "kernel" in touches else {})}
    judging = Judging(case, LAYOUT_PLACED_KERNEL_MAP, expected, outcome, Verdict("pass"))
    for name, record in records.items():  # each check judges its own record, as fuzz/verdict/runner.py has them do
        found = BY_NAME[name].judge(judging, record)
        if found is not None:
            return found
    return None


def block(layer: int, index: int) -> list[int]:
    return [0, (3 * layer + index) * PAGE, (3 * layer + index + 1) * PAGE]


def zero(*blocks: dict) -> dict:
    return {"consumers": {"zeroer": {"kind": "zeroing", "where": WHERE, "blocks": list(blocks)}}}


def test_a_zeroer_that_clears_exactly_the_block_passes():
    assert judge(two_layers(), zero({"block": 1, "zeroed": [block(0, 1), block(1, 1)], "dirtied": []})) is None


def test_zeroing_another_block_escapes():
    found = judge(two_layers(), zero({"block": 1, "zeroed": [block(0, 1), block(1, 1), block(0, 2)], "dirtied": []}))
    assert found is not None and found.kind == "zero-escape" and found.function == "method"


def test_stores_past_every_buffer_escape_even_when_the_buffers_look_untouched():
    # The interpreter dropped 2,048 bytes of stores aimed right after buffer 0 (fuzz/targets/triton_interp.py guarded).
    entry = {"block": 1, "zeroed": [], "dirtied": [], "outside": {"bytes": 2048, "first": [0, 0]}}
    found = judge(two_layers(), zero(entry))
    assert found.kind == "zero-escape"
    assert found.message.endswith("zeroing block 1 writes 2048 bytes outside every KV-cache buffer, the first 0 bytes past the "
                                  "end of buffer 0")
    before = judge(two_layers(), zero({**entry, "outside": {"bytes": 8, "first": [0, -64]}}))
    assert before.message.endswith("the first 64 bytes before buffer 0")


def test_zeroing_half_a_block_misses_and_names_the_layer():
    half = [0, 4 * PAGE, 4 * PAGE + PAGE // 2]
    found = judge(two_layers(), zero({"block": 1, "zeroed": [block(0, 1), half], "dirtied": []}))
    assert found is not None and found.kind == "zero-miss" and found.layer == "l1"


def test_writing_garbage_instead_of_zeros_misses():
    found = judge(two_layers(), zero({"block": 1, "zeroed": [block(0, 1)], "dirtied": [block(1, 1)]}))
    assert found is not None and found.kind == "zero-miss"


def test_the_cpu_runner_zeroes_only_full_attention():
    record = {"consumers": {"cpu-zero": {"kind": "zeroing", "where": WHERE, "blocks": [{"block": 0, "zeroed": [], "dirtied": []}]}}}
    assert judge(two_layers("sliding_window"), record) is None
    assert judge(two_layers("full"), record).kind == "zero-miss"  # type: ignore[union-attr]


def copy_record(src: int, dst: int, moved: list[tuple[int, int]]) -> dict:
    """A copy that wrote, for each (target, source) range start, one page holding the source's pattern bytes."""
    original = pattern_bytes(0, 6 * PAGE)
    changed = [[0, target, target + PAGE] for target, _ in moved]
    values = [original[source:source + PAGE].tobytes().hex() for _, source in moved]
    copies = [{"src": src, "dst": dst, "changed": changed, "values": values}]
    return {"consumers": {"copy": {"kind": "copying", "where": WHERE, "copies": copies}}}


def test_a_correct_copy_passes():
    assert judge(two_layers(), copy_record(0, 2, [(2 * PAGE, 0), (5 * PAGE, 3 * PAGE)])) is None


def test_a_copy_from_the_wrong_block_is_wrong():
    found = judge(two_layers(), copy_record(0, 2, [(2 * PAGE, PAGE), (5 * PAGE, 3 * PAGE)]))
    assert found is not None and found.kind == "copy-wrong" and found.layer == "l0"


def test_a_copy_onto_another_block_escapes():
    found = judge(two_layers(), copy_record(0, 2, [(2 * PAGE, 0), (5 * PAGE, 3 * PAGE), (PAGE, 0)]))
    assert found is not None and found.kind == "copy-escape"


def test_a_copy_reported_in_many_short_runs_is_judged_byte_for_byte():
    # Over a random fill pattern a copy leaves some destination bytes as they were (the source's byte happened to match),
    # so its changed bytes come as many short runs.
    whole = copy_record(0, 2, [(2 * PAGE, 0), (5 * PAGE, 3 * PAGE)])
    entry = whole["consumers"]["copy"]["copies"][0]
    data = b"".join(bytes.fromhex(text) for text in entry["values"])
    targets = [start + i for _, start, end in entry["changed"] for i in range(end - start)]
    cuts = range(0, len(targets), 64)  # 64 divides a page: no run straddles the two pages
    entry["changed"] = [[0, targets[i], targets[i] + 64] for i in cuts]
    entry["values"] = [data[i:i + 64].hex() for i in cuts]
    assert judge(two_layers(), whole) is None
    wrong = bytearray(bytes.fromhex(entry["values"][37]))
    wrong[5] ^= 0xFF
    entry["values"][37] = wrong.hex()
    found = judge(two_layers(), whole)
    assert found is not None and found.kind == "copy-wrong"
    assert "1 bytes of block 2" in found.message and f"at byte {2 * PAGE + 37 * 64 + 5}" in found.message


def region(intervals: list[list[int]], layers=("l0", "l1")) -> dict:
    return {"consumers": {"offload": {"kind": "mapping", "where": WHERE, "layers": list(layers), "blocks": [{"block": 1, "region": intervals}]}}}


def test_regions_must_be_exactly_the_block():
    assert judge(two_layers(), region([block(0, 1), block(1, 1)])) is None
    assert judge(two_layers(), region([block(0, 1)])).kind == "region-mismatch"  # type: ignore[union-attr]
    assert judge(two_layers(), region([block(0, 1), block(1, 1), block(1, 2)])).kind == "region-mismatch"  # type: ignore[union-attr]
    assert judge(two_layers(), region([block(0, 1)], layers=("l0",))) is None  # a layer the connector does not move


def kernel_record(landed: np.ndarray, stray: list | None = None, backend: str = "TRITON_ATTN") -> dict:
    token = {"block": 1, "position": 3, "slot": 19, "landed": encode_bytes(landed.astype(np.int64).view(np.uint8)), "stray": stray or []}
    return {"kernel": {"l0": {"writer": "vllm.X.do_kv_cache_update", "mla": False, "tokens": [token]}}}


def contract_offsets() -> np.ndarray:
    """Token 3 of block 1 in l0: LBNHC strides C 2 bytes, H 256, N 512, B 8192; K (2 heads x 64) then V at C 64."""
    k = [PAGE + 3 * 512 + h * 256 + d * 2 for h in range(2) for d in range(64)]
    v = [PAGE + 3 * 512 + h * 256 + 128 + d * 2 for h in range(2) for d in range(64)]
    return np.array(k + v, dtype=np.int64)


def test_a_write_at_the_contract_positions_passes():
    assert judge(two_layers(), kernel_record(contract_offsets())) is None


def test_kernel_findings():
    good = contract_offsets()
    swapped = good.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert judge(two_layers(), kernel_record(swapped)).kind == "kernel-order"  # type: ignore[union-attr]
    elsewhere = good.copy()
    elsewhere[5] = 2 * PAGE
    assert judge(two_layers(), kernel_record(elsewhere)).kind == "kernel-escape"  # type: ignore[union-attr]
    missing = good.copy()
    missing[7] = -1
    assert judge(two_layers(), kernel_record(missing)).kind == "kernel-miss"  # type: ignore[union-attr]
    assert judge(two_layers(), kernel_record(good, stray=[[0, 0, 2]])).kind == "kernel-escape"  # type: ignore[union-attr]


def test_private_interiors_are_held_to_block_and_head_only():
    case = two_layers(backend="CPU_ATTN")
    shuffled = contract_offsets().copy()
    shuffled[:64] = shuffled[:64][::-1]  # head 0's K reversed inside head 0
    assert judge(case, kernel_record(shuffled, backend="CPU_ATTN")) is None
    other_head = contract_offsets().copy()
    other_head[0] = PAGE + 3 * 512 + 256  # head 0's element in head 1's bytes
    assert judge(case, kernel_record(other_head, backend="CPU_ATTN")).kind == "kernel-escape"  # type: ignore[union-attr]


@pytest.mark.parametrize("kind, expect", [("kernel", "kernel-crash"), ("consumers", "crash-on-valid")])
def test_a_raising_consumer_or_writer_is_a_crash(kind, expect):
    error = {"type": "RuntimeError", "message": "view size is not compatible", "function": "do_kv_cache_update", "file": "x.py",
             "line": 1, "block": 0, "position": 0}
    record = ({"kernel": {"l0": {"writer": "vllm.X.do_kv_cache_update", "error": error}}} if kind == "kernel"
              else {"consumers": {"zeroer": {"kind": "zeroing", "where": WHERE, "error": error}}})
    found = judge(two_layers(), record)
    assert found is not None and found.kind == expect and found.function == "do_kv_cache_update"


def test_a_zeroer_refusing_pages_off_its_word_granule_is_no_finding():
    # KVBlockZeroer clears 4-byte words and asserts that pages are whole words: an MLA cache of one bfloat16 per
    # token and 1-token blocks has 2-byte pages (padded or not), which it refuses by design; 4-byte pages it must serve.
    error = {"type": "AssertionError", "message": "", "function": "__init__", "file": "v1/worker/utils.py", "line": 196}
    record = {"consumers": {"zeroer": {"kind": "zeroing", "where": WHERE, "error": error}}}
    for head_size, padded, expect in ((1, None, None), (1, 4096, None), (2, None, "crash-on-valid")):
        spec = SpecCase(kind="mla", block_size=1, num_kv_heads=1, head_size=head_size, page_size_padded=padded)
        case = Case(groups=(GroupCase(spec=spec, layers=("l0", "l1"), backend="TRITON_MLA", kernel_block_size=1),), num_blocks=3)
        found = judge(case, record)
        assert (found.kind if found else None) == expect
