"""The per-release check of tests/test_export_releases.py on 0.29+ (a file of its own so that xdist runs it beside the
others)."""

from __future__ import annotations

import pytest

from tests.sweep import sampled
from tests.test_export_releases import CORPUS_RELEASES, SAMPLE, check_every_module_on, exported_corpus  # noqa: F401 - a fixture


@pytest.mark.slow
@pytest.mark.releases
@pytest.mark.parametrize("version", sampled(CORPUS_RELEASES[6:], SAMPLE))
def test_every_exported_module_fails_exactly_on_the_releases_its_finding_affects(version, exported_corpus):  # noqa: F811
    check_every_module_on(version, exported_corpus)
