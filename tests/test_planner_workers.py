"""The planner-workers check (fuzz/checks/planner_workers.py): vLLM's engine-level planner, `get_kv_cache_configs`, plans
tensor-parallel ranks, pipeline stages and the model with the hybrid KV-cache manager off as oracles/planner.py says.

The oracle's projections, block counts and hybrid-off plans are compared with ones worked out here by hand; the judgement
is shown to report hand-made records that break them; the plans vLLM makes on 0.32.0 (installed), 0.28.0 and 0.34.0 for
a few cases are compared with numbers worked out here from the cases' page sizes, generated cases are run on them, and
trees whose planner takes the most blocks instead of the least, or gives a stage layers of another stage, are reported.

0.29 - 0.33 back a pipeline stage's tensors with other stages' layers where the stage owns none of a group of per-layer
specs (UniformTypeKVCacheSpecs): the empty projection keeps the whole group's specs, and get_kv_cache_config_from_groups
makes tensors of them (vLLM issue #54711; 0.34 builds a group's tensors from its layer names). The check reports it; the
tests on 0.32 expect it, and only it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fuzz.case import Case, GroupCase, SpecCase, Touches
from tests.sweep import sampled

NAMED = Touches(consumers=("planner-workers",))  # a case asks for the check by naming it
# A 16-token block of 2 KV heads x (K + V) x 64 bf16: 16 * 2 * 2 * 64 * 2 bytes.
PAGE = 8192
BASE = 1 << 20  # the blocks the whole model's memory holds (planner_workers.BASE_BLOCKS)
PLANNER_FILES = {"0.32.0": "vllm/v1/core/kv_cache_utils.py", "0.34.0": "vllm/v1/core/kv_cache_planning.py"}
# Releases whose stages back other stages' layers where they own none of a UniformTypeKVCacheSpecs group (issue #54711).
EMPTY_PROJECTION_BUG = ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")
SEED, GENERATED = 7, 40


def group(kind: str, layers: tuple[str, ...], heads: int = 2, head_size: int = 64, **fields: Any) -> GroupCase:
    spec = SpecCase(kind=kind, block_size=16, num_kv_heads=heads, head_size=head_size, dtype="bfloat16", **fields)
    if kind == "mamba":
        return GroupCase(spec=spec, layers=layers, kernel_block_size=16)
    return GroupCase(spec=spec, layers=layers, backend="TRITON_ATTN", kernel_block_size=16)


CASES = {
    "full": Case(groups=(group("full", ("l0", "l1", "l2")),), num_blocks=4, touches=NAMED),
    "hybrid": Case(groups=(group("full", ("f0", "f1")), group("sliding_window", ("s0", "s1"), sliding_window=64)), num_blocks=4,
                   touches=NAMED),
    # Mamba state of 16 float32 padded to the attention page: no one type with attention, so refused with the hybrid manager off.
    "mamba": Case(groups=(group("full", ("a0", "a1")), group("mamba", ("m0", "m1"), mamba_shapes=((16,),), mamba_dtypes=("float32",),
                                                            page_size_padded=PAGE)), num_blocks=4, touches=NAMED),
    # A sliding-window layer of a quarter page (1 head of 32): vLLM groups both kinds as per-layer specs (UniformTypeKVCacheSpecs),
    # and the stages cut it from the full-attention layers. Pages of two sizes need blocks outermost (0.29+).
    "narrow-window": Case(groups=(group("full", ("f0", "f1")), group("sliding_window", ("s0",), heads=1, head_size=32, sliding_window=64)),
                          num_blocks=4, layout="BLHNC", touches=NAMED),
}


# ------------------------------------------------------------------------------------------- the oracle, by hand


def test_a_worker_plans_every_group_with_only_its_own_layers():
    from oracles.planner import Group, projected

    full = Group(("f0", "f1"), 16, "full", ("full", "full"), (PAGE, PAGE))
    window = Group(("s0", "s1", "s2"), 32, "sliding_window", ("sliding_window",) * 3, (PAGE, PAGE, 2 * PAGE))
    assert projected([full, window], {"f1", "s2", "s0"}) == [
        Group(("f1",), 16, "full", ("full",), (PAGE,)), Group(("s0", "s2"), 32, "sliding_window", ("sliding_window",) * 2, (PAGE, 2 * PAGE))]
    # A stage owning none of a group's layers keeps the group, empty, with its block size and kind.
    assert projected([full, window], {"f0"})[1] == Group((), 32, "sliding_window", (), ())


def test_a_worker_s_tensors_must_back_its_layers_once_and_no_other():
    from oracles.planner import stray_layers

    assert stray_layers([["a", "b"], ["c"]], {"a", "b", "c"}) == ([], [], [])
    assert stray_layers([["a", "b"], ["x"]], {"a", "b"}) == (["x"], [], [])
    assert stray_layers([["a"]], {"a", "b"}) == ([], ["b"], [])
    assert stray_layers([["a", "b"], ["b"]], {"a", "b"}) == ([], [], ["b"])


def test_workers_get_the_least_blocks_any_memory_holds():
    from oracles.planner import least_blocks

    # 5 blocks less a byte hold 4; 7 whole blocks hold 7; at twice the bytes per block 7 blocks' memory holds 3.
    assert least_blocks([5 * PAGE - 1, 7 * PAGE], [PAGE, PAGE]) == 4
    assert least_blocks([9 * PAGE, 7 * PAGE], [PAGE, 2 * PAGE]) == 3


@pytest.mark.parametrize(("groups", "kind"), [
    ((group("full", ("a",)), group("sliding_window", ("b",), sliding_window=64)), "full"),
    ((group("full", ("a",)), group("chunked_local", ("b",), attention_chunk_size=64)), "full"),
    ((group("full", ("a",)), group("sliding_window", ("b",), sliding_window=64), group("chunked_local", ("c",), attention_chunk_size=32)),
     "full"),  # one window and one chunk size: both kept by the promoted layers
    ((group("sliding_window", ("a",), sliding_window=64), group("sliding_window", ("b",), heads=4, sliding_window=64)), "sliding_window"),
    ((group("full", ("a",)), group("mamba", ("m",), mamba_shapes=((16,),), mamba_dtypes=("float32",))), None),
    ((group("full", ("a",)), group("sliding_window", ("b",), sliding_window=64), group("sliding_window", ("c",), sliding_window=128)),
     None),  # promoted layers of two windows in one group
    ((group("sliding_window", ("a",), sliding_window=64), group("chunked_local", ("b",), attention_chunk_size=64)), None),
], ids=["full+window", "full+chunk", "full+window+chunk", "one-window", "full+mamba", "two-windows", "window+chunk"])
def test_the_hybrid_off_plan_is_one_type_or_a_refusal(groups, kind):
    from oracles.planner import unified

    expected = unified(Case(groups=groups, num_blocks=1))
    assert expected is not None and expected.kind == kind, expected


@pytest.mark.parametrize("groups", [
    (group("mla", ("a",)),),  # a kind the rule does not cover
    (group("mamba", ("m",), mamba_shapes=((16,),), mamba_dtypes=("float32",)),),  # Mamba alone
    (group("full", ("a",)), GroupCase(spec=SpecCase(kind="sliding_window", block_size=32, num_kv_heads=2, sliding_window=64),
                                      layers=("b",), backend="TRITON_ATTN")),  # two block sizes
], ids=["mla", "mamba-alone", "block-sizes"])
def test_the_oracle_says_nothing_of_hybrid_off_plans_it_has_no_rule_for(groups):
    from oracles.planner import unified

    assert unified(Case(groups=groups, num_blocks=1)) is None


# ------------------------------------------------------------------------------------------- the judgement, on records by hand


def plan(num_blocks: int, groups: list[tuple[list[str], str]], per_layer: int = PAGE) -> dict:
    """A worker's plan as the run records it: full-attention groups of `per_layer` pages, one tensor per group, the pool
    as wide as the widest group."""
    width = max(len(layers) for layers, _ in groups) * per_layer
    return {"num_blocks": num_blocks, "backing_bytes": num_blocks * width,
            "groups": [{"layers": layers, "block_size": 16, "kind": kind, "kinds": [kind] * len(layers), "pages": [per_layer] * len(layers)}
                       for layers, kind in groups],
            "tensors": [{"layers": layers, "size": num_blocks * width} for layers, _ in groups if layers]}


WHOLE = {"memory": [BASE * 2 * PAGE], "configs": [plan(BASE, [(["f0", "f1"], "full"), (["s0", "s1"], "sliding_window")])]}
HYBRID = CASES["hybrid"]


def judged_record(tp: dict | None = None, stages: dict | None = None, unified: dict | None = None, case: Case = HYBRID):
    from fuzz.checks.planner_workers import CHECK
    from fuzz.checks.protocol import Judging
    from fuzz.targets.base import Outcome
    from fuzz.verdict.compare import Verdict
    from oracles.contract import LAYOUT_PLACED_KERNEL_MAP

    whole_plan = WHOLE["configs"][0]
    record = {"whole": WHOLE,
              "tp": tp or {"memory": [(BASE + 1) * 2 * PAGE, BASE * 2 * PAGE], "configs": [whole_plan, whole_plan]},
              "stages": stages or {"skipped": "one layer"},
              "unified": unified or {"memory": [BASE * 2 * PAGE], "configs": [plan(BASE // 2, [(["f0", "f1", "s0", "s1"], "full")])]}}
    return CHECK.judge(Judging(case, LAYOUT_PLACED_KERNEL_MAP, None, Outcome(), Verdict("pass")), record)


def test_plans_as_the_oracle_says_pass():
    stages = {"memory": [BASE * 2 * PAGE, BASE * 2 * PAGE], "layers": [["f0"], ["f1", "s0", "s1"]],
              "configs": [plan(BASE, [(["f0"], "full"), ([], "sliding_window")]),
                          plan(BASE, [(["f1"], "full"), (["s0", "s1"], "sliding_window")])]}
    assert judged_record(stages=stages) is None


def test_a_rank_planned_the_most_blocks_is_reported():
    memory = [(BASE + 3) * 2 * PAGE, BASE * 2 * PAGE]  # 3 blocks more on rank 0
    finding = judged_record(tp={"memory": memory, "configs": [plan(BASE + 3, [(["f0", "f1"], "full"), (["s0", "s1"], "sliding_window")])] * 2})
    assert finding is not None and finding.kind == "workers-blocks" and finding.function == "get_kv_cache_configs", finding


def test_a_rank_planned_other_groups_is_reported():
    other = plan(BASE, [(["f0", "s0"], "full"), (["f1", "s1"], "sliding_window")])
    finding = judged_record(tp={"memory": [BASE * 2 * PAGE] * 2, "configs": [WHOLE["configs"][0], other]})
    assert finding is not None and finding.kind == "workers-differ" and "TP rank 1 of 2" in finding.message, finding


def test_a_stage_backing_another_stage_s_layer_is_reported():
    stray = plan(BASE, [(["f0"], "full"), ([], "sliding_window")])
    stray["tensors"].append({"layers": ["s0", "s1"], "size": BASE * PAGE})
    stages = {"memory": [BASE * 2 * PAGE] * 2, "layers": [["f0"], ["f1", "s0", "s1"]],
              "configs": [stray, plan(BASE, [(["f1"], "full"), (["s0", "s1"], "sliding_window")])]}
    finding = judged_record(stages=stages)
    assert finding is not None and finding.kind == "workers-layers" and finding.layer == "s0", finding


def test_a_stage_grouped_on_its_own_is_reported():
    """Issue #23883's class: a stage of two window layers groups them apart from the whole model's grouping."""
    own = plan(BASE, [(["f1"], "full"), (["s0"], "sliding_window"), (["s1"], "sliding_window")])
    stages = {"memory": [BASE * 2 * PAGE] * 2, "layers": [["f0"], ["f1", "s0", "s1"]],
              "configs": [plan(BASE, [(["f0"], "full"), ([], "sliding_window")]), own]}
    finding = judged_record(stages=stages)
    assert finding is not None and finding.kind == "workers-differ" and "projected" in finding.message, finding


