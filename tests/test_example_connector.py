"""The ExampleConnector check (fuzz/checks/example_connector.py): vLLM's example connector saves a request's blocks of a
case's caches to files (save_kv_layer) and loads them into other blocks of a second, freshly filled copy (start_load_kv);
the receiver must hold the sender's K and V for every saved token and change nowhere else (nixl.compare_ends).

The bytes the load may change on 0.32.0 (installed) and 0.34.0 are compared with the receiving blocks' pages worked out
here by hand; the judgement is shown to pass the connector where its indexing fits the caches, to report the two places it
does not (a layer's kernel-block cache indexed by the manager block size; an MLA cache that is not one run of token rows,
written through a reshaped copy), and to report a tree whose save reads the block after each asked one. Cases drawn as a
campaign draws them find nothing else.
"""

from __future__ import annotations

from typing import Any

import pytest

import oracles
from fuzz.case import Case, GroupCase, SpecCase, Touches
from fuzz.checks.protocol import Judging
from fuzz.targets.base import Outcome
from fuzz.verdict.compare import Verdict
from oracles.expectation import Expectation
from tests.sweep import sampled
from tests.test_decode_bench import generated, kernel_split, merged, mutated_tree, run_in_tree

NAME = "example-connector"
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
BLOCKS = 4
NAMED = Touches(consumers=(NAME,), blocks=(1, 3))  # a case asks for the check by naming it; it saves blocks 1 and 3
CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py"
# A token's K and V are 2 heads x 2 x 64 bf16 = 512 bytes; a 16-token page is 8192 bytes.
PAGE = 16 * 512
LAYER = BLOCKS * PAGE  # a layer-major layer's blocks, one after another
MLA_BLOCK = 64 * 576 * 2  # a 64-token block of MLA's 576-element latent


def case_of(kind: str, backend: str, layout: str, block_size: int, head_size: int, heads: int, kernel: int | None = None,
            blocks: tuple[int, ...] = (1, 3)) -> Case:
    spec = SpecCase(kind=kind, block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype="bfloat16")
    group = GroupCase(spec=spec, layers=LAYERS, backend=backend, kernel_block_size=kernel or block_size)
    return Case(groups=(group,), num_blocks=BLOCKS, layout=layout, touches=Touches(consumers=(NAME,), blocks=blocks))


CASES = {
    "full": case_of("full", "TRITON_ATTN", "LBHNC", 16, 64, 2),
    "adjacent": case_of("full", "TRITON_ATTN", "LBHNC", 16, 64, 2, blocks=(1, 2)),
    "blocks-outermost": case_of("full", "TRITON_ATTN", "BLHNC", 16, 64, 2),
    "mla-kernel-split": case_of("mla", "CPU_MLA", "LBNHC", 64, 576, 1, kernel=16),
    # 64-token blocks on ROCM_AITER_FA's 32-token kernel blocks (it takes 16 or 32).
    "kernel-split": case_of("full", "ROCM_AITER_FA", "LBHNC", 64, 64, 2, kernel=32),
    # MLA blocks outermost: a layer's token rows are not one run (block b's row holds both layers' pages).
    "mla-blocks-outermost": case_of("mla", "CPU_MLA", "BLNHC", 16, 576, 1),
}
# The bytes the load may change, worked out from the pages: the receiving blocks (blocks 2 and 1: from the last block down,
# the sent block 3 left out), merged.
RECEIVING = {
    "full": [[0, PAGE, 3 * PAGE], [0, LAYER + PAGE, LAYER + 3 * PAGE]],
    # Blocks 1 and 2 sent: 3 is the only other, then 1.
    "adjacent": [[0, PAGE, 2 * PAGE], [0, 3 * PAGE, 4 * PAGE], [0, LAYER + PAGE, LAYER + 2 * PAGE], [0, LAYER + 3 * PAGE, 2 * LAYER]],
    "blocks-outermost": [[0, 2 * PAGE, 6 * PAGE]],  # block rows 1 and 2, each both layers' pages
    # 64-token blocks of four 16-token kernel blocks each, contiguous: manager block b is kernel blocks 4b - 4b + 3.
    "mla-kernel-split": [[0, MLA_BLOCK, 3 * MLA_BLOCK], [0, 4 * MLA_BLOCK + MLA_BLOCK, 4 * MLA_BLOCK + 3 * MLA_BLOCK]],
}
RECEIVED = {"full": [2, 1], "adjacent": [3, 1], "blocks-outermost": [2, 1], "mla-kernel-split": [2, 1]}
CORRECT = ("full", "adjacent", "blocks-outermost", "mla-kernel-split")


