"""scripts/findings_table.py: FINDINGS.md's generated columns, and the range arithmetic behind them (no replay)."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("findings_table", REPO / "scripts" / "findings_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


table = _load_script()
Outcome, Columns = table.Outcome, table.Columns
VERSIONS = ["0.1.0", "0.2.0", "0.2.1", "0.3.0", "0.4.0", "0.5.0"]


def test_findings_md_is_what_the_recorded_replay_generates():
    versions, results = table.load_replay(REPO / "docs" / "findings-replay.json")
    layouts = table.load_layouts(REPO / "docs" / "findings-replay.json")
    text = table.FINDINGS.read_text()
    assert set(layouts) == set(versions)
    assert table.generate(text, table.linked_files(), results, versions, layouts) == text


def test_every_replayed_row_has_a_generated_reach_class():
    versions, results = table.load_replay(REPO / "docs" / "findings-replay.json")
    reach = table.finding_reach(table.linked_files(), results, table.load_layouts(REPO / "docs" / "findings-replay.json"))
    assert set(reach) == set(range(1, 38))
    assert set(reach.values()) == {"deployment", "flag", "latent"}
    # #18 needs the layout override on every release it affects; #10 is a registered dtype only a platform brings.
    assert (reach[18], reach[10]) == ("flag", "latent")


def test_the_reach_class_is_the_nearest_of_the_files_on_the_releases_where_they_fail(tmp_path, monkeypatch):
    from fuzz.export import reach as reach_module

    kinds = {("a.json", "0.1.0"): "latent", ("a.json", "0.2.0"): "flag", ("b.json", "0.2.0"): "deployment"}
    monkeypatch.setattr(table, "ROOT", tmp_path)
    monkeypatch.setattr("fuzz.export.finding.read_finding", lambda path: SimpleNamespace(case=path.name, meta={}))
    asked = []

    def judged(case, meta, layouts):
        asked.append((case, layouts["release"]))
        return reach_module.Reach(kinds[(case, layouts["release"])], "")

    monkeypatch.setattr(reach_module, "reach_of", judged)
    links = {"a.json": 7, "b.json": 8, "c.json": "candidate"}
    results = {"a.json": {"0.1.0": Outcome("fails"), "0.2.0": Outcome("fails"), "0.3.0": Outcome("pass")},
               "b.json": {"0.1.0": Outcome("other"), "0.2.0": Outcome("fails")},
               "c.json": {"0.1.0": Outcome("fails")}}
    layouts = {v: {"release": v} for v in ("0.1.0", "0.2.0", "0.3.0")}
    assert table.finding_reach(links, results, layouts) == {7: "flag", 8: "deployment"}
    assert sorted(asked) == [("a.json", "0.1.0"), ("a.json", "0.2.0"), ("b.json", "0.2.0")]  # only where a file fails


def test_the_reach_cell_keeps_its_hand_written_route():
    row = "| 5 | a bug | 0.29.0 - 0.34.0 | not fixed | latent; the 0.32+ crash with shipped backends |"
    assert table.rewrite_row(row, Columns("0.29.0 - 0.34.0", "not fixed", "flag")) == (
        "| 5 | a bug | 0.29.0 - 0.34.0 | not fixed | flag; the 0.32+ crash with shipped backends |")
    bare = "| 6 | a bug | 0.20.0 | 0.21.0 | shipped backends (CPU_MLA) |"
    assert table.rewrite_row(bare, Columns("0.20.0", "0.21.0", "deployment")) == (
        "| 6 | a bug | 0.20.0 | 0.21.0 | deployment: shipped backends (CPU_MLA) |")
    assert table.rewrite_row(bare, Columns("0.20.0", "0.21.0")) == bare  # no class generated: the cell stays


def test_every_corpus_file_is_replayed_and_every_numbered_finding_has_a_case():
    versions, results = table.load_replay(REPO / "docs" / "findings-replay.json")
    links = table.linked_files()
    assert set(table.corpus_files()) == set(results)
    assert all(set(per) == set(versions) for per in results.values())
    assert {n for n in links.values() if isinstance(n, int)} == set(range(1, 38))


def test_main_check_passes_from_the_recorded_replay():
    assert table.main(["--from", str(REPO / "docs" / "findings-replay.json"), "--check"]) == 0


@pytest.mark.parametrize("affected, expected", [
    (["0.3.0"], "0.3.0"),
    (["0.2.0", "0.2.1"], "0.2.0, 0.2.1"),
    (["0.2.0", "0.2.1", "0.3.0"], "0.2.0 - 0.3.0"),
    (["0.1.0", "0.3.0", "0.4.0", "0.5.0"], "0.1.0, 0.3.0 - 0.5.0"),
    (["0.1.0", "0.2.0", "0.4.0", "0.5.0"], "0.1.0, 0.2.0, 0.4.0, 0.5.0"),
    ([], "none"),
])
def test_releases_are_written_as_findings_writes_them(affected, expected):
    assert table.format_releases(affected, VERSIONS) == expected


def test_a_finding_is_affected_where_any_of_its_files_fails_and_not_applicable_where_none_can_be_expressed():
    links = {"a.json": 7, "b.json": 7, "c.json": "candidate"}
    results = {
        "a.json": {"0.1.0": Outcome("skipped"), "0.2.0": Outcome("fails"), "0.2.1": Outcome("pass"), "0.3.0": Outcome("pass")},
        "b.json": {"0.1.0": Outcome("case-error"), "0.2.0": Outcome("other"), "0.2.1": Outcome("fails"), "0.3.0": Outcome("rejected")},
        "c.json": {"0.1.0": Outcome("fails"), "0.2.0": Outcome("fails"), "0.2.1": Outcome("fails"), "0.3.0": Outcome("fails")},
    }
    states = table.finding_outcomes(links, results, VERSIONS[:4])
    assert states == {7: {"0.1.0": "n/a", "0.2.0": "affected", "0.2.1": "affected", "0.3.0": "unaffected"}}
    assert table.columns(states[7], VERSIONS[:4]) == Columns("0.2.0, 0.2.1", "0.3.0")


@pytest.mark.parametrize("states, expected", [
    ({"0.1.0": "affected", "0.2.0": "n/a", "0.2.1": "unaffected"}, Columns("0.1.0", "0.2.1")),  # n/a is no fix
    ({"0.1.0": "unaffected", "0.2.0": "affected", "0.2.1": "affected"}, Columns("0.2.0, 0.2.1", "not fixed")),
    ({"0.1.0": "affected", "0.2.0": "affected", "0.2.1": "n/a"}, Columns("0.1.0, 0.2.0", "not expressible from 0.2.1")),
    ({"0.1.0": "affected", "0.2.0": "n/a", "0.2.1": "n/a"}, Columns("0.1.0", "not expressible from 0.2.0")),
    ({"0.1.0": "affected", "0.2.0": "unaffected", "0.2.1": "affected"}, Columns("0.1.0, 0.2.1", "not fixed")),  # it came back
    ({"0.1.0": "unaffected", "0.2.0": "n/a", "0.2.1": "unaffected"}, Columns("none", "never affected")),
])
def test_fixed_in_is_the_first_release_after_the_last_affected_one_that_can_express_the_case(states, expected):
    # A release where none of a finding's cases can be expressed is no fix (nor a bug): "not expressible from".
    assert table.columns(states, ["0.1.0", "0.2.0", "0.2.1"]) == expected


def test_rows_keep_their_hand_written_notes_and_prose():
    row = "| 11 | the V1 runner's bug | 0.20.0 - 0.28.0 (V1 runner) | 0.29.0 (V1 reshape removed) | shipped backend |"
    assert table.rewrite_row(row, Columns("0.21.0 - 0.28.0", "0.29.0")) == (
        "| 11 | the V1 runner's bug | 0.21.0 - 0.28.0 (V1 runner) | 0.29.0 (V1 reshape removed) | shipped backend |")
    gone = "| 26 | a bug | 0.27.0 - 0.28.0 | 0.29.0 (no planner slabs) | flag |"
    assert table.rewrite_row(gone, Columns("0.24.0 - 0.28.0", "not expressible from 0.29.0")) == (
        "| 26 | a bug | 0.24.0 - 0.28.0 | not expressible from 0.29.0 (no planner slabs) | flag |")
    assert table.rewrite_row(table.rewrite_row(gone, Columns("0.24.0 - 0.28.0", "not expressible from 0.29.0")),
                             Columns("0.24.0 - 0.28.0", "0.30.0")) == "| 26 | a bug | 0.24.0 - 0.28.0 | 0.30.0 (no planner slabs) | flag |"
    plain = "| 5 | a bug | 0.29.0 - 0.34.0 | not fixed | latent |"
    assert table.rewrite_row(plain, Columns("0.29.0 - 0.33.0", "0.34.0")) == "| 5 | a bug | 0.29.0 - 0.33.0 | 0.34.0 | latent |"


def test_a_finding_without_corpus_cases_keeps_its_hand_written_columns_marked_as_not_replayed():
    row = "| 24 | a zeroer bug | 0.29.0 - 0.33.0 | 0.34.0 (`CPUKVBlockZeroer`) | flag |"
    marked = "| 24 | a zeroer bug | 0.29.0 - 0.33.0 (no corpus case: not replayed) | 0.34.0 (`CPUKVBlockZeroer`) | flag |"
    assert table.rewrite_row(row, None) == marked
    assert table.rewrite_row(marked, None) == marked


def test_only_rows_between_the_markers_are_rewritten():
    text = "\n".join(["| 1 | outside | 0.1.0 | 0.2.0 | x |", table.BEGIN, "| # | bug | releases affected | fixed in | reach |",
                      "| 1 | inside | 0.1.0 | 0.2.0 | x |", table.END, "| 1 | after | 0.1.0 | 0.2.0 | x |"])
    new = table.rewrite_table(text, {1: Columns("0.3.0", "not fixed")})
    assert new.split("\n") == ["| 1 | outside | 0.1.0 | 0.2.0 | x |", table.BEGIN, "| # | bug | releases affected | fixed in | reach |",
                               "| 1 | inside | 0.3.0 | not fixed | x |", table.END, "| 1 | after | 0.1.0 | 0.2.0 | x |"]


def test_a_replay_of_some_releases_updates_theirs_and_keeps_the_others():
    old = {"a.json": {"0.2.0": Outcome("fails"), "0.10.0": Outcome("pass")}, "gone.json": {"0.2.0": Outcome("pass")}}
    new = {"a.json": {"0.3.0": Outcome("skipped"), "0.10.0": Outcome("fails")}}
    versions, merged = table.merge_replay(["0.2.0", "0.10.0"], old, ["0.3.0", "0.10.0"], new)
    assert versions == ["0.2.0", "0.3.0", "0.10.0"]
    assert merged == {"a.json": {"0.2.0": Outcome("fails"), "0.3.0": Outcome("skipped"), "0.10.0": Outcome("fails")}}