def test_stages_planned_the_most_blocks_are_reported():
    """Stage 0 spends one page a block and holds 2 * BASE blocks, stage 1 two pages and BASE: both must get BASE."""
    stages = {"memory": [BASE * 2 * PAGE] * 2, "layers": [["f0"], ["f1", "s0", "s1"]],
              "configs": [plan(2 * BASE, [(["f0"], "full"), ([], "sliding_window")]),
                          plan(2 * BASE, [(["f1"], "full"), (["s0", "s1"], "sliding_window")])]}
    finding = judged_record(stages=stages)
    assert finding is not None and finding.kind == "workers-blocks" and "instead of 1048576" in finding.message, finding
    stages["configs"][0] = plan(BASE, [(["f0"], "full"), ([], "sliding_window")])
    finding = judged_record(stages=stages)
    assert finding is not None and finding.kind == "workers-differ" and "[1048576, 2097152] blocks" in finding.message, finding


def test_ranks_shrunk_to_other_blocks_than_asked_are_reported():
    whole_plan = WHOLE["configs"][0]
    shrunk = {"blocks": BASE - 2, "configs": [plan(BASE - 2, [(["f0", "f1"], "full"), (["s0", "s1"], "sliding_window")]), whole_plan]}
    finding = judged_record(tp={"memory": [BASE * 2 * PAGE] * 2, "configs": [whole_plan, whole_plan], "shrunk": shrunk})
    assert finding is not None and finding.kind == "workers-blocks" and finding.function == "shrink_kv_cache_configs", finding
    assert "TP rank 1 of 2 shrunk" in finding.message, finding


