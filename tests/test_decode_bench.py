"""The DecodeBench check (fuzz/checks/decode_bench.py): vLLM's DecodeBench connector, built for the worker role and
registered on a case's caches, fills a request's blocks through start_load_kv, and the bytes it wrote are held against
the bytes those blocks own (oracles/touch.py).

The bytes vLLM writes on 0.32.0 (installed) and 0.34.0 are compared with spans worked out here by hand from the cases'
page sizes; the judgement is shown to pass them, to report DecodeBench's fill of kernel-block caches by manager block ids
(kernel block b filled for manager block b), and to report a tree whose fill writes the block after each asked one. Cases
drawn as a campaign draws them find nothing else. Without vLLM, the judgement names each rule a written byte set breaks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import oracles
from fuzz.case import Case, GroupCase, SpecCase, Touches, from_dict
from fuzz.checks.protocol import Judging
from fuzz.targets.base import Outcome
from fuzz.verdict.compare import Verdict
from oracles.contract import LAYOUT_PLACED_KERNEL_MAP
from oracles.expectation import Expectation
from tests.conftest import one_group
from tests.sweep import sampled

NAME = "decode-bench"
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
BLOCKS = 4
NAMED = Touches(consumers=(NAME,), blocks=(1, 3))  # a case asks for the check by naming it; it fills blocks 1 and 3
CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/decode_bench_connector.py"
SEED = Path(__file__).resolve().parent.parent / "corpus" / "seeds" / "hybrid-attention-mamba-padded.json"
# A token's K and V are 2 heads x 2 x 64 bf16 = 512 bytes; a 16-token page is 8192 bytes.
PAGE = 16 * 512
LAYER = BLOCKS * PAGE  # a layer-major layer's blocks, one after another
KERNEL_PAGE = 16 * 576 * 2  # MLA's 576-element latent in a 16-token kernel block


def attention_case(layout: str = "LBHNC", blocks: tuple[int, ...] = (1, 3), **fields: Any) -> Case:
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
    return Case(groups=(GroupCase(spec=spec, layers=LAYERS, backend="TRITON_ATTN"),), num_blocks=BLOCKS, layout=layout,
                touches=dataclasses.replace(NAMED, blocks=blocks), **fields)


def hybrid_case() -> Case:
    """An attention group and a Mamba group sharing each layer's pool position (the corpus seed, with four blocks)."""
    seed = from_dict(json.loads(SEED.read_text()))
    return dataclasses.replace(seed, num_blocks=BLOCKS, touches=NAMED)


