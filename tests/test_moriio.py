"""The MoRI-IO check (fuzz/checks/moriio.py): vLLM's MoRI-IO worker registers a case's caches with a recording stand-in for
mori's IOEngine, each layer's per-block span is held against the bytes its block owns (oracles/transfer.py), and a peer
reads the case's blocks through vLLM's own READ path.

The spans vLLM works out on 0.32.0 and 0.34.0 are compared with spans worked out here by hand from the cases' page sizes;
the judgement is shown to pass them, to report a tree whose MoRI-IO layout moves one element too many per block, and to
report what vLLM does wrong on generated cases only in the families triaged (the module's report)."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fuzz.case import Case, GroupCase, SpecCase, Touches
from tests.sweep import sampled

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
BLOCKS = 4
NAMED = Touches(consumers=("moriio",))  # a case asks for the check by naming it
LAYOUT_MODULE = "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_layout.py"
# A token's K and V are 2 heads x 2 x 64 bf16 = 512 bytes; a 16-token page is 8192 bytes, two pages a 4096-byte multiple.
PAGE = 16 * 512
PADDING = 256
MR_PAGE = 4096  # vLLM pads the ROCm backing to whole pages (oracles/contract.py backing_allocation_bytes)
ODD_PAGE = 16 * 2 * 2 * 48 * 2


def attention_case(layout: str = "LBHNC", kind: str = "full", layers: tuple[str, ...] = LAYERS, backend: str = "TRITON_ATTN",
                   blocks: int = BLOCKS, head_size: int = 64, **fields: int) -> Case:
    spec = SpecCase(kind=kind, block_size=16, num_kv_heads=2, head_size=head_size, dtype="bfloat16", **fields)
    return Case(groups=(GroupCase(spec=spec, layers=layers, backend=backend),), num_blocks=blocks, layout=layout, touches=NAMED,
                platform="rocm")


def mla_case() -> Case:
    """MLA's 576-element latent in 64-token blocks of 16-token kernel blocks."""
    spec = SpecCase(kind="mla", block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16")
    return Case(groups=(GroupCase(spec=spec, layers=LAYERS, backend="CPU_MLA", kernel_block_size=16),), num_blocks=BLOCKS,
                layout="LBNHC", touches=NAMED, platform="rocm")


CASES = {
    "full": attention_case(),
    "sliding-window": attention_case(kind="sliding_window", sliding_window=64),
    "blocks-outermost": attention_case("BLHNC"),
    "padded": attention_case("LBNHC", layers=LAYERS[:1], page_size_padded=PAGE + PADDING),
    "generator-names": attention_case(layers=("g0.l0", "g0.l1")),
    # 6144-byte pages (head size 48), three of them: 4.5 memory pages, which vLLM pads to 5 on ROCm.
    "odd-pages": attention_case(layers=LAYERS[:1], blocks=3, head_size=48),
    # A KV-sharing layer reads its target's cache: vLLM adds it to the target's group after the connector is built.
    "kv-sharing": dataclasses.replace(attention_case(), kv_sharing=(("model.layers.2.self_attn.attn", LAYERS[1]),)),
    # MoRI-IO moves whole blocks: it refuses a view of kernel blocks (get_layer_transfer_geometry's ValueError).
    "mla-kernel-split": mla_case(),
    # The block axis inside the head axis: block b of a layer is one run per head (FINDINGS.md #18's layout).
    "heads-outside-blocks": attention_case("LHBNC", layers=LAYERS[:1], backend="ROCM_SEGMENTED_ATTN", blocks=2),
}


def layer_major(page: int, blocks: int, layers: int = 2, pitch: int | None = None) -> list[list[int]]:
    """Spans [region, block, buffer, start, end] of a layer-major layout (each layer's blocks consecutive, one buffer)."""
    pitch = pitch or page
    return [[layer, block, 0, (layer * blocks + block) * pitch, (layer * blocks + block) * pitch + page]
            for layer in range(layers) for block in range(blocks)]


EXPECTED = {
    "full": layer_major(PAGE, BLOCKS),
    "sliding-window": layer_major(PAGE, BLOCKS),
    # Block-outermost: block b's row holds layer 0's page, then layer 1's.
    "blocks-outermost": [[layer, b, 0, (2 * b + layer) * PAGE, (2 * b + layer + 1) * PAGE] for layer in range(2) for b in range(BLOCKS)],
    # Padded pages: block b one padded page in, its 8192 content bytes (the padding stays behind).
    "padded": [[0, b, 0, b * (PAGE + PADDING), b * (PAGE + PADDING) + PAGE] for b in range(BLOCKS)],
    "generator-names": layer_major(PAGE, BLOCKS),
    "kv-sharing": layer_major(PAGE, BLOCKS),
    "odd-pages": layer_major(ODD_PAGE, 3, layers=1),
}
# The one memory region registered over the shared backing: all of it (the backing padded to whole pages on ROCm).
BACKING = {name: 2 * BLOCKS * PAGE for name in ("full", "sliding-window", "blocks-outermost", "generator-names", "kv-sharing")}  # whole pages
BACKING["padded"] = -(-(BLOCKS * (PAGE + PADDING)) // MR_PAGE) * MR_PAGE
BACKING["odd-pages"] = 5 * MR_PAGE

SCRIPT = """
import json
from fuzz.checks import moriio
from fuzz.targets.loader import load_local
from tests.test_moriio import CASES, generated, judged
target = load_local()
offered = moriio.CHECK.offer(target.probe)
out = {"version": target.info.vllm_version, "off": getattr(offered, "reason", None), "none": offered is None}
for name in NAMES if callable(offered) else ():
    out[name] = judged(target, CASES[name])
if GENERATED and callable(offered):
    out["generated"] = dict(generated(target, *GENERATED))
print("RESULT " + json.dumps(out))
"""


def judged(target, case: Case) -> dict:
    """The check's record on the case's walk, cut to what the tests read, with its judgement (the finding's kind and
    message, or None)."""
    import oracles
    from fuzz.checks import moriio
    from fuzz.checks.protocol import Judging
    from fuzz.targets.base import Outcome
    from fuzz.verdict.compare import Verdict

    if case.groups[0].backend not in {b.name for b in target.info.backends}:
        return {"absent": case.groups[0].backend}
    run = moriio.CHECK.offer(target.probe)
    assert callable(run), f"vLLM {target.info.vllm_version} offers no MoRI-IO run: {run}"
    walk = target.walk(case)
    record = run(walk)
    expected = oracles.expect(walk.case, target.info.contract)
    judging = Judging(walk.case, target.info.contract, expected, Outcome(), Verdict("pass"))
    played = record.pop("played", None) or {"skipped": "not played"}
    keys = ("error", "skipped", "ratio", "spans", "registered", "advertised", "sessions", "buffer_bytes", "calls", "replaced")
    return {"finding": said(moriio.CHECK.judge(judging, record)), **{key: record.get(key) for key in keys},
            "regions": [region["name"] for region in record.get("regions", [])],
            "played": {"finding": None if "skipped" in played else said(moriio.CHECK.judge(judging, played)),
                       **{key: played.get(key) for key in ("peer", "skipped", "error", "moved", "failed", "finished", "wrong", "refused")}}}


def said(finding) -> str | None:
    """A finding as the tests read it: its kind and message."""
    return None if finding is None else f"{finding.kind}: {finding.message}"


def read(target, sender_case: Case, receiver_case: Case, sent: list[int], received: list[int]) -> tuple[dict, str | None]:
    """A played read of the sender's blocks into the receiver's, through vLLM's READ path, and its judgement."""
    import oracles
    from fuzz.checks import moriio, nixl
    from fuzz.checks.protocol import Judging
    from fuzz.targets.base import Outcome
    from fuzz.verdict.compare import Verdict

    cls = moriio.worker_module().MoRIIOConnectorWorker
    record = moriio.played(cls, nixl.End(target.walk(sender_case)), nixl.End(target.walk(receiver_case)), sent, received)
    expected = oracles.expect(receiver_case, target.info.contract)
    return record, said(moriio.CHECK.judge(Judging(receiver_case, target.info.contract, expected, Outcome(), Verdict("pass")), record))


def run_in_tree(source: str, names: list[str], cwd: Path, generated_sample: tuple[int, int] | None = None) -> dict:
    """SCRIPT on the named cases (and a generated sample: seed, count), in a worker environment of `source` (a release, or
    a tree's folder)."""
    from fuzz.errors import TargetError
    from fuzz.targets import releases

    try:
        target = releases.resolve(source)
    except TargetError as error:
        pytest.skip(f"vLLM {source} is not available here: {error}")
    env = releases.worker_environment(target)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(Path(__file__).absolute().parent.parent)])
    script = f"NAMES = {names!r}\nGENERATED = {generated_sample!r}\n{SCRIPT}"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=1800, cwd=cwd)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def assert_passes(out: dict) -> None:
    for name, spans in EXPECTED.items():
        got = out[name]
        assert got["error"] is None and got["skipped"] is None, (name, got)
        assert got["finding"] is None, (name, got["finding"])
        assert got["spans"] == spans, name
        assert got["registered"] == [[0, 0, BACKING[name]]] and got["buffer_bytes"] == [BACKING[name]], (name, got)
        assert {"create_backend", "register_torch_tensor"} <= set(got["calls"]), (name, got["calls"])
        assert all("(mori.io." in what for what in got["replaced"]), got["replaced"]
    assert out["kv-sharing"]["regions"] == list(LAYERS)  # the sharer is no transfer layer of the connector's
    # Each layer's advertised region: its blocks, end to end (block-outermost: from its first page to its last).
    assert out["full"]["advertised"] == [[0, 0, BLOCKS * PAGE], [0, BLOCKS * PAGE, 2 * BLOCKS * PAGE]]
    assert out["blocks-outermost"]["advertised"] == [[0, layer * PAGE, (2 * BLOCKS - 2 + layer) * PAGE + PAGE] for layer in range(2)]
    refused = out["mla-kernel-split"]
    assert refused["finding"] is not None and refused["finding"].startswith("refused-valid: "), refused
    assert refused["error"]["type"] == "ValueError" and refused["error"]["function"] == "get_layer_transfer_geometry", refused
    # A played read into a peer of the same blocks (the same case, or twice the TP) moved every pair it did not refuse,
    # and the receiver holds the sender's tokens.
    played = [out[name]["played"] for name in EXPECTED if out[name]["played"]["peer"] in ("same", "tp")]
    for record in played:
        assert record["finding"] is None, record


