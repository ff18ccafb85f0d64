"""Chaos: targets that segfault, abort, hang, exit or eat memory, and coordinators that are signalled,
killed or cannot write their corpus. Whatever happens, a campaign ends on time, every finding is on
disk, and the report says what happened (docs/reference/campaigns.md, "What a campaign guarantees").

The misbehaving targets are real vLLM trees with one function wrapped (tests/chaos_trees.py). Most
campaigns share one pool on a tree whose behaviour a control file sets per test; the chosen case of
(i) is one the tree's own witness saw reach the wrapped function once, with a shape no other case has.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import fuzz.targets
from fuzz.campaign import stop
from fuzz.campaign.engine import Campaign, CampaignOptions, Report
from fuzz.campaign.pool import Pool, RemoteTarget
from fuzz.case import Case, GroupCase, SpecCase
from fuzz.corpus.store import entries, known_signatures, save_finding
from fuzz.errors import TargetError
from fuzz.targets.base import TARGET_CRASHED, Execution, Outcome
from fuzz.targets.entry_points import signature_parameters
from fuzz.verdict.findings import PROCESS_KINDS
from fuzz.verdict.runner import judge
from oracles.contract import SHAPED_022
from tests.chaos_trees import make_tree, set_control
from tests.processes import alive, descendants, wait_for

REPO = Path(__file__).resolve().parent.parent
FUNCTION = "vllm.v1.worker.utils.allocate_kv_cache"  # the installed vLLM's (0.29 and later)
RESHAPE_023 = "vllm.v1.worker.gpu.attn_utils._reshape_kv_cache"
ACTIONS = ("segfault", "abort", "hang", "exit", "os-exit", "memory")
KILLING = ("segfault", "abort", "hang", "os-exit")  # the actions that end the worker process
# How a report names each misbehaviour: the finding's kind and a word of its message.
EXPECTED = {"segfault": ("crash-signal", "SIGSEGV"), "abort": ("crash-signal", "SIGABRT"), "hang": ("hang", "no answer"),
            "exit": ("crash-on-valid", "SystemExit"), "os-exit": ("crash-signal", "exited with status 7"), "memory": ("oom", "")}
CASE_TIMEOUT = 2.0
SEED, CASES = 0, 40
# Seconds past a bound kvfuzz enforces (--max-time, --start-timeout) a run may take on a loaded two-core CI machine: the
# workers' stop, the report, the interpreter's own start (docs/reference/campaigns.md promises a few seconds; the bound
# leaves room for a busy box).
# No test here asserts that anything starts or imports within a time shorter than kvfuzz's own start timeout.
MARGIN = 30.0
STOP_BOUND = 30.0  # seconds from a signal to the exit (docs/reference/campaigns.md: a couple of seconds; a loaded box takes longer)
BUCKET_RULES = [("bucket < 4", "segfault"), ("4 <= bucket < 7", "abort"), ("7 <= bucket < 9", "hang"), ("9 <= bucket < 12", "exit"),
                ("12 <= bucket < 14", "os-exit")]


# ---------------------------------------------------------------------------------------- helpers


def campaign(pool: Pool, folder: Path, max_time: float, max_cases: int = 10**12) -> tuple[Report, float]:
    options = CampaignOptions(device="cpu", max_time=max_time, max_cases=max_cases, seed=SEED, corpus_dir=folder / "corpus",
                              shrink_seconds=3.0)
    began = time.monotonic()
    report = Campaign(pool, options).run()
    return report, time.monotonic() - began


def describe(report: Report) -> str:
    rows = [f"{r.index}: {r.finding.signature} {r.note}" for r in report.findings]
    rows += [f"{r.index}: {r.status} {r.finding.signature} ({r.rerun})" for r in report.flaky]
    return f"{report.stop_reason} {report.error} {report.cases} cases\n" + "\n".join(rows)


def assert_on_disk(report: Report, corpus: Path) -> None:
    """Every finding and unconfirmed case is on disk, as the report says, and nothing else is."""
    kept = {r.path for r in report.findings} | {r.path for r in report.flaky if r.path is not None}
    assert None not in kept, describe(report)
    assert set(corpus.glob("*.json")) == kept, describe(report)
    for record in report.findings:
        assert json.loads(record.path.read_text())["signature"] == record.finding.signature  # type: ignore[union-attr]
    assert not list(corpus.glob(".tmp-*")), "no partial file"


def kvfuzz(*args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess[str], float]:
    began = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "fuzz.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    return result, time.monotonic() - began


def start_kvfuzz(*args: str, keep_warm: bool = True) -> subprocess.Popen[str]:
    env = None if keep_warm else {**os.environ, "KVFUZZ_KEEP_WARM": "0"}
    return subprocess.Popen([sys.executable, "-m", "fuzz.cli", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("kvfuzz:")]
    assert len(lines) == 1 and lines[0].startswith("kvfuzz: error: "), stderr
    return lines[0]


# ---------------------------------------------------------------------------------------- no vLLM needed


def test_entry_parameters_are_read_through_wrappers_and_a_signature_less_one_is_an_error():
    def _reshape_kv_cache(attn_groups, kv_cache_raw_tensors, cache_dtype):  # noqa: ANN001, ANN202
        return None

    @functools.wraps(_reshape_kv_cache)
    def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return _reshape_kv_cache(*args, **kwargs)

    def bare(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return _reshape_kv_cache(*args, **kwargs)

    assert signature_parameters(wrapped, "_reshape_kv_cache", "0.23.0") == (("attn_groups", "kv_cache_raw_tensors", "cache_dtype"), False)
    with pytest.raises(TargetError) as error:
        signature_parameters(bare, "_reshape_kv_cache", "0.23.0")
    message = str(error.value)
    assert "_reshape_kv_cache(*args, **kwargs)" in message and "\n" not in message


ADAPTER = '''
class Adapter:
    def __init__(self, function):
        self.function = function

    def make_views(self):
        reshape = self.function
        return reshape(attn_groups=[], cache_dtype="auto")
'''


def adapter_calling(function):  # noqa: ANN001, ANN201
    """An adapter whose frames are in fuzz/targets/, as kvfuzz's own call sites are."""
    namespace: dict[str, object] = {}
    exec(compile(ADAPTER, str(Path(fuzz.targets.__file__).parent / "chaos_adapter.py"), "exec"), namespace)  # noqa: S102
    return namespace["Adapter"](function)  # type: ignore[operator]


