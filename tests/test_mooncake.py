"""The Mooncake check (fuzz/checks/mooncake.py): vLLM's Mooncake worker registers a case's caches with a recording stand-in
for Mooncake's TransferEngine, each layer's per-block span is held against the bytes its block owns (oracles/transfer.py),
and the case's blocks are pushed into a peer through vLLM's own pull path.

The spans vLLM works out on 0.32.0 and 0.34.0 are compared with spans worked out here by hand from the cases' page sizes;
the judgement is shown to pass them, and to report a tree whose Mooncake connector registers a span one element too long,
or steps its blocks by the wrong stride."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import oracles
from fuzz.case import Case, GroupCase, SpecCase, Touches
from oracles import transfer
from oracles.contract import LAYOUT_PLACED_KERNEL_MAP
from tests.conftest import one_group
from tests.sweep import sampled

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
BLOCKS = 4
NAMED = Touches(consumers=("mooncake",))  # a case asks for the check by naming it
CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py"
# A token's K and V are 2 heads x 2 x 64 bf16 = 512 bytes; a 16-token page is 8192 bytes.
PAGE = 16 * 512
PADDING = 256


def attention_case(layout: str = "LBHNC", kind: str = "full", layers: tuple[str, ...] = LAYERS, **fields: int) -> Case:
    spec = SpecCase(kind=kind, block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16", **fields)
    return Case(groups=(GroupCase(spec=spec, layers=layers, backend="TRITON_ATTN"),), num_blocks=BLOCKS, layout=layout, touches=NAMED)


def mla_case() -> Case:
    """MLA's 576-element latent in 64-token blocks of 16-token kernel blocks: four kernel blocks of 16 x 576 bf16 per block."""
    spec = SpecCase(kind="mla", block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16")
    return Case(groups=(GroupCase(spec=spec, layers=LAYERS, backend="CPU_MLA", kernel_block_size=16),), num_blocks=BLOCKS,
                layout="LBNHC", touches=NAMED)


CASES = {
    "full": attention_case(),
    "sliding-window": attention_case(kind="sliding_window", sliding_window=64),
    "blocks-outermost": attention_case("BLHNC"),
    "padded": attention_case("LBNHC", layers=LAYERS[:1], page_size_padded=PAGE + PADDING),
    "mla-kernel-split": mla_case(),
    # The generator's layer names carry no layer index; the check hands them to Mooncake under vLLM's (vllm_names).
    "generator-names": attention_case(layers=("g0.l0", "g0.l1")),
    # Five blocks, its kernel block size stated as the walk states it: its played push goes into rank 1 of a decode instance
    # of twice the TP (nixl.peer_of reads the walked case), which holds head 1.
    "tp-peer": dataclasses.replace(attention_case(), num_blocks=5, groups=(
        dataclasses.replace(attention_case().groups[0], kernel_block_size=16),)),
}


def layer_major(page: int, kernel_blocks: int, pitch: int | None = None) -> list[list[int]]:
    """Spans of a layer-major layout (each layer's blocks consecutive, one buffer), layer by layer, block by block: block k
    of layer l starts k pitches into the layer's blocks and holds `page` bytes."""
    pitch = pitch or page
    return [[0, (layer * kernel_blocks + k) * pitch, (layer * kernel_blocks + k) * pitch + page]
            for layer in range(len(LAYERS)) for k in range(kernel_blocks)]


EXPECTED = {
    "full": layer_major(PAGE, BLOCKS),
    "sliding-window": layer_major(PAGE, BLOCKS),
    # Block-outermost: block b's row holds layer 0's page, then layer 1's.
    "blocks-outermost": [[0, b * 2 * PAGE + layer * PAGE, b * 2 * PAGE + (layer + 1) * PAGE] for layer in range(2) for b in range(BLOCKS)],
    # 64-token blocks moved as four 16-token kernel blocks of 16 x 576 bf16 each.
    "mla-kernel-split": layer_major(16 * 576 * 2, BLOCKS * 4),
    "generator-names": layer_major(PAGE, BLOCKS),
}

SCRIPT = """
import json
from fuzz.checks import mooncake
from fuzz.targets.loader import load_local
from tests.test_mooncake import CASES, judged
target = load_local()
offered = mooncake.CHECK.offer(target.probe)
out = {"version": target.info.vllm_version, "off": getattr(offered, "reason", None)}
for name in NAMES if callable(offered) else ():
    out[name] = judged(target, CASES[name])
print("RESULT " + json.dumps(out))
"""


def judged(target, case: Case) -> dict:
    """The check's record on the case's walk, cut to what the tests read, with its judgement (the finding's kind and
    message, or None)."""
    import oracles
    from fuzz.checks import mooncake
    from fuzz.checks.protocol import Judging
    from fuzz.targets.base import Outcome
    from fuzz.verdict.compare import Verdict

    run = mooncake.CHECK.offer(target.probe)
    assert callable(run), f"vLLM {target.info.vllm_version} offers no Mooncake run: {run}"
    walk = target.walk(case)
    record = run(walk)
    expected = oracles.expect(walk.case, target.info.contract)
    finding = mooncake.CHECK.judge(Judging(walk.case, target.info.contract, expected, Outcome(), Verdict("pass")), record)
    played = record.get("played", {})
    return {"finding": None if finding is None else f"{finding.kind}: {finding.message}",
            "error": record.get("error"), "skipped": record.get("skipped"), "ratio": record.get("ratio"),
            "descriptors": record.get("descriptors"), "registered": record.get("registered"), "buffers": record.get("buffer_bytes"),
            "calls": record.get("calls"),
            "played": {key: played.get(key) for key in ("peer", "skipped", "error", "moved", "failed", "finished", "wrong", "refused")}}


def run_in_tree(source: str, names: list[str], cwd: Path) -> dict:
    """SCRIPT on the named cases, in a worker environment of `source` (a release, or a tree's folder)."""
    from fuzz.errors import TargetError
    from fuzz.targets import releases

    try:
        target = releases.resolve(source)
    except TargetError as error:
        pytest.skip(f"vLLM {source} is not available here: {error}")
    env = releases.worker_environment(target)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(Path(__file__).absolute().parent.parent)])
    script = f"NAMES = {names!r}\n{SCRIPT}"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, cwd=cwd)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def assert_passes(out: dict) -> None:
    for name in CASES:
        got = out[name]
        assert got["error"] is None and got["skipped"] is None, (name, got)
        assert got["finding"] is None, (name, got["finding"])
        assert got["buffers"] and got["registered"] == [[0, 0, got["buffers"][0]]], (name, got)  # the one pool, whole
        assert {"initialize", "batch_register_memory"} <= set(got["calls"]), (name, got["calls"])
        if name in EXPECTED:
            assert got["descriptors"] == EXPECTED[name], name
    assert out["mla-kernel-split"]["ratio"] == 4 and out["full"]["ratio"] == 1
    # The padded page: blocks one padded page apart, each span its block's 8192 content bytes and at most its own padding.
    spans = out["padded"]["descriptors"]
    assert [start for _, start, _ in spans] == [b * (PAGE + PADDING) for b in range(BLOCKS)]
    assert all(PAGE <= end - start <= PAGE + PADDING for _, start, end in spans)
    # A played push reached the receiver where the peer builds: every pair moved, no token holds other bytes.
    played = [out[name]["played"] for name in CASES if not out[name]["played"]["skipped"]]
    assert played, out
    for record in played:
        assert record["error"] is None and record["refused"] == [], record
        assert record["failed"] or (record["finished"] and record["moved"] > 0 and record["wrong"] == []), record


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.32.0", "0.34.0"])
def test_the_release_registers_each_block_s_bytes(version, tmp_path):
    out = run_in_tree(version, list(CASES), tmp_path)
    assert out["version"] == version
    assert_passes(out)


