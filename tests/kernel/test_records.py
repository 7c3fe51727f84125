"""Records round-trip through JSON, and anything malformed is one InvalidRecord (never a bare ValueError)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import pytest

from unicron.kernel.errors import InvalidRecord
from unicron.kernel.types import (
    DetectionMethod,
    ErrorKind,
    NodeInfo,
    NodeStatus,
    RankSpec,
    RankStatus,
    Record,
    Report,
    StoreAddress,
)


def test_a_record_round_trips_through_json() -> None:
    addr = StoreAddress(task="t", generation=3, node="n0", host="10.0.0.1", port=29500)
    assert StoreAddress.from_json(addr.to_json()) == addr
    assert StoreAddress.from_json(addr.to_json().encode()) == addr


@pytest.mark.parametrize("raw", [b"\xff\xfe", "{", "[" * 100_000, "[]", '{"task": 1}'])
def test_malformed_json_is_invalid_record(raw: str | bytes) -> None:
    with pytest.raises(InvalidRecord):
        NodeInfo.from_json(raw)


def _asdict_dict(rec: Record) -> dict[str, Any]:
    """What ``to_dict`` gave before it stopped calling ``dataclasses.asdict`` (issue 16: its copies cost)."""
    return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in dataclasses.asdict(rec).items()}  # type: ignore[call-overload]


def test_to_dict_is_what_asdict_gives_for_nested_records() -> None:
    ranks = [RankStatus(task="t", generation=2, rank=r, pid=100 + r, state="running", step=r) for r in range(3)]
    status = NodeStatus(node="n0", ts=1.5, generation=2, task="t", ranks=ranks,
                        gpu_health=[{"gpu": 0, "ecc": [1, 2]}])
    report = Report(method=DetectionMethod.EXCEPTION_PROPAGATION, kind=ErrorKind.ECC_ERROR, node="n0", rank=1)
    for rec in (status, report):
        assert rec.to_dict() == _asdict_dict(rec)
        assert type(rec).from_json(rec.to_json()) == rec
    assert status.to_dict()["ranks"][1] == dataclasses.asdict(ranks[1])
    assert status.to_dict()["gpu_health"][0]["ecc"] is not status.gpu_health[0]["ecc"]  # a copy, as before


def test_a_rank_set_is_ranges_and_round_trips() -> None:
    from unicron.kernel.types import MAX_RANK, RankSet, TaskAssignment

    members = RankSet.of([*range(0, 4000), *range(4008, 8000), 9000])
    assert members.ranges == [[0, 4000], [4008, 8000], [9000, 9001]]
    assert len(members) == 7993 and 4007 not in members and 4008 in members and list(RankSet()) == []
    a = TaskAssignment(task="t", generation=1, argv=["x"], env={}, world_size=9001, ranks=[], store_node="n",
                       members=members)
    assert len(a.to_json()) < 600  # 7,993 ids, each in every node's record, were ~40 kB
    assert TaskAssignment.from_json(a.to_json()) == a
    for bad in ([[3, 1]], [[0, 2], [1, 4]], [[-1, 2]], [[0, MAX_RANK + 1]], [[1]]):
        with pytest.raises(InvalidRecord, match=r"RankSet\.ranges"):
            RankSet.from_dict({"ranges": bad})


def test_a_first_placements_rank_record_is_what_an_agent_from_before_previous_nodes_reads() -> None:
    """Readers refuse unknown fields: ``previous_nodes`` written empty made every node record of a new
    coordinator unreadable to an agent or standby not yet upgraded (it launched nothing on its node)."""
    first, moved = RankSpec(rank=0, local_rank=0, gpu=0), RankSpec(rank=1, local_rank=0, gpu=0, previous_nodes=["n2"])
    assert set(first.to_dict()) == {"rank", "local_rank", "gpu"}
    assert moved.to_dict()["previous_nodes"] == ["n2"]
    for spec in (first, moved):
        assert RankSpec.from_json(spec.to_json()) == spec
