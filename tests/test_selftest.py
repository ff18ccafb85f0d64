"""fuzz/selftest.py: a short physical-probe campaign on the CPU, reported as a table."""

from __future__ import annotations

import io
import re

import pytest

from fuzz.campaign.selftest import format_table, selftest

COLUMNS = ("device", "torch", "vLLM", "cases", "cases/s", "verdicts", "findings by kind", "probe mismatches", "result")


def test_table_lines_up():
    text = format_table([("device", "cpu"), ("cases/s", "12.5")])
    lines = text.splitlines()
    assert lines[0] == lines[-1] and set(lines[0]) == {"-"}
    assert lines[1].index("cpu") == lines[2].index("12.5")


@pytest.mark.slow
def test_selftest_on_cpu(tmp_path):
    pytest.importorskip("vllm")
    out = io.StringIO()
    # Cases are drawn from (seed, index) alone: the first 300 are the same everywhere, and clean on vLLM 0.32.
    status = selftest("cpu", max_time=5.0, out=out, max_cases=300, corpus=tmp_path / "findings")
    text = out.getvalue()
    assert status == 0, text
    for column in COLUMNS:
        assert re.search(rf"^{re.escape(column)}\s{{2,}}\S", text, re.MULTILINE), (column, text)
    assert re.search(r"^probe mismatches\s+0$", text, re.MULTILINE)
    assert re.search(r"^result\s+PASS$", text, re.MULTILINE)
