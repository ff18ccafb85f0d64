"""The UMBP check (fuzz/checks/umbp.py): vLLM's UMBP store connector, built for its worker role, registers a case's caches
with a recording stand-in for MORI's UMBP client, and the block layout it plans is held against the bytes each block owns
(oracles/transfer.py).

UMBP arrives in 0.33 and gets its runtime adapters in 0.34, so the release runs are 0.34.0's (in a worker environment of
its tree). The plans vLLM works out are compared with ranges worked out here by hand from the cases' page sizes; the
judgement is shown to pass them, to report a tree whose planner moves one element too many per block, and to report on
generated cases only what has been triaged (the check's report)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.case import Case, GroupCase, SpecCase, Touches

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
BLOCKS = 4
NAMED = Touches(consumers=("umbp",))
DATA_MODULE = "vllm/distributed/kv_transfer/kv_connector/v1/umbp/data.py"
PAGE = 16 * 512  # 16 tokens of 2 heads x (64 K + 64 V) bf16
HEAD_RUN = PAGE // 2  # one head's 16 tokens
PADDING = 256


def attention_case(layout: str = "LBHNC", layers: tuple[str, ...] = LAYERS, backend: str = "TRITON_ATTN", blocks: int = BLOCKS,
                   **fields: int) -> Case:
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16", **fields)
    return Case(groups=(GroupCase(spec=spec, layers=layers, backend=backend),), num_blocks=blocks, layout=layout, touches=NAMED,
                platform="rocm")


CASES = {
    "full": attention_case(),
    "blocks-outermost": attention_case("BLHNC"),
    # The block axis inside the head axis: a block is one run per head; UMBP plans each head's run.
    "heads-outside-blocks": attention_case("LHBNC", layers=LAYERS[:1], backend="ROCM_SEGMENTED_ATTN", blocks=2),
    "padded": attention_case("LBNHC", layers=LAYERS[:1], page_size_padded=PAGE + PADDING),
}
# The plan's spans [region, block, buffer, start, end], group 0's blocks in order, each block's layers in order.
EXPECTED = {
    "full": [[layer, b, 0, (layer * BLOCKS + b) * PAGE, (layer * BLOCKS + b + 1) * PAGE] for b in range(BLOCKS) for layer in range(2)],
    "blocks-outermost": [[layer, b, 0, (2 * b + layer) * PAGE, (2 * b + layer + 1) * PAGE] for b in range(BLOCKS) for layer in range(2)],
    # Head h of block b: the h-th of the layer's per-head arrays (2 blocks of one head's run each), block b's run in it.
    "heads-outside-blocks": [[0, b, 0, (2 * h + b) * HEAD_RUN, (2 * h + b + 1) * HEAD_RUN] for b in range(2) for h in range(2)],
    # The whole padded page: the block's own padding travels with it.
    "padded": [[0, b, 0, b * (PAGE + PADDING), (b + 1) * (PAGE + PADDING)] for b in range(BLOCKS)],
}

SCRIPT = """
import json
from fuzz.checks import umbp
from fuzz.targets.loader import load_local
from tests.test_umbp import CASES, judged, generated
target = load_local()
offered = umbp.CHECK.offer(target.probe)
out = {"version": target.info.vllm_version, "off": getattr(offered, "reason", None), "none": offered is None}
for name in NAMES if callable(offered) else ():
    out[name] = judged(target, CASES[name])
if GENERATED and callable(offered):
    out["generated"] = generated(target, *GENERATED)