def test_a_refusal_is_reported_unless_the_oracle_says_refuse():
    refused = {"memory": [1], "error": "ValueError: Failed to promote local KV cache specs to one unified type.",
               "function": "_promote_local_kv_cache_specs"}
    finding = judged_record(unified=refused)
    assert finding is not None and finding.kind == "planner-workers" and finding.function == "_promote_local_kv_cache_specs"
    assert judged_record(unified=refused, case=CASES["mamba"]) is None


def test_a_hybrid_off_plan_that_is_no_one_group_is_reported():
    two = {"memory": [BASE * 2 * PAGE], "configs": [WHOLE["configs"][0]]}
    finding = judged_record(unified=two)
    assert finding is not None and finding.kind == "unified-groups" and "2 groups instead of one" in finding.message, finding
    finding = judged_record(unified=two, case=CASES["mamba"])
    assert finding is not None and finding.kind == "planner-workers" and "instead of refusing" in finding.message, finding


# ------------------------------------------------------------------------------------------- vLLM's plans


def judged(target: Any, case: Case) -> dict:
    """The check's record on the case's walk and its judgement (the finding's kind and message, or None)."""
    from fuzz.checks import planner_workers
    from fuzz.checks.protocol import Judging, Unusable
    from fuzz.errors import Inexpressible
    from fuzz.targets.base import Outcome
    from fuzz.verdict.compare import Verdict

    run = planner_workers.CHECK.offer(target.probe)
    assert callable(run), f"vLLM {target.info.vllm_version} offers no planner-workers run: {run}"
    try:
        walk = target.walk(case)
        record = run(walk)
    except (Unusable, Inexpressible) as why:  # the check, or this release's views, cannot take the case
        return {"skipped": str(why), "finding": None}
    finding = planner_workers.CHECK.judge(Judging(walk.case, target.info.contract, None, Outcome(), Verdict("pass")), record)
    return {"record": record, "finding": None if finding is None else [finding.kind, finding.message, finding.layer]}