def test_a_call_that_does_not_fit_the_signature_is_kvfuzz_s_error_and_a_wrong_call_inside_vllm_is_an_outcome():
    from fuzz.tracebacks import capture

    def _reshape_kv_cache(attn_groups, kv_cache_dtype):  # noqa: ANN001, ANN202 - a parameter renamed
        return None

    @functools.wraps(_reshape_kv_cache)
    def passing_on(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return _reshape_kv_cache(*args, **kwargs)

    for function in (_reshape_kv_cache, passing_on):
        with pytest.raises(TargetError) as error:
            capture(adapter_calling(function).make_views)
        message = str(error.value)
        assert "_reshape_kv_cache(attn_groups, kv_cache_dtype)" in message and "unexpected keyword argument 'cache_dtype'" in message
        assert "\n" not in message

    import vllm

    # vLLM calling its own helper wrongly: code whose frames are in the vllm package.
    inside = {}
    source = "def helper(x):\n    return x\n\n\ndef buggy(attn_groups, cache_dtype):\n    return helper(attn_groups, cache_dtype)\n"
    exec(compile(source, str(Path(vllm.__file__).parent / "kvfuzz_chaos_helper.py"), "exec"), inside)  # noqa: S102
    outcome = capture(adapter_calling(inside["buggy"]).make_views)
    assert (outcome.error_type, outcome.error_function) == ("TypeError", "buggy")
    assert "helper() takes 1 positional argument" in (outcome.error_message or "")


def test_a_lost_candidate_is_an_outcome_even_when_its_case_was_never_declared():
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64)
    case = Case(groups=(GroupCase(spec=spec, layers=("l0",), backend="TRITON_ATTN", kernel_block_size=16),), num_blocks=2, layout="NHD")
    lost = Execution(case, outcome=Outcome(error_type=TARGET_CRASHED, error_message="killed by SIGSEGV", error_function="worker"))
    verdict = judge(lost, SHAPED_022).verdict
    assert verdict.finding is not None and (verdict.finding.kind, verdict.finding.message) == ("crash-signal", "killed by SIGSEGV")