@pytest.mark.slow
@pytest.mark.parametrize("version", sampled(["0.32.0", "0.34.0"], ["0.34.0"]))
def test_the_release_registers_and_moves_each_block_s_bytes(version, tmp_path):
    out = run_in_tree(version, list(CASES), tmp_path)
    assert out["version"] == version
    assert_passes(out)
    # Heads outside the blocks: MoRI-IO moves one span per block from the block's first byte, which here is one head's
    # run of several blocks (FINDINGS.md candidates; see the check's report). 0.34 sizes a block by its view's extent, a
    # region past the backing, which it refuses.
    lhbnc = out["heads-outside-blocks"]
    if "absent" not in lhbnc:
        assert lhbnc["finding"] is not None and lhbnc["finding"].split(":")[0] in ("transfer-mismatch", "refused-valid"), lhbnc


def test_the_installed_release_reads_the_same_case_whole(kvfuzz_target):
    """A read of the same case: every pair moved through vLLM's own READ path (one span per layer and block: blocks 1 and
    3 are not adjacent), the receiver's blocks 2 and 0 hold the sender's bytes, and the workers' pools are gone afterwards."""
    if "TRITON_ATTN" not in {b.name for b in kvfuzz_target.info.backends}:
        pytest.skip("no TRITON_ATTN")
    before = set(threading.enumerate())
    record, finding = read(kvfuzz_target, CASES["full"], CASES["full"], [1, 3], [2, 0])
    assert finding is None and record["finished"] and record["moved"] == 4 and record["refused"] == [], record
    assert record["wrong"] == [] and record["failed"] == [], record
    assert set(threading.enumerate()) <= before