def generated(target: Any, count: int, seed: int = SEED) -> list[dict]:
    """The check on `count` generated cases (those the target walks): each one's finding, and whether a finding is the
    empty projection's (`empty_projection_strays`)."""
    from fuzz import space
    from fuzz.case import replace
    from fuzz.errors import CaseMismatch
    from fuzz.tracebacks import vllm_failure

    results = []
    for index in range(count):
        case = replace(space.draw_indexed(target.info, seed, index), touches=NAMED)
        try:
            got = judged(target, case)
        except CaseMismatch:
            continue
        except Exception as error:  # noqa: BLE001 - vLLM refusing the case's views: the view path's to judge, not this check's
            if vllm_failure(error) is None:
                raise
            continue
        explained = got["finding"] is not None and empty_projection_strays(got["record"])
        results.append({"index": index, "skipped": got.get("skipped"), "finding": got["finding"], "empty_projection": explained})
    return results


def empty_projection_strays(record: dict) -> bool:
    """Whether every stage backs only its own layers and, beyond them, exactly the layers of the whole model's per-layer
    groups (UniformTypeKVCacheSpecs) it owns none of: the empty projection of issue #54711, and nothing else."""
    stages = record["stages"]
    groups = record["whole"]["configs"][0]["groups"]
    for layers, config in zip(stages.get("layers", []), stages.get("configs", []), strict=True):
        owned = set(layers)
        backed = {name for tensor in config["tensors"] for name in tensor["layers"]}
        unowned = {name for g in groups if g["kind"] == "uniform_type" and not owned & set(g["layers"]) for name in g["layers"]}
        if backed - owned != unowned or not owned <= backed:
            return False
    return True


