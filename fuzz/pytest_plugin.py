"""The kvfuzz pytest plugin (entry point `kvfuzz`): fuzz and replay against any vLLM from pytest.

Options:
  --kvfuzz-vllm SPEC       the target: installed (default), a release such as 0.22.0, or a checkout
  --kvfuzz-device DEVICE   cpu (default) or cuda
  --kvfuzz-profile NAME    Hypothesis settings: ci (small, derandomized; default), dev, nightly
  --kvfuzz-corpus DIR      the corpus replayed by `kvfuzz_entry` tests (default: corpus/, else the built-in one)
  --kvfuzz-example-db DIR  Hypothesis' example database (default: .hypothesis/examples in the project root)

The example database lives in the project, so a CI job that keeps the folder between runs (a
cache) replays yesterday's failing examples before it generates new ones. The dev and nightly
profiles use it. The ci profile is derandomized, every run the same examples, and Hypothesis
runs a derandomized test without a database (it refuses both at once): its failures recur by
themselves, and the failures a nightly run saved are replayed by that nightly profile.

Fixtures: `kvfuzz_target` (a Target: in-process for the installed vLLM, a worker process
otherwise), `kvfuzz_device`, `kvfuzz_entry`, which parametrizes a test over every corpus
file with a readable id (spec kinds, backends, finding kind or "seed", file stem), and
`kvfuzz_known`, the signatures the corpus keeps as expected failures of the target's release.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

PROFILES = {
    "ci": {"max_examples": 60, "derandomize": True, "print_blob": True},
    "dev": {"max_examples": 300},
    "nightly": {"max_examples": 20_000, "print_blob": True},
}
EXAMPLE_DB = Path(".hypothesis") / "examples"  # Hypothesis' own default place, under the project root


def register_profiles(example_db: Path | None) -> None:
    """The profiles; those that are not derandomized keep their examples in `example_db`."""
    for name, values in PROFILES.items():
        database = None if values.get("derandomize") or example_db is None else DirectoryBasedExampleDatabase(example_db)
        settings.register_profile(name, deadline=None, suppress_health_check=list(HealthCheck), database=database, **values)


register_profiles(None)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvfuzz")
    group.addoption("--kvfuzz-vllm", default="installed", help="vLLM to test: installed, a release (0.22.0) or a checkout folder")
    group.addoption("--kvfuzz-device", default="cpu", help="cpu or cuda")
    group.addoption("--kvfuzz-profile", default="ci", choices=sorted(PROFILES), help="Hypothesis settings profile")
    group.addoption("--kvfuzz-corpus", default=None, help="corpus folder for kvfuzz_entry tests (default: corpus/, else the built-in one)")
    group.addoption("--kvfuzz-example-db", default=None, metavar="DIR",
                    help="Hypothesis' example database (default: .hypothesis/examples in the project root)")


def pytest_configure(config: pytest.Config) -> None:
    option = config.getoption("--kvfuzz-example-db")
    register_profiles(Path(option) if option else Path(config.rootpath) / EXAMPLE_DB)
    settings.load_profile(config.getoption("--kvfuzz-profile"))


def _corpus_root(config: pytest.Config) -> Path:
    option = config.getoption("--kvfuzz-corpus")
    if option:
        return Path(option)
    local = Path(config.rootpath) / "corpus"
    if local.is_dir():
        return local
    from fuzz.corpus.builtin import builtin_corpus

    return builtin_corpus()


def entry_id(entry: Any) -> str:
    kinds = "+".join(g.spec.kind for g in entry.case.groups)
    backends = "+".join(g.backend_name for g in entry.case.groups)
    return f"{kinds}-{backends}-{entry.meta.get('kind', 'seed')}-{entry.path.stem[:12]}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kvfuzz_entry" in metafunc.fixturenames:
        from fuzz.corpus.store import entries

        root = _corpus_root(metafunc.config)
        found = list(entries(root)) if root.exists() else []
        metafunc.parametrize("kvfuzz_entry", found, ids=[entry_id(e) for e in found])


@pytest.fixture(scope="session")
def kvfuzz_device(request: pytest.FixtureRequest) -> str:
    return str(request.config.getoption("--kvfuzz-device"))


@pytest.fixture(scope="session")
def kvfuzz_target(request: pytest.FixtureRequest) -> Iterator[Any]:
    spec = request.config.getoption("--kvfuzz-vllm")
    if spec == "installed":
        pytest.importorskip("vllm")
        from fuzz.targets.loader import load_local

        yield load_local()
        return
    from fuzz.campaign.pool import Pool, RemoteTarget
    from fuzz.targets import releases

    with Pool(releases.resolve(spec), workers=1) as pool:
        yield RemoteTarget(pool)


@pytest.fixture(scope="session")
def kvfuzz_known(request: pytest.FixtureRequest, kvfuzz_target: Any) -> frozenset[str]:
    from fuzz.corpus.store import entries, expected_signatures

    root = _corpus_root(request.config)
    return expected_signatures(entries(root), kvfuzz_target.info.vllm_version) if root.exists() else frozenset()
