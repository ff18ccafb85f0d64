"""A mutation session: the unmutated tree's baseline, then every mutant's campaign, side by side.

1. reach: the campaign's cases run once on the unmutated tree with the selected functions traced;
   a mutant on a line no case executes is `unreached` and is not run.
2. baseline: a campaign of twice the budget on the unmutated tree; the case index at which it first
   met each signature is known to every mutant's campaign (a bug vLLM already has kills nothing).
3. mutants: a campaign of `budget` seconds each from an empty corpus, `jobs` at a time, each in a
   process of its own on a copy of the tree with one edit; it stops at its first finding beyond the
   baseline: a new signature, or a known one on an earlier case than the baseline met it.
4. confirmation: every such finding's case is replayed on the unmutated tree; one that fails
   there the same way was a baseline miss, not a kill.
Outcomes: killed, survived, unreached, stillborn (the tree does not import), equivalent (listed
in fuzz/mutate/equivalent.json with the reason no case can show it). Each result is appended
to the session file as it comes, so a rerun with the same file resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzz import SOURCE_ROOT
from fuzz.campaign import stop
from fuzz.errors import TargetError
from fuzz.mutate.functions import Function, layout_functions
from fuzz.mutate.operators import Mutant, mutants_of
from fuzz.mutate.tree import copy_package, mutant_tree, tree_root
from fuzz.targets.releases import TargetSource, worker_environment

EQUIVALENT_FILE = Path(__file__).with_name("equivalent.json")
START_MARGIN_S = 180.0  # a mutant process may take this long beyond its budget (vLLM import, shrinking) before it is killed
STATUSES = ("killed", "survived", "unreached", "stillborn", "equivalent")


@dataclass(frozen=True)
class MutateOptions:
    functions: tuple[str, ...] = ()
    budget: float = 30.0
    jobs: int = 2
    seed: int = 0
    device: str = "cpu"
    synthetic: bool = True
    case_timeout: float = 10.0
    max_memory: int = 4 << 30
    reach_seconds: float | None = None  # default: the budget
    session: Path | None = None
    max_mutants: int | None = None


@dataclass(frozen=True)
class MutantResult:
    mutant: Mutant
    status: str
    detail: str = ""
    seconds: float = 0.0
    cases: int = 0
    start_s: float | None = None  # the mutant's target start-up (its zygote importing the mutated vLLM)
    campaign_s: float | None = None  # from the campaign's start (after start-up) to its first new finding, or its end
    forked: bool | None = None  # its target a fork of the unmutated tree's standby (fuzz/mutate/swap.py), not an import

    def to_dict(self) -> dict[str, Any]:
        return {**self.mutant.to_dict(), "edit": self.mutant.edit, "status": self.status, "detail": self.detail,
                "seconds": round(self.seconds, 2), "cases": self.cases, "start_s": self.start_s, "campaign_s": self.campaign_s,
                "forked": self.forked}


@dataclass
class Session:
    source: TargetSource
    options: MutateOptions
    functions: list[Function] = field(default_factory=list)
    results: list[MutantResult] = field(default_factory=list)
    baseline: list[str] = field(default_factory=list)
    first_index: dict[str, int] = field(default_factory=dict)  # signature -> first case index the unmutated tree showed it at
    reach_cases: int = 0
    standby_key: str = ""  # the unmutated tree's standby, which the mutants' zygotes are forked from (fuzz/mutate/swap.py)


def run_session(source: TargetSource, options: MutateOptions, progress: Callable[[str], None] = lambda _: None) -> Session:
    root = tree_root(source)
    session = Session(source, options, layout_functions(root, options.functions))
    mutants = [m for f in session.functions for m in mutants_of((root / f.path).read_text(), f.path, f.qualname)]
    if options.max_mutants is not None:
        mutants = mutants[: options.max_mutants]
    done = _resume(options.session, session)
    equivalent = load_equivalent()
    work = Path(tempfile.mkdtemp(prefix="kvfuzz-mutate-"))
    try:
        progress(f"{len(mutants)} mutants of {len(session.functions)} functions; tracing which lines the cases reach")
        reached, session.reach_cases = _reach(source, root, session.functions, options, work, progress)
        baseline_corpus = work / "baseline"
        progress(f"baseline campaign on the unmutated tree ({2 * options.budget:g} s)")
        base = _one(source, None, baseline_corpus, options, budget=2 * options.budget, stop_at_new=False, work=work, name="baseline")
        session.baseline = base.get("signatures", [])
        session.first_index = base.get("first_index", {})
        session.standby_key = base.get("standby_key", "")
        if base["status"] == "stillborn":
            raise RuntimeError(f"the unmutated tree does not run: {base.get('detail')}")
        pending = []
        for mutant in mutants:
            if mutant.id in done:
                continue
            if mutant.id in equivalent:
                _record(session, MutantResult(mutant, "equivalent", equivalent[mutant.id]))
            elif not _is_reached(mutant, root, reached):
                _record(session, MutantResult(mutant, "unreached", f"no case of {session.reach_cases} executed line {mutant.line}"))
            else:
                pending.append(mutant)
        progress(f"{len(pending)} mutants to run, {options.jobs} at a time")
        found = _run_mutants(source, root, pending, options, work, session, progress)
        _confirm(source, found, session, options)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return session


def load_equivalent(path: Path = EQUIVALENT_FILE) -> dict[str, str]:
    """Mutant id -> why no case can tell the mutant from the original."""
    if not path.exists():
        return {}
    return {key: value["reason"] for key, value in json.loads(path.read_text()).items()}


def _resume(path: Path | None, session: Session) -> set[str]:
    if path is None or not path.exists():
        return set()
    done = set()
    for line in path.read_text().splitlines():
        data = json.loads(line)
        mutant = Mutant(data["path"], data["function"], data["operator"], data["line"], data["offset"], data["original"],
                        data["replacement"], data["occurrence"])
        session.results.append(MutantResult(mutant, data["status"], data["detail"], data["seconds"], data["cases"],
                                            data.get("start_s"), data.get("campaign_s"), data.get("forked")))
        done.add(mutant.id)
    return done


def _record(session: Session, result: MutantResult) -> None:
    session.results.append(result)
    if session.options.session is not None:
        with open(session.options.session, "a") as handle:
            handle.write(json.dumps(result.to_dict()) + "\n")


def _python_env(source: TargetSource, tree: Path | None = None) -> dict[str, str]:
    """The environment of a process that imports `source`'s vLLM, or the copy of it at `tree`."""
    env = worker_environment(source)
    if tree is None:
        tree = source.python_path  # None for the installed vLLM: nothing goes before the venv's
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(source.python_path)]
    env["PYTHONPATH"] = os.pathsep.join([*([str(tree)] if tree is not None else []), *parts, str(SOURCE_ROOT)])
    return env