def test_a_read_from_a_prefill_of_other_block_sizes_is_found(kvfuzz_target):
    """A decode instance of 32-token blocks reads a prefill's 16-token blocks: vLLM computes the prefill side's offsets with
    its own block stride (compute_block_transfer_offsets: rb * geometry.block_stride, the local geometry), so it reads other
    bytes than the sent blocks' (0.32; 0.34 refuses the pair for attention, not for MLA)."""
    if "TRITON_ATTN" not in {b.name for b in kvfuzz_target.info.backends}:
        pytest.skip("no TRITON_ATTN")
    if not kvfuzz_target.info.vllm_version.startswith("0.32"):
        pytest.skip("the decode side's strides are checked on 0.32")
    sender_case = attention_case()
    receiver_case = dataclasses.replace(sender_case, groups=(dataclasses.replace(
        sender_case.groups[0], spec=dataclasses.replace(sender_case.groups[0].spec, block_size=32)),))
    record, finding = read(kvfuzz_target, sender_case, receiver_case, [1, 2], [3])
    assert finding is not None and finding.split(":")[0] in ("transfer-wrong", "transfer-mismatch"), record


# ------------------------------------------------------------------------------------------- generated cases

# What the check reports on generated cases, by family (each triaged: the check's report): vLLM's explicit refusals,
# layouts whose blocks are not one run of bytes, a read from a prefill of other block sizes, and KV sharing inside
# UniformTypeKVCacheSpecs groups.
REFUSAL_MESSAGES = ("block length mismatch", "Unsupported MoRIIO", "shared KV backing too small")


