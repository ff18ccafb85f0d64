"""Fixes of issue 47's triage: what vLLM's own layers declare, what vLLM raises around a check's code, and what the NIXL
agent's stand-in answers.

- kvfuzz's MLA stand-in must hold every attribute `MLAAttention.get_kv_cache_spec` reads, including those read through
  the class's own methods it calls (0.31's `_uses_flat_kv_cache()`), and nothing it calls counts as state.
- Where a release's MLA layer adds a block-stride alignment itself (0.31, for backends that read the cache as flat rows),
  a spec without it is no spec that release builds: FlashInfer's sparse MLA beside a group of another page size, in a
  block-outermost layout, passes on 0.31.0 and crashes in `MLAAttention.bind_kv_cache` on 0.30.0, whose layer declares no
  alignment (FINDINGS.md, candidates).
- An exception vLLM raises in a check's run outside what the check catches itself is judged the same for every check.
- The recording NIXL agent answers `get_xfer_telemetry` as nixl does, so that 0.30 - 0.31 (which read it unguarded)
  complete a played transfer and its receive post-processing runs (FINDINGS #34).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fuzz.case import Case, GroupCase, SpecCase
from fuzz.targets.spec_builder import _mla_reads
from fuzz.verdict.runner import raised
from tests.conftest import release_target

REPO = Path(__file__).resolve().parent.parent


class Layer:
    def get_kv_cache_spec(self, vllm_config):
        return (self.head_size, self._flat() and self.cache_dtype)

    def _flat(self) -> bool:
        return self.backend == "FLASHINFER_MLA_SPARSE" or self._other()

    def _other(self) -> bool:
        return self._flat() and self.window  # calls back: visited once

    def get_attn_backend(self):
        return self.backend


def test_mla_reads_follow_the_methods_the_spec_calls():
    assert _mla_reads(Layer) == {"head_size", "cache_dtype", "backend", "window"}


def a_case() -> Case:
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
    return Case(groups=(GroupCase(spec=spec, layers=("l0",), backend="TRITON_ATTN"),), num_blocks=2, layout="LBNHC")


@pytest.mark.parametrize(("error", "kind"), [("AssertionError", "crash-on-valid"), ("RuntimeError", "crash-on-valid"),
                                             ("ValueError", "refused-valid"), ("NotImplementedError", "refused-valid")])
def test_what_vllm_raises_around_a_check_is_a_crash_or_a_refusal(error, kind):
    record = {"raised": {"type": error, "message": "stride", "function": "bind_kv_cache", "file": "x.py", "line": 1}}
    finding = raised(a_case(), "kernel-probe", record)
    assert finding.kind == kind and finding.function == "bind_kv_cache"
    assert finding.message == f"kernel-probe: {error}: stride"


FINDINGS = REPO / "corpus" / "findings"
# (corpus file, release, replay status): a case kvfuzz judged wrongly before a fix, replayed where the fix shows.
# - FlashInfer sparse MLA in a block-outermost pool: 0.30's layer declares no alignment and bind_kv_cache asserts (the
#   candidate); 0.31's layer declares the row, which the declared case now takes ("fixed": the file records 0.30 only).
# - FINDINGS #34: a played NIXL transfer into larger blocks, judged on 0.31 now that the recording agent answers
#   get_xfer_telemetry as nixl does (0.30 - 0.31 read it unguarded, and every played transfer there failed unjudged).
REPLAYED = [("cbc8e1ed099a-d6fa183ae7e3ba72", "0.30.0", "expected"), ("cbc8e1ed099a-d6fa183ae7e3ba72", "0.31.0", "fixed"),
            ("2b395bd3c658-3b6b1a53c47fe2b0", "0.31.0", "expected"), ("2b395bd3c658-3b6b1a53c47fe2b0", "0.32.0", "fixed")]


@pytest.mark.slow
@pytest.mark.releases
@pytest.mark.parametrize(("stem", "version", "status"), REPLAYED)
def test_cases_judged_wrongly_before_a_fix_replay_as_recorded(stem, version, status):
    from fuzz.corpus.replay import replay_entry
    from fuzz.corpus.store import entries, expected_signatures

    [entry] = [e for e in entries(FINDINGS) if e.path.stem == stem]
    with release_target(version) as target:
        outcome = replay_entry(target, entry, "cpu", known=expected_signatures([entry], version))
    assert outcome.status == status, outcome


def played_record(sent: list[int], received: list[int], heads: list[int]) -> dict:
    wrong = [{"token": 0, "receiver_block": received[0], "heads": heads, "layer": "l0"}]
    return {"where": "NixlPullConnectorWorker.start_load_kv", "sent": sent, "received": received, "failed": [],
            "refused": [], "wrong": wrong}


def test_a_wrong_transfer_is_one_signature_whatever_heads_and_blocks_it_scrambles():
    """A played transfer that leaves other bytes in the receiver is one bug however many heads or blocks show it: the
    message counts them, so each list length is not a new signature (issue 47's re-runs met each as "new")."""
    from fuzz.checks.nixl import judge_played
    from fuzz.checks.protocol import Judging

    judging = Judging(case=a_case(), contract=None, expected=None, outcome=None, verdict="pass")
    one = judge_played(judging, played_record([1], [1], [1]), "start_load_kv")
    many = judge_played(judging, played_record([1, 2], [3], [1, 2, 3, 4, 5, 6, 7]), "start_load_kv")
    assert one.kind == many.kind == "transfer-wrong"
    assert one.signature == many.signature
    assert "7 head(s), head 1 first" in many.message and "2 sender block(s)" in many.message


def test_a_case_of_a_release_without_quant_modes_is_skipped_where_vllm_derives_one(kvfuzz_target, kvfuzz_device):
    """0.19.1 stores an fp8 cache's quant mode as none (its specs have no field); a release that derives one from the
    cache dtype cannot build that case, so it is skipped naming the field, not judged a spec-mismatch of vLLM's (two
    0.19.1 candidates replayed on the installed vLLM said `spec-mismatch | get_kv_quant_mode` before)."""
    from fuzz.corpus import file
    from fuzz.verdict.runner import run_case

    if not kvfuzz_target.info.can("mla", "kv_quant_mode"):
        pytest.skip("this vLLM's MLA specs have no quant mode either")
    case = file.load(FINDINGS / "b7171eea18dd-8fd953605e22dc2b.json")
    assert {g.spec.cache_dtype: g.spec.kv_quant_mode for g in case.groups if g.spec.kind == "mla"} == {"fp8": "none"}
    verdict = run_case(kvfuzz_target, case, kvfuzz_device).verdict
    assert verdict.status == "skipped" and "field kv_quant_mode" in (verdict.reason or ""), verdict