def judged(target: Any, case: Case) -> dict[str, Any]:
    """The check's record on the case's walk, cut to what the tests read, with its judgement (kind: message, or None)."""
    from fuzz.checks import example_connector

    run = example_connector.CHECK.offer(target.probe)
    assert callable(run), f"vLLM {target.info.vllm_version} offers no ExampleConnector run: {run}"
    walk = target.walk(case)
    record = run(walk)
    expected = oracles.expect(walk.case, target.info.contract)
    finding = example_connector.CHECK.judge(Judging(walk.case, target.info.contract, expected, Outcome(), Verdict("pass")), record)
    return {"finding": None if finding is None else f"{finding.kind}: {finding.message}", "function": finding and finding.function,
            "error": record.get("error"), "skipped": record.get("skipped"), "sent": record.get("sent"), "received": record.get("received"),
            "wrong": record.get("wrong"), "changed": merged(record.get("changed", [])), "allowed": merged(record.get("allowed", []))}


def assert_played(out: dict[str, Any]) -> None:
    for name in CORRECT:
        got = out[name]
        assert got["error"] is None and got["skipped"] is None and got["finding"] is None, (name, got)
        assert got["received"] == RECEIVED[name] and got["wrong"] == [], (name, got)
        assert got["allowed"] == RECEIVING[name], (name, got["allowed"])  # every byte of the receiving blocks' tokens
        inside = [[buffer, start, end] for buffer, start, end in got["changed"]
                  if any(b == buffer and s <= start and end <= e for b, s, e in RECEIVING[name])]
        assert inside == got["changed"], (name, got["changed"])
    # vLLM's save indexes a kernel-block cache by the manager block size: token 32 of a block is past a 32-token kernel block.
    split = out["kernel-split"]
    assert split["finding"] is not None and split["finding"].startswith("crash-on-valid: ") and "IndexError" in split["finding"], split
    assert split["function"] == "extract_kv_from_layer"
    # vLLM's load writes an MLA layer through reshape(-1, C), a copy where the token rows are not one run: nothing lands.
    outermost = out["mla-blocks-outermost"]
    assert outermost["finding"] is not None and outermost["finding"].startswith("transfer-wrong: "), outermost
    assert outermost["changed"] == [], outermost


def available(target: Any) -> None:
    names = {b.name for b in target.info.backends}
    for name, case in CASES.items():
        if any(g.backend not in names for g in case.groups):
            pytest.skip(f"vLLM {target.info.vllm_version} has no backend of case {name}")


def test_the_installed_release_loads_the_saved_tokens_into_the_receiving_blocks(kvfuzz_target):
    available(kvfuzz_target)
    assert_played({name: judged(kvfuzz_target, case) for name, case in CASES.items()})


# ------------------------------------------------------------------------------------------- generated cases


def mla_rows_split(case: Case, expected: Expectation) -> bool:
    """An MLA layer's view is not one run of token rows ([B, 1, N, C] whose blocks lie N * C elements apart, its tokens C
    apart): a reshape to [B * N, C] is a copy."""
    mla = {name for group in case.groups if group.spec.is_mla for name in group.layers}
    for name in mla & set(expected.layers):
        for view in expected.layers[name].views:
            blocks, _, tokens, content = view.shape
            size = view.element_size
            rows = (view.byte_strides[0] if blocks > 1 else tokens * content * size, view.byte_strides[2], view.byte_strides[3])
            if rows != (tokens * content * size, content * size, size):
                return True
    return False