def mla_case() -> Case:
    """64-token MLA blocks on CPU_MLA's 16-token kernel blocks: the caches the runner hands connectors hold 16 kernel
    blocks per layer."""
    spec = SpecCase(kind="mla", block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16")
    return Case(groups=(GroupCase(spec=spec, layers=LAYERS, backend="CPU_MLA", kernel_block_size=16),), num_blocks=BLOCKS,
                layout="LBNHC", touches=NAMED)


CASES = {
    "full": attention_case(),
    "adjacent": attention_case(blocks=(1, 2)),
    "blocks-outermost": attention_case("BLHNC"),
    "kv-sharing": attention_case(kv_sharing=(("model.layers.2.self_attn.attn", LAYERS[0]),)),
    "hybrid": hybrid_case(),
    "mla-kernel-split": mla_case(),
}

# The bytes each case's fill must write, worked out from its pages: [buffer, start, end), merged.
EXPECTED = {
    # Layer-major: block b of layer l is page l * 4 + b.
    "full": [[0, PAGE, 2 * PAGE], [0, 3 * PAGE, 4 * PAGE], [0, LAYER + PAGE, LAYER + 2 * PAGE], [0, LAYER + 3 * PAGE, 2 * LAYER]],
    "adjacent": [[0, PAGE, 3 * PAGE], [0, LAYER + PAGE, LAYER + 3 * PAGE]],
    # Block-outermost: block b's row holds layer 0's page, then layer 1's.
    "blocks-outermost": [[0, 2 * PAGE, 4 * PAGE], [0, 6 * PAGE, 8 * PAGE]],
    # The sharing layer holds its target's cache: nothing more is written.
    "kv-sharing": [[0, PAGE, 2 * PAGE], [0, 3 * PAGE, 4 * PAGE], [0, LAYER + PAGE, LAYER + 2 * PAGE], [0, LAYER + 3 * PAGE, 2 * LAYER]],
    # The attention group fills blocks 1 and 3 (8192-byte pages); the Mamba group, asked one block on (blocks 2 and 1), its
    # 176 content bytes (3 x 8 bf16, then 2 x 4 x 4 float32) at the start of each of those pages.
    "hybrid": [[0, PAGE, 2 * PAGE + 176], [0, 3 * PAGE, 4 * PAGE]],
    # vLLM's fill on 0.32 - 0.34: kernel blocks 1 and 3 of each layer (manager block 0's second and fourth) for manager
    # blocks 1 and 3, whose kernel blocks are 4 - 7 and 12 - 15.
    "mla-kernel-split": [[0, KERNEL_PAGE, 2 * KERNEL_PAGE], [0, 3 * KERNEL_PAGE, 4 * KERNEL_PAGE],
                         [0, 17 * KERNEL_PAGE, 18 * KERNEL_PAGE], [0, 19 * KERNEL_PAGE, 20 * KERNEL_PAGE]],
}
ASKED = {"hybrid": [[1, 3], [1, 2]], "adjacent": [[1, 2]]}  # per group; one group, [1, 3], elsewhere
CORRECT = ("full", "adjacent", "blocks-outermost", "kv-sharing", "hybrid")


def merged(rows: list[list[int]]) -> list[list[int]]:
    """[buffer, start, end) rows as sorted, merged intervals."""
    out: list[list[int]] = []
    for buffer, start, end in sorted(rows):
        if out and out[-1][0] == buffer and start <= out[-1][2]:
            out[-1][2] = max(out[-1][2], end)
        else:
            out.append([buffer, start, end])
    return out


def judged(target: Any, case: Case) -> dict[str, Any]:
    """The check's record on the case's walk, cut to what the tests read, with its judgement (kind: message, or None)."""
    from fuzz.checks import decode_bench

    run = decode_bench.CHECK.offer(target.probe)
    assert callable(run), f"vLLM {target.info.vllm_version} offers no DecodeBench run: {run}"
    walk = target.walk(case)
    record = run(walk)
    expected = oracles.expect(walk.case, target.info.contract)
    finding = decode_bench.CHECK.judge(Judging(walk.case, target.info.contract, expected, Outcome(), Verdict("pass")), record)
    return {"finding": None if finding is None else f"{finding.kind}: {finding.message}", "error": record.get("error"),
            "skipped": record.get("skipped"), "written": merged(record.get("written", [])),
            "asked": [entry["blocks"] for entry in record.get("asked", [])], "layers": [entry["layers"] for entry in record.get("asked", [])]}


def assert_fills(out: dict[str, Any]) -> None:
    for name in CASES:
        got = out[name]
        assert got["error"] is None and got["skipped"] is None, (name, got)
        assert got["written"] == EXPECTED[name], (name, got["written"])
        assert got["asked"] == ASKED.get(name, [[1, 3]]), (name, got["asked"])
        if name in CORRECT:
            assert got["finding"] is None, (name, got["finding"])
    # The connector is built with the config as planned: the sharing layer is in no group (the runner adds it later).
    assert all("model.layers.2.self_attn.attn" not in layers for layers in out["kv-sharing"]["layers"])
    kernel = out["mla-kernel-split"]["finding"]
    assert kernel is not None and kernel.startswith("fill-stray: ") and "not asked to fill (block 0 of layer" in kernel, kernel


def test_the_installed_release_fills_each_asked_block(kvfuzz_target):
    for name, case in CASES.items():
        if any(g.backend and g.backend not in {b.name for b in kvfuzz_target.info.backends} for g in case.groups):
            pytest.skip(f"vLLM {kvfuzz_target.info.vllm_version} has no backend of case {name}")
    assert_fills({name: judged(kvfuzz_target, case) for name, case in CASES.items()})


def test_a_backend_that_refuses_connectors_is_not_driven(kvfuzz_target):
    """ROCM_ATTN says it does not support KV connectors (its K/V-first cache): vLLM's selector never picks it while one is
    configured, so the check skips it."""
    if "ROCM_ATTN" not in {b.name for b in kvfuzz_target.info.backends}:
        pytest.skip("no ROCM_ATTN")
    case = dataclasses.replace(CASES["full"], groups=(dataclasses.replace(CASES["full"].groups[0], backend="ROCM_ATTN"),))
    got = judged(kvfuzz_target, case)
    assert got["skipped"] is not None and "ROCM_ATTN does not support KV connectors" in got["skipped"], got


# ------------------------------------------------------------------------------------------- generated cases


def kernel_split(expected: Expectation) -> bool:
    """The oracle's views split a manager block into several kernel blocks somewhere."""
    return any(view.kernel_ratio > 1 for layer in expected.layers.values() for view in layer.views)


def generated(target: Any, name: str, count: int, seed: int = 7) -> tuple[int, list[tuple[Case, Expectation, Any]]]:
    """The first `count` cases of a campaign of `seed` (as the generator draws them), each asking for check `name` on the V2
    runner where the check calls it realistic: how many the check ran to a judgement, and its findings with the case and
    the oracle's expectation."""
    from fuzz.case import replace
    from fuzz.checks.registry import BY_NAME
    from fuzz.space import Rejected, draw_indexed
    from fuzz.verdict.runner import run_case

    check = BY_NAME[name]
    ran, found = 0, []
    for index in range(count):
        try:
            drawn = draw_indexed(target.info, seed, index, touches=True)
        except Rejected:
            continue
        case = replace(drawn, runner="v2", touches=replace(drawn.touches or Touches(), consumers=(name,), tokens=()))
        if check.unrealistic(case) is not None:
            continue
        result = run_case(target, case, checks=[name])
        record = result.outcome.checks.get(name) if result.outcome is not None else None
        if name not in result.checks or record is None or "skipped" in record:
            continue
        ran += 1
        if result.checks[name] is not None:
            found.append((result.case, result.expectation, result.checks[name]))
    return ran, found


def unexplained(found: list[tuple[Case, Expectation, Any]]) -> list[str]:
    """Findings other than DecodeBench's fill of kernel-block caches by manager block ids."""
    return [f"{finding.kind}: {finding.message}" for _, expected, finding in found
            if not (finding.kind == "fill-stray" and kernel_split(expected))]


@pytest.mark.slow
@pytest.mark.sweep
def test_generated_cases_find_only_the_fill_of_kernel_blocks_by_manager_ids(kvfuzz_target):
    ran, found = generated(kvfuzz_target, NAME, 150)
    assert ran >= 40, f"only {ran} of 150 drawn cases ran the fill"
    assert unexplained(found) == []
    assert found, "no drawn case splits its blocks into kernel blocks"


# ------------------------------------------------------------------------------------------- other trees, in a subprocess

SCRIPT = """
import json
from fuzz.checks import decode_bench
from fuzz.targets.loader import load_local
from tests.test_decode_bench import CASES, NAME, generated, judged, unexplained
target = load_local()
offered = decode_bench.CHECK.offer(target.probe)
out = {"version": target.info.vllm_version, "off": getattr(offered, "reason", None)}
for name in NAMES if callable(offered) else ():
    out[name] = judged(target, CASES[name])
if GENERATED and callable(offered):
    ran, found = generated(target, NAME, GENERATED)
    out["generated"] = {"ran": ran, "found": len(found), "unexplained": unexplained(found)}
print("RESULT " + json.dumps(out))
"""


def release_tree(version: str) -> Path:
    """The folder holding a release's `vllm` package: the installed one's, or a cached (fetched) release's."""
    if version == "installed":
        vllm = pytest.importorskip("vllm")
        return Path(vllm.__file__).resolve().parent.parent
    from fuzz.errors import TargetError
    from fuzz.targets import releases

    try:
        source = releases.resolve(version)
    except TargetError as error:
        pytest.skip(f"vLLM {version} is not available here: {error}")
    assert source.python_path is not None
    return source.python_path


def run_in_tree(source: str, names: list[str], cwd: Path, script: str = SCRIPT, generated_cases: int = 0) -> dict[str, Any]:
    """`script` on the named cases, in a worker environment of `source` (a release, or a tree's folder)."""
    from fuzz.errors import TargetError
    from fuzz.targets import releases

    try:
        target = releases.resolve(source)
    except TargetError as error:
        pytest.skip(f"vLLM {source} is not available here: {error}")
    env = releases.worker_environment(target)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(Path(__file__).absolute().parent.parent)])
    done = subprocess.run([sys.executable, "-c", f"NAMES = {names!r}\nGENERATED = {generated_cases}\n{script}"], env=env,
                          capture_output=True, text=True, timeout=900, cwd=cwd)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def mutated_tree(version: str, root: Path, connector: str, old: str, new: str) -> Path:
    """The release's tree linked file by file into `root`, its `connector` module replaced by a copy with `old` made `new`."""
    shutil.copytree(release_tree(version) / "vllm", root / "vllm", symlinks=True, copy_function=os.symlink)
    path = root / connector
    text = path.read_text()
    assert text.count(old) == 1, f"{version}'s {connector} has {text.count(old)} of {old!r}"
    path.unlink()
    path.write_text(text.replace(old, new))
    return root


