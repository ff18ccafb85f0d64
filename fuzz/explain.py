"""`kvfuzz explain`: the oracle's layout and vLLM's, side by side, per layer."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from fuzz.case import Case
from fuzz.runner import run_case
from fuzz.targets.base import Target
from oracles.expectation import LayerExpectation


def byte_strides(layer: LayerExpectation) -> list[int | None]:
    """Byte step along each axis of the expected view, read off its first owned elements."""
    grid = layer.offsets.reshape(layer.shape)
    strides: list[int | None] = []
    for axis, size in enumerate(layer.shape):
        if size < 2 or grid.size == 0:
            strides.append(None)
            continue
        first = grid.take(0, axis=axis).reshape(-1)
        second = grid.take(1, axis=axis).reshape(-1)
        ok = (first >= 0) & (second >= 0)
        strides.append(int(second[ok][0] - first[ok][0]) if ok.any() else None)
    return strides


def explain_data(target: Target, case: Case, device: str) -> dict[str, Any]:
    result = run_case(target, case, device)
    expected, outcome = result.expectation, result.outcome
    layers: dict[str, Any] = {}
    for name in case.layer_names + [s for s, _ in case.kv_sharing]:
        want = expected.layers.get(name) if expected and expected.accepted else None
        got = outcome.views.get(name) if outcome else None
        layers[name] = {
            "expected": None if want is None else {
                "shape": list(want.shape), "dtype": want.dtype, "byte_strides": byte_strides(want),
                "first_byte": int(want.offsets[want.offsets >= 0].min()) if (want.offsets >= 0).any() else None,
                "bytes": int(np.count_nonzero(want.offsets >= 0)) * want.element_size},
            "actual": None if got is None else {
                "shape": list(got.shape), "dtype": got.dtype,
                "byte_strides": [s * got.element_size for s in got.stride], "first_byte": got.offset_bytes},
        }
    verdict = result.verdict
    return {
        "target": {"vllm_version": target.info.vllm_version, "generation": target.info.generation},
        "verdict": verdict.status,
        "finding": verdict.finding.to_dict() if verdict.finding else None,
        "reason": verdict.reason or (expected.reject_reason if expected else None),
        "buffer_bytes": {"expected": expected.buffer_bytes if expected else None,
                         "actual": outcome.buffer_bytes if outcome else None},
        "error": None if not outcome or not outcome.raised else f"{outcome.error_type} in {outcome.error_function}: {outcome.error_message}",
        "layers": layers,
    }


def explain(target: Target, case: Case, device: str, as_json: bool = False) -> str:
    data = explain_data(target, case, device)
    if as_json:
        return json.dumps(data, indent=1)
    lines = [f"case {case.describe()}  blocks={case.num_blocks}  on vLLM {data['target']['vllm_version']}",
             f"verdict: {data['verdict']}" + (f"  ({data['reason']})" if data["reason"] else "")]
    if data["finding"]:
        lines.append(f"finding: {data['finding']['signature']}")
    if data["error"]:
        lines.append(f"vLLM raised: {data['error']}")
    lines.append(f"buffer bytes: expected {data['buffer_bytes']['expected']}  actual {data['buffer_bytes']['actual']}")
    lines.append(f"{'layer':14} {'side':9} {'shape':22} {'dtype':14} {'byte strides':28} first byte")
    for name, sides in data["layers"].items():
        for side in ("expected", "actual"):
            view = sides[side]
            if view is None:
                lines.append(f"{name:14} {side:9} -")
                continue
            lines.append(f"{name:14} {side:9} {str(tuple(view['shape'])):22} {view['dtype']:14} "
                         f"{str(view['byte_strides']):28} {view['first_byte']}")
    return "\n".join(lines)