def triaged(case: Case, finding) -> bool:
    from oracles import transfer

    message = finding.message
    if finding.kind == "refused-valid":
        return any(text in message for text in REFUSAL_MESSAGES)
    if not transfer.block_is_one_run(case.layout):
        return finding.kind in ("transfer-mismatch", "transfer-overlap", "transfer-wrong", "refused-valid", "transfer-unregistered")
    return "start_load_kv" in message and finding.kind in ("transfer-mismatch", "transfer-wrong")


def generated(target, seed: int, count: int) -> collections.Counter:
    """The check on `count` cases of a seeded campaign sample, each on ROCm and naming the check: its verdicts by family,
    and every finding outside the triaged families."""
    from fuzz.checks import moriio
    from fuzz.space import Rejected, draw_indexed
    from fuzz.verdict.runner import run_case

    tally: collections.Counter = collections.Counter()
    for index in range(count):
        try:
            case = draw_indexed(target.info, seed, index, touches=True)
        except Rejected:
            continue
        named = dataclasses.replace(case.touches or Touches(), consumers=("moriio",), tokens=())
        case = dataclasses.replace(case, platform="rocm", touches=named)
        if moriio.CHECK.unrealistic(case) is not None:
            tally["unrealistic"] += 1
            continue
        result = run_case(target, case, "cpu", checks=("moriio",))
        if "moriio" not in result.checks:
            tally["not run"] += 1
            continue
        finding = result.checks["moriio"]
        if finding is None:
            tally["judged"] += 1
        elif triaged(result.case, finding):
            tally[finding.kind] += 1
        else:
            tally[f"untriaged {finding.kind}: {finding.message}"] += 1
    return tally


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.parametrize("version", ["0.32.0", "0.34.0"])
def test_generated_cases_report_only_triaged_families(version, tmp_path):
    tally = run_in_tree(version, [], tmp_path, (11, 80))["generated"]
    assert not [key for key in tally if key.startswith("untriaged")], tally
    assert tally.get("judged", 0) >= 10, tally


# ------------------------------------------------------------------------------------------- mutated trees


def mutated_tree(version: str, root: Path, old: str, new: str) -> Path:
    """The release's tree linked file by file into `root`, its MoRI-IO layout module replaced by a copy with `old` made `new`."""
    from fuzz.errors import TargetError
    from fuzz.targets import releases

    try:
        source = releases.resolve(version)
    except TargetError as error:
        pytest.skip(f"release not available here: {error}")
    if source.python_path is None:
        import vllm

        tree = Path(vllm.__file__).parent.parent
    else:
        tree = source.python_path
    shutil.copytree(tree / "vllm", root / "vllm", symlinks=True, copy_function=os.symlink)
    path = root / LAYOUT_MODULE
    text = path.read_text()
    assert text.count(old) == 1, f"{version}'s MoRI-IO layout has no single {old!r}"
    path.unlink()
    path.write_text(text.replace(old, new))
    return root


# Every block's transfer one element longer: each block's span reaches into the next block's first element.
LONGER = ("    sizes = [transfer_size_byte] * total", "    sizes = [transfer_size_byte + element_size] * total")


@pytest.mark.slow
@pytest.mark.parametrize("version", sampled(["0.32.0", "0.34.0"], ["0.34.0"]))
def test_a_span_one_element_too_long_is_reported(version, tmp_path):
    """On pages that leave the padded backing's last memory page part free (so the last span stays registered), the first
    block's span covers the second block's first element."""
    root = mutated_tree(version, tmp_path / "tree", *LONGER)
    out = run_in_tree(str(root), ["odd-pages", "full"], tmp_path)
    got = out["odd-pages"]
    assert got["error"] is None and got["skipped"] is None, got
    assert got["finding"] is not None and got["finding"].startswith("transfer-mismatch: "), got
    assert "block 0 covers 2 bytes" in got["finding"], got
    # Where the spans fill the backing to its last byte, the last one runs past the memory registered.
    assert out["full"]["finding"] is not None and out["full"]["finding"].startswith("transfer-unregistered: "), out["full"]