def test_the_installed_release_pushes_the_same_case_whole(kvfuzz_target):
    """A push into the same case: the receiver's blocks hold the sender's bytes after vLLM's own pull path ran, and the
    workers' event loops, sender pool and ZMQ context are gone afterwards."""
    if "TRITON_ATTN" not in {b.name for b in kvfuzz_target.info.backends}:
        pytest.skip("no TRITON_ATTN")
    before = set(threading.enumerate())
    got = judged(kvfuzz_target, CASES["padded"])
    assert got["finding"] is None and got["played"]["peer"] == "same", got
    assert got["played"]["finished"] and not got["played"]["failed"] and got["played"]["moved"] == 2, got  # one layer, two blocks
    assert set(threading.enumerate()) <= before


@pytest.mark.slow
def test_0_29_moves_a_whole_page_per_kernel_block(tmp_path):
    """0.29's registration takes an attention layer's whole page (64 tokens x 576 bf16 = 73728 bytes) as the transfer
    length of each 16-token kernel block it steps through (18432 bytes apart): kernel block k's span covers blocks k to
    k + 3. 0.30 divides the page by the kernel blocks per block, and refuses a length past the stride."""
    out = run_in_tree("0.29.0", ["full", "mla-kernel-split"], tmp_path)
    assert out["full"]["finding"] is None and out["full"]["descriptors"] == EXPECTED["full"]
    assert out["mla-kernel-split"]["descriptors"][0] == [0, 0, 73728]
    finding = out["mla-kernel-split"]["finding"]
    assert finding is not None and finding.startswith("transfer-mismatch: ") and "kernel block 0 covers 55296 bytes" in finding


