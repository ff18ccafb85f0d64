"""The property itself, under pytest: the target agrees with the oracle on drawn cases.

Against the installed vLLM by default; `pytest --kvfuzz-vllm 0.22.0` runs it against that release.
A finding the corpus already records for the target's release is expected; anything else fails,
and Hypothesis shrinks it first."""

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz.case import dumps
from fuzz.corpus import entries
from fuzz.minimize import minimize
from fuzz.runner import run_case
from fuzz.strategies import cases

CORPUS = Path(__file__).resolve().parent.parent / "corpus" / "findings"


@pytest.fixture(scope="session")
def known_signatures(kvfuzz_target):
    version = kvfuzz_target.info.vllm_version
    return {e.expected_signature for e in entries(CORPUS) if version in e.affected_versions} if CORPUS.exists() else set()


@given(st.data())
def test_target_agrees_with_the_oracle(kvfuzz_target, kvfuzz_device, known_signatures, data):
    case = data.draw(cases(kvfuzz_target.info))
    finding = run_case(kvfuzz_target, case, kvfuzz_device).verdict.finding
    if finding is None or finding.signature in known_signatures:
        return
    # Hypothesis shrinks the draws; kvfuzz's minimizer then shrinks the case itself, as for every engine.
    small, _ = minimize(case, lambda c: (f := run_case(kvfuzz_target, c, kvfuzz_device).verdict.finding) is not None
                        and f.signature == finding.signature, kvfuzz_target.info, max_seconds=30)
    raise AssertionError(f"{finding.signature}\nminimized case: {dumps(small)}")
