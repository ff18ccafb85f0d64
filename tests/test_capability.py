"""A backend whose declared shape reads the device capability is asked as on a GPU that would run the call
(fuzz/targets/capability.py): the artefact it replaces declared, on a CPU, a branch no platform takes for that cache."""

from __future__ import annotations

from typing import NamedTuple

from fuzz.targets import capability


class DeviceCapability(NamedTuple):
    major: int
    minor: int


class _Cpu:
    def get_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        return None


current_platform = _Cpu()


class RecordsOnNewGpus:
    """SM12x stores 3-byte records per element for "packed"; SM10x takes only plain caches; nothing older runs it."""

    supported_dtypes: list = []

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability.major in (10, 12)

    @classmethod
    def supports_combination(cls, head_size: int, dtype: object, kv_cache_dtype: str | None, block_size: int | None,
                             use_mla: bool, has_sink: bool, use_sparse: bool, use_mm_prefix: bool,
                             device_capability: DeviceCapability) -> str | None:
        if device_capability.major == 10:
            return None if kv_cache_dtype in ("auto", "fp8") else "plain caches only"
        return None if kv_cache_dtype in ("fp8", "packed") else "records only"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        capability = current_platform.get_device_capability()
        if capability is not None and capability.major == 12:
            return (num_blocks, block_size, 3 * head_size)
        return (num_blocks, block_size, head_size)


class Plain:
    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_size)


def _wrapped() -> type:
    backend = type("Backend", (RecordsOnNewGpus,), dict(vars(RecordsOnNewGpus)))
    assert capability.ask_on_supported_gpu(backend)
    return backend


def test_a_shape_is_asked_on_the_first_gpu_whose_backend_accepts_the_cache():
    backend = _wrapped()
    assert backend.get_kv_cache_shape(2, 16, 1, 8, cache_dtype_str="packed") == (2, 16, 24)  # only SM12x takes it
    assert backend.get_kv_cache_shape(2, 16, 1, 8, "auto") == (2, 16, 8)  # SM10x
    assert backend.get_kv_cache_shape(2, 16, 1, 8, "fp8") == (2, 16, 8)  # SM10x first
    assert current_platform.get_device_capability() is None, "the platform is restored after the call"


def test_a_cache_dtype_no_supported_gpu_accepts_is_refused_and_others_are_not():
    backend = _wrapped()
    assert capability.refused_everywhere(backend, ("auto", "fp8", "packed", "int4"), 8, 16) == {"int4"}


def test_a_backend_that_does_not_read_the_capability_is_left_as_it_is():
    backend = type("Backend", (Plain,), dict(vars(Plain)))
    assert not capability.reads_capability(backend)
    assert not capability.ask_on_supported_gpu(backend)
    assert backend.__dict__["get_kv_cache_shape"] is Plain.__dict__["get_kv_cache_shape"]
    assert capability.refused_everywhere(backend, ("nonsense",), 8, 16) == frozenset()


def test_a_wrapped_backend_still_reads_as_capability_dependent_and_is_wrapped_once():
    backend = _wrapped()
    assert capability.reads_capability(backend)
    first = backend.__dict__["get_kv_cache_shape"]
    assert capability.ask_on_supported_gpu(backend)
    assert backend.__dict__["get_kv_cache_shape"] is first, "a second description leaves the first wrapper in place"
    assert backend.get_kv_cache_shape(1, 4, 1, 2, "packed") == (1, 4, 6)