@pytest.mark.slow
def test_releases_before_0_29_are_off(tmp_path):
    out = run_in_tree("0.28.0", [], tmp_path)
    assert out["off"] is not None and "before 0.29" in out["off"]


# ------------------------------------------------------------------------------------------- mutated trees


def mutated_tree(version: str, root: Path, old: str, new: str) -> Path:
    """The release's tree linked file by file into `root`, its Mooncake connector replaced by a copy with `old` made `new`."""
    from fuzz.errors import TargetError
    from fuzz.targets import releases

    try:
        source = releases.resolve(version)
    except TargetError as error:
        pytest.skip(f"release not available here: {error}")
    assert source.python_path is not None
    shutil.copytree(source.python_path / "vllm", root / "vllm", symlinks=True, copy_function=os.symlink)
    path = root / CONNECTOR
    text = path.read_text()
    assert old in text, f"{version}'s Mooncake connector has no {old!r}"
    path.unlink()
    path.write_text(text.replace(old, new))
    return root


# Every region's transfer length one bf16 element longer: each block's span reaches into the next block's first element.
LONGER = ("self.kv_block_len_per_layer.append(kv_block_len)", "self.kv_block_len_per_layer.append(kv_block_len + 2)")
# The block stride taken as twice the view's: the element size counted twice, block k read 2k pages in.
WIDER = ("block_len = region_cache.stride(0) * region_cache.element_size()",
         "block_len = region_cache.stride(0) * region_cache.element_size() * 2")


# The prefill side slices the head range of the decode rank after the one that asked (TP 1 into TP 2: rank 1 gets head 0).
OTHER_RANK = ("(remote_tp_rank % ratio_abs) * remote_kv_block_len", "((remote_tp_rank + 1) % ratio_abs) * remote_kv_block_len")


def test_the_tp_peer_case_is_pushed_into_rank_1_of_twice_the_tp():
    from fuzz.checks import nixl

    how, peer, tp_size, tp_rank = nixl.peer_of(CASES["tp-peer"])
    assert (how, tp_size, tp_rank) == ("tp", 2, 1) and peer.groups[0].spec.num_kv_heads == 1


@pytest.mark.slow
@pytest.mark.parametrize("version", sampled(["0.32.0", "0.34.0"], ["0.34.0"]))
def test_a_push_of_the_wrong_rank_s_heads_is_reported(version, tmp_path):
    root = mutated_tree(version, tmp_path / "tree", *OTHER_RANK)
    got = run_in_tree(str(root), ["tp-peer"], tmp_path)["tp-peer"]
    assert got["played"]["peer"] == "tp" and got["played"]["wrong"], got
    assert got["finding"] is not None and got["finding"].startswith("transfer-wrong: "), got


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.32.0", "0.34.0"])
@pytest.mark.parametrize(("mutation", "case"), [(LONGER, "full"), (WIDER, "full"), (WIDER, "mla-kernel-split")],
                         ids=["one-element-longer", "wrong-stride", "wrong-kernel-stride"])
