"""The spare of a Ray campaign: a target on an actor of its own, for cases that may kill their worker.

Shrinking a crash finding runs candidates that may take down the process running them.
`RayPool.spare_target` starts one more actor for that (on a fuzzing node, sharing its GPU);
`RaySpareTarget` runs cases on it, and when the actor dies, waits for Ray to restart it and tries
the case again, up to MAX_ATTEMPTS times.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

from fuzz.case import Case, to_dict
from fuzz.checks.protocol import Check
from fuzz.checks.registry import offered_checks
from fuzz.cluster.members import MAX_ATTEMPTS, RECHECK_S, Member
from fuzz.errors import TargetError
from fuzz.targets.base import Execution, TargetInfo


class SpareOwner(Protocol):
    """What the spare needs of its pool (`fuzz.cluster.pool.RayPool`): the spare actor, the restart
    count it adds to, and how long a lost actor may take to come back."""

    spare: Member | None
    restarts: int
    lost_timeout: float


@dataclass(frozen=True)
class RaySpareTarget:
    """A Target whose vLLM lives in the pool's spare actor; a case that kills its worker is an outcome."""

    pool: SpareOwner = field(repr=False)
    info: TargetInfo
    max_buffer_bytes: int = 1 << 30

    def checks(self) -> tuple[Check, ...]:
        return offered_checks(self.info)

    def execute(self, case: Case, device: str, probe: bool | str = False, checks: Collection[str] | None = None) -> Execution:
        """Run the case on the spare actor, every deeper check it asks for with it (`checks` must be None); the pool counts
        its restarts (the actor's and its local worker's)."""
        assert checks is None, "a remote target runs every check a case asks for"
        import ray

        pool = self.pool
        for _ in range(MAX_ATTEMPTS):
            spare = pool.spare
            assert spare is not None
            try:
                result = ray.get(spare.handle.execute.remote(to_dict(case), device, probe))
            except ray.exceptions.RayActorError:
                pool.restarts += 1
                wait_back(spare, pool.lost_timeout)
                continue
            pool.restarts += result["restarts"] - spare.seen_restarts
            spare.seen_restarts = result["restarts"]
            return Execution.from_dict(result["execution"])
        raise TargetError(f"the Ray worker that shrinks crash findings died {MAX_ATTEMPTS} times in a row")


def wait_back(member: Member, lost_timeout: float) -> None:
    """Wait up to `lost_timeout` seconds for Ray to restart the spare actor and for it to answer again."""
    import ray

    deadline = time.monotonic() + lost_timeout
    while time.monotonic() < deadline:
        try:
            hello = ray.get(member.handle.hello.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.ActorUnavailableError:
            time.sleep(RECHECK_S)
            continue
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            break
        member.seen_restarts = hello.get("restarts", 0)
        return
    raise TargetError("the Ray worker that shrinks crash findings is gone and did not come back")
