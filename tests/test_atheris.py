"""The atheris engine: ProviderSource byte semantics, crash attribution, and short real campaigns."""

from __future__ import annotations

import base64
import ctypes
import io
import json
import os
import time
from pathlib import Path

import pytest

atheris = pytest.importorskip("atheris")

from fuzz.case import Case, dumps  # noqa: E402
from fuzz.corpus.file import load  # noqa: E402
from fuzz.engines.atheris_engine import run_atheris  # noqa: E402
from fuzz.engines.libfuzzer import (  # noqa: E402
    classify_exit,
    libfuzzer_flags,
    libfuzzer_seed,
    parse_coverage,
    quarantine,
    write_seed_inputs,
)
from fuzz.engines.provider import InputSlot, ProviderSource, case_from_bytes  # noqa: E402
from fuzz.space import Rejected, draw_case  # noqa: E402
from fuzz.targets.base import BackendInfo, Execution, TargetInfo  # noqa: E402
from oracles.contract import LAYOUT_PLACED_KERNEL_MAP  # noqa: E402

FAKE_INFO = TargetInfo(
    vllm_version="0.0.0+fake",
    generation="fake",
    contract=LAYOUT_PLACED_KERNEL_MAP,
    spec_kinds=("full", "sliding_window", "mla"),
    backends=(
        BackendInfo("FAKE_ATTN", False, ("x16",), None, ("bfloat16", "float16"), ("auto",)),
        BackendInfo("FAKE_MLA", True, (64,), None, ("bfloat16",), ("auto",), compresses=True),
    ),
    layouts=("LBNHC", "BLNHC", "LBHNC"),
    spec_fields={"mla": ("compress_ratio",)},
)


def source(data: bytes) -> ProviderSource:
    return ProviderSource.from_bytes(data)


# ------------------------------------------------------------------ ProviderSource: bytes in, values out


def test_integer_consumes_from_the_end_big_endian_modulo_range():
    s = source(bytes([1, 2, 3, 4, 5, 6, 7, 8]))
    assert [s.integer(0, 255) for _ in range(3)] == [8, 7, 6]
    assert s.provider.remaining_bytes() == 5
    s = source(bytes([1, 2, 3, 4, 5, 6, 7, 8]))
    assert s.integer(0, 1000) == 0x0807 % 1001 == 53  # two bytes for a range over 256
    assert s.integer(-5, 5) == -5 + 6 % 11
    assert source(bytes([1, 2, 3])).integer(0, 70000) == 0x030201 % 70001 == 57119


def test_integer_with_one_value_consumes_nothing_and_empty_input_gives_the_low_bound():
    s = source(bytes([5]))
    assert s.integer(4, 4) == 4 and s.provider.remaining_bytes() == 1
    s = source(b"")
    assert (s.integer(3, 5), s.integer(-2, 9)) == (3, -2)


def test_choice_indexes_by_one_byte():
    assert source(bytes([1, 2, 3])).choice(["a", "b", "c"]) == "a"  # 3 % 3
    assert source(bytes([0, 4])).choice(["a", "b", "c"]) == "b"  # 4 % 3
    s = source(bytes([9, 7]))
    assert (s.choice((10, 20)), s.choice((10, 20)), s.choice((10, 20))) == (20, 20, 10)  # 7 % 2, 9 % 2, exhausted
    assert source(b"").choice(["only"]) == "only"


def test_chance_is_true_for_the_top_percent_and_false_when_exhausted():
    assert source(bytes([99])).chance(1) is True
    assert source(bytes([98])).chance(1) is False
    assert source(bytes([80])).chance(20) is True
    assert source(bytes([79])).chance(20) is False
    assert source(bytes([179])).chance(20) is False  # 179 % 100 = 79
    assert source(b"").chance(99) is False


def test_reject_raises_rejected():
    with pytest.raises(Rejected):
        source(b"").reject()


def test_draw_case_from_fixed_bytes_is_deterministic_and_short_inputs_are_simplest():
    simplest = case_from_bytes(b"", FAKE_INFO)
    assert simplest is not None
    assert (len(simplest.groups), simplest.num_blocks, simplest.layout) == (1, 1, "LBNHC")
    assert simplest.groups[0].spec.kind == "full" and len(simplest.groups[0].layers) == 1
    drawn = 0
    for n in range(200):
        data = bytes((n * 37 + i * 11) % 256 for i in range(n % 90))
        first = case_from_bytes(data, FAKE_INFO)
        assert (first is None) == (case_from_bytes(data, FAKE_INFO) is None)
        if first is not None:
            drawn += 1
            assert dumps(first) == dumps(draw_case(source(data), FAKE_INFO))
    assert drawn > 50


