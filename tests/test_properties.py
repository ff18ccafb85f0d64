"""The property itself, under pytest: the target agrees with the oracle on drawn cases.

Against the installed vLLM by default; `pytest --kvfuzz-vllm 0.22.0` runs it against that release.
A finding the corpus already records for the target's release is expected; anything else fails,
and Hypothesis shrinks it first."""

from hypothesis import given
from hypothesis import strategies as st

from fuzz.case import dumps
from fuzz.corpus.minimize import shrink_finding
from fuzz.strategies import cases
from fuzz.verdict.runner import run_case


@given(st.data())
def test_target_agrees_with_the_oracle(kvfuzz_target, kvfuzz_device, kvfuzz_known, data):
    case = data.draw(cases(kvfuzz_target.info))
    finding = run_case(kvfuzz_target, case, kvfuzz_device).verdict.finding
    if finding is None or finding.signature in kvfuzz_known:
        return
    # Hypothesis shrinks the draws; kvfuzz's minimizer then shrinks the case itself, as for every engine.
    small, _, _ = shrink_finding(case, finding, lambda c: run_case(kvfuzz_target, c, kvfuzz_device).verdict.finding,
                                 kvfuzz_target.info, max_seconds=30)
    raise AssertionError(f"{finding.signature}\nminimized case: {dumps(small)}")