def unexplained(found: list[tuple[Case, Expectation, Any]]) -> list[str]:
    """Findings other than the two kvfuzz knows: the save's IndexError on kernel-block caches, and the load's lost MLA
    tokens where the token rows are not one run."""
    out = []
    for case, expected, finding in found:
        crash = finding.kind == "crash-on-valid" and "IndexError" in finding.message and kernel_split(expected)
        lost = finding.kind == "transfer-wrong" and mla_rows_split(case, expected)
        if not (crash or lost):
            out.append(f"{finding.kind}: {finding.message}")
    return out


@pytest.mark.slow
@pytest.mark.sweep
def test_generated_cases_find_only_the_two_known_mismatches(kvfuzz_target):
    ran, found = generated(kvfuzz_target, NAME, 250)
    assert ran >= 30, f"only {ran} of 250 drawn cases played a save and load"
    assert unexplained(found) == []


# ------------------------------------------------------------------------------------------- other trees, in a subprocess

SCRIPT = """
import json
from fuzz.checks import example_connector
from fuzz.targets.loader import load_local
from tests.test_decode_bench import generated
from tests.test_example_connector import CASES, NAME, judged, unexplained
target = load_local()
offered = example_connector.CHECK.offer(target.probe)
out = {"version": target.info.vllm_version, "off": getattr(offered, "reason", None)}
for name in NAMES if callable(offered) else ():
    out[name] = judged(target, CASES[name])
if GENERATED and callable(offered):
    ran, found = generated(target, NAME, GENERATED)
    out["generated"] = {"ran": ran, "found": len(found), "unexplained": unexplained(found)}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_0_34_loads_the_saved_tokens_and_generated_cases_find_nothing_else(tmp_path):
    out = run_in_tree("0.34.0", list(CASES), tmp_path, SCRIPT, generated_cases=120)
    assert out["version"] == "0.34.0" and out["off"] is None
    assert_played(out)
    assert out["generated"]["ran"] >= 10 and out["generated"]["unexplained"] == [], out["generated"]


# The save reads the block after each asked one.
ONE_BLOCK_OFF = ("return layer[block_idxs, :, offsets]", "return layer[block_idxs + 1, :, offsets]")


@pytest.mark.slow
@pytest.mark.parametrize("version", sampled(["installed", "0.34.0"], ["0.34.0"]))
def test_a_save_one_block_off_is_reported(version, tmp_path):
    root = mutated_tree(version, tmp_path / "tree", CONNECTOR, *ONE_BLOCK_OFF)
    got = run_in_tree(str(root), ["adjacent"], tmp_path, SCRIPT)["adjacent"]
    assert got["error"] is None and got["skipped"] is None, got
    assert got["finding"] is not None and got["finding"].startswith("transfer-wrong: "), got
    assert got["wrong"][0]["token"] == 0 and got["wrong"][0]["receiver_block"] == 3


# ------------------------------------------------------------------------------------------- when vLLM runs it


def test_only_single_group_attention_models_are_played():
    """ExampleConnector does not declare SupportsHMA: vLLM plans one KV-cache group for it; kvfuzz plays attention layers."""
    import dataclasses

    from fuzz.checks import example_connector

    case = CASES["full"]
    assert example_connector.CHECK.unrealistic(case) is None
    two = dataclasses.replace(case, groups=(case.groups[0], dataclasses.replace(case.groups[0], layers=("model.layers.2.self_attn.attn",))))
    assert example_connector.CHECK.unrealistic(two) == example_connector.ONE_GROUP_RULE
    mamba = dataclasses.replace(case.groups[0], spec=SpecCase(kind="mamba", block_size=16, mamba_shapes=((3, 8),), mamba_dtypes=("bfloat16",)))
    assert "attention layers only" in example_connector.CHECK.unrealistic(dataclasses.replace(case, groups=(mamba,)))


def test_the_receiving_blocks_are_others_where_the_pool_has_them():
    from fuzz.checks import example_connector

    assert example_connector.receiving_blocks(4, [1, 3]) == [2, 1]
    assert example_connector.receiving_blocks(8, [1, 3]) == [7, 6]
    assert example_connector.receiving_blocks(2, [1]) == [1]  # one usable block: loaded back where it was saved from


def test_the_check_is_drawn_into_campaigns():
    from fuzz.checks import example_connector

    assert example_connector.CHECK.drawn is True and example_connector.CHECK.applies(CASES["full"])
