"""A case's picture as text: `text_diff` sets the oracle's views against vLLM's, layer by layer.

For each layer and tensor it gives shape, dtype, byte strides and first byte on both sides, then
which buffer bytes hold a different element byte (with the first such byte's owner on each side,
from `fuzz.explain.bytemap`). `title_lines` heads both this table and the PNG of `fuzz.explain.picture`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

import numpy as np

from fuzz.explain.bytemap import Tensor, actual_tensors, expected_tensors
from fuzz.explain.vllm_error import demand_lines, error_text, parse_storage_error
from fuzz.targets.base import ViewRecord
from fuzz.verdict.runner import CaseResult


def title_lines(result: CaseResult, vllm: str | None) -> list[str]:
    """The case, its block count and vLLM version (or contract), then its verdict, wrapped."""
    case, verdict = result.case, result.verdict
    where = f"vLLM {vllm}" if vllm else (f"contract {result.expectation.contract}" if result.expectation else "")
    head = f"{case.describe()}  ·  {case.num_blocks} blocks  ·  {where}"
    if verdict.finding is not None:
        status = f"{verdict.status}: {verdict.finding.signature}"
    else:
        status = verdict.status + (f" ({verdict.reason})" if verdict.reason else "")
    return [head, *textwrap.wrap(status, 150)[:3]]


def text_diff(result: CaseResult, *, vllm: str | None = None, others: Sequence[tuple[str, CaseResult]] = ()) -> str:
    """Expected against actual, per layer and tensor: shape, byte strides, first byte, and which
    bytes differ (with the first differing byte's owner on each side)."""
    case, expectation, outcome = result.case, result.expectation, result.outcome
    lines = title_lines(result, vllm)
    if others:
        lines.append("V2 model runner:")
    if expectation is not None and not expectation.accepted:
        layer = f" (layer {expectation.reject_layer})" if expectation.reject_layer else ""
        lines.append(f"oracle rejects the case: {expectation.reject_reason}{layer}")
    if outcome is not None and outcome.raised:
        lines.append(f"vLLM raised {error_text(outcome)}")
        demand = parse_storage_error(outcome.error_message)
        if demand is not None:
            lines += ["  " + line for line in demand_lines(demand, expectation, outcome.error_layer)]
    accepted = expectation is not None and expectation.accepted
    exp_sizes = list(expectation.buffers) if accepted and expectation is not None else None
    act_sizes = [b.size for b in outcome.buffers] if outcome is not None and not outcome.raised else None
    lines.append(f"buffer bytes: expected {exp_sizes if exp_sizes is not None else '-'}  actual {act_sizes if act_sizes is not None else '-'}")
    expected = expected_tensors(case, expectation)
    actual = actual_tensors(case, expectation, outcome) if act_sizes is not None else []
    lines.append(f"{'layer':12} {'tensor':6} {'side':8} {'shape':22} {'dtype':13} {'byte strides':28} {'first byte':>10} buffer")
    for name in case.layer_names:
        lines += _layer_rows(name, result, expected, actual, exp_sizes or [], act_sizes or [])
    for sharer, target in case.kv_sharing:
        mine = outcome.views.get(sharer) if outcome is not None else None
        theirs = outcome.views.get(target) if outcome is not None else None
        same = mine is not None and theirs is not None and [_geometry(v) for v in mine] == [_geometry(v) for v in theirs]
        lines.append(f"{sharer:12} shares {target}'s cache: vLLM's views {'alias it' if same else 'do NOT alias it'}")
    for label, other in others:
        # A case run by both model runners: the other runner's layout, against its own contract, below the V2 runner's.
        contract = f", contract {other.expectation.contract}" if other.expectation is not None else ""
        lines += ["", f"{label}{contract}:", *text_diff(other, vllm=vllm).splitlines()[1:]]
    return "\n".join(lines)


def _geometry(view: ViewRecord) -> tuple[object, ...]:
    return (view.shape, view.stride, view.offset_bytes, view.dtype, view.buffer)


def _layer_rows(name: str, result: CaseResult, expected: list[Tensor], actual: list[Tensor], exp_sizes: list[int],
                act_sizes: list[int]) -> list[str]:
    """One layer's rows: expected and actual geometry of each tensor, then how their bytes differ."""
    expectation, outcome = result.expectation, result.outcome
    wanted = expectation.layers[name].views if expectation is not None and name in expectation.layers else ()
    got = outcome.views.get(name, ()) if outcome is not None else ()
    rows = []
    for number in range(max(len(wanted), len(got), 1)):
        want = wanted[number] if number < len(wanted) else None
        view = got[number] if number < len(got) else None
        rows.append(_row(name, number, "expected", want and (want.shape, want.dtype, want.byte_strides, want.byte_offset, want.buffer)))
        rows.append(_row(name, number, "actual", view and (view.shape, view.dtype, view.byte_strides, view.offset_bytes, view.buffer)))
        mine = next((t for t in expected if t.layer == name and t.tensor == number), None)
        theirs = next((t for t in actual if t.layer == name and t.tensor == number), None)
        if mine is not None or theirs is not None:
            rows.append(" " * 20 + "-> " + byte_difference(mine, theirs, exp_sizes, act_sizes))
    return rows


def _row(name: str, number: int, side: str, data: tuple | None) -> str:
    if not data:
        return f"{name:12} {number:<6} {side:8} -"
    shape, dtype, strides, first, buffer = data
    return f"{name:12} {number:<6} {side:8} {str(tuple(shape)):22} {dtype:13} {str(tuple(strides)):28} {first:>10} {buffer}"


def _keys(tensor: Tensor, size: int) -> tuple[np.ndarray, int, int]:
    """(per-byte element key over `size` bytes, bytes outside the buffer, highest byte reached)."""
    keys = np.full(size, -1, dtype=np.int64)
    addresses = tensor.byte_addresses()
    values = (tensor.index[:, None] * tensor.element_size + np.arange(tensor.element_size)[None, :]).reshape(-1)
    inside = (addresses >= 0) & (addresses < size)
    keys[addresses[inside]] = values[inside]
    return keys, int((~inside).sum()), int(addresses.max()) + 1 if addresses.size else 0


def byte_difference(mine: Tensor | None, theirs: Tensor | None, exp_sizes: list[int], act_sizes: list[int]) -> str:
    """How many buffer bytes hold a different element byte on the two sides, and the first of them."""
    exp_size = exp_sizes[mine.buffer] if mine is not None and mine.buffer < len(exp_sizes) else 0
    act_size = act_sizes[theirs.buffer] if theirs is not None and theirs.buffer < len(act_sizes) else 0
    size = max(exp_size, act_size)
    want, _, _ = _keys(mine, size) if mine is not None else (np.full(size, -1, dtype=np.int64), 0, 0)
    got, outside, reach = _keys(theirs, size) if theirs is not None else (np.full(size, -1, dtype=np.int64), 0, 0)
    differ = np.flatnonzero(want != got)
    used = int(((want >= 0) | (got >= 0)).sum())
    words = [f"{differ.size:,} of {used:,} bytes differ" if differ.size else f"same {used:,} bytes"]
    if differ.size:
        first = int(differ[0])
        expected_owner = mine.describe(want[first]) if mine is not None and want[first] >= 0 else "nothing"
        actual_owner = theirs.describe(got[first]) if theirs is not None and got[first] >= 0 else "nothing"
        words.append(f"first at byte {first:,}: expected {expected_owner}, actual {actual_owner}")
    if outside:
        words.append(f"{outside:,} B outside the buffer (up to byte {reach:,} of {act_size:,})")
    return "; ".join(words)
