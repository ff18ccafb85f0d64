"""What the driver of a Ray campaign keeps about its actors, their batches and their nodes.

Plain records that `fuzz.cluster.pool.RayPool` updates as actor calls finish: the batch (`Job`) a
campaign worker queued, the fuzzing actor (`Member`) that holds it, and per node (`NodeStats`)
the cases done and the restarts seen while the node took part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fuzz.campaign.pool import Loss

MAX_ATTEMPTS = 3  # actor deaths one batch (Job.attempts) may cause before it is taken for the culprit
RECHECK_S = 1.0  # how often a lost actor is asked whether Ray has restarted it (Member.checked)

@dataclass(frozen=True)
class Job:
    """One FUZZ task of a campaign worker; `attempts` counts the actors that died running it."""

    worker: int
    task: dict[str, Any]
    attempts: int = 0


@dataclass
class Member:
    """A fuzzing actor as the driver sees it."""

    number: int
    handle: Any
    node: str = ""
    address: str = ""
    alive: bool = False
    retired: bool = False  # dead for good, or serving a different vLLM
    call: Any = None  # ObjectRef of the call in flight
    calling: str = ""  # "fuzz" or "hello"
    job: Job | None = None  # the batch it holds (running, or waiting for an ack)
    seen_restarts: int = 0  # its local pool's restart count, as last reported
    checked: float = 0.0  # when it was last asked whether it is back


@dataclass
class NodeStats:
    """One node's part in the campaign."""

    address: str
    joined: float  # when its first actor answered (monotonic)
    left: float | None = None  # when its last live actor was lost
    cases: int = 0
    restarts: int = 0

    def rate(self, began: float | None, now: float) -> float:
        """Cases per second while the node took part in the campaign."""
        if began is None:
            return 0.0
        seconds = (self.left or now) - max(began, self.joined)
        return self.cases / seconds if seconds > 0 else 0.0


def cases_through(loss: Loss, task: dict[str, Any]) -> int:
    """Cases of `task` done when its worker was lost, the one that killed it included (as the campaign counts them)."""
    if loss.index is None or loss.batch != task["batch"]:
        return 0
    return loss.index - task["start"] + 1