def expect_plans(name: str, record: dict) -> None:
    """The plans of CASES[name] as worked out here: pages of PAGE bytes; the pool of a block holds the widest group's pages
    (groups share a block's bytes), and with the hybrid manager off every layer's."""
    whole = record["whole"]["configs"][0]
    widths = {"full": 3, "hybrid": 2}
    width = widths[name] * PAGE
    assert whole["num_blocks"] == BASE and whole["backing_bytes"] == BASE * width
    tp = record["tp"]
    blocks = min(memory // width for memory in tp["memory"])
    assert 2 <= len(tp["memory"]) <= 4 and blocks in (BASE, BASE + 2, BASE + 4, BASE + 6)  # even: an odd count's memory is a byte short
    for config in tp["configs"]:
        assert config["groups"] == whole["groups"] and config["num_blocks"] == blocks and config["backing_bytes"] == blocks * width
    stages = record["stages"]
    layers = [name for g in whole["groups"] for name in g["layers"]]
    assert [n for stage in stages["layers"] for n in stage] == layers and 2 <= len(stages["layers"]) <= 3
    per_block = []
    for stage, config in zip(stages["layers"], stages["configs"], strict=True):
        own = [[n for n in g["layers"] if n in stage] for g in whole["groups"]]
        assert [g["layers"] for g in config["groups"]] == own
        assert sorted(n for t in config["tensors"] for n in t["layers"]) == sorted(stage)
        per_block.append(max(len(names) for names in own) * PAGE)
    least = min(memory // size for memory, size in zip(stages["memory"], per_block, strict=True))
    assert {config["num_blocks"] for config in stages["configs"]} == {least}
    unified = record["unified"]["configs"][0]
    assert [g["layers"] for g in unified["groups"]] == [layers] and set(unified["groups"][0]["kinds"]) == {"full"}
    assert unified["num_blocks"] == BASE * width // (len(layers) * PAGE)


def test_the_installed_release_plans_workers_as_the_whole_model(kvfuzz_target):
    for name in ("full", "hybrid"):
        got = judged(kvfuzz_target, CASES[name])
        assert got["finding"] is None, (name, got["finding"])
        expect_plans(name, got["record"])
    got = judged(kvfuzz_target, CASES["mamba"])
    assert got["finding"] is None and got["record"]["unified"]["error"].startswith("ValueError"), got


def test_the_check_runs_where_a_case_names_it(kvfuzz_target):
    """Through the target and the verdict as a campaign runs it: the record in the outcome, judged with the case."""
    from fuzz.verdict.runner import judge

    execution = kvfuzz_target.execute(CASES["full"], "cpu")
    assert execution.outcome is not None and "whole" in execution.outcome.checks["planner-workers"], execution
    result = judge(execution, kvfuzz_target.info.contract)
    assert result.verdict.status == "pass" and "planner-workers" in result.checks and result.checks["planner-workers"] is None, result


def test_the_installed_release_backs_a_stage_with_other_stages_layers(kvfuzz_target):
    """vLLM 0.32's stage that owns none of a per-layer group's layers still gets tensors for them (issue #54711)."""
    version = kvfuzz_target.info.vllm_version
    got = judged(kvfuzz_target, CASES["narrow-window"])
    if version not in EMPTY_PROJECTION_BUG:
        assert got["finding"] is None, got
        return
    assert got["finding"] is not None and got["finding"][0] == "workers-layers", got
    assert "back layers of other stages" in got["finding"][1] and empty_projection_strays(got["record"]), got


@pytest.mark.slow
@pytest.mark.sweep
def test_generated_cases_on_the_installed_release(kvfuzz_target):
    results = generated(kvfuzz_target, GENERATED)
    assert_generated(kvfuzz_target.info.vllm_version, results)


def assert_generated(version: str, results: list[dict]) -> None:
    """Most generated cases planned and judged; a finding only where the release has the empty projection's bug, and
    then only that bug."""
    planned = [r for r in results if r["skipped"] is None]
    assert len(planned) >= GENERATED // 2, results
    for result in planned:
        if version in EMPTY_PROJECTION_BUG and result["finding"] is not None:
            assert result["finding"][0] == "workers-layers" and result["empty_projection"], result
        else:
            assert result["finding"] is None, result


SCRIPT = """
import json
from fuzz.targets.loader import load_local
from tests.test_planner_workers import CASES, generated, judged
target = load_local()
out = {"version": target.info.vllm_version, "cases": {name: judged(target, CASES[name]) for name in NAMES},
       "generated": generated(target, COUNT)}
print("RESULT " + json.dumps(out))
"""


def run_in_tree(source: str, names: list[str], count: int, cwd: Path) -> dict:
    """SCRIPT on the named cases and `count` generated ones, in a worker environment of `source` (a release, or a tree)."""
    from fuzz.errors import TargetError
    from fuzz.targets import releases

    try:
        target = releases.resolve(source)
    except TargetError as error:
        pytest.skip(f"vLLM {source} is not available here: {error}")
    env = releases.worker_environment(target)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(Path(__file__).absolute().parent.parent)])
    script = f"NAMES = {names!r}\nCOUNT = {count}\n{SCRIPT}"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=1200, cwd=cwd)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("version", sampled(["0.28.0", "0.34.0"], ["0.34.0"]))
