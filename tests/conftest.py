from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile("ci")


@pytest.fixture(scope="session")
def target():
    pytest.importorskip("vllm")
    from fuzz.targets import load_target

    return load_target("installed")
