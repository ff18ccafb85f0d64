"""Directed cases: learn which case features reach the changed lines, and draw towards them.

A case's features are what a reviewer would name it by (spec kinds, backends, layout, dtypes, packing,
runner, kernel-block splitting, padded pages, ...). Workers trace the changed functions (fuzz/ci/trace.py)
and report, per batch, how often each feature came with a case that executed a changed line. The
coordinator (`Direction`) adds these up into a policy: per feature, the log of its reach rate over the
overall rate (smoothed towards it). While no case has reached a changed line yet, the policy favours
features seen least, so a rarely drawn variant gets its turn sooner.

A directed case is drawn from derived seeds of the same index (candidate 0 is the undirected draw) until a
candidate is likely to reach (its estimated reach rate, the overall rate times its features' lifts, is at
least ACCEPT), at most CANDIDATES draws, and the best-scoring one runs; before the first hit, EXPLORE draws and
the rarest features win. A changed line that one case in fifty reaches needs many draws per hit, and a draw
costs a twentieth of a case's run. UNDIRECTED of the indices, picked by a hash of (seed, index), keep the
undirected draw. The choice depends only on the task (seed, index, policy), so the coordinator can redraw the case a
dead worker was running, and every case stays replayable from its JSON.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fuzz.case import Case, dumps
from fuzz.ci.diff import ChangedFunction
from fuzz.ci.model import DiffCoverage, FunctionCoverage
from fuzz.space import Rejected, draw_indexed
from fuzz.targets.base import TargetInfo

CANDIDATES = 24  # draws per directed case, at most
EXPLORE = 6  # draws per directed case while no case has reached the change
ACCEPT = 0.5  # estimated reach rate at which a candidate is taken without drawing more
UNDIRECTED = 0.15  # share of indices that keep the undirected draw
WARMUP = 64  # traced cases before the policy directs anything
PRIOR = 4.0  # pseudo-cases pulling a feature's reach rate towards the overall rate
MAX_SAMPLES = 24  # reaching cases kept to run on the baseline


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


def draw(info: TargetInfo, seed: int, index: int, policy: dict[str, Any] | None, *, synthetic: bool = True, scale: str = "small",
         touches: bool = False) -> tuple[Case, bool]:
    """Case `index`: the undirected draw, or with a policy and outside the undirected share the first candidate likely
    to reach, else the best of the candidates drawn. Returns the case and whether it was directed. Raises Rejected
    when no candidate can be built."""
    if not policy or not policy.get("weights") or undirected(seed, index):
        return draw_indexed(info, seed, index, synthetic=synthetic, scale=scale, touches=touches), False
    weights, base = policy["weights"], policy.get("base", 0.0)
    best: tuple[float, Case] | None = None
    for candidate in range(CANDIDATES if base else EXPLORE):
        try:
            case = draw_indexed(info, candidate_seed(seed, candidate), index, synthetic=synthetic, scale=scale, touches=touches)
        except Rejected:
            continue
        value = score(case, weights)
        if best is None or value > best[0]:
            best = (value, case)
        if base and estimate(value, base) >= ACCEPT:
            break
    if best is None:
        raise Rejected(f"no candidate case for index {index}")
    return best[1], True


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
        self.sent = sent  # hit sets already sampled by this worker in this campaign

    def add(self, case: Case, hits: set[tuple[str, int]], directed: bool, index: int, ran: Case) -> None:
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
        key = frozenset(hits)
        if key not in self.sent or len(self.samples) < 1:
            self.sent.add(key)
            self.samples.append({"index": index, "case": _plain(ran), "lines": sorted([path, line] for path, line in hits)})

    def to_dict(self) -> dict[str, Any]:
        return {"stats": self.stats.to_dict(), "lines": sorted([path, line] for path, line in self.lines),
                "functions": dict(self.per_function), "directed": dict(self.directed), "samples": self.samples[:4]}


class WorkerReach:
    """A worker's tracing for one campaign: draws (directed or not), traces each case's run, and reports per batch."""

    def __init__(self, functions: list[dict[str, Any]]) -> None:
        from fuzz.ci.trace import ChangeTracer

        self.tracer = ChangeTracer(ChangedFunction.from_dict(f) for f in functions)
        self.sent: set[frozenset[tuple[str, int]]] = set()
        self.batch = BatchReach(self.tracer.functions, self.sent)
        self.drawn: Case | None = None
        self.directed = False

    def begin(self) -> None:
        self.batch = BatchReach(self.tracer.functions, self.sent)

    def draw(self, info: TargetInfo, task: dict[str, Any], index: int) -> Case:
        self.drawn, self.directed = draw(info, task["seed"], index, task.get("policy"), synthetic=task["synthetic"],
                                         scale=task.get("scale", "small"), touches=True)
        return self.drawn

    def start(self) -> None:
        self.tracer.start()

    def stop(self, index: int, ran: Case) -> None:
        hits = self.tracer.stop()
        if self.drawn is not None:
            self.batch.add(self.drawn, hits, self.directed, index, ran)

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
    _sampled: set[str] = field(default_factory=set)

    @property
    def traced(self) -> list[ChangedFunction]:
        return [f for f in self.functions if not f.import_time]

    def task(self) -> dict[str, Any]:
        """Fields for a FUZZ task: the changed functions to trace and, once warmed up, the policy to draw by."""
        if not self.traced:
            return {}
        weights = self.stats.policy() if self.directed and self.stats.cases >= WARMUP else None
        return {"changed": [f.to_dict() for f in self.traced], "policy": weights}

    def take(self, reach: dict[str, Any]) -> None:
        self.stats.merge(reach.get("stats", {}))
        self.lines.update((path, line) for path, line in reach.get("lines", ()))
        self.per_function.update(reach.get("functions", {}))
        self.counts.update(reach.get("directed", {}))
        for sample in reach.get("samples", ()):
            key = _hash(sample["case"])
            if len(self.samples) < MAX_SAMPLES and key not in self._sampled:
                self._sampled.add(key)
                self.samples.append(sample)

    def redraw(self, info: TargetInfo, task: dict[str, Any], index: int) -> Case:
        """The case a task's worker ran at `index` (for a worker that died on it)."""
        return draw(info, task["seed"], index, task.get("policy"), synthetic=task["synthetic"], scale=task.get("scale", "small"),
                    touches=True)[0]

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
