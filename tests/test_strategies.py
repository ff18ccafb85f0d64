"""The generators reach every option, every drawn case is one vLLM could build, and draws replay."""

import random
from collections import Counter

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from fuzz.space import RandomSource, Rejected, accepts, choose_kernel_block_size, draw_indexed, unrealistic
from fuzz.strategies import cases
from oracles import pages
from tests.conftest import synthetic_info


def test_kernel_block_size_rule():
    assert choose_kernel_block_size(64, ("x16",)) == 64
    assert choose_kernel_block_size(256, (16, 32)) == 32
    assert choose_kernel_block_size(512, (256,)) == 256
    assert choose_kernel_block_size(16, ("x32",)) is None
    assert accepts((16, "x64"), 128) and not accepts((16,), 32)


def test_random_source_pins_draws_to_values():
    source = RandomSource(random.Random(7))
    assert [source.integer(0, 9) for _ in range(5)] == [3, 1, 6, 0, 5]
    assert source.choice(("a", "b", "c")) == "b"
    assert [source.chance(50) for _ in range(4)] == [True, False, True, True]


def test_indexed_draws_replay_exactly(placed_info):
    first = [draw_indexed(placed_info, 3, i) for i in range(50)]
    assert [draw_indexed(placed_info, 3, i) for i in range(50)] == first
    assert len({repr(c) for c in first}) > 40


def _realistic(info, case):
    assert unrealistic(case, info) is None, unrealistic(case, info)
    for group in case.groups:
        spec = group.spec
        sizes = group.synthetic_backend.kernel_block_sizes if group.synthetic_backend else (
            info.backend(group.backend).kernel_block_sizes if group.backend else (spec.block_size,))
        want = spec.block_size if spec.kind == "encoder_only" else choose_kernel_block_size(spec.block_size, sizes)
        assert group.kernel_block_size == want, "the kernel block size is the one vLLM's rule picks"
    attention = [g for g in case.groups if g.spec.kind != "mamba"]
    for group in case.groups:
        if group.spec.kind == "mamba" and attention:  # a Mamba-only model has no attention page to match
            assert pages.page(group.spec).page_bytes == pages.page(attention[0].spec).page_bytes
            assert len(group.layers) >= max(len(g.layers) for g in attention), "a Mamba layer in every pool"


def _count(info, examples):
    counts: Counter[str] = Counter()

    @seed(1234)
    @settings(max_examples=examples, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(cases(info))
    def draw(case):
        _realistic(info, case)
        counts["groups=%d" % min(len(case.groups), 2)] += 1
        counts["layout=" + case.layout] += 1
        counts["sharing"] += bool(case.kv_sharing)
        counts["mamba-only"] += bool(case.groups) and all(g.spec.kind == "mamba" for g in case.groups)
        for group in case.groups:
            spec = group.spec
            counts["kind=" + spec.kind] += 1
            counts["dtype=" + spec.dtype] += 1
            counts["cache=" + spec.cache_dtype] += 1
            counts["padded"] += pages.page(spec).padded
            ratio = spec.compress_ratio
            counts["ratio=1" if ratio == 1 else "ratio=2" if ratio == 2 else "ratio=power-of-two" if ratio & (ratio - 1) == 0
                   else "ratio=other"] += 1
            counts["storage-block-1"] += spec.block_size == spec.compress_ratio
            counts["block=power-of-two" if spec.block_size & (spec.block_size - 1) == 0 else "block=other"] += 1
            counts["kernel-does-not-split-states"] += (group.kernel_block_size or spec.block_size) % ratio != 0
            counts["head=odd"] += spec.head_size % 2
            counts["kernel-split"] += (group.kernel_block_size or spec.block_size) < spec.block_size
            counts["synthetic"] += group.synthetic_backend is not None

    draw()
    return counts


def test_generators_reach_every_option(placed_info):
    counts = _count(placed_info, 3000)
    # Edges of every numeric range, not the numbers of known bugs: compress ratios 2, other powers of two and others, a
    # stored block of one state, block sizes that are not powers of two, odd head sizes, kernel blocks cutting a state.
    wanted = (["groups=1", "groups=2", "sharing", "mamba-only", "padded", "ratio=2", "ratio=power-of-two", "ratio=other", "storage-block-1",
               "kernel-split", "synthetic", "block=power-of-two", "block=other", "kernel-does-not-split-states", "head=odd"]
              + ["kind=" + k for k in placed_info.spec_kinds] + ["layout=" + name for name in placed_info.layouts]
              + ["dtype=" + d for d in ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8", "int8")]
              + ["cache=auto", "cache=fp8", "cache=fp8_ds_mla"])
    missing = [w for w in wanted if counts[w] == 0]
    assert not missing, f"never drawn: {missing}; counts {dict(counts)}"


def test_backend_shaped_targets_get_one_backend_and_page_per_case(shaped_info):
    for index in range(400):
        try:
            case = draw_indexed(shaped_info, 5, index)
        except Rejected:
            continue
        attention = [g for g in case.groups if g.spec.kind != "mamba"]
        assert case.layout in ("NHD", "HND")
        assert len({(g.backend, g.synthetic_backend) for g in attention}) == (1 if attention else 0)  # 0: a Mamba-only model
        assert len({pages.page(g.spec).page_bytes for g in case.groups}) == 1
        assert all(g.spec.head_size_v is None for g in attention)


@given(st.data())
def test_fast_and_hypothesis_paths_draw_from_one_space(data):
    """A case Hypothesis draws is one the fast path could draw: same builder, same rules."""
    info = synthetic_info()
    case = data.draw(cases(info))
    _realistic(info, case)
