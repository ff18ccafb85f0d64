"""`kvfuzz explain`: the oracle's layout and vLLM's, side by side, per layer and tensor."""

from __future__ import annotations

import json
from typing import Any

from fuzz.case import Case
from fuzz.targets.base import Target
from fuzz.verdict.runner import CaseResult, other_runners, run_case


def describe(result: CaseResult, target: Target) -> dict[str, Any]:
    expected, outcome, case = result.expectation, result.outcome, result.case
    layers: dict[str, Any] = {}
    for name in case.layer_names + [s for s, _ in case.kv_sharing]:
        want = expected.layers.get(name) if expected and expected.accepted else None
        got = outcome.views.get(name) if outcome else None
        layers[name] = {
            "expected": None if want is None else [
                {"shape": list(v.shape), "dtype": v.dtype, "byte_strides": list(v.byte_strides), "first_byte": v.byte_offset,
                 "buffer": v.buffer} for v in want.views],
            "actual": None if got is None else [
                {"shape": list(v.shape), "dtype": v.dtype, "byte_strides": list(v.byte_strides), "first_byte": v.offset_bytes,
                 "buffer": v.buffer} for v in got],
        }
    verdict = result.verdict
    return {
        "target": {"vllm_version": target.info.vllm_version, "generation": target.info.generation, "contract": target.info.contract.name},
        "verdict": verdict.status,
        "finding": verdict.finding.to_dict() if verdict.finding else None,
        "reason": verdict.reason or (expected.reject_reason if expected else None),
        "buffers": {"expected": list(expected.buffers) if expected else None,
                    "actual": [b.size for b in outcome.buffers] if outcome else None},
        "error": None if not outcome or not outcome.raised else f"{outcome.error_type} in {outcome.error_function}: {outcome.error_message}",
        "layers": layers,
        "runner": outcome.runner if outcome else None,
        "other_runners": {label: describe(other, target) for label, other in other_runners(result, target.info.contract)},
        "checks": outcome.checks if outcome else None,
    }


def explain(target: Target, case: Case, device: str, as_json: bool = False, probe: bool | str = False) -> str:
    result = run_case(target, case, device, probe=probe)
    return json.dumps(describe(result, target), indent=1) if as_json else render(result, target)


def render(result: CaseResult, target: Target) -> str:
    """The text form, one view: both sides per layer and tensor, each followed by the bytes that differ."""
    from fuzz.explain.picture_text import text_diff

    return text_diff(result, vllm=f"{target.info.vllm_version}, contract {target.info.contract.name}",
                     others=other_runners(result, target.info.contract))
