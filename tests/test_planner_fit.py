"""The planner-fit check: planned from memory without the block-count override, vLLM's planner gives the
blocks the memory holds; on the installed vLLM and on fakes whose arithmetic is wrong in the ways the
override hides."""

import os
import sys
from types import SimpleNamespace

import pytest

from fuzz.case import Case, GroupCase, SpecCase
from fuzz.checks.planner_fit import CHECK, backing_bytes, memory_for, run
from fuzz.checks.protocol import Judging
from fuzz.targets.base import Outcome
from fuzz.targets.walk import Walk
from fuzz.verdict.compare import Verdict
from oracles import pages
from oracles.contract import SHAPED_022

CASE = Case(groups=(GroupCase(spec=SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64), layers=("l0", "l1"),
                              backend="TRITON_ATTN", kernel_block_size=16),), num_blocks=5)


def tensor(size, block_stride=0):
    return SimpleNamespace(size=size, block_stride=block_stride)


def planner(blocks_from_memory, tensors_per_plan=2, page=4096):
    """A fake planner: two unpacked tensors of `page` bytes per block each, its block count from memory."""
    def plan(memory):
        n = blocks_from_memory(memory)
        return SimpleNamespace(num_blocks=n, kv_cache_tensors=[tensor(page * n) for _ in range(tensors_per_plan)])
    return plan


def judged(plan, num_blocks=5):
    """The check's run on a walk whose override plan has `num_blocks` blocks and whose planner from memory is `plan`, and its
    verdict on what it recorded. An error `plan` raises here passes for vLLM's (its frame is in vllm/: vllm_of_plan)."""
    override_plan = planner(lambda _: num_blocks)(0)
    case = CASE if num_blocks == CASE.num_blocks else Case(groups=CASE.groups, num_blocks=num_blocks)
    walk = Walk(case=case, config=override_plan, attn_groups=[], kernel_block_sizes=[], manager_views={}, bound_views={}, raw=[],
                runners=("v2",), vllm_config=None, replan=vllm_of_plan(plan))
    facts = run(walk)
    return CHECK.judge(Judging(case, SHAPED_022, None, Outcome(), Verdict("pass")), facts), facts


def vllm_of_plan(plan):
    """`plan` called from a frame that reads as vLLM's (a code object compiled under a vllm/ path), so that an error it raises
    is classified as vLLM's, as the planner's own would be."""
    loaded = sys.modules.get("vllm")
    folder = os.path.dirname(loaded.__file__) if loaded is not None and getattr(loaded, "__file__", None) else "/site-packages/vllm"
    namespace = {"plan": plan}
    exec(compile("def replan(memory):\n    return plan(memory)\n", os.path.join(folder, "v1/core/kv_cache_utils.py"), "exec"), namespace)
    return namespace["replan"]


def test_memory_is_the_blocks_exactly_or_one_byte_short():
    assert memory_for(4, 100) == 400 and memory_for(5, 100) == 499


def test_packed_tensors_share_one_backing_allocation():
    assert backing_bytes([tensor(300, block_stride=30), tensor(300, block_stride=30), tensor(50)]) == 350


@pytest.mark.parametrize("num_blocks", [1, 4, 5])
def test_a_planner_that_fits_the_memory_passes(num_blocks):
    finding, facts = judged(planner(lambda memory: memory // 8192), num_blocks)
    assert finding is None
    assert facts["bytes_per_block"] == 8192 and facts["num_blocks"] == (num_blocks if num_blocks % 2 == 0 else num_blocks - 1)


@pytest.mark.parametrize("wrong", [
    lambda memory: memory // 4096 // 2 * 2,  # divides by a page, not by the bytes per block, then rounds
    lambda memory: memory * 8192,  # `//` for `*`
    lambda memory: min(memory // 8192, 0),  # `min` for `max`
    lambda memory: max(memory // 8192, 1),  # never below one block: shows only where the memory holds none (odd 1 block)
])
def test_wrong_block_arithmetic_is_a_planner_fit_finding(wrong):
    findings = [judged(planner(wrong), n)[0] for n in (1, 4, 5)]
    assert any(f is not None and f.kind == "planner-fit" and f.function == "get_kv_cache_config_from_groups" for f in findings)


def test_tensors_of_another_size_than_the_blocks_given_are_a_finding():
    def plan(memory):
        n = memory // 8192
        return SimpleNamespace(num_blocks=n, kv_cache_tensors=[tensor(4096 * (n + 1)), tensor(4096 * n)])
    finding, _ = judged(plan, 4)
    assert finding is not None and "bytes of tensors instead of" in finding.message


def test_refusing_memory_for_no_block_is_allowed_and_any_other_refusal_is_not():
    def refuse(memory):
        raise ValueError("no memory for the KV cache")
    assert judged(refuse, 1)[0] is None  # memory one byte short of the only block
    finding, _ = judged(refuse, 4)
    assert finding is not None and "ValueError" in finding.message


def test_the_installed_planner_fits_its_memory(kvfuzz_target):
    """The real planner, a case of two full-attention layers: per block it spends the two layers' pages."""
    result = kvfuzz_target.execute(CASE, "cpu")
    outcome = result.outcome
    assert outcome is not None and outcome.error_type is None, outcome
    fit = outcome.checks.get("planner-fit")
    if fit is None:
        pytest.skip("this vLLM's planner takes a block count, not memory")
    page = pages.page(CASE.groups[0].spec).page_bytes
    assert fit["bytes_per_block"] == 2 * page
    assert fit["num_blocks"] == 4 and fit["tensor_bytes"] == 4 * 2 * page