# ------------------------------------------------------------------ pieces of the coordinator


def test_slot_keeps_the_input_in_flight_and_the_counts(tmp_path):
    slot = InputSlot(tmp_path / "slot")
    slot.begin(b"\x01\x02")
    slot.end("pass")
    slot.begin(b"abc")
    slot.end("finding")
    slot.begin(b"in flight")
    state = InputSlot(tmp_path / "slot").read()  # as another process sees it
    assert state.busy and state.data == b"in flight"
    assert state.counts == {"pass": 1, "finding": 1, "rejected": 0, "skipped": 0, "unbuildable": 0}
    slot.end("rejected")
    assert not InputSlot(tmp_path / "slot").read().busy
    slot.close()


def test_parse_coverage_takes_the_last_status_line():
    log = ("INFO: Seed: 1\n#2\tINITED cov: 140 ft: 140 corp: 1/1b exec/s: 0 rss: 624Mb\n"
           "#8\tNEW    cov: 140 ft: 254 corp: 2/3b lim: 4 exec/s: 0 rss: 624Mb L: 2/2 MS: 1 CrossOver-\n"
           "#16384\tpulse  cov: 298 ft: 917 corp: 149/1526b lim: 33 exec/s: 1170 rss: 666Mb\nDone\n")
    coverage = parse_coverage(log)
    assert (coverage.edges, coverage.features, coverage.corpus, coverage.execs) == (298, 917, 149, 16384)
    assert parse_coverage("no status lines").edges == 0


@pytest.mark.parametrize(("code", "log", "expected"), [
    (77, "Fatal Python error: Segmentation fault\n==1== ERROR: libFuzzer: deadly signal", ("crash-signal", "killed by SIGSEGV")),
    (77, "Fatal Python error: Aborted\n==1== ERROR: libFuzzer: deadly signal", ("crash-signal", "killed by SIGABRT")),
    (70, " === Timeout: 4s elapsed, timeout=2s ===\n==1== ERROR: libFuzzer: timeout after 4 seconds", ("hang", "no answer within 2 s")),
    (71, "==1== ERROR: libFuzzer: out-of-memory (used: 1585Mb; limit: 1500Mb)", ("oom", "resident memory passed the worker's cap")),
    (77, " === Uncaught Python exception: ===\nKeyError: 'x'\nTraceback", ("crash-signal", "uncaught KeyError in the harness")),
    (-9, "", ("oom", "killed by SIGKILL (the kernel's out-of-memory killer?)")),
    (-11, "", ("crash-signal", "killed by SIGSEGV")),
    (3, "", ("crash-signal", "exited with status 3")),
])
def test_classify_exit(code, log, expected):
    assert classify_exit(code, log, 2.0) == expected


def test_quarantine_moves_every_input_with_the_crashing_bytes(tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "seed-0001").write_bytes(b"boom")
    (inputs / "0a1b2c").write_bytes(b"boom")
    (inputs / "seed-0002").write_bytes(b"fine")
    moved = quarantine(inputs, b"boom", tmp_path / "quarantine")
    assert sorted(p.name for p in moved) == ["0a1b2c", "seed-0001"]
    assert sorted(p.name for p in inputs.iterdir()) == ["seed-0002"]


