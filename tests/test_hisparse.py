"""The HiSparse check (fuzz/checks/hisparse.py): vLLM lays out and binds a sparse-MLA model's host pool and device pool, and
every view's blocks are held against the pages oracles/hisparse.py expects.

The views vLLM makes on 0.32.0 and 0.34.0 are compared with views worked out here by hand from the cases' page sizes; the
judgement is shown to pass them, and to report a tree whose layout.py lays the indexer's layers one element too close."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.case import Case, GroupCase, SpecCase, Touches
from oracles import hisparse as oracle
from tests.sweep import sampled

NAMED = Touches(consumers=("hisparse-caches",))
LAYERS = ("l0", "l1")
BLOCKS = 4
LAYOUT_PY = "vllm/v1/hisparse/layout.py"
# A 64-token page of DeepSeek's 576-element bf16 latent, and of the V3.2 indexer's 132-byte rows.
PAGE = 64 * 576 * 2
FP8_PAGE = 64 * 656
INDEXER_PAGE = 64 * 132
# host_budget: 4 blocks of max_model_len, 2 more, 3 spare, 7 bytes over: the pool keeps 9 whole blocks of both layers.
HOST_BLOCKS = 9


def sparse_case(cache_dtype: str = "auto", layout: str = "BLNHC", layers: tuple[str, ...] = LAYERS, block_size: int = 64,
                **fields: object) -> Case:
    # An fp8_ds_mla record is stored as bytes, its size published by the backend.
    record = ({"dtype": "uint8", "state_content_bytes": 656, "kv_quant_mode": "fp8_per_tensor"} if cache_dtype == "fp8_ds_mla"
              else {"dtype": "bfloat16"})
    spec = SpecCase(kind="mla", block_size=block_size, num_kv_heads=1, head_size=576, cache_dtype=cache_dtype, **record)
    return Case(groups=(GroupCase(spec=spec, layers=layers, backend="FLASHMLA_SPARSE"),), num_blocks=BLOCKS, layout=layout,
                touches=NAMED, **fields)


CASES = {
    "bf16": sparse_case(),
    "fp8-ds-mla": sparse_case("fp8_ds_mla", layout="BLHNC", layers=("l0", "l1", "l2")),
    "kv-sharing": sparse_case(kv_sharing=(("l2", "l0"),)),
    # 128-token manager blocks: the indexer's backend takes 64-token blocks only, and HiSparse pages every cache in those.
    "manager-128": sparse_case(block_size=128),
}


def expected_views(page: int, layers: int) -> dict[tuple[str, str], tuple[str, int, int, int, int]]:
    """(layer, role) -> (pool, first byte, block stride, bytes per block, blocks), by hand: the host pool is each layer's
    host blocks one after another (one page apart); the device pool's block is as wide as its widest group's block (one
    layer's resident page), the indexer's layers side by side in it, each resident and hot view at its start (their groups
    overlay one another: a block id is one group's at a time)."""
    views = {}
    for index in range(layers):
        layer = f"l{index}"
        views[(layer, oracle.SOURCE)] = ("host", index * HOST_BLOCKS * page, page, page, HOST_BLOCKS)
        views[(layer, oracle.INDEXER)] = ("device", index * INDEXER_PAGE, page, INDEXER_PAGE, BLOCKS)
        views[(layer, oracle.RESIDENT)] = ("device", 0, page, page, BLOCKS)
        views[(layer, oracle.HOT)] = ("device", 0, page, page, BLOCKS)
    return views


SCRIPT = """
import json
from fuzz.checks import hisparse
from fuzz.targets.loader import load_local
from tests.test_hisparse import CASES, judged
target = load_local()
offered = hisparse.CHECK.offer(target.probe)
out = {"version": target.info.vllm_version, "offered": callable(offered), "off": getattr(offered, "reason", None)}
for name in NAMES if callable(offered) else ():
    out[name] = judged(target, CASES[name])
print("RESULT " + json.dumps(out))
"""


def judged(target, case: Case) -> dict:
    """The check's record on the case, cut to what the tests read, with its judgement (the finding's kind and message)."""
    from fuzz.checks import hisparse
    from fuzz.checks.protocol import Judging, Unusable
    from fuzz.targets.base import Outcome
    from fuzz.targets.walk import Walk
    from fuzz.verdict.compare import Verdict

    run = hisparse.CHECK.offer(target.probe)
    assert callable(run), f"vLLM {target.info.vllm_version} offers no HiSparse run: {run}"
    try:
        record = run(Walk.of_case(case, target.config, lambda runner: Outcome()))
    except Unusable as why:
        return {"skipped": str(why)}
    finding = hisparse.CHECK.judge(Judging(case, target.info.contract, None, Outcome(), Verdict("rejected")), record)
    views = {f"{v['layer']}/{v['role']}": [v["pool"], v["first"], v["stride"], v["extent"], v["blocks"]] for v in record["views"]}
    readers = {reader: [[v["role"], v["pool"], v["first"], v["stride"]] for v in read] for reader, read in record["readers"].items()}
    return {"finding": None if finding is None else f"{finding.kind}: {finding.message}", "skipped": None, "views": views,
            "readers": readers, "pools": record["pool_bytes"], "host_blocks": record["host_blocks"], "strays": record["strays"],
            "pinned": [size for _, size in record["pinned"]]}


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
    done = subprocess.run([sys.executable, "-c", f"NAMES = {names!r}\n{SCRIPT}"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=cwd)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def assert_laid_out_by_hand(got: dict, page: int, layers: int) -> None:
    assert got["skipped"] is None and got["finding"] is None, got
    assert got["strays"] == []
    want = expected_views(page, layers)
    assert {key: tuple(value) for key, value in got["views"].items()} == {f"{layer}/{role}": v for (layer, role), v in want.items()}
    assert got["host_blocks"] == HOST_BLOCKS and got["pools"]["host"] == HOST_BLOCKS * layers * page
    assert got["pinned"] == [-(-HOST_BLOCKS * layers * page // 4096) * 4096]  # one registration, whole OS pages


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.32.0", "0.34.0"])
def test_the_release_lays_out_each_page_where_the_oracle_says(version, tmp_path):
    out = run_in_tree(version, list(CASES), tmp_path)
    assert out["version"] == version and out["offered"], out
    assert_laid_out_by_hand(out["bf16"], PAGE, 2)
    assert_laid_out_by_hand(out["fp8-ds-mla"], FP8_PAGE, 3)
    assert_laid_out_by_hand(out["manager-128"], PAGE, 2)
    sharing = out["kv-sharing"]
    if version == "0.32.0":  # MLA layers share KV from 0.34, which binds them (binding.get_kv_sharing_readers)
        assert sharing["skipped"] is not None and "share no KV" in sharing["skipped"], sharing
    else:
        assert sharing["finding"] is None and sharing["strays"] == [], sharing
        assert sharing["readers"] == {"l2": [["resident", "device", 0, PAGE], ["hot", "device", 0, PAGE]]}


@pytest.mark.slow
def test_releases_before_0_30_have_no_hisparse(tmp_path):
    out = run_in_tree("0.29.0", [], tmp_path)
    assert out["offered"] is False and out["off"] is None, out


# ------------------------------------------------------------------------------------------- a mutated tree


def mutated_tree(version: str, root: Path, old: str, new: str) -> Path:
    """The release's tree linked file by file into `root`, its HiSparse layout.py replaced by a copy with `old` made `new`."""
    from fuzz.errors import TargetError
    from fuzz.targets import releases

    try:
        source = releases.resolve(version)
    except TargetError as error:
        pytest.skip(f"release not available here: {error}")
    assert source.python_path is not None
    shutil.copytree(source.python_path / "vllm", root / "vllm", symlinks=True, copy_function=os.symlink)
    path = root / LAYOUT_PY
    text = path.read_text()
    assert text.count(old) == 1, f"{version}'s HiSparse layout.py has no single {old!r}"
    path.unlink()
    path.write_text(text.replace(old, new))
    return root


# The resident and hot caches' blocks one bf16 element closer than the device pool's block: each block's last element is
# the next block's first.
SHORT_STRIDE = ("block_stride = bytes_per_block\n", "block_stride = bytes_per_block - 2\n")


@pytest.mark.slow
@pytest.mark.parametrize("version", sampled(["0.32.0", "0.34.0"], ["0.34.0"]))
def test_a_mutated_layout_is_reported(version, tmp_path):
    root = mutated_tree(version, tmp_path / "tree", *SHORT_STRIDE)
    got = run_in_tree(str(root), ["bf16"], tmp_path)["bf16"]
    assert got["finding"] is not None and got["finding"].startswith("hisparse-overlap: "), got
    assert "resident view model.layers.0.self_attn.attn.hisparse_resident" in got["finding"], got


# ------------------------------------------------------------------------------------------- the judgement, without vLLM


def model() -> oracle.Model:
    return oracle.expect(CASES["bf16"], HOST_BLOCKS * 2 * PAGE + 7)


def views_by_hand() -> list[oracle.View]:
    return [oracle.View(f"{layer}.{role}", layer, role, {"source": 0, "indexer": 1}.get(role, 2 + int(layer[1]) * 2 + (role == "hot")),
                        pool, first, stride, extent, extent, blocks)
            for (layer, role), (pool, first, stride, extent, blocks) in expected_views(PAGE, 2).items()]


POOLS = {"host": HOST_BLOCKS * 2 * PAGE, "device": BLOCKS * PAGE}


def test_the_oracle_expects_the_pages_worked_out_by_hand():
    expected = model()
    assert expected.source_pages == {"l0": PAGE, "l1": PAGE} and expected.indexer_page == INDEXER_PAGE
    assert expected.host_blocks == HOST_BLOCKS and expected.host_pool_bytes == HOST_BLOCKS * 2 * PAGE
    assert oracle.judge(expected, views_by_hand(), POOLS, {}) is None


def test_the_fp8_ds_mla_page_is_656_bytes_a_token():
    assert oracle.expect(CASES["fp8-ds-mla"], 0).source_pages["l0"] == FP8_PAGE


@pytest.mark.parametrize(("change", "kind"), [
    ({"extent": PAGE - 2, "content": PAGE - 2}, "page"),  # a resident block one element short of the page
    ({"first": 2}, "outside"),  # the last block two bytes past the pool
    ({"stride": PAGE // 2, "blocks": BLOCKS}, "overlap"),  # a layer's blocks half a page apart: each overlaps the next
], ids=["short-page", "past-the-pool", "blocks-overlap"])
def test_a_wrong_resident_view_is_reported(change, kind):
    views = views_by_hand()
    index = next(i for i, v in enumerate(views) if (v.layer, v.role) == ("l1", oracle.RESIDENT))
    views[index] = dataclasses.replace(views[index], **change)
    problem = oracle.judge(model(), views, POOLS, {})
    assert problem is not None and problem.kind == kind, problem


def test_two_groups_may_share_bytes_under_one_block_id_only():
    """The resident views of two layers overlay each other (two groups, one pool); the indexer's block b shares bytes with
    their block b only. Moving layer 1's indexer one block on makes its block b meet their block b + 1: both live at once."""
    views = views_by_hand()
    assert oracle.judge(model(), views, POOLS, {}) is None
    index = next(i for i, v in enumerate(views) if (v.layer, v.role) == ("l1", oracle.INDEXER))
    views[index] = dataclasses.replace(views[index], first=views[index].first + PAGE)
    problem = oracle.judge(model(), views, {**POOLS, "device": (BLOCKS + 1) * PAGE}, {})
    assert problem is not None and problem.kind == "overlap", problem


def test_a_host_pool_of_another_size_is_reported():
    problem = oracle.judge(model(), views_by_hand(), {**POOLS, "host": POOLS["host"] + PAGE}, {})
    assert problem is not None and problem.kind == "host-pool", problem


def test_a_kv_sharing_layer_must_read_its_target_s_views():
    views = views_by_hand()
    resident = next(v for v in views if (v.layer, v.role) == ("l0", oracle.RESIDENT))
    assert oracle.judge(model(), views, POOLS, {"l2": [resident]}) is None
    problem = oracle.judge(model(), views, POOLS, {"l2": [dataclasses.replace(resident, first=PAGE)]})
    assert problem is not None and problem.kind == "sharing", problem


def test_only_sparse_mla_cases_in_a_block_outermost_layout_are_realistic():
    from fuzz.checks import hisparse

    assert hisparse.CHECK.unrealistic(CASES["bf16"]) is None
    assert "block-outermost" in hisparse.CHECK.unrealistic(sparse_case(layout="LBNHC"))
    assert "block-compact" in hisparse.CHECK.unrealistic(sparse_case(layout="BHLNC"))  # a layer's page in pieces
    other = dataclasses.replace(CASES["bf16"], groups=(dataclasses.replace(CASES["bf16"].groups[0], backend="FLASHMLA"),))
    assert "sparse-MLA" in hisparse.CHECK.unrealistic(other)
    assert hisparse.CHECK.drawn is False and hisparse.CHECK.applies(CASES["bf16"])