def _reach(source: TargetSource, root: Path, functions: list[Function], options: MutateOptions, work: Path,
           progress: Callable[[str], None]) -> tuple[dict[str, set[int]], int]:
    config = {"functions": [{"path": f.path, "qualname": f.qualname} for f in functions], "seed": options.seed,
              "seconds": options.reach_seconds if options.reach_seconds is not None else options.budget,
              "max_cases": 10**9, "synthetic": options.synthetic, "device": options.device}
    config_path, out = work / "reach.json", work / "reached.json"
    config_path.write_text(json.dumps(config))
    log = work / "reach.log"
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "fuzz.mutate.reach", str(config_path), str(out)], env=_python_env(source),
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        began, limit = time.monotonic(), config["seconds"] + START_MARGIN_S
        if stop.wait_or_kill(process, limit, until=out.exists) and process.poll() is None:  # its first write: the target is up
            progress(f"target up in {time.monotonic() - began:.1f} s; tracing the unmutated tree's cases ({config['seconds']:g} s)")
            stop.wait_or_kill(process, limit - (time.monotonic() - began))
    if not out.exists():
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        raise TargetError(f"--vllm {source.spec}: tracing the unmutated tree failed before any case ran: {(lines or ['no output'])[-1][:300]}")
    data = json.loads(out.read_text())
    return {path: set(lines) for path, lines in data["lines"].items()}, data["cases"]


def _is_reached(mutant: Mutant, root: Path, reached: dict[str, set[int]]) -> bool:
    lines = reached.get(mutant.path, set())
    span = mutant.original.count("\n")
    return any(line in lines for line in range(mutant.line, mutant.line + span + 1))


def _one(source: TargetSource, tree: Path | None, corpus_dir: Path, options: MutateOptions, *, budget: float, stop_at_new: bool, work: Path,
         name: str, first_index: dict[str, int] | None = None) -> dict[str, Any]:
    """Run fuzz.mutate.one to the end (the baseline)."""
    process, out = _start_one(source, tree, corpus_dir, options, budget=budget, stop_at_new=stop_at_new, work=work, name=name,
                              first_index=first_index or {})
    if not stop.wait_or_kill(process, budget + START_MARGIN_S):
        return {"status": "stillborn", "detail": f"no result within {budget + START_MARGIN_S:g} s"}
    return json.loads(out.read_text()) if out.exists() else {"status": "stillborn", "detail": f"exited with status {process.returncode}"}


