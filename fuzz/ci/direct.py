"""Directed cases: learn which case features reach the changed lines, and draw towards them.

A case's features are what a reviewer would name it by (spec kinds, backends, layout, dtypes, packing,
runner, kernel-block splitting, padded pages, ...). Workers trace the changed functions (fuzz/ci/trace.py)
and report, per batch, how often each feature came with a case that executed a changed line. The
coordinator (`Direction`) adds these up into a policy: per feature, the log of its reach rate over the
overall rate (smoothed towards it). While no case has reached a changed line yet, the policy favours
features seen least, so a rarely drawn variant gets its turn sooner.

A case's tape is the floats its draw consumed (`TapeSource`): replayed, it draws the same case. Workers send
the tapes of some reaching cases; the coordinator keeps the newest MAX_TAPES and hands them out with the policy.
Most of a directed case's candidates (all but FRESH) start from a neighbour of such a tape (one to three of its
floats drawn anew), so most keep what made their parent reach, whatever choice that was (a block size that
splits into kernel blocks, a `chance` that packs); each choice among named options (spec kinds, backends, layouts, dtypes, runners,
packings) is also weighted by its feature's lift. Candidates are drawn until one is likely to reach (its
estimated reach rate, the overall rate times its features' lifts, is at least ACCEPT), at most CANDIDATES, and
the best-scoring one runs. Before the first hit, EXPLORE draws and the rarest features win. UNDIRECTED of the
indices, picked by a hash of (seed, index), keep the undirected draw. The choice depends only on the task (seed,
index, policy and its tapes), so the coordinator can redraw the case a dead worker was running, and every case
stays replayable from its JSON.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fuzz.campaign.protocol import Task
from fuzz.case import Case, dumps
from fuzz.ci.diff import ChangedFunction
from fuzz.ci.model import DiffCoverage, FunctionCoverage
from fuzz.space import RandomSource, Rejected, case_seed, draw_case
from fuzz.targets.base import TargetInfo

CANDIDATES = 8  # draws per directed case, at most
EXPLORE = 4  # draws per directed case while no case has reached the change
STEER = 3.0  # the largest log-lift a steered choice weighs an option by, either way
ACCEPT = 0.5  # estimated reach rate at which a candidate is taken without drawing more
UNDIRECTED = 0.15  # share of indices that keep the undirected draw
WARMUP = 64  # traced cases before the policy directs anything
PRIOR = 4.0  # pseudo-cases pulling a feature's reach rate towards the overall rate
MAX_SAMPLES = 24  # reaching cases kept to run on the baseline
MAX_TAPES = 32  # tapes of reaching cases that directed draws start from, the newest kept
TAPES_PER_BATCH = 4
FRESH = 0.25  # share of directed candidates drawn from a fresh seed though tapes exist: room for other ways to reach


def features(case: Case) -> frozenset[str]:
    """The case's features: each a `name=value` a draw can be steered by."""
    found = {f"layout={case.layout}", f"runner={case.runner}", f"packing={case.packing}", f"spec_source={case.spec_source}",
             f"platform={case.platform}", f"groups={len(case.groups)}", f"kv_sharing={bool(case.kv_sharing)}",
             f"blocks={'1' if case.num_blocks == 1 else 'few' if case.num_blocks <= 4 else 'many'}"}
    for group in case.groups:
        spec = group.spec
        backend = group.synthetic_backend.name if group.synthetic_backend is not None else group.backend
        found |= {f"kind={spec.kind}", f"backend={backend}", f"dtype={spec.dtype}", f"cache_dtype={spec.cache_dtype}",
                  f"quant={spec.kv_quant_mode}", f"synthetic={group.synthetic_backend is not None}"}
        if group.kernel_block_size is not None and group.kernel_block_size < spec.block_size:
            found.add("split=kernel-blocks")
        if spec.page_size_padded is not None or spec.alignment is not None:
            found.add("pages=padded")
        if spec.compress_ratio > 1:
            found.add("compressed=yes")
        if spec.model_version:
            found.add(f"model={spec.model_version}")
        if group.layer_heads:
            found.add("layer_heads=uneven")
        if group.layer_head_sizes:
            found.add("layer_head_sizes=uneven")
        if group.layer_cache_dtypes:
            found.add("layer_cache_dtypes=mixed")
        if len(group.layers) > 1:
            found.add("layers=several")
    if case.touches is not None and case.touches.consumers:
        found.add("consumers=yes")
    return frozenset(found)