@pytest.mark.slow
def test_0_34_fills_each_asked_block_and_generated_cases_find_nothing_else(tmp_path):
    out = run_in_tree("0.34.0", list(CASES), tmp_path, generated_cases=60)
    assert out["version"] == "0.34.0" and out["off"] is None
    assert_fills(out)
    assert out["generated"]["ran"] >= 15 and out["generated"]["unexplained"] == [], out["generated"]


# The fill writes the block after each asked one.
ONE_BLOCK_OFF = ("kv_cache[valid_block_ids] = fill_values.view(kv_cache.dtype)",
                 "kv_cache[valid_block_ids + 1] = fill_values.view(kv_cache.dtype)")


@pytest.mark.slow
@pytest.mark.parametrize("version", sampled(["installed", "0.34.0"], ["0.34.0"]))
def test_a_fill_one_block_off_is_reported(version, tmp_path):
    root = mutated_tree(version, tmp_path / "tree", CONNECTOR, *ONE_BLOCK_OFF)
    got = run_in_tree(str(root), ["adjacent"], tmp_path)["adjacent"]
    assert got["error"] is None and got["skipped"] is None, got
    assert got["written"] == [[0, 2 * PAGE, 4 * PAGE], [0, LAYER + 2 * PAGE, 2 * LAYER]]  # blocks 2 and 3
    assert got["finding"] is not None and got["finding"].startswith("fill-stray: "), got
    assert "(block 3 of layer model.layers.0.self_attn.attn)" in got["finding"]


