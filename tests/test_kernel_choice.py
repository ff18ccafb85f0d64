"""Which kernel block size disagreements are the case's fault and which are vLLM's: a size vLLM derives that its
backend declares (and that divides the block) makes a stated size a case error; anything else is judged."""

from types import SimpleNamespace

import pytest

from fuzz.case import Case, GroupCase, SpecCase
from fuzz.targets.common import CaseMismatch, check_derived_kernel_sizes, stated_kernel_sizes_declared


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
