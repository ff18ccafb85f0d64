"""One case's runner walk, as the deeper checks (fuzz/checks) get it.

The adapter's walk (planner, attention groups, kernel block sizes, raw buffers, views) is what a
model runner hands its zeroer, block copy, KV connectors and attention layers. Checks run on it
in the worker process, and code a model runner owns only when it is the walk of that runner:
`runners` names the model runners whose own initialisation builds exactly these views.

A check that needs no views (the other model runner) gets a walk of the case alone: no config,
groups, views or buffers, and `rerun` to walk the case again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fuzz.case import Case

if TYPE_CHECKING:
    from fuzz.targets.base import Outcome


def _no_rerun(runner: str) -> Outcome:
    raise NotImplementedError(f"this walk cannot be run again by the {runner} runner")


def _no_replan(memory: int) -> Any:
    raise NotImplementedError("this walk's groups cannot be planned again")


def _no_peer(case: Case) -> Walk:
    raise NotImplementedError("this walk has no target to walk a peer's case")


@dataclass
class Walk:
    case: Case  # as declared
    config: Any  # vLLM's KVCacheConfig
    attn_groups: list[list[Any]]  # AttentionGroup objects per KV-cache group
    kernel_block_sizes: list[int]
    manager_views: dict[str, Any]  # what the runner keeps and connectors get: addressed by manager block ids
    bound_views: dict[str, Any]  # what each layer is given to bind (kernel-block views from 0.32)
    raw: list[torch.Tensor]  # the raw buffers, in Outcome.buffers order
    runners: tuple[str, ...]  # "v1" (GPUModelRunner, CPUModelRunner), "v2" (gpu/), "cpu" (0.34's cpu/)
    vllm_config: Any
    # The case's groups planned again from a memory in bytes, the block-count override unset: vLLM's KVCacheConfig.
    replan: Callable[[int], Any] = field(default=_no_replan)
    # The case walked by another model runner ("v1"): its views' Outcome, an error in vLLM's code included.
    rerun: Callable[[str], Outcome] = field(default=_no_rerun)
    # Another case walked on the same target, its own buffers (the other end of a transfer); raises Inexpressible where the
    # target cannot run it.
    walk_of: Callable[[Case], Walk] = field(default=_no_peer)

    @property
    def device(self) -> torch.device:
        return self.raw[0].device

    @classmethod
    def of_case(cls, case: Case, vllm_config: Any, rerun: Callable[[str], Outcome]) -> Walk:
        """A walk of the case alone, for checks that need no views."""
        return cls(case=case, config=None, attn_groups=[], kernel_block_sizes=[], manager_views={}, bound_views={}, raw=[],
                   runners=(), vllm_config=vllm_config, rerun=rerun)