print("RESULT " + json.dumps(out))
"""


def judged(target, case: Case) -> dict:
    """The check's record on the case's walk, cut to what the tests read, with its judgement."""
    import oracles
    from fuzz.checks import umbp
    from fuzz.checks.protocol import Judging
    from fuzz.targets.base import Outcome
    from fuzz.verdict.compare import Verdict

    if case.groups[0].backend not in {b.name for b in target.info.backends}:
        return {"absent": case.groups[0].backend}
    walk = target.walk(case)
    record = umbp.CHECK.offer(target.probe)(walk)
    expected = oracles.expect(walk.case, target.info.contract)
    finding = umbp.CHECK.judge(Judging(walk.case, target.info.contract, expected, Outcome(), Verdict("pass")), record)
    keys = ("error", "skipped", "spans", "registered", "buffer_bytes", "objects", "load_layouts", "calls", "replaced")
    return {"finding": None if finding is None else f"{finding.kind}: {finding.message}", **{key: record.get(key) for key in keys}}


def generated(target, seed: int, count: int) -> dict[str, int]:
    """The check on `count` cases of a seeded campaign sample, each on ROCm and naming the check: verdicts counted by what
    they are (a finding by its kind and vLLM function)."""
    import dataclasses

    from fuzz.checks import umbp
    from fuzz.space import Rejected, draw_indexed
    from fuzz.verdict.runner import run_case

    tally: dict[str, int] = {}
    for index in range(count):
        try:
            case = draw_indexed(target.info, seed, index, touches=True)
        except Rejected:
            continue
        named = dataclasses.replace(case.touches or Touches(), consumers=("umbp",), tokens=())
        case = dataclasses.replace(case, platform="rocm", touches=named)
        if umbp.CHECK.unrealistic(case) is not None:
            key = "unrealistic"
        else:
            result = run_case(target, case, "cpu", checks=("umbp",))
            finding = result.checks.get("umbp")
            key = "not run" if "umbp" not in result.checks else "judged" if finding is None else f"{finding.kind}: {finding.message}"
        tally[key] = tally.get(key, 0) + 1
    return tally


def run_in_tree(source: str, names: list[str], cwd: Path, generated_sample: tuple[int, int] | None = None) -> dict:
    """SCRIPT on the named cases (and a generated sample), in a worker environment of `source` (a release or a tree)."""
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


@pytest.mark.slow
def test_0_34_plans_each_block_s_bytes(tmp_path):
    out = run_in_tree("0.34.0", list(CASES), tmp_path)
    assert out["version"] == "0.34.0"
    for name, spans in EXPECTED.items():
        got = out[name]
        if "absent" in got:
            continue
        assert got["error"] is None and got["skipped"] is None and got["finding"] is None, (name, got)
        assert got["spans"] == spans, (name, got["spans"])
        # Each mode registers the one backing storage, whole (ROCm pads it to whole pages).
        assert got["registered"] == {"embedded": [[0, 0, got["buffer_bytes"][0]]], "standalone": [[0, 0, got["buffer_bytes"][0]]]}, got
        assert all(bulk == plan for _, _, bulk, plan in got["load_layouts"]) and got["load_layouts"], got
        assert all("mori.cpp" in what or "_MoriLookupServer" in what for what in got["replaced"]), got
    # A block's object: each layer's page (each head's run) side by side.
    assert out["full"]["objects"][0] == [0, 0, [[0, PAGE], [PAGE, PAGE]]]
    assert out["heads-outside-blocks"]["objects"][1] == [0, 1, [[0, HEAD_RUN], [HEAD_RUN, HEAD_RUN]]]


@pytest.mark.slow
@pytest.mark.sweep
def test_generated_cases_on_0_34_report_only_refusals(tmp_path):
    """Triaged on 0.34: UMBP refuses, with a ValueError whose message blames an unset layout, a one-block LHBNC pool (its
    heads are one run, shorter than its page's stride); every other generated case is judged clean."""
    tally = run_in_tree("0.34.0", [], tmp_path, (11, 80))["generated"]
    findings = {key: count for key, count in tally.items() if key not in ("judged", "unrealistic", "not run")}
    assert all(key.startswith("refused-valid: ") and "kv_cache_layout is unset" in key for key in findings), findings
    assert tally.get("judged", 0) >= 30, tally


@pytest.mark.slow
@pytest.mark.parametrize(("version", "state"), [("0.32.0", "none"), ("0.33.0", "off")])
def test_releases_before_0_34_are_not_driven(version, state, tmp_path):
    out = run_in_tree(version, [], tmp_path)
    assert out["none"] if state == "none" else (out["off"] is not None and "runtime adapter" in out["off"]), out


# Every attention region's range one bf16 element longer than its page.
LONGER = ("                        length=region.block_bytes,\n", "                        length=region.block_bytes + 2,\n")


@pytest.mark.slow
def test_a_range_one_element_too_long_is_reported(tmp_path):
    from fuzz.errors import TargetError
    from fuzz.targets import releases

    try:
        source = releases.resolve("0.34.0")
    except TargetError as error:
        pytest.skip(f"release not available here: {error}")
    root = tmp_path / "tree"
    shutil.copytree(source.python_path / "vllm", root / "vllm", symlinks=True, copy_function=os.symlink)
    path = root / DATA_MODULE
    text = path.read_text()
    assert text.count(LONGER[0]) == 1
    path.unlink()
    path.write_text(text.replace(*LONGER))
    got = run_in_tree(str(root), ["full"], tmp_path)["full"]
    assert got["finding"] is not None and got["finding"].startswith("transfer-mismatch: "), got
    assert "block 0 covers 2 bytes" in got["finding"], got


# ------------------------------------------------------------------------------------------- without vLLM


def test_a_plan_whose_ranges_share_object_bytes_is_found():
    from fuzz.checks import umbp

    assert umbp.object_overlap({"objects": [[0, 1, [[0, 8192], [8192, 8192]]]]}) is None
    found = umbp.object_overlap({"objects": [[0, 1, [[0, 8192], [8190, 8192]]]]})
    assert found is not None and "block 1" in found and "object bytes 8190 to 8192" in found


def test_a_bulk_load_layout_other_than_the_plan_is_found():
    from fuzz.checks import umbp

    same = [[0, 0, 8192]]
    assert umbp.load_mismatch({"load_layouts": [[0, 2, same, same]]}) is None
    assert "block 2" in umbp.load_mismatch({"load_layouts": [[0, 2, [[0, 0, 8194]], same]]})


def test_registered_storage_must_lie_in_the_buffers():
    from fuzz.checks import umbp

    inside = {"registered": {"embedded": [[0, 0, 65536]], "standalone": [[0, 0, 65536]]}, "buffer_bytes": [65536]}
    assert umbp.unregistered(inside) is None
    past = {"registered": {"embedded": [[0, 0, 65536]], "standalone": [[0, 0, 65600]]}, "buffer_bytes": [65536]}
    assert "standalone mode" in umbp.unregistered(past)


def test_umbp_is_drawn_only_where_vllm_runs_it():
    import dataclasses

    from fuzz.checks import umbp

    assert umbp.CHECK.unrealistic(CASES["full"]) is None
    assert "ROCm" in umbp.CHECK.unrealistic(dataclasses.replace(CASES["full"], platform="cuda"))
    assert umbp.CHECK.drawn is False and umbp.CHECK.applies(CASES["full"])


def test_the_recording_client_keeps_what_it_registers():
    from fuzz.checks import umbp

    client = umbp.RecordingClient(umbp.UMBPConfig())
    assert client.register_memory(4096, 8192, umbp.MemoryLocationType.CPU, -1) is True
    assert client.registered == [(4096, 8192)] and client.get_deployment_mode() == umbp.UMBPDeploymentMode.Embedded
    with pytest.raises(AttributeError):
        client.batch_get_into_ptr  # noqa: B018 - a method the stand-in does not state
    assert client.gaps
