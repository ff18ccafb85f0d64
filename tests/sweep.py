"""The default suite runs a sample of each sweep (releases, longer scenarios); the rest is marked `sweep` and runs with
`scripts/test.sh --sweep`, which CI runs after README's test command."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest


def sampled(versions: Iterable[str], sample: Iterable[str]) -> list[Any]:
    """The versions as pytest parameters, those outside the sample marked `sweep`."""
    keep = set(sample)
    return [version if version in keep else pytest.param(version, marks=pytest.mark.sweep) for version in versions]
