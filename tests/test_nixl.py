"""The NIXL check (fuzz/checks/nixl.py): vLLM's NIXL worker registers a case's caches with a recording stand-in for the
nixl agent, and every local descriptor is held against the bytes its kernel block owns (oracles/transfer.py).

The descriptors of the installed vLLM are compared with lists worked out here by hand from the cases' page sizes; the
judgement is shown to pass them, to fail a worker whose first descriptor is one element too long, and (without vLLM)
to name each rule a synthetic descriptor list breaks."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

import oracles
from fuzz.case import Case, GroupCase, SpecCase, Touches
from fuzz.checks.protocol import Judging
from fuzz.targets.base import Outcome
from fuzz.verdict.compare import Verdict
from oracles import transfer
from oracles.contract import LAYOUT_PLACED_KERNEL_MAP
from tests.conftest import one_group

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
BLOCKS = 4
NAMED = Touches(consumers=("nixl",))  # a case asks for the check by naming it


def attention_case(backend: str, layout: str, block_size: int, kernel: int | None = None) -> Case:
    spec = SpecCase(kind="full", block_size=block_size, num_kv_heads=2, head_size=64, dtype="bfloat16")
    group = GroupCase(spec=spec, layers=LAYERS, backend=backend, kernel_block_size=kernel or block_size)
    return Case(groups=(group,), num_blocks=BLOCKS, layout=layout, touches=NAMED)


def mla_case(block_size: int, kernel: int) -> Case:
    spec = SpecCase(kind="mla", block_size=block_size, num_kv_heads=1, head_size=576, dtype="bfloat16")
    return Case(groups=(GroupCase(spec=spec, layers=LAYERS, backend="CPU_MLA", kernel_block_size=kernel),), num_blocks=BLOCKS,
                layout="LBNHC", touches=NAMED)


def judged(target, case: Case, longer_first: bool = False) -> tuple[Case, dict, str | None]:
    """The check's record on the case's walk (with `longer_first`, from a worker whose first descriptor is one bfloat16
    element too long), and its judgement: the finding's kind and message, or None."""
    from fuzz.checks import nixl

    run = nixl.CHECK.offer(target.probe)
    assert run is not None, "the release has a NIXL worker"
    walk = target.walk(case)
    with lengthened_first_descriptor() if longer_first else contextlib.nullcontext():
        record = run(walk)
    assert "skipped" not in record and "error" not in record, record
    expected = oracles.expect(walk.case, target.info.contract)
    finding = nixl.CHECK.judge(Judging(walk.case, target.info.contract, expected, Outcome(), Verdict("pass")), record)
    return walk.case, record, None if finding is None else f"{finding.kind}: {finding.message}"


@contextlib.contextmanager
def lengthened_first_descriptor() -> Iterator[None]:
    """vLLM's descriptor builder with the first row's length one bfloat16 element longer: `_stack_descs` (rows of address,
    length, device; 0.32) or `_block_strided_descs` (strided rows; 0.34), wherever the worker's classes define it."""
    from fuzz.checks import nixl

    cls = nixl.worker_class()
    assert cls is not None
    for name in ("_stack_descs", "_block_strided_descs"):
        owner = next((klass for klass in cls.__mro__ if name in vars(klass)), None)
        if owner is None:
            continue
        original = getattr(owner, name)

        def longer(*args, original=original):
            rows = original(*args)
            rows[0, 1] += 2
            return rows

        with mock.patch.object(owner, name, staticmethod(longer)):
            yield
        return
    raise AssertionError("no descriptor builder to lengthen")


def driven(target, case: Case, longer_first: bool = False) -> tuple[Case, dict, str | None]:
    if case.groups[0].backend not in {b.name for b in target.info.backends}:
        pytest.skip(f"vLLM {target.info.vllm_version} has no {case.groups[0].backend}")
    return judged(target, case, longer_first)


