"""Which kernel block size disagreements are the case's fault and which are vLLM's: a size vLLM derives that its
backend declares (and that divides the block) makes a stated size a case error; anything else is judged."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fuzz.case import Case, GroupCase, SpecCase
from fuzz.errors import CaseMismatch
from fuzz.targets.walker import check_derived_kernel_sizes, stated_kernel_sizes_declared
from oracles import contract


class MultipleOf:
    def __init__(self, base):
        self.base = base


def groups_declaring(*sizes):
    backend = SimpleNamespace(get_supported_kernel_block_sizes=lambda spec=None: list(sizes))
    return [[SimpleNamespace(backend=backend, kv_cache_spec=None)]]


CASE = Case(groups=(GroupCase(spec=SpecCase(kind="full", block_size=64, num_kv_heads=2, head_size=64), layers=("l0",),
                              backend="TRITON_ATTN", kernel_block_size=16),), num_blocks=4)


def check(derived, *sizes):
    attn = groups_declaring(*sizes)
    check_derived_kernel_sizes(CASE, {0: derived}, lambda index: tuple(
        f"x{s.base}" if isinstance(s, MultipleOf) else s for s in attn[index][0].backend.get_supported_kernel_block_sizes()))


def test_a_valid_size_vllm_prefers_makes_the_stated_one_a_case_error():
    with pytest.raises(CaseMismatch, match="the case says 16, vLLM derives 32"):
        check(32, 16, 32)


@pytest.mark.parametrize(("derived", "sizes"), [(8, (16, 32)), (48, (MultipleOf(16),)), (128, (16, 128))])
def test_a_derived_size_the_backend_does_not_declare_or_that_does_not_divide_the_block_is_judged(derived, sizes):
    check(derived, *sizes)  # no CaseMismatch: the views built with vLLM's size are compared with the case's


def test_the_same_size_is_no_disagreement():
    check(16, 16)


def test_vllm_refusing_a_stated_size_its_backend_declares_is_vllm_s_refusal():
    assert stated_kernel_sizes_declared(CASE, groups_declaring(16, 32))
    assert stated_kernel_sizes_declared(CASE, groups_declaring(MultipleOf(8)))
    assert not stated_kernel_sizes_declared(CASE, groups_declaring(32))
    assert not stated_kernel_sizes_declared(CASE, [[]])  # no backend could say


def test_vllm_picking_another_declared_size_than_its_rule_is_a_broken_rule_not_a_case_error():
    stated_by_rule = Case(groups=(GroupCase(spec=SpecCase(kind="full", block_size=64, num_kv_heads=2, head_size=64), layers=("l0",),
                                            backend="TRITON_ATTN", kernel_block_size=32),), num_blocks=4)
    declared = (16, 32)
    assert contract.kernel_block_size(64, declared) == 32
    assert check_derived_kernel_sizes(stated_by_rule, {0: 16}, lambda index: declared) == {0: [16, 32]}
    assert check_derived_kernel_sizes(stated_by_rule, {0: 32}, lambda index: declared) == {}


@pytest.mark.parametrize("block_size", [16, 48, 64, 96, 256])
@pytest.mark.parametrize("sizes", [(16, 32), (MultipleOf(16),), (64, 128), (1, MultipleOf(16)), (MultipleOf(32), 16), (48,)])
def test_the_rule_picks_the_block_where_declared_else_the_largest_declared_divisor(block_size, sizes):
    labels = tuple(f"x{s.base}" if isinstance(s, MultipleOf) else s for s in sizes)
    takes = [size for size in range(1, block_size + 1) if any(size == s if isinstance(s, int) else size % s.base == 0 for s in sizes)]
    dividing = [size for size in takes if block_size % size == 0]
    wanted = block_size if block_size in takes else max((s for s in dividing if s in labels), default=None)
    assert contract.kernel_block_size(block_size, labels) == wanted


SMALLEST_FIRST = '''
    if _block_size_is_supported(backends, kv_manager_block_size, specs):
        smaller = [size for backend, spec in zip(backends, specs, strict=True) for size in backend.get_supported_kernel_block_sizes(spec)
                   if isinstance(size, int) and kv_manager_block_size % size == 0 and _block_size_is_supported(backends, size, specs)]
        return min(smaller, default=kv_manager_block_size)
'''


@pytest.mark.slow
def test_a_vllm_whose_kernel_block_rule_picks_smaller_blocks_is_judged_not_an_internal_error(tmp_path):
    """A copy of the installed vLLM whose select_common_block_size takes the smallest declared size that divides the block:
    its views are right at that size, so the campaign reports the broken rule (a warning), never a case error."""
    from tests.test_entry_points import checkout_of_installed, rewrite

    root = checkout_of_installed(tmp_path / "tree")
    original = "    if _block_size_is_supported(backends, kv_manager_block_size, specs):\n        return kv_manager_block_size\n"
    assert original in (root / "vllm/v1/worker/utils.py").read_text()
    rewrite(root, "vllm/v1/worker/utils.py", lambda text: text.replace(original, SMALLEST_FIRST.lstrip("\n"), 1))
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "fuzz.cli", "run", "--vllm", str(root), "--max-cases", "800", "--workers", "1",
                             "--seed", "0", "--corpus", str(tmp_path / "corpus"), "--report", str(report), "--fail-on", "warning",
                             "--quiet"], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 1, result.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["verdicts"].get("internal-error", 0) == 0, data.get("internal_errors")
    kinds = {finding["kind"] for finding in data["findings"]}
    assert "kernel-block-choice" in kinds, kinds
