"""StatusReader (issue 16 item 4): a status that moved only in time and steps is read without the full
record check, and reads exactly as the full read would; anything else takes the full read."""

from __future__ import annotations

import json

import pytest

from coordinator.statuses import StatusReader
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.types import NodeStatus, RankStatus


def _status(ts: float, steps: list[int | None], state: str = "running", generation: int = 3) -> NodeStatus:
    return NodeStatus(node="n1", ts=ts, generation=generation, task="t", gpu_health=[{"gpu": 0, "ok": True, "ts": ts}],
                      ranks=[RankStatus(task="t", generation=generation, rank=i, pid=100 + i, state=state, step=s)
                             for i, s in enumerate(steps)])


def test_steps_and_time_read_cheaply_and_equal_to_the_full_read() -> None:
    reader = StatusReader()
    history: list[tuple[float, list[int | None]]] = [(1.0, [None, None]), (2.0, [4, 5]), (3.0, [6, 6]), (4.0, [6, 7])]
    for ts, steps in history:
        raw = _status(ts, steps).to_json()
        assert reader.read("n1", raw) == NodeStatus.from_json(raw)
    assert reader.full_reads == 1


def test_any_other_change_is_read_in_full() -> None:
    reader = StatusReader()
    reader.read("n1", _status(1.0, [1, 1]).to_json())
    exited = _status(2.0, [2, 2], state="exited").to_json()
    assert reader.read("n1", exited) == NodeStatus.from_json(exited)
    moved = _status(3.0, [0, 0], generation=4).to_json()
    assert reader.read("n1", moved) == NodeStatus.from_json(moved)
    assert reader.full_reads == 3


@pytest.mark.parametrize("step", ["7", 1.5, True])
def test_a_bad_step_is_refused_as_the_full_read_refuses_it(step: object) -> None:
    reader = StatusReader()
    reader.read("n1", _status(1.0, [1, 1]).to_json())
    bad = json.loads(_status(2.0, [2, 2]).to_json())
    bad["ranks"][1]["step"] = step
    with pytest.raises(InvalidRecord):
        reader.read("n1", json.dumps(bad))
    with pytest.raises(InvalidRecord):
        reader.read("n1", b"{not json")