def test_releases_before_0_29_are_off():
    """The check drives the per-layer caches of 0.29+; a probe without allocate_kv_cache (the backend-shaped generation)
    gets Off where the connector is there, and nothing where it is not."""
    from fuzz.checks import decode_bench

    class Probe:
        def find(self, role: str) -> None:
            return None

    offered = decode_bench.CHECK.offer(Probe())
    if decode_bench.connector_module() is None:
        assert offered is None
    else:
        assert offered is not None and "0.29+" in offered.reason


# ------------------------------------------------------------------------------------------- the judgement, without vLLM


def synthetic() -> tuple[Case, Expectation]:
    """Two layers of 2 heads x 64 bf16, 16-token blocks, layer-major, three blocks: each layer's page is 8192 bytes."""
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
    case = one_group(spec, layout="LBNHC", blocks=3, layers=("l0", "l1"))
    return case, oracles.expect(case, LAYOUT_PLACED_KERNEL_MAP)


def verdict(case: Case, expected: Expectation, written: list[list[int]], blocks: list[int] | None = None) -> str | None:
    from fuzz.checks import decode_bench

    record = {"where": "DecodeBenchConnectorWorker._fill_block_tensor", "written": written,
              "asked": [{"group": 0, "layers": ["l0", "l1"], "blocks": blocks or [1]}]}
    judging = Judging(case, LAYOUT_PLACED_KERNEL_MAP, expected, Outcome(), Verdict("pass"))
    finding = decode_bench.CHECK.judge(judging, {"kind": "filling", **record})
    return None if finding is None else f"{finding.kind}: {finding.message}"