# ------------------------------------------------------------------------------------------- without vLLM


@pytest.mark.parametrize(("record", "found"), [
    ({"registered": [[0, 0, 65536]], "advertised": [[0, 0, 65536]], "spans": [[0, 0, 0, 0, 8192]], "sessions": [[0, 0, 65536]]}, None),
    ({"registered": [[0, 0, 65538]], "advertised": [], "spans": [], "sessions": []}, "registers 65538 bytes"),
    ({"registered": [[0, 0, 4096]], "advertised": [[-1, 100, 200]], "spans": [], "sessions": []}, "advertises a region of 100 bytes"),
    ({"registered": [[0, 0, 4096]], "advertised": [], "spans": [[0, 1, 0, 4000, 4200]], "sessions": [[0, 0, 4096]]}, "outside the memory"),
], ids=["inside", "past-the-buffer", "in-no-buffer", "past-its-session"])
def test_registered_memory_and_spans_must_lie_where_they_are_registered(record, found):
    from fuzz.checks import moriio

    problem = moriio.unregistered({**record, "buffer_bytes": [65536], "regions": [{"name": "layer"}]})
    assert (problem is None) if found is None else (problem is not None and found in problem), problem


@pytest.mark.parametrize(("changes", "reason"), [
    ({}, None),
    ({"platform": "cuda"}, "ROCm"),
    ({"packing": "cross_layers"}, "cross-layer"),
], ids=["rocm", "cuda", "cross-layer"])
def test_moriio_is_drawn_only_where_vllm_runs_it(changes, reason):
    from fuzz.checks import moriio

    found = moriio.CHECK.unrealistic(dataclasses.replace(CASES["full"], **changes))
    assert (found is None) if reason is None else (found is not None and reason in found), found
    encoder = dataclasses.replace(CASES["full"], groups=(dataclasses.replace(CASES["full"].groups[0], spec=dataclasses.replace(
        CASES["full"].groups[0].spec, kind="encoder_only")),))
    assert "encoder-only" in moriio.CHECK.unrealistic(encoder)


def test_the_recording_engine_registers_as_mori_does():
    """Contiguous tensors only (mori's register_torch_tensor raises otherwise), as their elements' bytes; a session read
    copies only inside memory both engines registered."""
    import torch

    from fuzz.checks import moriio

    engine, peer = moriio.RecordingEngine("local"), moriio.RecordingEngine("remote")
    mine, theirs = torch.zeros(64, dtype=torch.uint8), torch.arange(64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="contiguous"):
        engine.register_torch_tensor(mine.view(8, 8).t())
    local, remote = engine.register_torch_tensor(mine), peer.register_torch_tensor(theirs[:32])
    assert (local.size, remote.size) == (64, 32)
    session = engine.create_session(local, remote)
    assert session.batch_read([0], [8], [8], 0).Succeeded() and mine[:8].tolist() == list(range(8, 16))
    assert session.batch_read([8], [30], [8], 1).Failed() and not mine[8:16].any()  # 30 + 8 lies past the remote region
    assert moriio.MemoryDesc.unpack(local.pack()) == local


def test_a_rehomed_walk_keeps_its_views_on_page_aligned_copies(kvfuzz_target):
    import mmap

    import torch

    from fuzz.checks import moriio

    if "TRITON_ATTN" not in {b.name for b in kvfuzz_target.info.backends}:
        pytest.skip("no TRITON_ATTN")
    walk = kvfuzz_target.walk(CASES["blocks-outermost"])
    home = moriio.rehomed(walk)
    assert [raw.untyped_storage().data_ptr() % mmap.PAGESIZE for raw in home.raw] == [0]
    for name, view in walk.manager_views.items():
        moved = home.manager_views[name]
        assert (moved.shape, moved.stride(), moved.storage_offset()) == (view.shape, view.stride(), view.storage_offset())
        assert torch.equal(moved.view(torch.uint8), view.view(torch.uint8))


def test_the_check_is_not_drawn_into_campaigns_yet():
    from fuzz.checks import moriio

    assert moriio.CHECK.drawn is False and moriio.CHECK.applies(CASES["full"])