def _start_one(source: TargetSource, tree: Path | None, corpus_dir: Path, options: MutateOptions, *, budget: float, stop_at_new: bool,
               work: Path, name: str, first_index: dict[str, int],
               fork_of: dict[str, Any] | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    config = {"corpus": str(corpus_dir), "first_index": first_index, "case_timeout": options.case_timeout,
              "max_memory": options.max_memory, "device": options.device, "budget": budget, "seed": options.seed,
              "synthetic": options.synthetic, "stop_at_new": stop_at_new, "fork_of": fork_of}
    config_path, out = work / f"{name}.config.json", work / f"{name}.result.json"
    config_path.write_text(json.dumps(config))
    env = _python_env(source, tree)
    log = open(work / f"{name}.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "fuzz.mutate.one", str(config_path), str(out)], env=env, stdin=subprocess.DEVNULL,
                               stdout=log, stderr=log, start_new_session=True)
    log.close()
    return process, out


def _run_mutants(source: TargetSource, root: Path, pending: list[Mutant], options: MutateOptions, work: Path,
                 session: Session, progress: Callable[[str], None]) -> list[tuple[Mutant, dict[str, Any], float]]:
    """Run the mutants' campaigns, `jobs` at a time; the findings to confirm."""
    running: dict[str, tuple[Mutant, subprocess.Popen[bytes], Path, float, Path]] = {}
    found: list[tuple[Mutant, dict[str, Any], float]] = []
    queue = list(pending)
    try:
        return _drive(source, root, queue, running, found, options, work, session, progress)
    finally:
        for _, process, *_ in running.values():  # only left when a stop request cut the run short
            stop.kill_group(process)


def _drive(source: TargetSource, root: Path, queue: list[Mutant], running: dict[str, Any], found: list[tuple[Mutant, dict[str, Any], float]],
           options: MutateOptions, work: Path, session: Session,
           progress: Callable[[str], None]) -> list[tuple[Mutant, dict[str, Any], float]]:
    while queue or running:
        stop.check()
        while queue and len(running) < options.jobs:
            mutant = queue.pop(0)
            folder = work / mutant.id
            mutant_tree(root, mutant, folder / "tree")
            corpus_dir = folder / "corpus"
            corpus_dir.mkdir(parents=True)
            patch = {"path": mutant.path, "qualname": mutant.function, "source": (folder / "tree" / mutant.path).read_text()}
            process, out = _start_one(source, folder / "tree", corpus_dir, options, budget=options.budget, stop_at_new=True, work=folder,
                                      name="run", first_index=session.first_index,
                                      fork_of={"key": session.standby_key, "patch": patch} if session.standby_key else None)
            running[mutant.id] = (mutant, process, out, time.monotonic(), folder)
        time.sleep(0.2)
        for key, (mutant, process, out, started, folder) in list(running.items()):
            elapsed = time.monotonic() - started
            if process.poll() is None and elapsed < options.budget + START_MARGIN_S:
                continue
            if process.poll() is None:
                stop.kill_group(process)
            result = json.loads(out.read_text()) if out.exists() else {"status": "stillborn", "detail": _last_line(folder / "run.log")}
            del running[key]
            if result["status"] == "found":
                found.append((mutant, result, elapsed))
            else:
                status = "survived" if result["status"] == "quiet" else "stillborn"
                _record(session, MutantResult(mutant, status, result.get("detail", ""), elapsed, *_timing(result)))
            shutil.rmtree(folder, ignore_errors=True)
            progress(f"{len(session.results) + len(found)} / {len(session.results) + len(found) + len(running) + len(queue)} done")
    return found


def _timing(result: dict[str, Any]) -> tuple[int, float | None, float | None, bool | None]:
    """Cases run, start-up and campaign seconds, and whether its target was forked, as a mutant's process reported them."""
    return result.get("cases", 0), result.get("start_s"), result.get("elapsed_s"), result.get("forked")


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    return lines[-1][:300] if lines else "the mutant's process left no result"


def _confirm(source: TargetSource, found: list[tuple[Mutant, dict[str, Any], float]], session: Session, options: MutateOptions) -> None:
    """A mutant is killed when its finding's case does not fail the same way on the unmutated tree."""
    if not found:
        return
    from fuzz.campaign.pool import Pool, RemoteTarget
    from fuzz.case import from_dict
    from fuzz.verdict.runner import run_case

    # The unmutated tree as the baseline campaign ran it: a fork of its standby where that is still there.
    fork_of = (session.standby_key, None) if session.standby_key else None
    with Pool(source, workers=1, case_timeout=options.case_timeout, max_memory=options.max_memory, fork_of=fork_of) as pool:
        target = RemoteTarget(pool)
        for mutant, result, elapsed in found:
            verdict = run_case(target, from_dict(result["case"]), options.device).verdict
            same = verdict.finding is not None and verdict.finding.signature == result["signature"]
            status = "survived" if same else "killed"
            detail = ("its only finding fails the unmutated tree too: " if same else "") + result["signature"]
            _record(session, MutantResult(mutant, status, detail, elapsed, *_timing(result)))


__all__ = ["STATUSES", "MutantResult", "MutateOptions", "Session", "load_equivalent", "run_session", "copy_package"]