def test_an_unconfirmed_case_and_a_partial_file_are_not_known_findings(tmp_path):
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=1, head_size=64)
    case = Case(groups=(GroupCase(spec=spec, layers=("l0",), backend="TRITON_ATTN", kernel_block_size=16),), num_blocks=1)
    save_finding(tmp_path, case, {"signature": "hang | full | worker | no answer within # s", "signature_id": "a", "confirmed": False})
    save_finding(tmp_path, case, {"signature": "crash-signal | full | worker | killed by SIGSEGV", "signature_id": "b", "confirmed": True})
    (tmp_path / ".tmp-abc.partial").write_text('{"signature": "cut sh')
    assert known_signatures(tmp_path) == {"crash-signal | full | worker | killed by SIGSEGV"}
    assert len(list(entries(tmp_path))) == 2


def test_a_stop_request_is_honoured_and_a_second_signal_exits_at_once():
    code = """
import os, signal, time
from fuzz.campaign import stop
with stop.handling():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    assert stop.requested() == signal.SIGTERM
    try:
        stop.check()
    except stop.Stopped:
        print("stopped", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
print("not reached")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == stop.exit_status(signal.SIGTERM) == 143, result
    assert result.stdout.split() == ["stopped"] and "exiting at once" in result.stderr


# ---------------------------------------------------------------------------------------- one pool, many misbehaviours


@dataclass
class Chaos:
    pool: Pool
    control: Path
    index: int  # a case that reaches the wrapped function once, with a shape of its own
    shape: str


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    pytest.importorskip("vllm")
    from fuzz.space import draw_indexed
    from fuzz.targets import releases
    from fuzz.verdict.runner import run_case

    folder = tmp_path_factory.mktemp("chaos")
    control, witness = folder / "control.json", folder / "witness.txt"
    tree = make_tree(folder / "tree", FUNCTION, control=control)
    with Pool(releases.resolve(str(tree)), workers=2, case_timeout=CASE_TIMEOUT, max_memory=256 << 20) as pool:
        set_control(control, witness=str(witness))
        target, seen = RemoteTarget(pool), []
        for index in range(CASES):
            before = len(witness.read_text().splitlines()) if witness.exists() else 0
            verdict = run_case(target, draw_indexed(pool.info, SEED, index), "cpu").verdict
            shapes = witness.read_text().splitlines()[before:]
            seen.append((index, shapes, verdict.status))
        counts: dict[str, int] = {}
        for _, shapes, _ in seen:
            for shape in shapes:
                counts[shape] = counts.get(shape, 0) + 1
        index, shapes, _ = next(s for s in seen if s[0] >= 2 and len(s[1]) == 1 and counts[s[1][0]] == 1 and s[2] == "pass")
        set_control(control)
        yield Chaos(pool, control, index, shapes[0])


@pytest.mark.slow
@pytest.mark.parametrize("action", ACTIONS)
def test_a_case_that_misbehaves_is_recorded_as_its_kind_and_shrinking_survives_candidates_that_misbehave(chaos, action, tmp_path):
    """(i) on a case and (ii) while shrinking: the chosen case does `action`, and so does every call
    that repeats the previous one's groups (what shrinking candidates do, in a worker or the spare)."""
    set_control(chaos.control, cases={chaos.shape: action}, repeated=action)
    # Sized in cases: the time limit is only a hard cap, far beyond what the cases take on a busy machine.
    report, _ = campaign(chaos.pool, tmp_path, max_time=600, max_cases=CASES)
    assert report.stop_reason == "max-cases" and report.cases == CASES, describe(report)
    assert not report.errors and not report.error, describe(report)
    assert_on_disk(report, tmp_path / "corpus")
    kind, word = EXPECTED[action]
    record = next((r for r in report.findings if r.index == chaos.index), None)
    assert record is not None and record.finding.kind == kind and word in record.finding.message, describe(report)
    assert record.confirmed, "it does it again in a fresh worker"
    if action in KILLING:
        assert any("shrinking cut short" in r.note or r.minimized for r in report.findings), describe(report)


