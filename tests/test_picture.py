"""fuzz/picture.py: byte-map pictures and the text diff, on real outcomes and on hand-made ones."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

import oracles
from fuzz.case import from_dict
from fuzz.corpus.file import load
from fuzz.explain.picture import draw, parse_storage_error, text_diff
from fuzz.targets.base import BufferRecord, Outcome, ViewRecord
from fuzz.verdict.runner import CaseResult, run_case
from oracles.contract import CONTRACTS

SEEDS = Path(__file__).resolve().parent.parent / "corpus" / "seeds"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# vLLM 0.32 splits a 128-token compressed MLA block (one state) into 64-token kernel blocks; the oracle
# says a kernel block must hold whole compressed states: an accepted-invalid finding on the installed vLLM.
HALF_STATE_KERNEL = {"schema": 1, "num_blocks": 2, "layout": "LBNHC", "groups": [{
    "layers": ["l0"], "kernel_block_size": 64, "synthetic_backend": {"name": "half", "kernel_block_sizes": [64]},
    "spec": {"kind": "mla", "block_size": 128, "head_size": 512, "dtype": "float16", "compress_ratio": 128, "model_version": "deepseek_v4"}}]}
# No kernel block size of 48 divides a 16-token block: vLLM refuses with ValueError, a rejection.
# Two layers packed block-outermost, split into kernel blocks: the contract and vLLM both refuse it.
PACKED_SPLIT = {"schema": 1, "num_blocks": 2, "layout": "BLNHC", "groups": [{
    "layers": ["l0", "l1"], "synthetic_backend": {"name": "sixteen", "kernel_block_sizes": [16]}, "kernel_block_size": 16,
    "spec": {"kind": "full", "block_size": 32, "num_kv_heads": 2, "head_size": 64}}]}
SET_STORAGE = ("setStorage: sizes [256, 2, 584], strides [1728, 584, 1], storage offset 0, and itemsize 1 requiring a storage "
               "size of 441808 are out of bounds for storage of size 3456")


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def assert_sane_png(path: Path) -> None:
    width, height = png_size(path)
    assert 800 <= width <= 3000 and 200 <= height <= 4000, (width, height)
    assert path.stat().st_size < 1 << 20


@pytest.fixture(scope="module")
def target():
    pytest.importorskip("vllm")
    from fuzz.targets.loader import load_local

    loaded = load_local()
    if not loaded.info.contract.layout_placed:
        pytest.skip("these cases are written for a layout-placed vLLM (0.29 and later)")
    return loaded


def test_passing_seed(target, tmp_path):
    result = run_case(target, load(SEEDS / "dsv4-ratio128-1728-page.json"), "cpu")
    assert result.verdict.status == "pass"
    draw(result, tmp_path / "pass.png", vllm=target.info.vllm_version)
    assert_sane_png(tmp_path / "pass.png")
    text = text_diff(result)
    assert "same 2,336 bytes" in text


def test_failing_case(target, tmp_path):
    result = run_case(target, from_dict(HALF_STATE_KERNEL), "cpu")
    assert result.verdict.status == "finding", result.verdict
    draw(result, tmp_path / "finding.png")
    assert_sane_png(tmp_path / "finding.png")
    text = text_diff(result)
    assert result.verdict.finding.kind in text
    assert "oracle rejects the case" in text
    assert any(line.startswith("l0") and "actual" in line for line in text.splitlines())


def test_rejected_case(target, tmp_path):
    result = run_case(target, from_dict(PACKED_SPLIT), "cpu")
    assert result.verdict.status == "rejected", result.verdict
    draw(result, tmp_path / "rejected.png")
    assert_sane_png(tmp_path / "rejected.png")
    assert "vLLM raised ValueError" in text_diff(result)


# ---------------------------------------------------------------- hand-made outcomes: no vLLM needed


def seed_result(outcome: Outcome, status: str = "finding") -> CaseResult:
    from fuzz.verdict.compare import Verdict

    case = load(SEEDS / "dsv4-ratio128-1728-page.json")
    return CaseResult(case, Verdict(status), oracles.expect(case, CONTRACTS["placed-0.32"]), outcome)


def test_storage_error_is_parsed():
    demand = parse_storage_error(SET_STORAGE)
    assert demand is not None
    assert demand.sizes == (256, 2, 584) and demand.strides == (1728, 584, 1)
    assert (demand.needed, demand.available) == (441808, 3456)
    assert parse_storage_error("something else") is None


def test_raised_storage_error(tmp_path):
    result = seed_result(Outcome(error_type="RuntimeError", error_message=SET_STORAGE, error_function="_reshape_kv_cache", error_layer="l0"))
    draw(result, tmp_path / "raised.png", vllm="0.22.0")
    assert_sane_png(tmp_path / "raised.png")
    text = text_diff(result)
    assert "438,352 B past its end" in text
    assert "it needs 441,808 B; the buffer has 3,456 B" in text


def test_view_past_the_buffer(tmp_path):
    # Block stride one page too long: block 1 lands past the end of the 3456-byte buffer.
    view = ViewRecord((2, 1, 2, 584), (2304, 584, 584, 1), 0, "uint8", 1, 0)
    result = seed_result(Outcome(views={"l0": (view,)}, buffers=(BufferRecord(3456, ("l0",)),)))
    draw(result, tmp_path / "oob.png")
    assert_sane_png(tmp_path / "oob.png")
    text = text_diff(result)
    assert "outside the buffer" in text
    assert "first at byte 1,728" in text


def test_aliasing_view_is_a_clash():
    from fuzz.explain.picture import actual_tensors, byte_map

    view = ViewRecord((2, 1, 2, 584), (0, 584, 584, 1), 0, "uint8", 1, 0)  # both blocks on page 0
    result = seed_result(Outcome(views={"l0": (view,)}, buffers=(BufferRecord(3456, ("l0",)),)))
    tensors = actual_tensors(result.case, result.expectation, result.outcome)
    bmap = byte_map(tensors, 3456)
    assert bmap.clash[:1168].all() and not bmap.clash[1168:].any()