def test_releases_plan_workers_as_the_whole_model(version, tmp_path):
    out = run_in_tree(version, list(CASES), GENERATED, tmp_path)
    assert out["version"] == version
    for name in ("full", "hybrid"):
        assert out["cases"][name]["finding"] is None, (name, out["cases"][name])
        expect_plans(name, out["cases"][name]["record"])
    assert out["cases"]["mamba"]["record"]["unified"]["error"].startswith("ValueError"), out["cases"]["mamba"]
    assert out["cases"]["narrow-window"]["finding"] is None, out["cases"]["narrow-window"]
    assert_generated(version, out["generated"])
    if version == "0.34.0":  # the TP ranks shrunk after warmup, by a few blocks
        shrunk = out["cases"]["full"]["record"]["tp"]["shrunk"]
        assert shrunk["configs"] and {c["num_blocks"] for c in shrunk["configs"]} == {shrunk["blocks"]}


# ------------------------------------------------------------------------------------------- mutated trees


def mutated_tree(version: str, root: Path, old: str, new: str) -> Path:
    """The release's tree linked file by file into `root`, its planner module replaced by a copy with `old` made `new`."""
    from fuzz.errors import TargetError
    from fuzz.targets import releases

    try:
        source = releases.resolve(version)
    except TargetError as error:
        pytest.skip(f"release not available here: {error}")
    assert source.python_path is not None
    shutil.copytree(source.python_path / "vllm", root / "vllm", symlinks=True, copy_function=os.symlink)
    path = root / PLANNER_FILES[version]
    text = path.read_text()
    assert text.count(old) == 1, f"{version}'s planner has {text.count(old)} of {old!r}"
    path.unlink()
    path.write_text(text.replace(old, new))
    return root


# The workers' one block count taken as the most any worker's memory holds.
MOST = ("    min_num_blocks = min(\n", "    min_num_blocks = max(\n")
# A stage's groups take the first layers of each whole group, as many as it owns: a later stage gets an earlier one's.
FIRST_LAYERS = ("layer_name for layer_name in group.layer_names if layer_name in worker_spec",
                "layer_name for layer_name in group.layer_names[:sum(name in worker_spec for name in group.layer_names)]")


@pytest.mark.slow
@pytest.mark.parametrize("version", sampled(["0.32.0", "0.34.0"], ["0.34.0"]))
@pytest.mark.parametrize(("mutation", "kind"), [(MOST, "workers-blocks"), (FIRST_LAYERS, "workers-layers")],
                         ids=["most-blocks", "another-stage-s-layers"])
def test_a_mutated_planner_is_reported(version, mutation, kind, tmp_path):
    root = mutated_tree(version, tmp_path / "tree", *mutation)
    got = run_in_tree(str(root), ["full"], 0, tmp_path)["cases"]["full"]
    assert got["finding"] is not None and got["finding"][0] == kind, got


def test_the_check_is_drawn_into_campaigns():
    from fuzz.checks.planner_workers import CHECK
    from fuzz.verdict.findings import DESCRIPTIONS

    assert CHECK.drawn is True and CHECK.applies(CASES["full"]) and not CHECK.applies(Case(groups=CASES["full"].groups, num_blocks=4))
    assert set(CHECK.kinds) <= set(DESCRIPTIONS)
