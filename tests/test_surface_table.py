"""scripts/surface_table.py: docs/reference/surface.md's per-release surface table is what the kept `kvfuzz surface` maps
generate."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load_script():
    spec = importlib.util.spec_from_file_location("surface_table", REPO / "scripts" / "surface_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


table = _load_script()


def survey(version: str, statuses: dict[str, str], lines: tuple[int, int] = (30, 40)) -> dict:
    functions = [{"qualname": name, "status": status} for name, status in statuses.items()]
    driven = sum(status == "driven" for status in statuses.values())
    return {"version": version, "functions": functions, "campaign": {"seconds": 60.0, "cases": 1234, "crashed_cases": []},
            "counts": {"found": len(statuses), "driven": driven, "not_driven": len(statuses) - driven,
                       "not_driven_by_kind": {"gpu": len(statuses) - driven}, "unexplained": 0, "lines_executed": lines[0],
                       "lines_of_driven": lines[1], "line_coverage": lines[0] / lines[1] if lines[1] else None}}


def test_the_pages_table_is_what_the_kept_maps_generate():
    assert table.PAGE == REPO / "docs" / "reference" / "surface.md"
    text = table.PAGE.read_text()
    assert text.count(table.BEGIN) == 1 and text.count(table.END) == 1
    assert table.BEGIN not in (REPO / "README.md").read_text()  # the table lives on its page, not in README
    maps = table.kept_maps()
    assert {m["version"] for m in maps} >= {"0.22.0", "0.28.0", "0.32.0", "0.34.0"}
    assert table.main(["--check"]) == 0
    # A kept map is a release's answer too: each function it found was driven or has its reason (fuzz/surface/reasons.py).
    assert {m["version"]: m["counts"]["unexplained"] for m in maps if m["counts"]["unexplained"]} == {}


def test_rows_follow_release_order_and_name_each_driven_function():
    text = f"before\n{table.BEGIN}\nstale\n{table.END}\nafter\n"
    maps = [survey("0.10.0", {"b": "driven", "a": "driven", "c": "not driven"}), survey("0.9.1", {"x": "not driven"}, (0, 0))]
    out = table.generate(text, maps)
    rows = out.split(table.BEGIN + "\n")[1].split("\n" + table.END)[0].splitlines()[2:]
    assert [r.split(" | ")[0] for r in rows] == ["| 0.9.1", "| 0.10.0"]
    assert "| 2 (67%) | 30 / 40 (75%) | 1: gpu 1 |" in rows[1] and rows[1].endswith("`a`, `b` |")
    assert "| 0 (0%) | - |" in rows[0]
    assert out.startswith("before\n") and out.endswith("after\n") and "stale" not in out


def test_a_page_without_the_markers_is_a_one_line_error():
    with pytest.raises(SystemExit, match="no surface table markers"):
        table.generate("no markers here", [])
