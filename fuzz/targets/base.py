"""What every target adapter returns: plain records, never vLLM or torch objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from fuzz.case import Case
from oracles.contract import Contract


@dataclass(frozen=True)
class BackendInfo:
    """A backend's declarations, as the target reports them. Generators draw from these."""

    name: str
    is_mla: bool
    kernel_block_sizes: tuple[int | str, ...]  # ints, or "xN" for any multiple of N
    layouts: tuple[str, ...] | None  # None: any layout
    model_dtypes: tuple[str, ...]
    cache_dtypes: tuple[str, ...]
    compresses: bool = False  # serves caches that store several tokens per state


@dataclass(frozen=True)
class TargetInfo:
    vllm_version: str
    generation: str
    contract: Contract
    spec_kinds: tuple[str, ...]
    backends: tuple[BackendInfo, ...]
    layouts: tuple[str, ...]

    def backend(self, name: str) -> BackendInfo | None:
        return next((b for b in self.backends if b.name == name), None)


@dataclass(frozen=True)
class ViewRecord:
    """Metadata of one layer's view: enough to compute every element's byte address."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]  # in elements
    offset_bytes: int  # from the start of the backing buffer
    dtype: str
    element_size: int
    same_buffer: bool
    identity: int = 0  # id() of the tensor object, to tell aliases from copies


@dataclass(frozen=True)
class Outcome:
    """What the real vLLM code did with a case."""

    views: dict[str, ViewRecord] = field(default_factory=dict)
    buffer_bytes: int = 0
    kernel_block_sizes: dict[int, int] = field(default_factory=dict)
    error_type: str | None = None
    error_message: str | None = None
    error_function: str | None = None

    @property
    def raised(self) -> bool:
        return self.error_type is not None


class Target(Protocol):
    info: TargetInfo

    def declare(self, case: Case) -> Case:
        """The case with the fields its backends publish (vLLM's customize_spec) filled in."""
        ...

    def run(self, case: Case, device: str) -> Outcome:
        """Build the real objects, call vLLM's functions, and record the views."""
        ...

    def unsupported(self, case: Case) -> str | None:
        """Why this target cannot express the case (a skip, never a finding), or None."""
        ...
