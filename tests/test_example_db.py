"""The pytest plugin keeps Hypothesis' example database in the project, so a later run (a CI job that
restored the folder) replays the saved failing example before generating new ones; the derandomized
ci profile runs without one, as Hypothesis requires."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.database import InMemoryExampleDatabase
from hypothesis.errors import InvalidArgument

REPO = Path(__file__).resolve().parents[1]
PROPERTY = """
from hypothesis import given, strategies as st

@given(st.integers())
def test_small(x):
    assert x < 1000
"""


def pytest_run(folder: Path, *options: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "test_property.py",
                           "--hypothesis-show-statistics", *options], cwd=folder, env=env, capture_output=True, text=True, check=False)


def reuse_phase(output: str) -> str:
    match = re.search(r"during reuse phase.*?\n(.*?)\n(.*?)\n", output, re.S)
    return match.group(2) if match else ""


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "test_property.py").write_text(PROPERTY)
    return tmp_path


def test_saved_failure_is_replayed_first_from_the_project_database(project):
    database = project / "ci-cache" / "examples"
    first = pytest_run(project, "--kvfuzz-profile", "dev", "--kvfuzz-example-db", str(database))
    assert first.returncode == 1 and "x=1000" in first.stdout, first.stdout[-2000:]
    assert any(database.rglob("*")), "the failing example was not saved"
    again = pytest_run(project, "--kvfuzz-profile", "dev", "--kvfuzz-example-db", str(database))
    assert again.returncode == 1 and "x=1000" in again.stdout
    assert "0 passing, 1 failing" in reuse_phase(again.stdout), again.stdout[-2000:]


def test_default_database_is_in_the_project_root(project):
    pytest_run(project, "--kvfuzz-profile", "nightly")
    assert any((project / ".hypothesis" / "examples").rglob("*"))


def test_ci_profile_is_derandomized_and_saves_nothing(project):
    database = project / "db"
    runs = [pytest_run(project, "--kvfuzz-profile", "ci", "--kvfuzz-example-db", str(database)) for _ in range(2)]
    assert all(run.returncode == 1 for run in runs) and not database.exists()
    assert "reuse phase" not in runs[0].stdout
    assert "@reproduce_failure" in runs[0].stdout  # print_blob: the log alone reproduces a failure
    with pytest.raises(InvalidArgument, match="derandomize=True implies database=None"):
        settings(derandomize=True, database=InMemoryExampleDatabase())