@pytest.mark.slow
@pytest.mark.parametrize("action", ACTIONS)
def test_every_case_misbehaving_in_every_worker_at_once_still_ends_on_time(chaos, action, tmp_path):
    """(iv): every call does `action`, in both workers and the spare."""
    set_control(chaos.control, all=action)
    max_time = 6 if action == "hang" else 4  # a hang takes a case timeout, and its confirmation another
    report, seconds = campaign(chaos.pool, tmp_path, max_time=max_time)
    set_control(chaos.control)
    assert seconds <= max_time + MARGIN
    assert report.stop_reason == "max-time", describe(report)
    assert not report.error, describe(report)
    assert_on_disk(report, tmp_path / "corpus")
    kind, word = EXPECTED[action]
    assert any(r.finding.kind == kind and word in r.finding.message for r in [*report.findings, *report.flaky]), describe(report)


# ---------------------------------------------------------------------------------------- the command line


@pytest.mark.slow
@pytest.mark.parametrize(("action", "says"), [("segfault", "killed by SIGSEGV"), ("abort", "killed by SIGABRT"), ("exit", "SystemExit: 3"),
                                              ("os-exit", "exited with status 7"), ("memory", "MemoryError")])
def test_a_target_that_fails_while_imported_is_a_one_line_error(action, says, tmp_path):
    """(iii): the zygote dies, exits or eats memory while it imports vLLM."""
    pytest.importorskip("vllm")
    from fuzz.targets import releases

    tree = make_tree(tmp_path / "tree", FUNCTION, at_import=action)
    with pytest.raises(TargetError) as error:
        Pool(releases.resolve(str(tree)), workers=2, max_memory=256 << 20)
    assert says in str(error.value) and "\n" not in str(error.value)
    assert "did not start within" not in str(error.value), "told as it happened, not as a start timeout"


@pytest.mark.slow
def test_a_target_that_hangs_while_imported_ends_the_run_on_time_with_a_report(tmp_path):
    """(iii): the zygote never finishes importing vLLM: the run ends at --start-timeout (--max-time counts only
    fuzzing), an error with a report."""
    pytest.importorskip("vllm")
    tree = make_tree(tmp_path / "tree", FUNCTION, at_import="hang")
    result, seconds = kvfuzz("run", "--vllm", str(tree), "--start-timeout", "8", "--max-time", "5", "--corpus", str(tmp_path / "corpus"),
                             "--report", str(tmp_path / "report.json"), "--junit", str(tmp_path / "junit.xml"), "--quiet")
    assert result.returncode == 2, result
    assert "did not start within 8 s" in one_error_line(result.stderr)
    assert seconds <= 8 + MARGIN
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["stop_reason"] == "error" and "did not start within" in report["error"]
    assert report["start_s"] >= 8 and report["cases"] == 0
    assert "<error" in (tmp_path / "junit.xml").read_text()


SHORTER_SIGNATURE = '''
def _chaos_wrapper(kv_cache_config, device, layout):
    return _real(kv_cache_config, device, layout)


_chaos_wrapper.__name__ = _chaos_wrapper.__qualname__ = "allocate_kv_cache"
'''


@pytest.mark.slow
def test_a_target_kvfuzz_calls_wrongly_is_a_one_line_error_not_findings(tmp_path):
    pytest.importorskip("vllm")
    tree = make_tree(tmp_path / "tree", FUNCTION, define=SHORTER_SIGNATURE)
    result, _ = kvfuzz("run", "--vllm", str(tree), "--max-time", "120", "--workers", "2", "--corpus", str(tmp_path / "corpus"),
                       "--report", str(tmp_path / "report.json"), "--quiet")
    assert result.returncode == 2, result
    line = one_error_line(result.stderr)
    assert "allocate_kv_cache(kv_cache_config, device, layout)" in line and "takes 3 positional arguments but 4 were given" in line
    report = json.loads((tmp_path / "report.json").read_text())
    # kvfuzz's own calls are never findings. The tree's V1 runner calling its own allocate_kv_cache with 4 arguments is
    # vLLM's code not fitting vLLM's code: that one may be reported (named after the runner method that made the call).
    ours = [f for f in report["findings"] if f["function"] != "initialize_kv_cache_tensors"]
    assert ours == [] and report["flaky"] == []
    assert all(json.loads(p.read_text())["function"] == "initialize_kv_cache_tensors" for p in (tmp_path / "corpus").glob("*.json"))


