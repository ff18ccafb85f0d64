"""The minimizer: deterministic, realistic candidates only, and it reaches the smallest failing case."""

from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend
from fuzz.corpus.minimize import minimize, size
from fuzz.space import unrealistic
from tests.conftest import synthetic_info


def big_case() -> Case:
    spec = SpecCase(kind="mla", block_size=256, head_size=576, compress_ratio=4, model_version="deepseek_v4", alignment=576)
    fake = SyntheticBackend("alpha", kernel_block_sizes=(64,))
    groups = tuple(GroupCase(spec=spec, layers=tuple(f"g{i}.l{j}" for j in range(3)), synthetic_backend=fake, kernel_block_size=64)
                   for i in range(3))
    return Case(groups=groups, num_blocks=4, layout="BLNHC")


def test_shrinks_to_one_group_one_layer_one_block_and_is_deterministic():
    info = synthetic_info()
    seen = []

    def fails(case: Case) -> bool:  # the "bug": any compressed MLA case split into kernel blocks
        seen.append(case)
        assert unrealistic(case, info) is None, "only realistic candidates are run"
        group = case.groups[0]
        return group.spec.compress_ratio > 1 and group.kernel_block_size < group.spec.block_size

    small, steps = minimize(big_case(), fails, info)
    assert (len(small.groups), len(small.groups[0].layers), small.num_blocks) == (1, 1, 1)
    assert small.layout == "LBNHC" and small.groups[0].spec.alignment is None
    assert size(small) < size(big_case())
    again, _ = minimize(big_case(), fails, info)
    assert again == small and steps == len(seen) // 2