@dataclass
class ReachStats:
    """Per feature: cases seen with it and cases among them that executed a changed line; and the same overall."""

    seen: Counter[str] = field(default_factory=Counter)
    reached: Counter[str] = field(default_factory=Counter)
    cases: int = 0
    hits: int = 0

    def add(self, found: frozenset[str], reached: bool) -> None:
        self.cases += 1
        self.hits += reached
        self.seen.update(found)
        if reached:
            self.reached.update(found)

    def merge(self, data: dict[str, Any]) -> None:
        self.cases += data.get("cases", 0)
        self.hits += data.get("hits", 0)
        self.seen.update(data.get("seen", {}))
        self.reached.update(data.get("reached", {}))

    def to_dict(self) -> dict[str, Any]:
        return {"cases": self.cases, "hits": self.hits, "seen": dict(self.seen), "reached": dict(self.reached)}

    def policy(self) -> dict[str, Any]:
        """`weights` per feature: log(smoothed reach rate / overall rate), and `base`, the overall rate; before the
        first hit, rarer features weigh more and `base` is 0 (no candidate is taken early)."""
        if not self.cases:
            return {}
        if not self.hits:
            return {"weights": {name: -math.log1p(count) for name, count in self.seen.items()}, "base": 0.0}
        base = (self.hits + 0.5) / (self.cases + 1.0)
        return {"weights": {name: round(math.log(((self.reached[name] + PRIOR * base) / (count + PRIOR)) / base), 4)
                            for name, count in self.seen.items()}, "base": base}


def score(case: Case, weights: dict[str, float]) -> float:
    """The sum of the case's feature weights (a feature not seen yet: 0, as likely to reach as any case)."""
    return sum(weights.get(name, 0.0) for name in features(case))


def estimate(value: float, base: float) -> float:
    """A score as an estimated reach rate (naive Bayes on lifts: it overestimates when features go together)."""
    return base * math.exp(min(value, 50.0))


def undirected(seed: int, index: int, share: float = UNDIRECTED) -> bool:
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < share


def candidate_seed(seed: int, candidate: int) -> int:
    return seed if candidate == 0 else (seed * 1_000_003 + candidate * 0x5DEECE66D) & ((1 << 63) - 1)


class TapeSource(RandomSource):
    """A RandomSource that replays a prefix of floats before its own, records every float it hands out (the case's
    tape: replayed, it draws the same case), and with `lifts` weighs each choice among named options by exp(its
    lift): an option named by a feature (`kind=mla`: the option "mla"), clamped to +-STEER so that none is ruled out;
    options no feature names keep uniform odds."""

    def __init__(self, rng: random.Random, prefix: Sequence[float] = (), lifts: dict[str, float] | None = None) -> None:
        super().__init__(rng)
        fresh = rng.random
        pending = list(reversed(prefix))
        self.tape: list[float] = []

        def next_float() -> float:
            value = pending.pop() if pending else fresh()
            self.tape.append(value)
            return value

        self.random = next_float
        self.lifts = lifts

    def choice(self, options: Sequence[Any]) -> Any:
        if not self.lifts or len(options) < 2 or not isinstance(options[0], str):
            return super().choice(options)
        odds = [math.exp(self.lifts.get(option, 0.0)) for option in options]
        point = self.random() * sum(odds)
        for option, weight in zip(options, odds, strict=True):
            point -= weight
            if point < 0:
                return option
        return options[-1]


def option_lifts(weights: dict[str, float]) -> dict[str, float]:
    """Per option value, the mean weight of the features naming it (a value two features share, such as a dtype that
    is both a model and a cache dtype, gets their mean), clamped to +-STEER."""
    named: dict[str, list[float]] = {}
    for feature, weight in weights.items():
        _, sep, value = feature.partition("=")
        if sep:
            named.setdefault(value, []).append(weight)
    return {value: max(-STEER, min(STEER, sum(found) / len(found))) for value, found in named.items()}


def mutated(tape: Sequence[float], rng: random.Random) -> list[float]:
    """A reaching case's tape with one to three of its floats drawn anew: a neighbour that keeps most of its choices."""
    changed = list(tape)
    for _ in range(rng.randint(1, 3)):
        changed[rng.randrange(len(changed))] = rng.random()
    return changed