def layer_major(page: int, kernel_blocks: int) -> list[list[int]]:
    """Descriptors of a layer-major layout (each layer's blocks consecutive, one buffer): layer by layer, block by block."""
    return [[0, (layer * kernel_blocks + k) * page, (layer * kernel_blocks + k + 1) * page]
            for layer in range(len(LAYERS)) for k in range(kernel_blocks)]


# A token's K and V are 2 heads x 2 x 64 bf16 = 512 bytes.
@pytest.mark.parametrize(("case", "descriptors"), [
    (attention_case("CPU_ATTN", "LBHNC", 32), layer_major(32 * 512, BLOCKS)),
    (attention_case("CPU_ATTN", "LBHNC", 64, 32), layer_major(64 * 512, BLOCKS)),
    (attention_case("TRITON_ATTN", "LBNHC", 16), layer_major(16 * 512, BLOCKS)),
    # Block-outermost: block b's row holds layer 0's page, then layer 1's; one descriptor per layer page.
    (attention_case("TRITON_ATTN", "BLHNC", 16),
     [[0, b * 2 * 8192 + layer * 8192, b * 2 * 8192 + (layer + 1) * 8192] for layer in range(2) for b in range(BLOCKS)]),
    # MLA 64-token blocks on 16-token kernel blocks: four descriptors per block, 16 x 576 bf16 each.
    (mla_case(64, 16), layer_major(16 * 576 * 2, BLOCKS * 4)),
], ids=["cpu-32", "cpu-64", "triton-16", "triton-blocks-outermost", "cpu-mla-kernel-split"])
def test_descriptors_cover_their_blocks(kvfuzz_target, case, descriptors):
    declared, record, finding = driven(kvfuzz_target, case)
    assert finding is None
    ratio = 4 if declared.groups[0].spec.kind == "mla" else 1
    assert record["ratio"] == ratio
    assert record["descriptors"] == descriptors
    assert record["replaced"] and all("nixl._api" in what for what in record["replaced"])
    assert {"get_reg_descs", "register_memory", "get_xfer_descs", "prep_xfer_dlist"} <= set(record["calls"])


@pytest.mark.parametrize("case", [attention_case("CPU_ATTN", "LBHNC", 32), attention_case("TRITON_ATTN", "BLHNC", 16)],
                         ids=["layer-major", "blocks-outermost"])
def test_one_element_too_long_is_found(kvfuzz_target, case):
    _, record, finding = driven(kvfuzz_target, case, longer_first=True)
    assert record["descriptors"][0][2] - record["descriptors"][0][1] == record["regions"][0]["block_len"] + 2
    assert finding is not None
    assert finding.startswith("transfer-mismatch: ") and "kernel block 0" in finding and "2 bytes" in finding


def test_padded_pages_of_a_shared_pool_crash_the_registration(kvfuzz_target):
    """Pages padded past their content (vLLM pads attention pages to a hybrid model's largest page) in a pool that holds
    both layers: register_kv_caches measures the view by its elements' bytes (cache.nbytes), not by its padded blocks,
    and asserts that the pool cannot be split into regions."""
    page = 16 * 2 * 2 * 64 * 2
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16", page_size_padded=page + 256)
    case = Case(groups=(GroupCase(spec=spec, layers=LAYERS, backend="TRITON_ATTN"),), num_blocks=BLOCKS, layout="LBNHC", touches=NAMED)
    if "TRITON_ATTN" not in {b.name for b in kvfuzz_target.info.backends}:
        pytest.skip("no TRITON_ATTN")
    from fuzz.checks import nixl

    walk = kvfuzz_target.walk(case)
    record = nixl.CHECK.offer(kvfuzz_target.probe)(walk)
    assert record["error"]["type"] == "AssertionError", record
    assert "cannot be partitioned into NIXL regions" in record["error"]["message"]
    expected = oracles.expect(walk.case, kvfuzz_target.info.contract)
    finding = nixl.CHECK.judge(Judging(walk.case, kvfuzz_target.info.contract, expected, Outcome(), Verdict("pass")), record)
    assert finding is not None and finding.kind == "crash-on-valid"
    # One layer alone owns its pool, and its descriptors then move each page's 256 bytes of padding with the content: the
    # block's own bytes, as the offloading connector's regions may hold them.
    alone = Case(groups=(GroupCase(spec=spec, layers=LAYERS[:1], backend="TRITON_ATTN"),), num_blocks=BLOCKS, layout="LBNHC", touches=NAMED)
    _, record, found = driven(kvfuzz_target, alone)
    assert record["descriptors"] == [[0, b * (page + 256), (b + 1) * (page + 256)] for b in range(BLOCKS)]
    assert found is None


