"""Fuzzing engines beside the default one.

The default engine (`fuzz.campaign.engine.Campaign` over `fuzz.campaign.pool.Pool`) draws cases from a seeded
random source in forked workers. `fuzz.engines.atheris_engine` drives the same property (draw a
case from `fuzz.space`, run it through target and oracle, a Finding is a failure) through
atheris/libFuzzer, with the vLLM modules under test instrumented so coverage steers the draws.
"""

from __future__ import annotations

import importlib.util

ENGINES = ("default", "atheris")


def atheris_available() -> bool:
    """Whether atheris can be imported here (the `atheris` extra)."""
    return importlib.util.find_spec("atheris") is not None


__all__ = ["ENGINES", "atheris_available"]