def test_a_mutated_connector_is_reported(version, mutation, case, tmp_path):
    root = mutated_tree(version, tmp_path / "tree", *mutation)
    got = run_in_tree(str(root), [case], tmp_path)[case]
    assert got["error"] is None and got["skipped"] is None, got
    assert got["finding"] is not None and got["finding"].startswith("transfer-mismatch: "), got


# ------------------------------------------------------------------------------------------- the judgement, without vLLM


@pytest.mark.parametrize(("registered", "outside"), [
    ([[0, 0, 65536]], False),
    ([[0, 0, 65538]], True),  # two bytes past the pool
    ([[-1, 4096, 8192]], True),  # no buffer holds it
], ids=["the-pool", "past-its-end", "elsewhere"])
def test_registered_memory_must_lie_in_the_buffers(registered, outside):
    from fuzz.checks import mooncake

    found = mooncake.outside({"registered": registered, "buffer_bytes": [65536]})
    assert (found is not None) == outside, found


@pytest.mark.parametrize(("layout", "one_run"), [
    ("LBHNC", True), ("LBNHC", True), ("BLHNC", True), ("BLNHC", True),  # a layer's block: heads, tokens and content
    ("LHBNC", False), ("BHLNC", False),  # a layer's block: one run per head
    ("NHD", True), ("HND", True),
])
def test_a_block_is_one_run_of_bytes_where_its_heads_lie_inside_it(layout, one_run):
    from oracles import transfer

    assert transfer.block_is_one_run(layout) is one_run


def test_generator_names_are_renamed_with_one_layer_index_each_and_kept_where_they_have_one():
    from fuzz.checks import mooncake

    case = CASES["generator-names"]
    names = mooncake.vllm_names(case)
    assert names == {"g0.l0": "model.layers.0.self_attn.attn", "g0.l1": "model.layers.1.self_attn.attn"}
    assert mooncake.vllm_names(CASES["full"]) == {name: name for name in LAYERS}


def test_the_check_is_drawn_into_campaigns():
    from fuzz.checks import mooncake

    assert mooncake.CHECK.drawn is True and mooncake.CHECK.applies(CASES["full"])

def sharing_and_two_groups() -> list[tuple[Case, list[transfer.Descriptor]]]:
    """Two cases whose second layer's blocks are the first layer's bytes, each with a span per block and layer: a KV-sharing
    layer (one cache), and two one-layer groups over one pool (a block id is one group's at a time)."""
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
    sharing = dataclasses.replace(one_group(spec, layout="LBNHC", blocks=3, layers=("l0",)), kv_sharing=(("l1", "l0"),))
    two_groups = Case(groups=(GroupCase(spec=spec, layers=("l0",)), GroupCase(spec=spec, layers=("l1",))), num_blocks=3,
                      layout="LBNHC")
    page = 16 * 2 * 2 * 64 * 2
    spans = [transfer.Descriptor(region, k, 0, k * page, (k + 1) * page) for region in (0, 1) for k in range(3)]
    return [(sharing, spans), (two_groups, spans)]


@pytest.mark.parametrize("index", [0, 1], ids=["kv-sharing", "two-groups"])
def test_spans_of_one_block_id_may_share_bytes_in_one_cache_or_across_groups(index):
    """Mooncake registers a KV-sharing layer's region beside its target's, and each group's layers over the pool the groups
    share: the same bytes under the same block id are one cache's, never two blocks'."""
    case, spans = sharing_and_two_groups()[index]
    expected = oracles.expect(case, LAYOUT_PLACED_KERNEL_MAP)
    assert transfer.check(case, expected, spans, 1, ["l0", "l1"]) is None
    unnamed = transfer.check(case, expected, spans, 1)  # a connector whose regions name no layer: every shared byte counts
    assert unnamed is not None and unnamed.kind == "overlap"


def test_spans_of_two_block_ids_sharing_bytes_overlap_whatever_their_layers():
    case, spans = sharing_and_two_groups()[0]
    expected = oracles.expect(case, LAYOUT_PLACED_KERNEL_MAP)
    swapped = [*spans[:3], dataclasses.replace(spans[3], kernel_block=1), dataclasses.replace(spans[4], kernel_block=0), spans[5]]
    problem = transfer.check(case, expected, swapped, 1, ["l0", "l1"])
    assert problem is not None and problem.kind in ("foreign", "overlap")