# ------------------------------------------------------------------------------------------- played transfers

SENT, RECEIVED = [1, 3], [2, 0]  # the sender's blocks 1 and 3 into the receiver's blocks 2 and 0


def play(target, sender_case: Case, receiver_case: Case, receiver_tp: tuple[int, int] = (1, 0), mutate=contextlib.nullcontext):
    """Both ends' walks, the transfer played, the record judged (the finding's kind, or None) and both ends for a look."""
    from fuzz.checks import nixl

    sender = nixl.End(target.walk(sender_case))
    receiver = nixl.End(target.walk(receiver_case), *receiver_tp)
    tokens = len(SENT) * sender_case.groups[0].spec.block_size
    received = RECEIVED[: max(1, min(len(RECEIVED), tokens // receiver_case.groups[0].spec.block_size))]
    with mutate():
        record = nixl.played(nixl.worker_class(), sender, receiver, SENT, received)
    expected = oracles.expect(receiver.walk.case, target.info.contract)
    finding = nixl.CHECK.judge(Judging(receiver.walk.case, target.info.contract, expected, Outcome(), Verdict("pass")), record)
    return record, None if finding is None else finding.kind, sender, receiver


def token(view, block: int, position: int, heads: slice = slice(None)):
    """Token `position` of block `block` of a (block, head, token, K and V) view, as bytes."""
    return view[block, heads, position].contiguous().view(torch.uint8)


def test_a_played_transfer_moves_exactly_the_sent_tokens(kvfuzz_target):
    case = attention_case("TRITON_ATTN", "LBHNC", 16)
    record, finding, sender, receiver = play(kvfuzz_target, case, case)
    assert finding is None and record["moved"] == 4 and record["finished"], record  # two layers, two blocks
    for layer in LAYERS:
        mine, theirs = receiver.walk.manager_views[layer], sender.walk.manager_views[layer]
        for position in (0, 7, 15):
            assert torch.equal(token(mine, 2, position), token(theirs, 1, position))
            assert torch.equal(token(mine, 0, position), token(theirs, 3, position))
        assert not torch.equal(token(mine, 1, 0), token(theirs, 1, 0)), "an unsent block keeps its own bytes"


@pytest.mark.parametrize("rank", [0, 1])
def test_a_decode_rank_of_twice_the_tp_reads_its_own_head(kvfuzz_target, rank):
    """The sender (TP 1) holds heads 0 and 1; the receiver's rank r (TP 2) holds one head: the sender's head r."""
    sender_case = attention_case("TRITON_ATTN", "LBHNC", 16)
    receiver_case = dataclasses.replace(sender_case, groups=(dataclasses.replace(
        sender_case.groups[0], spec=dataclasses.replace(sender_case.groups[0].spec, num_kv_heads=1)),))
    record, finding, sender, receiver = play(kvfuzz_target, sender_case, receiver_case, (2, rank))
    assert finding is None, record
    mine, theirs = receiver.walk.manager_views[LAYERS[0]], sender.walk.manager_views[LAYERS[0]]
    assert torch.equal(token(mine, 2, 5), token(theirs, 1, 5, slice(rank, rank + 1)))


def test_a_decode_rank_reading_the_other_rank_s_head_is_found(kvfuzz_target):
    """vLLM's TP mapping made wrong on purpose: rank 0 of the receiver reads head 1's slice (rank 1's)."""
    from fuzz.checks import nixl

    sender_case = attention_case("TRITON_ATTN", "LBHNC", 16)
    receiver_case = dataclasses.replace(sender_case, groups=(dataclasses.replace(
        sender_case.groups[0], spec=dataclasses.replace(sender_case.groups[0].spec, num_kv_heads=1)),))
    module = nixl.agent_module(nixl.worker_class())
    original = module.compute_tp_mapping

    def other_rank(*args, **kwargs):
        mapping = original(*args, **kwargs)
        return dataclasses.replace(mapping, rank_offset_factor=1 - mapping.rank_offset_factor)

    record, finding, _, _ = play(kvfuzz_target, sender_case, receiver_case, (2, 0),
                                 lambda: mock.patch.object(module, "compute_tp_mapping", other_rank))
    assert finding == "transfer-wrong", record
    assert record["wrong"][0]["heads"] == [0]


def test_smaller_sender_blocks_are_reassembled(kvfuzz_target):
    """16-token sender blocks into a 32-token receiver block: vLLM moves each block's bytes and reorders them on receipt."""
    record, finding, sender, receiver = play(kvfuzz_target, attention_case("TRITON_ATTN", "LBHNC", 16),
                                             attention_case("TRITON_ATTN", "LBHNC", 32))
    assert finding is None, record
    mine, theirs = receiver.walk.manager_views[LAYERS[1]], sender.walk.manager_views[LAYERS[1]]
    assert torch.equal(token(mine, 2, 20), token(theirs, 3, 4))


def test_mla_kernel_blocks_reach_a_decode_rank_of_twice_the_tp(kvfuzz_target):
    """MLA's latent is replicated: rank 1 of TP 2 reads the whole latent; 64-token blocks move as four 16-token kernel blocks."""
    record, finding, sender, receiver = play(kvfuzz_target, mla_case(64, 16), mla_case(64, 16), (2, 1))
    assert finding is None and record["moved"] == 2 * 2 * 4, record
    mine, theirs = receiver.walk.bound_views[LAYERS[0]], sender.walk.bound_views[LAYERS[0]]  # (kernel block, 1, 16, 576)
    assert torch.equal(token(mine, 2 * 4 + 2, 9), token(theirs, 1 * 4 + 2, 9))  # token 41 of block 2 from token 41 of block 1


def test_a_longer_descriptor_in_a_played_transfer_is_found(kvfuzz_target):
    case = attention_case("TRITON_ATTN", "LBHNC", 16)
    record, finding, _, _ = play(kvfuzz_target, case, case, mutate=lengthened_first_descriptor)
    assert finding == "transfer-mismatch" and record["refused"], record


def test_a_decode_with_smaller_blocks_is_refused_by_an_assertion(kvfuzz_target):
    """32-token sender blocks into 16-token receiver blocks: vLLM refuses the pair only with an `assert` (gone under
    python -O) in TransferTopology.block_size_ratio, whose message calls 16 and 32 not divisible."""
    record, finding, _, _ = play(kvfuzz_target, attention_case("TRITON_ATTN", "LBHNC", 32), attention_case("TRITON_ATTN", "LBHNC", 16))
    assert finding == "assert-on-invalid", record
    assert record["error"]["type"] == "AssertionError" and record["error"]["function"] == "block_size_ratio"


def test_a_handshake_between_layouts_is_refused(kvfuzz_target):
    record, finding, _, _ = play(kvfuzz_target, attention_case("TRITON_ATTN", "LBHNC", 16), attention_case("TRITON_ATTN", "LBNHC", 16))
    assert finding is None and record["error"]["type"] == "RuntimeError" and "kv_cache_layout" in record["error"]["message"]


RELEASE_SCRIPT = """
import dataclasses
import json
from fuzz.targets.loader import load_local
from tests.test_nixl import attention_case, judged, mla_case, play
SENDER = attention_case("TRITON_ATTN", "LBHNC", 16)
target = load_local()
out = {"version": target.info.vllm_version}
for name, case in (("cpu", attention_case("CPU_ATTN", "LBHNC", 32)), ("blocks-outermost", attention_case("TRITON_ATTN", "BLHNC", 16)),
                   ("mla", mla_case(64, 16))):
    _, record, finding = judged(target, case)
    out[name] = {"descriptors": record["descriptors"], "finding": finding}
out["longer"] = judged(target, attention_case("CPU_ATTN", "LBHNC", 32), longer_first=True)[2]
one_head = dataclasses.replace(SENDER.groups[0].spec, num_kv_heads=1)
half = dataclasses.replace(SENDER, groups=(dataclasses.replace(SENDER.groups[0], spec=one_head),))
out["tp2"] = play(target, SENDER, half, (2, 1))[1]
out["blocks16to32"] = play(target, SENDER, attention_case("TRITON_ATTN", "LBHNC", 32))[1]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_release_0_34(tmp_path):
    """The same judgement on 0.34.0, whose worker hands nixl strided descriptor rows (the recording agent expands them)."""
    from tests.processes import run_in_release

    out = run_in_release("0.34.0", RELEASE_SCRIPT, tmp_path)
    assert out["version"] == "0.34.0"
    assert out["cpu"] == {"descriptors": layer_major(32 * 512, BLOCKS), "finding": None}
    assert out["blocks-outermost"]["finding"] is None
    assert out["blocks-outermost"]["descriptors"] == [[0, b * 16384 + layer * 8192, b * 16384 + (layer + 1) * 8192]
                                                      for layer in range(2) for b in range(BLOCKS)]
    assert out["mla"] == {"descriptors": layer_major(16 * 576 * 2, BLOCKS * 4), "finding": None}
    assert out["longer"] is not None and out["longer"].startswith("transfer-mismatch: ")
    assert out["tp2"] is None and out["blocks16to32"] is None  # played transfers: rank 1 of TP 2, 16- into 32-token blocks


# ------------------------------------------------------------------------------------------- the oracle, without vLLM


def synthetic():
    """Two layers of 2 heads x 64 bf16, 16-token blocks, layer-major: each layer's page is 16 x 2 x 2 x 64 x 2 = 8192 bytes."""
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
    case = one_group(spec, layout="LBNHC", blocks=3, layers=("l0", "l1"))
    return case, oracles.expect(case, LAYOUT_PLACED_KERNEL_MAP)


def descriptors(rows: list[tuple[int, int]], region_blocks: int = 3) -> list[transfer.Descriptor]:
    return [transfer.Descriptor(i // region_blocks, i % region_blocks, 0, start, end) for i, (start, end) in enumerate(rows)]


PAGE = 8192
RIGHT = [(k * PAGE, (k + 1) * PAGE) for k in range(6)]


def test_right_descriptors_pass():
    case, expected = synthetic()
    assert transfer.check(case, expected, descriptors(RIGHT), 1) is None


def test_a_descriptor_into_the_next_block_is_foreign():
    case, expected = synthetic()
    rows = [RIGHT[0], (PAGE, 2 * PAGE + 2), *RIGHT[2:]]
    problem = transfer.check(case, expected, descriptors(rows), 1)
    assert problem is not None and problem.kind == "foreign" and (problem.region, problem.kernel_block) == (0, 1)
    assert problem.byte_set[0].starts.tolist() == [2 * PAGE] and problem.byte_set[0].ends.tolist() == [2 * PAGE + 2]


def test_a_short_descriptor_misses_its_last_element():
    case, expected = synthetic()
    rows = [(0, PAGE - 2), *RIGHT[1:]]
    problem = transfer.check(case, expected, descriptors(rows), 1)
    assert problem is not None and problem.kind == "missed" and problem.kernel_block == 0
    assert problem.byte_set[0].starts.tolist() == [PAGE - 2]


def test_logical_block_ids_on_split_blocks_miss_the_second_half():
    """Descriptors counted in manager blocks where each manager block is two kernel blocks (vLLM #28677's shape)."""
    spec = SpecCase(kind="full", block_size=32, num_kv_heads=2, head_size=64, dtype="bfloat16")
    case = one_group(spec, layout="LBNHC", blocks=2, kernel=16, layers=("l0",))
    expected = oracles.expect(case, LAYOUT_PLACED_KERNEL_MAP)
    half = 16 * 2 * 2 * 64 * 2
    problem = transfer.check(case, expected, descriptors([(0, half), (half, 2 * half)], region_blocks=2), 2)
    assert problem is not None and problem.kind == "missed" and problem.kernel_block == 2
    assert transfer.check(case, expected, descriptors([(k * half, (k + 1) * half) for k in range(4)], region_blocks=4), 2) is None


def test_duplicate_descriptors_overlap():
    case, expected = synthetic()
    rows = [*RIGHT, RIGHT[4]]
    found = descriptors(rows)
    found[-1] = transfer.Descriptor(2, 1, 0, *RIGHT[4])
    problem = transfer.check(case, expected, found, 1)
    assert problem is not None and problem.kind == "overlap"


def test_a_descriptor_outside_every_buffer():
    case, expected = synthetic()
    found = descriptors(RIGHT)
    found[3] = transfer.Descriptor(1, 0, -1, 123, 456)
    problem = transfer.check(case, expected, found, 1)
    assert problem is not None and problem.kind == "outside"


@pytest.mark.parametrize(("layout", "drawn"), [("LBNHC", False), ("LBHNC", False), ("BLNHC", True), ("BLHNC", True)])
def test_compressed_caches_are_moved_only_in_block_outermost_layouts(layout, drawn):
    """A model with compressed caches has DeepSeek V4's indexer, whose backend supports only BLHNC and BLNHC: NIXL (which
    asserts it on 0.32 - 0.33) is not driven on such a case in a layer-outer layout, and is on a block-outermost one."""
    from fuzz.checks import nixl

    spec = SpecCase(kind="sliding_window_mla", block_size=128, num_kv_heads=1, head_size=576, dtype="bfloat16", compress_ratio=8,
                    sliding_window=2)
    case = Case(groups=(GroupCase(spec=spec, layers=LAYERS, backend="FLASHINFER_MLA_SPARSE_DSV41"),), num_blocks=BLOCKS,
                layout=layout, touches=NAMED)
    reason = nixl.CHECK.unrealistic(case)
    assert (reason is None) == drawn, reason
    uncompressed = dataclasses.replace(case, groups=(dataclasses.replace(case.groups[0], spec=dataclasses.replace(spec, compress_ratio=1)),))
    assert nixl.CHECK.unrealistic(uncompressed) is None


def test_synthetic_backends_that_declare_differently_are_two_backends():
    """NIXL picks one kernel block size for the model over its backends (select_common_block_size): two groups of one
    synthetic backend name that declare different kernel block sizes are two backends, which NIXL is not driven on."""
    from fuzz.case import SyntheticBackend
    from fuzz.checks import nixl

    spec = SpecCase(kind="mla", block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16")
    one = SyntheticBackend(name="alpha", kernel_block_sizes=(64,))
    groups = tuple(GroupCase(spec=spec, layers=(f"g{i}.l0",), synthetic_backend=backend)
                   for i, backend in enumerate((one, dataclasses.replace(one, kernel_block_sizes=(1,)))))
    case = Case(groups=groups, num_blocks=BLOCKS, layout="BLNHC", touches=NAMED)
    assert nixl.CHECK.unrealistic(case) == "NIXL moves a model of one attention backend"
    alike = dataclasses.replace(case, groups=(groups[0], dataclasses.replace(groups[1], synthetic_backend=one)))
    assert nixl.CHECK.unrealistic(alike) is None
