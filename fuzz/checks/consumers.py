"""The consumers (fuzz/targets/consumers.py: block zeroers, block copy, connector regions), each on its own: what it
is given is the V2 walk's views of the case and the blocks it zeroes, copies or maps."""

from __future__ import annotations

from collections.abc import Hashable

from fuzz.case import Case, Touches, replace


def name(consumer: str) -> str:
    """The check's name for one consumer, e.g. `consumer:zeroer`."""
    return f"consumer:{consumer}"


def asks_for(case: Case, consumer: str) -> bool:
    return case.touches is not None and consumer in case.touches.consumers


def key(case: Case, consumer: str) -> Hashable:
    touches = case.touches
    assert touches is not None
    mine = Touches(consumers=(consumer,), blocks=touches.blocks, copies=touches.copies, tokens=())
    return replace(case, touches=mine, device=None, runner="v2")


def without(case: Case, consumer: str) -> Case:
    touches = case.touches
    assert touches is not None
    left = tuple(name for name in touches.consumers if name != consumer)
    kept = replace(touches, consumers=left)
    if not left:
        kept = replace(kept, blocks=(), copies=())
    return replace(case, touches=kept if kept.size else None)
