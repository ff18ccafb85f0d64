"""`kvfuzz mutate`: the operators make exactly the edits they name, keep files' line counts, find
functions that moved, and (slow) every mutant of a small layout function dies."""

import ast
import json
import statistics
import textwrap

import pytest

from fuzz.mutate.functions import layout_functions
from fuzz.mutate.operators import apply, mutants_of

SOURCE = textwrap.dedent('''\
    import logging

    logger = logging.getLogger(__name__)


    def strides(spec, num_blocks, kernel_block_size=None):
        """Byte strides."""
        block_size = spec.block_size
        if kernel_block_size is not None and block_size % kernel_block_size:
            raise ValueError(f"{block_size} is not a multiple of {kernel_block_size + 1}")
        ratio = block_size // (kernel_block_size or block_size)
        logger.info("ratio %d", ratio + 1)
        order = (0, 2, 1)
        return num_blocks * ratio + min(ratio, 4), order
    ''')


def edits(source=SOURCE):
    return {(m.operator, m.original, m.replacement) for m in mutants_of(source, "m.py", "strides")}


def test_operators_make_the_edits_they_name_and_leave_messages_and_logging_alone():
    expected = {
        ("swap-name", "kernel_block_size", "block_size"),
        ("swap-name", "block_size", "kernel_block_size"),
        ("flip-compare", "kernel_block_size is not None", "kernel_block_size is None"),
        ("drop-raise", 'raise ValueError(f"{block_size} is not a multiple of {kernel_block_size + 1}")', "pass"),
        ("floordiv-mul", "block_size // (kernel_block_size or block_size)", "block_size * (kernel_block_size or block_size)"),
        ("floordiv-mul", "num_blocks * ratio", "num_blocks // ratio"),
        ("drop-term", "num_blocks * ratio + min(ratio, 4)", "num_blocks * ratio"),
        ("drop-term", "num_blocks * ratio + min(ratio, 4)", "min(ratio, 4)"),
        ("min-max", "min(ratio, 4)", "max(ratio, 4)"),
        ("off-by-one", "4", "5"),
        ("off-by-one", "4", "3"),
        ("permute-order", "(0, 2, 1)", "(2, 0, 1)"),
        ("permute-order", "(0, 2, 1)", "(0, 1, 2)"),
        ("off-by-one", "0", "1"), ("off-by-one", "0", "-1"),
        ("off-by-one", "2", "3"), ("off-by-one", "2", "1"),
        ("off-by-one", "1", "2"), ("off-by-one", "1", "0"),
    }
    assert edits() == expected


def test_an_edit_keeps_the_line_count_and_changes_behaviour():
    def run(source):
        namespace: dict = {}
        exec(compile(source, "m.py", "exec"), namespace)

        class Spec:
            block_size = 64

        return namespace["strides"](Spec, 3, 16)

    assert run(SOURCE) == (3 * 4 + 4, (0, 2, 1))
    results = set()
    for mutant in mutants_of(SOURCE, "m.py", "strides"):
        mutated = apply(SOURCE, mutant)
        assert len(mutated.splitlines()) == len(SOURCE.splitlines()), mutant.edit
        ast.parse(mutated)
        assert mutated.splitlines()[mutant.line - 1] != SOURCE.splitlines()[mutant.line - 1], mutant.edit
        try:
            results.add(repr(run(mutated)))
        except Exception as error:  # noqa: BLE001 - a mutant may well raise
            results.add(type(error).__name__)
    assert len(results) > 8, results


def test_multi_line_edits_keep_the_following_lines_where_they_were():
    source = "def f(x):\n    if x:\n        raise ValueError(\n            'no'\n        )\n    return x\n"
    (mutant,) = [m for m in mutants_of(source, "m.py", "f") if m.operator == "drop-raise"]
    mutated = apply(source, mutant)
    assert mutated.splitlines()[5] == "    return x"
    assert "raise" not in mutated


def test_mutant_ids_survive_code_moving_above_the_function():
    mutants = mutants_of(SOURCE, "m.py", "strides")
    before = {m.id for m in mutants}
    assert len(before) == len(mutants), "every mutant has an id of its own, repeated edits included"
    moved = SOURCE.replace("import logging\n", "import logging\nimport os\n\n\ndef other():\n    return 1\n")
    assert {m.id for m in mutants_of(moved, "m.py", "strides")} == before


def test_layout_functions_follow_a_function_that_moved(tmp_path):
    worker = tmp_path / "vllm" / "v1" / "worker"
    worker.mkdir(parents=True)
    (worker / "utils.py").write_text("def allocate_kv_cache(c):\n    return _helper(c)\n\n\ndef _helper(c):\n    return c\n")
    moved = tmp_path / "vllm" / "v1" / "core" / "planning"
    moved.mkdir(parents=True)
    (moved / "plan.py").write_text("class Builder:\n    def get_kv_cache_config_from_groups(self, g):\n        return g\n")
    found = {(f.path, f.qualname, f.role) for f in layout_functions(tmp_path)}
    assert ("vllm/v1/worker/utils.py", "allocate_kv_cache", "allocation") in found
    assert ("vllm/v1/worker/utils.py", "_helper", "allocation") in found
    assert ("vllm/v1/core/planning/plan.py", "Builder.get_kv_cache_config_from_groups", "planner") in found
    with pytest.raises(LookupError, match="no function named nowhere"):
        layout_functions(tmp_path, ["nowhere"])