def _from_tape(info: TargetInfo, rng: random.Random, prefix: Sequence[float], lifts: dict[str, float] | None, *, synthetic: bool,
               scale: str, touches: bool, attempts: int = 50) -> tuple[Case, list[float]]:
    """A case drawn as `draw_indexed` draws one (the same floats give the same case), and its tape: the floats of the
    attempt that made it, so that replayed they draw it at once."""
    source = TapeSource(rng, prefix, lifts)
    for _ in range(attempts):
        start = len(source.tape)
        try:
            return draw_case(source, info, synthetic=synthetic, scale=scale, touches=touches), source.tape[start:]
        except Rejected:
            continue
    raise Rejected(f"no valid case in {attempts} attempts")


def draw(info: TargetInfo, seed: int, index: int, policy: dict[str, Any] | None, *, synthetic: bool = True, scale: str = "small",
         touches: bool = False) -> tuple[Case, bool]:
    """Case `index`: the undirected draw, or with a policy and outside the undirected share a directed one (see
    `draw_taped`). Returns the case and whether it was directed. Raises Rejected when no candidate can be built."""
    case, directed, _ = draw_taped(info, seed, index, policy, synthetic=synthetic, scale=scale, touches=touches)
    return case, directed


def draw_taped(info: TargetInfo, seed: int, index: int, policy: dict[str, Any] | None, *, synthetic: bool = True,
               scale: str = "small", touches: bool = False) -> tuple[Case, bool, list[float]]:
    """`draw` with the drawn case's tape. A directed case's candidates are steered draws, each from a neighbour of a
    reaching case's tape once the policy holds some (`tapes`), or from a fresh seed; the first candidate likely to
    reach runs, else the best-scoring one."""
    if not policy or not policy.get("weights") or undirected(seed, index):
        case, tape = _from_tape(info, random.Random(case_seed(seed, index)), (), None, synthetic=synthetic, scale=scale, touches=touches)
        return case, False, tape
    weights, base, tapes = policy["weights"], policy.get("base", 0.0), policy.get("tapes") or []
    lifts = option_lifts(weights)
    best: tuple[float, Case, list[float]] | None = None
    for candidate in range(CANDIDATES if base else EXPLORE):
        rng = random.Random(case_seed(candidate_seed(seed, candidate), index))
        prefix = mutated(tapes[rng.randrange(len(tapes))], rng) if tapes and rng.random() >= FRESH else ()
        try:
            case, tape = _from_tape(info, rng, prefix, lifts, synthetic=synthetic, scale=scale, touches=touches)
        except Rejected:
            continue
        value = score(case, weights)
        if best is None or value > best[0]:
            best = (value, case, tape)
        if base and estimate(value, base) >= ACCEPT:
            break
    if best is None:
        raise Rejected(f"no candidate case for index {index}")
    return best[1], True, best[2]


# ------------------------------------------------------------------ the worker's side


class BatchReach:
    """What one worker batch learned: the stats, the changed lines executed, cases per changed function, sample cases."""

    def __init__(self, functions: list[ChangedFunction], sent: set[frozenset[tuple[str, int]]]) -> None:
        self.functions = functions
        self.stats = ReachStats()
        self.lines: set[tuple[str, int]] = set()
        self.per_function: Counter[str] = Counter()
        self.directed = Counter[str]()  # cases and hits, directed and undirected
        self.samples: list[dict[str, Any]] = []
        self.tapes: list[list[float]] = []
        self.sent = sent  # hit sets already sampled by this worker in this campaign

    def add(self, case: Case, hits: set[tuple[str, int]], directed: bool, index: int, ran: Case, tape: list[float] | None = None) -> None:
        reached = bool(hits)
        self.stats.add(features(case), reached)
        side = "directed" if directed else "undirected"
        self.directed[f"{side}_cases"] += 1
        if not reached:
            return
        self.directed[f"{side}_hits"] += 1
        self.lines |= hits
        for function in self.functions:
            if any((function.path, line) in hits for line in function.lines):
                self.per_function[function.name] += 1
        if tape and len(self.tapes) < TAPES_PER_BATCH:
            self.tapes.append(tape)
        key = frozenset(hits)
        if key not in self.sent or len(self.samples) < 1:
            self.sent.add(key)
            self.samples.append({"index": index, "case": _plain(ran), "lines": sorted([path, line] for path, line in hits)})

    def to_dict(self) -> dict[str, Any]:
        return {"stats": self.stats.to_dict(), "lines": sorted([path, line] for path, line in self.lines),
                "functions": dict(self.per_function), "directed": dict(self.directed), "samples": self.samples[:4],
                "tapes": self.tapes}


