"""One case's runner walk, kept for the code that addresses KV blocks by bytes beyond the views.

The adapter's walk (planner, attention groups, kernel block sizes, raw buffers, views) is what a
model runner hands its zeroer, block copy, KV connectors and attention layers. Consumers and the
kernel probe (fuzz/targets/consumers.py, kernel_probe.py) run on it in the worker process, and
only when it is the walk of the runner that owns them: `runners` names the model runners whose
own initialisation builds exactly these views.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fuzz.case import Case


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

    @property
    def device(self) -> torch.device:
        return self.raw[0].device
