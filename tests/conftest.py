"""Shared fixtures. The kvfuzz pytest plugin (fuzz/pytest_plugin.py) supplies kvfuzz_target,
kvfuzz_device, kvfuzz_entry and the Hypothesis profiles (ci by default)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from fuzz.targets.releases import FetchError, gpu_driver_present

if "TRITON_INTERPRET" not in os.environ and not gpu_driver_present():
    # As in kvfuzz's workers (fuzz/targets/releases.py): the in-process target's Triton cache writes and zeroers then run
    # under Triton's interpreter, which reads this before its first import.
    os.environ["TRITON_INTERPRET"] = "1"

from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend
from fuzz.targets.base import BackendInfo, TargetInfo
from oracles.contract import LAYOUT_PLACED_KERNEL_MAP, SHAPED_022

ALL_KINDS = ("full", "sliding_window", "mla", "sliding_window_mla", "mamba", "cross", "sink", "chunked_local", "encoder_only")
EVERY_FIELD = ("compress_ratio", "alignment", "model_version", "head_size_v", "kv_quant_mode", "num_head_slots",
               "state_content_bytes", "block_stride_alignment", "page_size_padded", "sink_len")


STANDBY_DIR = pytest.StashKey[str]()


@contextlib.contextmanager
def release_target(version: str) -> Iterator[Any]:
    """A one-worker pool on a release (cached, or fetched), as a target; the test skips where the release cannot be had."""
    from fuzz.campaign.pool import Pool, RemoteTarget
    from fuzz.errors import TargetError
    from fuzz.targets.releases import resolve

    try:
        source = resolve(version)
    except TargetError as error:
        pytest.skip(f"release not available here: {error}")
    with Pool(source, workers=1) as pool:
        yield RemoteTarget(pool)


def pytest_configure(config: pytest.Config) -> None:
    """The session's targets are kept warm in a folder of its own (fuzz/campaign/standby.py): a test's campaign on a
    release another test started begins in a second. The controller makes the folder before xdist starts its workers
    (they inherit the environment) and stops the standbys when the session ends."""
    if hasattr(config, "workerinput") or os.environ.get("KVFUZZ_STANDBY_DIR"):
        return
    folder = tempfile.mkdtemp(prefix="kvfuzz-standby-tests-")
    os.environ["KVFUZZ_STANDBY_DIR"] = folder
    # Releases recur across test files: keep more of them warm than a user's default (each holds ~450 MB).
    os.environ.setdefault("KVFUZZ_KEEP_WARM_COUNT", "8")
    config.stash[STANDBY_DIR] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(STANDBY_DIR, None)
    if folder is not None:
        from fuzz.campaign import standby

        standby.stop_all()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # noqa: ANN201 - a hook wrapper
    """A release the package index cannot give (no network, a registry down) skips the tests that need it, with the
    line scripts/test.sh's fetch step printed, instead of failing them: the machine's fault, not the change's."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None and call.excinfo.errisinstance(FetchError):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {call.excinfo.value.line()}")


def synthetic_info(contract=LAYOUT_PLACED_KERNEL_MAP, layouts=("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")) -> TargetInfo:
    """A target description with one attention and one compressing MLA backend, for oracle and generator tests."""
    return TargetInfo(
        vllm_version="synthetic", generation="test", contract=contract, spec_kinds=ALL_KINDS,
        backends=(BackendInfo("A", False, ("x16",), None, ("bfloat16", "float16"), ("auto", "fp8")),
                  BackendInfo("M", True, (64,), None, ("bfloat16",), ("auto", "fp8_ds_mla"), compresses=True)),
        layouts=layouts, spec_fields={kind: EVERY_FIELD for kind in ALL_KINDS},
        cache_dtypes={"auto": None, "fp8": "uint8", "fp8_ds_mla": "uint8"}, quant_modes=("none", "fp8_per_tensor"),
    )


@pytest.fixture
def placed_info() -> TargetInfo:
    return synthetic_info()


@pytest.fixture
def shaped_info() -> TargetInfo:
    kinds = tuple(k for k in ALL_KINDS if k != "encoder_only")
    base = synthetic_info(SHAPED_022, ("NHD", "HND"))
    return TargetInfo(**{**base.__dict__, "spec_kinds": kinds})


def one_group(spec: SpecCase, layout: str = "LBNHC", blocks: int = 4, kernel: int | None = None, layers=("l0",),
              backend: SyntheticBackend | None = None) -> Case:
    group = GroupCase(spec=spec, layers=tuple(layers), synthetic_backend=backend or SyntheticBackend("any"),
                      kernel_block_size=kernel or spec.block_size)
    return Case(groups=(group,), num_blocks=blocks, layout=layout)