class WorkerReach:
    """A worker's tracing for one campaign: draws (directed or not), traces each case's run, and reports per batch."""

    def __init__(self, functions: list[dict[str, Any]]) -> None:
        from fuzz.ci.trace import ChangeTracer

        self.tracer = ChangeTracer(ChangedFunction.from_dict(f) for f in functions)
        self.sent: set[frozenset[tuple[str, int]]] = set()
        self.batch = BatchReach(self.tracer.functions, self.sent)
        self.drawn: Case | None = None
        self.directed = False
        self.tape: list[float] = []

    def begin(self) -> None:
        self.batch = BatchReach(self.tracer.functions, self.sent)

    def draw(self, info: TargetInfo, task: Task, index: int) -> Case:
        self.drawn, self.directed, self.tape = draw_taped(info, task.seed, index, task.policy, synthetic=task.synthetic, scale=task.scale,
                                                          touches=True)
        return self.drawn

    def start(self) -> None:
        self.tracer.start()

    def stop(self, index: int, ran: Case) -> None:
        hits = self.tracer.stop()
        if self.drawn is not None:
            self.batch.add(self.drawn, hits, self.directed, index, ran, self.tape)

    def report(self) -> dict[str, Any]:
        return self.batch.to_dict()


def _plain(case: Case) -> Any:
    import json

    return json.loads(dumps(case))


# ------------------------------------------------------------------ the coordinator's side


@dataclass
class Direction:
    """The coordinator's state: what the task tells workers, and what their batches reported, added up."""

    functions: list[ChangedFunction]
    directed: bool = True
    stats: ReachStats = field(default_factory=ReachStats)
    lines: set[tuple[str, int]] = field(default_factory=set)
    per_function: Counter[str] = field(default_factory=Counter)
    counts: Counter[str] = field(default_factory=Counter)
    samples: list[dict[str, Any]] = field(default_factory=list)
    tapes: deque[list[float]] = field(default_factory=lambda: deque(maxlen=MAX_TAPES))
    _sampled: set[str] = field(default_factory=set)

    @property
    def traced(self) -> list[ChangedFunction]:
        return [f for f in self.functions if not f.import_time]

    def task(self) -> dict[str, Any]:
        """Fields for a FUZZ task: the changed functions to trace and, once warmed up, the policy to draw by."""
        if not self.traced:
            return {}
        policy = self.stats.policy() if self.directed and self.stats.cases >= WARMUP else None
        if policy and self.tapes:
            policy["tapes"] = list(self.tapes)
        return {"changed": [f.to_dict() for f in self.traced], "policy": policy}

    def take(self, reach: dict[str, Any]) -> None:
        self.stats.merge(reach.get("stats", {}))
        self.lines.update((path, line) for path, line in reach.get("lines", ()))
        self.per_function.update(reach.get("functions", {}))
        self.counts.update(reach.get("directed", {}))
        self.tapes.extend(reach.get("tapes", ()))
        for sample in reach.get("samples", ()):
            key = _hash(sample["case"])
            if len(self.samples) < MAX_SAMPLES and key not in self._sampled:
                self._sampled.add(key)
                self.samples.append(sample)

    def redraw(self, info: TargetInfo, task: dict[str, Any], index: int) -> Case:
        """The case a task's worker ran at `index` (for a worker that died on it); `task` as sent (Task.to_dict())."""
        sent = Task.from_dict(task)
        return draw(info, sent.seed, index, sent.policy, synthetic=sent.synthetic, scale=sent.scale, touches=True)[0]

    def executed(self, function: ChangedFunction) -> tuple[int, ...]:
        return tuple(line for line in function.lines if (function.path, line) in self.lines)

    def coverage(self, compared: int = 0) -> DiffCoverage:
        """What the campaign's cases did with the changed lines; import-time lines ran when vLLM was imported."""
        rows = [FunctionCoverage(f, f.lines, None) if f.import_time else FunctionCoverage(f, self.executed(f), self.per_function[f.name])
                for f in self.functions]
        return DiffCoverage(rows, self.directed, self.stats.cases, self.stats.hits, dict(self.counts), compared)


def _hash(data: Any) -> str:
    import json

    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