@pytest.mark.sweep
@pytest.mark.slow
def test_every_mutant_of_the_layer_shape_function_dies(tmp_path):
    """The tool's own self-test: a small layout function whose mutants a working kvfuzz must all kill."""
    pytest.importorskip("vllm")
    import io

    from fuzz.cli import main

    out = io.StringIO()
    # A mutant's campaign stops at its first finding (a fraction of a second here): the budget is a cap, with room for a
    # loaded machine to kill the same mutants (the unmutated tree's baseline runs twice the budget, whole).
    code = main(["mutate", "--function", "compute_layer_kv_cache_shape_bytes", "--budget", "10", "--jobs", "2", "--device", "cpu",
                 "--case-timeout", "10", "--json", "--session", str(tmp_path / "session.jsonl")], stdout=out)
    assert code == 0
    report = json.loads(out.getvalue())
    assert report["totals"]["killed"] >= 6, report["mutants"]
    assert report["totals"]["survived"] == report["totals"]["unreached"] == 0, [m for m in report["mutants"] if m["status"] != "killed"]
    killed = [m for m in report["mutants"] if m["status"] == "killed"]
    assert all(m["start_s"] > 0 and 0 <= m["campaign_s"] <= m["seconds"] for m in killed), killed
    assert all(m["forked"] for m in killed), "each mutant's target a fork of the unmutated tree's standby, not an import"
    firsts = sorted(m["campaign_s"] for m in killed)
    assert report["timing"]["killed_median_first_finding_s"] == round(statistics.median(firsts), 2)


def test_each_listed_equivalent_mutant_is_a_mutant_of_its_release():
    """fuzz/mutate/equivalent.json names mutants by id: each id is one the operators make on the named
    function of the named release, with the edit the file shows (so no stale id silently excuses a survivor)."""
    from fuzz.mutate.session import EQUIVALENT_FILE
    from tests.chaos_trees import installed_vllm

    vllm = pytest.importorskip("vllm")
    listed = json.loads(EQUIVALENT_FILE.read_text())
    mine = [entry for entry in listed.values() if entry["release"] == vllm.__version__.split("+")[0]]
    assert mine, "no listed mutant of the installed release"
    for mutant_id, entry in listed.items():
        path, qualname = entry["function"].split("::")
        if entry["release"] != vllm.__version__.split("+")[0]:
            continue  # another release's mutant: its id is checked where that release is installed
        root = installed_vllm()
        made = {m.id: m for m in mutants_of((root / path).read_text(), path, qualname)}
        assert mutant_id in made and made[mutant_id].edit == entry["edit"] and entry["reason"], (mutant_id, entry)


def test_every_process_of_a_session_imports_the_release_under_test_or_its_mutant(tmp_path):
    """The reach pass and the baseline import the release itself; a mutant's process its copy, never both."""
    from fuzz.mutate.session import _python_env
    from fuzz.targets.releases import TargetSource

    release = TargetSource("0.23.0", "release", "0.23.0", tmp_path / "0.23.0")
    paths = _python_env(release)["PYTHONPATH"].split(":")
    assert paths[0] == str(tmp_path / "0.23.0")
    mutant = _python_env(release, tmp_path / "mutant")["PYTHONPATH"].split(":")
    assert mutant[0] == str(tmp_path / "mutant") and str(tmp_path / "0.23.0") not in mutant
    assert str(tmp_path) not in _python_env(TargetSource("installed", "installed", None, None))["PYTHONPATH"]


def test_a_known_signature_kills_only_on_a_case_before_the_unmutated_tree_first_showed_it():
    from fuzz.mutate.one import beyond

    baseline = {"shape | f | x": 40}
    assert beyond(baseline, "shape | f | x", 12)  # the unmutated tree passed case 12
    assert not beyond(baseline, "shape | f | x", 40) and not beyond(baseline, "shape | f | x", 90)  # no telling there
    assert beyond(baseline, "alias | g | y", 500)  # a signature the unmutated tree never showed


def test_the_timing_medians_are_over_killed_mutants_only():
    from fuzz.mutate.operators import Mutant
    from fuzz.mutate.report import timing
    from fuzz.mutate.session import MutantResult

    def result(status: str, start: float | None, first: float | None) -> MutantResult:
        mutant = Mutant("vllm/x.py", "f", "op", 3, 1, "a", "b", 0)
        return MutantResult(mutant, status, "", 10.0, 5, start, first)

    results = [result("killed", 4.0, 0.5), result("killed", 6.0, 2.5), result("killed", 5.0, 1.0),
               result("survived", 1.0, 30.0), result("killed", None, None)]
    assert timing(results) == {"killed_median_start_s": 5.0, "killed_median_first_finding_s": 1.0}
    assert timing([result("survived", 1.0, 30.0)]) == {"killed_median_start_s": None, "killed_median_first_finding_s": None}
