"""`kvfuzz bench`: how fast the pipeline runs against the bare vLLM calls, measured in one run.

One process with the target's vLLM (`python -m fuzz.campaign.bench`, started by the command with the
target first on the path) measures on the same case mix:
- bare-reshape: vLLM's allocation and view calls (the function under test) on prebuilt inputs;
- bare-walk: the whole V2-runner walk kvfuzz calls (planner, kernel block sizes, allocation,
  views) on prebuilt case objects;
- pipeline: kvfuzz end to end on one core: draw, declare, vLLM walk, oracle, metadata comparison; and the same with
  vLLM's raw buffers zero-filled where no check reads their bytes (as before fuzz/targets/unfilled.py);
- peers without any oracle: a plain Hypothesis @given harness over compressed-MLA specs that only
  calls vLLM and checks the storage size, and the same test driven by fuzz_one_input with random bytes;
- probe kinds side by side, on one mix of drawn cases: metadata only, the physical probe, the kernel
  probe (tokens through each backend's cache write) and the consumers (zeroers, block copy, regions).
The command then runs campaigns with 1 and 2 worker processes for the worker-scaling figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend
from fuzz.space import Rejected, draw_indexed, for_run
from fuzz.targets.base import Target
from fuzz.verdict.runner import run_case

SECONDS = 3.0
PEER_EXAMPLES = 1500


def rate(run_once: Callable[[int], None], count: int, seconds: float = SECONDS) -> float:
    """Calls per second of run_once(i) over i = 0, 1, ... (cycling through `count` items)."""
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run_once(done % count)
        done += 1
    return done / (time.perf_counter() - start)


def case_mix(target: Target, seed: int, count: int) -> list[Case]:
    """Cases the target accepts and runs through without an error: the bare calls need inputs that work."""
    mix = []
    for index in range(count * 3):
        try:
            case = draw_indexed(target.info, seed, index)
        except Rejected:
            continue
        execution = target.execute(case, "cpu")
        if execution.outcome is not None and not execution.outcome.raised:
            mix.append(execution.case)
        if len(mix) == count:
            break
    return mix


def measure(target: Any, seed: int, count: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    mix = case_mix(target, seed, count)
    device = torch.device("cpu")
    calls = [target.prepare(case, device).views for case in mix]
    results: dict[str, Any] = {"vllm_version": target.info.vllm_version, "generation": target.info.generation, "cases_in_mix": len(mix)}
    results["bare_reshape_per_s"] = rate(lambda i: calls[i](), len(calls))
    results["bare_walk_per_s"] = rate(lambda i: target.prepare(mix[i], device).views(), len(mix))
    results["pipeline_per_s"] = rate(lambda i: run_case(target, draw_or_skip(target, seed + 1, i), "cpu"), 10**9)
    results["pipeline_filled_buffers_per_s"] = filled_pipeline_rate(target, seed + 1)
    results["unfilled_vs_filled_buffers"] = results["pipeline_per_s"] / results["pipeline_filled_buffers_per_s"]
    results["pipeline_stages_us"] = stages(target, seed + 2, 2000)
    results.update(peers(target))
    results.update(probe_kinds(target, seed + 3))
    results["pipeline_vs_bare_reshape"] = results["pipeline_per_s"] / results["bare_reshape_per_s"]
    results["pipeline_vs_bare_walk"] = results["pipeline_per_s"] / results["bare_walk_per_s"]
    return results


def filled_pipeline_rate(target: Any, seed: int) -> float:
    """The same pipeline with every raw buffer zero-filled, as vLLM allocates it: the other side of leaving the buffers
    of a run that reads no byte unfilled (fuzz/targets/unfilled.py)."""
    from fuzz.targets import walker

    unfilled = walker.unfilled_buffers
    walker.unfilled_buffers = contextlib.nullcontext  # type: ignore[assignment]
    try:
        return rate(lambda i: run_case(target, draw_or_skip(target, seed, i), "cpu"), 10**9)
    finally:
        walker.unfilled_buffers = unfilled


def stages(target: Any, seed: int, count: int) -> dict[str, float]:
    """Where a pipeline case's time goes: drawing, the target (declare + vLLM walk + records), oracle, comparison."""
    import oracles
    from fuzz.verdict.compare import compare

    spent = dict.fromkeys(("draw", "target", "oracle", "compare"), 0.0)
    for index in range(count):
        start = time.perf_counter()
        case = draw_or_skip(target, seed, index)
        drawn = time.perf_counter()
        execution = target.execute(case, "cpu")
        executed = time.perf_counter()
        spent["draw"] += drawn - start
        spent["target"] += executed - drawn
        if execution.outcome is None:
            continue
        expected = oracles.expect(execution.case, target.info.contract)
        judged = time.perf_counter()
        compare(execution.case, expected, execution.outcome)
        spent["oracle"] += judged - executed
        spent["compare"] += time.perf_counter() - judged
    return {stage: round(seconds / count * 1e6, 1) for stage, seconds in spent.items()}


