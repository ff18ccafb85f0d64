"""The FUZZ task: one typed batch, its defaults written once, a plain dict on the wire."""

import json

import pytest

from fuzz.campaign.protocol import ProtocolError, Task


def test_a_task_survives_the_wire():
    task = Task(3, 7, 100, 16, True, "cpu", campaign="c", known=("b", "a"), consumers_every=None, scale="production",
                changed=[{"path": "vllm/x.py", "lines": [1, 2]}], policy={"kind=mla": 2.0})
    assert Task.from_dict(json.loads(json.dumps(task.to_dict()))) == task


def test_fields_left_out_take_the_defaults():
    task = Task.from_dict({"batch": 1, "seed": 0, "start": 0, "count": 8, "synthetic": True, "device": "cpu"})
    assert (task.campaign, task.known, task.probe_every, task.probe_kind, task.consumers_every) == (None, (), 0, "physical", 0)
    assert (task.scale, task.max_buffer_bytes, task.shrink_seconds, task.changed, task.policy) == ("small", 1 << 30, 60.0, None, None)


@pytest.mark.parametrize("data", [{"batch": 1, "seed": 0, "start": 0, "count": 8, "synthetic": True},
                                  {"batch": 1, "seed": 0, "start": 0, "count": 8, "synthetic": True, "device": "cpu", "nonsense": 1}])
def test_a_missing_or_unknown_field_is_a_protocol_error(data):
    with pytest.raises(ProtocolError, match="bad FUZZ task"):
        Task.from_dict(data)
