"""The generators reach every option, and every drawn case is one vLLM could build."""

from collections import Counter

from hypothesis import HealthCheck, given, seed, settings

from fuzz.strategies import accepts, cases, choose_kernel_block_size
from oracles import pages
from tests.test_oracle import INFO


def test_kernel_block_size_rule():
    assert choose_kernel_block_size(64, ("x16",)) == 64
    assert choose_kernel_block_size(256, (16, 32)) == 32
    assert choose_kernel_block_size(512, (256,)) == 256
    assert choose_kernel_block_size(16, ("x32",)) is None
    assert accepts((16, "x64"), 128) and not accepts((16,), 32)


def test_generators_reach_every_option():
    counts: Counter[str] = Counter()

    @seed(1234)
    @settings(max_examples=1500, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(cases(INFO))
    def draw(case):
        counts["groups=%d" % min(len(case.groups), 2)] += 1
        counts["layout=" + case.layout] += 1
        counts["sharing"] += bool(case.kv_sharing)
        for group in case.groups:
            spec = group.spec
            counts["kind=" + spec.kind] += 1
            counts["dtype=" + spec.dtype] += 1
            counts["cache=" + spec.cache_dtype] += 1
            counts["padded"] += pages.page(spec).padded
            counts["compressed"] += spec.compress_ratio > 1
            counts["ratio=%d" % spec.compress_ratio] += 1
            counts["storage-block-1"] += spec.block_size == spec.compress_ratio
            counts["kernel-split"] += (group.kernel_block_size or spec.block_size) < spec.block_size
            counts["synthetic"] += group.synthetic_backend is not None
            # Realism: the kernel block size is the one vLLM's rule gives for the backend.
            sizes = group.synthetic_backend.kernel_block_sizes if group.synthetic_backend else (
                INFO.backend(group.backend).kernel_block_sizes if group.backend else (spec.block_size,))
            assert group.kernel_block_size == choose_kernel_block_size(spec.block_size, sizes)

    draw()
    wanted = (["groups=1", "groups=2", "sharing", "padded", "compressed", "ratio=4", "ratio=128", "storage-block-1",
               "kernel-split", "synthetic"]
              + ["kind=" + k for k in INFO.spec_kinds]
              + ["layout=" + name for name in INFO.layouts]
              + ["dtype=" + d for d in ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8", "int8")]
              + ["cache=auto", "cache=fp8", "cache=fp8_ds_mla"])
    missing = [w for w in wanted if counts[w] == 0]
    assert not missing, f"never drawn: {missing}; counts {dict(counts)}"