@pytest.fixture(scope="module")
def release_023():
    from fuzz.targets import releases

    return releases.resolve("0.23.0").python_path


@pytest.mark.slow
@pytest.mark.releases
def test_a_signature_less_wrapper_of_0_23_is_a_one_line_error(release_023, tmp_path):
    tree = make_tree(tmp_path / "tree", RESHAPE_023, BUCKET_RULES, base=release_023, wraps=False)
    result, _ = kvfuzz("run", "--vllm", str(tree), "--max-time", "120", "--workers", "2", "--case-timeout", "5",
                       "--corpus", str(tmp_path / "corpus"), "--quiet")
    assert result.returncode == 2, result
    assert "_reshape_kv_cache(*args, **kwargs)" in one_error_line(result.stderr)


@pytest.mark.slow
@pytest.mark.releases
def test_a_wrapped_0_23_that_misbehaves_on_some_buffer_sizes(release_023, tmp_path):
    """The issue's scenario, shortened: findings of the wrapper's kinds only, beyond the ones the corpus keeps."""
    tree = make_tree(tmp_path / "tree", RESHAPE_023, BUCKET_RULES, base=release_023)
    corpus = shutil.copytree(REPO / "corpus" / "findings", tmp_path / "corpus")
    kept = set(corpus.glob("*.json"))
    # --max-time counts fuzzing only: importing the wrapped 0.23 (over 20 s on a loaded 2-core box) is not in it.
    budget = 20
    result, _ = kvfuzz("run", "--vllm", str(tree), "--max-time", str(budget), "--workers", "2", "--case-timeout", "2",
                       "--corpus", str(corpus), "--report", str(tmp_path / "report.json"), "--junit", str(tmp_path / "junit.xml"),
                       "--quiet")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["fuzz_s"] <= budget + MARGIN and report["start_s"] > 0, report
    assert result.returncode == (1 if report["findings"] else 0), result
    assert report["stop_reason"] == "max-time" and report["target"]["generation"] == "G3"
    for finding in [*report["findings"], *report["flaky"]]:
        assert finding["kind"] in PROCESS_KINDS or "SystemExit" in finding["message"], finding
    new = {Path(f["case_file"]) for f in report["findings"]} | {Path(f["case_file"]) for f in report["flaky"] if f["case_file"]}
    assert set(corpus.glob("*.json")) == kept | new
    assert "<testsuite" in (tmp_path / "junit.xml").read_text()


@pytest.fixture
def busy_tree(tmp_path):
    """A target that crashes, hangs or exits on some buffer sizes, and hangs on repeated calls: a
    coordinator running against it confirms, shrinks and restarts workers much of the time."""
    pytest.importorskip("vllm")
    return make_tree(tmp_path / "tree", FUNCTION, [*BUCKET_RULES, ("repeated", "hang")])


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_at_a_random_moment_stops_the_campaign_with_its_report(busy_tree, signum, tmp_path):
    corpus, report_path = tmp_path / "corpus", tmp_path / "report.json"
    process = start_kvfuzz("run", "--vllm", str(busy_tree), "--max-time", "300", "--workers", "2", "--case-timeout", "2",
                           "--corpus", str(corpus), "--report", str(report_path), "--junit", str(tmp_path / "junit.xml"))
    assert process.stdout is not None and process.stdout.readline().startswith("kvfuzz:")
    delay = random.uniform(0.5, 8.0)
    time.sleep(delay)
    process.send_signal(signum)
    sent = time.monotonic()
    try:
        code = process.wait(timeout=STOP_BOUND)
    finally:
        process.kill()
    assert code == 128 + signum, (delay, process.stderr.read() if process.stderr else "")
    assert time.monotonic() - sent <= STOP_BOUND
    report = json.loads(report_path.read_text())
    assert report["stop_reason"] == signal.Signals(signum).name, delay
    confirmed = {f["signature"] for f in report["findings"] if f.get("confirmed", True)}
    assert all(Path(f["case_file"]).exists() for f in report["findings"])
    assert confirmed <= known_signatures(corpus), "a --corpus rerun loads every finding"
    assert "<testsuite" in (tmp_path / "junit.xml").read_text()


