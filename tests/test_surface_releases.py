"""Every function of a release's KV-cache map is driven or explained (tests/test_surface.py's rule), per release; two files
so that xdist's `--dist loadfile` runs the releases side by side."""

from __future__ import annotations

import pytest

from tests.sweep import sampled
from tests.test_surface import assert_every_function_driven_or_explained


@pytest.mark.slow
@pytest.mark.releases
@pytest.mark.parametrize("version", sampled(["0.22.0", "0.23.0", "0.28.0"], ("0.34.0",)))
def test_release_every_function_driven_or_explained(version: str) -> None:
    assert_every_function_driven_or_explained(version)