BLOCK_1 = [[0, PAGE, 2 * PAGE], [0, 4 * PAGE, 5 * PAGE]]  # block 1 of each of the three-block layers


def test_the_asked_block_of_every_layer_passes():
    case, expected = synthetic()
    assert verdict(case, expected, BLOCK_1) is None
    assert verdict(case, expected, BLOCK_1 + BLOCK_1) is None  # the two runs' bytes, listed twice


def test_a_byte_of_the_next_block_strays():
    case, expected = synthetic()
    found = verdict(case, expected, [[0, PAGE, 2 * PAGE + 2], BLOCK_1[1]])
    assert found is not None and found.startswith("fill-stray: ") and "2 bytes, the first at byte 16384" in found
    assert "(block 2 of layer l0)" in found


def test_an_unwritten_element_is_missed():
    case, expected = synthetic()
    found = verdict(case, expected, [BLOCK_1[0], [0, 4 * PAGE, 5 * PAGE - 2]])
    assert found is not None and found.startswith("fill-miss: ") and "2 bytes, the first at byte 40958" in found
    assert "block 1 of layer l1" in found


def test_a_layer_left_out_is_missed():
    case, expected = synthetic()
    found = verdict(case, expected, BLOCK_1[:1])
    assert found is not None and found.startswith("fill-miss: ") and "of block 1 of layer l1" in found


def test_a_block_s_own_padding_may_be_written():
    """Block b's padding is b's own: a fill that writes it writes nothing of another block."""
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16", page_size_padded=PAGE + 256)
    case = one_group(spec, layout="LBNHC", blocks=3, layers=("l0",))
    expected = oracles.expect(case, LAYOUT_PLACED_KERNEL_MAP)
    from fuzz.checks import decode_bench

    record = {"kind": "filling", "where": "w._fill_block_tensor", "asked": [{"group": 0, "layers": ["l0"], "blocks": [1]}]}
    judging = Judging(case, LAYOUT_PLACED_KERNEL_MAP, expected, Outcome(), Verdict("pass"))
    padded = PAGE + 256
    assert decode_bench.CHECK.judge(judging, {**record, "written": [[0, padded, 2 * padded]]}) is None
    stray = decode_bench.CHECK.judge(judging, {**record, "written": [[0, padded, 2 * padded + 1]]})
    assert stray is not None and stray.kind == "fill-stray"


def test_each_group_fills_blocks_of_its_own():
    """The request's blocks, group by group: the case's (the null block aside), shifted one block on per group."""
    from fuzz.checks import decode_bench

    case = dataclasses.replace(attention_case(blocks=(0, 1, 3)), num_blocks=5)
    assert decode_bench.asked_blocks(case, 3) == [[1, 3], [2, 4], [1, 3]]
    assert decode_bench.asked_blocks(dataclasses.replace(case, touches=Touches(consumers=(NAME,))), 1) == [[1, 2]]


def test_the_check_is_drawn_into_campaigns():
    from fuzz.checks import decode_bench

    assert decode_bench.CHECK.drawn is True and decode_bench.CHECK.applies(CASES["full"])