@pytest.mark.slow
def test_sigkill_of_the_coordinator_leaves_no_process_and_loses_no_finding(busy_tree, tmp_path):
    corpus = tmp_path / "corpus"
    # A zygote of its own, a child of the coordinator (one forked from a standby: tests/test_standby.py).
    process = start_kvfuzz("run", "--vllm", str(busy_tree), "--max-time", "300", "--workers", "2", "--case-timeout", "2",
                           "--corpus", str(corpus), "--quiet", keep_warm=False)
    try:
        wait_for(lambda: len(list(corpus.glob("*.json"))) >= 2, 180, "two findings on disk")
        family = descendants(process.pid)
        assert len(family) >= 3, "the zygote and two workers"
    finally:
        process.kill()
        process.wait()
    on_disk = {path: path.read_text() for path in corpus.glob("*.json")}
    wait_for(lambda: not any(alive(pid) for pid in family), 10, "every target process gone")
    result, _ = kvfuzz("run", "--max-time", "120", "--max-cases", "8", "--corpus", str(corpus), "--quiet")  # the installed vLLM
    assert result.returncode in (0, 1), result
    for path, text in on_disk.items():
        assert path.exists() and json.loads(path.read_text())["signature"] == json.loads(text)["signature"]
    assert len(list(entries(corpus))) >= len(on_disk)


# ---------------------------------------------------------------------------------------- a corpus that cannot be written


def namespaces_work() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_namespaces = pytest.mark.skipif(not namespaces_work(), reason="needs a user and mount namespace (unshare -rm) for a private tmpfs")


def in_namespace(script: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run a shell script as root of a mount namespace of its own, where it can mount a tmpfs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


@needs_namespaces
@pytest.mark.parametrize(("prepare", "says"), [("mount -o remount,ro {mnt}", "Read-only file system"),
                                              ("dd if=/dev/zero of={mnt}/filler bs=4k 2>/dev/null", "No space left on device")],
                         ids=["read-only", "full"])
def test_a_read_only_or_full_corpus_is_a_one_line_error_before_anything_starts(prepare, says, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (f"mount -t tmpfs -o size=256k tmpfs {mnt} && mkdir {mnt}/corpus && {prepare.format(mnt=mnt)}; "
              f"exec {sys.executable} -m fuzz.cli run --vllm /no/such/tree --corpus {mnt}/corpus --max-time 30")
    result = in_namespace(script)
    assert result.returncode == 2, result
    line = one_error_line(result.stderr)
    assert "--corpus" in line and says in line


@pytest.mark.slow
@needs_namespaces
@pytest.mark.parametrize(("spoil", "says"), [("dd if=/dev/zero of={mnt}/filler bs=4k 2>/dev/null", "No space left on device")],
                         ids=["full"])
def test_a_corpus_that_becomes_full_keeps_the_finding_in_the_report(busy_tree, spoil, says, tmp_path):
    """A disk that fills up (or turns read-only: the same failed write) mid-run: the campaign stops, and
    the report keeps what could not be written."""
    mnt, report_path, listing = tmp_path / "mnt", tmp_path / "report.json", tmp_path / "listing.txt"
    mnt.mkdir()
    script = f"""
mount -t tmpfs -o size=4m tmpfs {mnt} || exit 99
{sys.executable} -m fuzz.cli run --vllm {busy_tree} --max-time 240 --workers 2 --case-timeout 2 --corpus {mnt}/corpus \\
    --report {report_path} --quiet &
pid=$!
tries=0
until ls {mnt}/corpus/*.json >/dev/null 2>&1; do sleep 0.2; tries=$((tries + 1)); [ $tries -gt 900 ] && kill $pid; done
{spoil.format(mnt=mnt)}
wait $pid
code=$?
ls {mnt}/corpus > {listing}
exit $code
"""
    result = in_namespace(script)
    assert result.returncode == 2, result
    line = one_error_line(result.stderr)
    assert "cannot write findings to" in line and says in line
    report = json.loads(report_path.read_text())
    assert report["stop_reason"] == "error" and says in report["error"]
    unwritten = [f for f in [*report["findings"], *report["flaky"]] if f["case_file"] is None or "not written" in f.get("note", "")]
    assert unwritten and all("case" in f or f["case_file"] for f in unwritten), report
    on_disk = set(listing.read_text().split())
    assert {Path(f["case_file"]).name for f in report["findings"] if f["case_file"]} <= on_disk