def test_seed_inputs_are_deterministic_and_only_fill_an_empty_corpus(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_seed_inputs(tmp_path / name, 7, 5)
    first = sorted((p.name, p.read_bytes()) for p in (tmp_path / "a").iterdir())
    assert len(first) == 5 and first == sorted((p.name, p.read_bytes()) for p in (tmp_path / "b").iterdir())
    write_seed_inputs(tmp_path / "a", 8, 9)
    assert len(list((tmp_path / "a").iterdir())) == 5


def test_libfuzzer_flags():
    flags = libfuzzer_flags(0, 0, 2.5, Path("/w/p"), ["-use_value_profile=1"])
    assert flags == ["-seed=1", "-timeout=3", "-max_len=512", "-artifact_prefix=/w/p/", "-use_value_profile=1"]
    assert libfuzzer_seed(0, 1) != libfuzzer_seed(0, 0) != libfuzzer_seed(1, 0)


# ------------------------------------------------------------------ crash attribution, on fake targets (no vLLM)


def segfaulting_target() -> CrashingTarget:
    return CrashingTarget(hang=False)


def crashing_target() -> CrashingTarget:
    return CrashingTarget(hang=True)


def segfaults(case: Case) -> bool:
    return case.num_blocks == 2 and case.layout == "LBHNC" and case.groups[0].spec.block_size == 64


def hangs(case: Case) -> bool:
    spec = case.groups[0].spec
    return case.num_blocks == 3 and case.layout == "BLNHC" and spec.block_size == 16 and spec.kind == "full"


def killers(paths: list[Path]) -> list[bool]:
    """For each fuzzer input file, whether the case it draws segfaults or hangs the crashing target."""
    cases = (case_from_bytes(path.read_bytes(), FAKE_INFO) for path in paths)
    return [case is not None and (segfaults(case) or hangs(case)) for case in cases]


class CrashingTarget:
    """Segfaults (and hangs) on rare cases, each under 1 in 100 random ones, and skips the rest; its
    branches are instrumented, so libFuzzer climbs the conditions one clause at a time."""

    info = FAKE_INFO

    def __init__(self, hang: bool) -> None:
        self.hang = hang

    def execute(self, case: Case, device: str, probe: bool = False, checks: object = None) -> Execution:
        if segfaults(case):
            ctypes.string_at(0)
        if self.hang and hangs(case):
            time.sleep(30)
        return Execution(case, skipped="fake target")


def fake_run(tmp_path: Path, factory: str, max_time: float, **options) -> dict:
    return run_atheris("installed", device="cpu", max_time=max_time, seed=3, corpus_dir=tmp_path / "corpus", case_timeout=1,
                       out=io.StringIO(), work_dir=tmp_path / "work", minimize_time=0, target_factory=f"tests.test_atheris:{factory}",
                       instrument=["tests.test_atheris"], **options)


def test_a_segfault_becomes_a_finding_with_the_case_that_caused_it(tmp_path):
    report = fake_run(tmp_path, "segfaulting_target", 5, seed_inputs=0)
    crashes = [f for f in report["findings"] if f["kind"] == "crash-signal"]
    assert [f["message"] for f in crashes] == ["killed by SIGSEGV"]
    assert segfaults(load(crashes[0]["case_file"]))
    assert crashes[0]["cases_until_found"] <= report["cases"]
    assert report["process_deaths"][0]["case_in_flight"]
    meta = json.loads(Path(crashes[0]["case_file"]).read_text())
    assert meta["engine"] == "atheris" and meta["signature"] == crashes[0]["signature"]
    assert segfaults(case_from_bytes(base64.b64decode(meta["fuzzer_input"]), FAKE_INFO))
    # libFuzzer's own artifact of the crash draws the same case as the slot did.
    artifacts = sorted((tmp_path / "work").glob("process-*/crash-*"))
    assert artifacts and segfaults(case_from_bytes(artifacts[0].read_bytes(), FAKE_INFO))


@pytest.mark.slow
def test_crashes_and_hangs_are_recorded_bad_seeds_quarantined_and_fuzzing_goes_on(tmp_path):
    report = fake_run(tmp_path, "crashing_target", 30)
    kinds = {f["kind"]: f for f in report["findings"]}
    assert set(kinds) == {"crash-signal", "hang"}
    assert kinds["crash-signal"]["message"] == "killed by SIGSEGV"
    assert kinds["hang"]["message"] == "no answer within 1 s"
    assert segfaults(load(kinds["crash-signal"]["case_file"]))
    assert hangs(load(kinds["hang"]["case_file"]))
    assert {d["kind"] for d in report["process_deaths"]} == {"crash-signal", "hang"}
    deaths = len(report["process_deaths"])
    assert deaths >= 2 and deaths - 1 <= report["restarts"] <= deaths  # no restart when too little time is left
    assert report["verdicts"]["skipped"] > 200 and report["verdicts"]["finding"] >= 2
    # An input of libFuzzer's corpus that killed a process left it (when the killer was a fresh mutation,
    # not a kept input, there is nothing to move), so no restarted process dies loading the corpus.
    folder = tmp_path / "work" / "quarantine"
    quarantined = list(folder.iterdir()) if folder.exists() else []
    kept = list((tmp_path / "work" / "inputs").iterdir())
    assert not {p.name for p in quarantined} & {p.name for p in kept}
    assert all(killers(quarantined)) and not any(killers(kept))


@pytest.mark.parametrize("stop_reason, shrunk", [("SIGINT", False), ("max-time", True)])
def test_a_run_stopped_by_sigint_keeps_its_findings_as_found_and_shrinks_none(tmp_path, monkeypatch, stop_reason, shrunk):
    from fuzz.engines import atheris_engine

    found = [{"signature": "crash-on-valid | mla | f | E", "path": str(tmp_path / "finding.json")}]
    calls: list[int] = []

    def fuzz(state):
        state.stop_reason = stop_reason

    monkeypatch.setattr(atheris_engine, "_fuzz", fuzz)
    monkeypatch.setattr(atheris_engine, "gather_records", lambda state: found)
    monkeypatch.setattr(atheris_engine, "minimize_records", lambda state, records, budget: calls.append(len(records)) or 2.5)
    monkeypatch.setattr(atheris_engine, "build_report", lambda state, records, minimize_s: {"findings": records, "minimize_s": minimize_s})
    monkeypatch.setattr(atheris_engine, "print_summary", lambda report, out: None)
    report = run_atheris("installed", device="cpu", max_time=1, seed=0, corpus_dir=tmp_path, out=io.StringIO())
    assert report["findings"] == found
    assert (calls, report["minimize_s"]) == (([1], 2.5) if shrunk else ([], 0.0))


# ------------------------------------------------------------------ real campaigns


@pytest.mark.slow
def test_short_campaign_on_the_installed_vllm(tmp_path):
    pytest.importorskip("vllm")
    out = io.StringIO()
    report = run_atheris("installed", device="cpu", max_time=10, seed=0, corpus_dir=tmp_path, out=out, minimize_time=0)
    assert report["engine"] == "atheris" and report["target"]["spec"] == "installed"
    assert report["cases"] > 0 and report["cases_per_s"] > 0
    assert report["coverage"]["edges"] > 0 and report["coverage"]["features"] >= report["coverage"]["edges"]
    assert "vllm.v1.kv_cache_interface" in report["instrumented"]
    assert sum(report["verdicts"].values()) == report["cases"]
    for key in ("target", "cases", "elapsed_s", "cases_per_s", "verdicts", "findings"):
        assert key in report
    for finding in report["findings"]:
        assert Path(finding["case_file"]).exists()
        assert finding["cases_until_found"] >= 1 and finding["seconds_until_found"] >= 0
    assert "coverage" in out.getvalue()


def is_38831(finding: dict) -> bool:
    """vLLM #38831: compressed MLA (storage_block_size < block_size) with kernel-block splitting
    crashes the 0.22 reshape on a valid case."""
    if finding["kind"] != "crash-on-valid" or "mla" not in finding["spec_kind"] or finding["function"] != "_reshape_kv_cache":
        return False
    case = load(finding["case_file"])
    return any(g.spec.compress_ratio > 1 and (g.kernel_block_size or g.spec.block_size) < g.spec.block_size for g in case.groups)


@pytest.mark.sweep  # the default suite runs the engine's short campaign on the installed vLLM
@pytest.mark.slow
@pytest.mark.releases
def test_finds_the_compressed_mla_crash_on_0_22(tmp_path, monkeypatch):
    if Path("/tmp/whl").is_dir() and "KVFUZZ_WHEELHOUSE" not in os.environ:
        monkeypatch.setenv("KVFUZZ_WHEELHOUSE", "/tmp/whl")
    from fuzz.targets.releases import resolve

    source = resolve("0.22.0")
    # Sized in cases, not seconds: a busy machine runs fewer cases in a given time, never other ones.
    report = run_atheris(source, device="cpu", max_time=600, max_cases=2000, seed=0, corpus_dir=tmp_path, out=io.StringIO(),
                         minimize_time=8)
    assert report["target"]["vllm_version"].startswith("0.22.0")
    found = [f for f in report["findings"] if is_38831(f)]
    assert found, [f["signature"] for f in report["findings"]]
    assert found[0]["cases_until_found"] < 2000
    assert report["findings"][0]["minimized"]  # shrunk first: found first