PROBE_KINDS = ("metadata", "physical", "kernel", "consumers")


def probe_kinds(target: Target, seed: int, count: int = 300) -> dict[str, float]:
    """Cases per second of the whole pipeline (run and judged) with each probe kind, on the same drawn cases, and each
    one's rate relative to metadata only."""
    drawn = [draw_or_skip(target, seed, i, touches=True) for i in range(count)]
    mixes = {"metadata": ([for_run(c, consumers=False, kernel=False) for c in drawn], False),
             "physical": ([for_run(c, consumers=False, kernel=False) for c in drawn], "physical"),
             "kernel": ([for_run(c, consumers=False, kernel=True) for c in drawn], "kernel"),
             "consumers": ([for_run(c, consumers=True, kernel=False) for c in drawn], False)}
    figures: dict[str, float] = {}
    for kind in PROBE_KINDS:
        cases, probe = mixes[kind]
        figures[f"probe_{kind}_per_s"] = rate(lambda i, cases=cases, probe=probe: run_case(target, cases[i], "cpu", probe=probe), len(cases))
    for kind in PROBE_KINDS[1:]:
        figures[f"probe_{kind}_vs_metadata"] = figures[f"probe_{kind}_per_s"] / figures["probe_metadata_per_s"]
    return figures


def draw_or_skip(target: Target, seed: int, index: int, touches: bool = False) -> Case:
    while True:
        try:
            return draw_indexed(target.info, seed, index, touches=touches)
        except Rejected:
            index += 10**9


def peers(target: Any) -> dict[str, float]:
    """The two oracle-free harnesses the issue measured kvfuzz against."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    compressing = next((b for b in target.info.backends if b.compresses), None)
    shaped = not target.info.contract.layout_placed
    layout = "NHD" if shaped else "LBNHC"

    @st.composite
    def compressed_mla(draw: st.DrawFn) -> Case:
        block = draw(st.sampled_from((64, 128, 256, 512)))
        ratio = draw(st.sampled_from((1, 2, 4, 128)).filter(lambda r: block % r == 0))
        spec = SpecCase(kind="mla", block_size=block, head_size=draw(st.sampled_from((512, 584))), dtype="uint8",
                        alignment=576, compress_ratio=ratio, model_version="deepseek_v4")
        group = (GroupCase(spec=spec, layers=("l0",), backend=compressing.name, kernel_block_size=block) if compressing and not shaped
                 else GroupCase(spec=spec, layers=("l0",), synthetic_backend=SyntheticBackend("peer", ("x1",), None, ("B", "T", "D")),
                                kernel_block_size=block))
        return Case(groups=(group,), num_blocks=draw(st.integers(1, 4)), layout=layout)

    count = [0]

    def body(case: Case) -> None:
        count[0] += 1
        try:
            views, raw, _ = target.prepare(target.declare(case), torch.device("cpu")).views()
        except Exception:  # noqa: BLE001 - the peers only count cases, a crash is one too
            return
        assert all(v.untyped_storage().nbytes() <= sum(r.untyped_storage().nbytes() for r in raw) for v in views.values()
                   if isinstance(v, torch.Tensor))

    quiet = settings(database=None, deadline=None, suppress_health_check=list(HealthCheck), max_examples=PEER_EXAMPLES)
    given_rate = _timed(quiet(given(compressed_mla())(body)), count)
    fuzz_one = given(compressed_mla())(body).hypothesis.fuzz_one_input  # type: ignore[attr-defined]
    rng = random.Random(0)
    count[0] = 0
    start = time.perf_counter()
    while time.perf_counter() - start < SECONDS:
        fuzz_one(rng.randbytes(64))
    fuzz_rate = count[0] / (time.perf_counter() - start)
    return {"peer_given_per_s": given_rate, "peer_fuzz_one_input_per_s": fuzz_rate}


def _timed(run: Callable[[], None], count: list[int]) -> float:
    count[0] = 0
    start = time.perf_counter()
    run()
    return count[0] / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fuzz.campaign.bench")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=200)
    args = parser.parse_args(argv)
    from fuzz.targets.loader import load_local

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    print(json.dumps(measure(load_local(), args.seed, args.cases)), file=sys.stdout)


if __name__ == "__main__":
    main()
