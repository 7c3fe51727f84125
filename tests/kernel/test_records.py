"""Records round-trip through JSON, and anything malformed is one InvalidRecord (never a bare ValueError)."""

from __future__ import annotations

import dataclasses
import enum
import json
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import pytest
import structlog

from unicron.kernel import link, protocol
from unicron.kernel import types as types_module
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.inject import Injection
from unicron.kernel.types import (
    MAX_UNKNOWN_WARNINGS,
    DetectionMethod,
    ErrorKind,
    NodeAssignment,
    NodeInfo,
    NodeStatus,
    RankSpec,
    RankStatus,
    Record,
    Report,
    StoreAddress,
    TaskAssignment,
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
    # (with every field set: one omitted while empty, phase_deadline, is not asdict's)
    ranks = [RankStatus(task="t", generation=2, rank=r, pid=100 + r, state="running", step=r, phase="checkpoint",
                        phase_deadline=10.0 + r) for r in range(3)]
    status = NodeStatus(node="n0", ts=1.5, generation=2, task="t", ranks=ranks,
                        gpu_health=[{"gpu": 0, "ecc": [1, 2]}])
    report = Report(method=DetectionMethod.EXCEPTION_PROPAGATION, kind=ErrorKind.ECC_ERROR, node="n0", rank=1)
    for rec in (status, report):
        assert rec.to_dict() == _asdict_dict(rec)
        assert type(rec).from_json(rec.to_json()) == rec
    assert status.to_dict()["ranks"][1] == dataclasses.asdict(ranks[1])
    assert status.to_dict()["gpu_health"][0]["ecc"] is not status.gpu_health[0]["ecc"]  # a copy, as before
    training = dataclasses.replace(ranks[0], phase="train", phase_deadline=None)
    assert training.to_dict() == {k: v for k, v in dataclasses.asdict(training).items() if k != "phase_deadline"}


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
    """Readers once refused unknown fields: ``previous_nodes`` written empty made every node record of a
    new coordinator unreadable to an agent or standby not yet upgraded (it launched nothing on its node).
    It is still left out while empty, for the readers of those versions."""
    first, moved = RankSpec(rank=0, local_rank=0, gpu=0), RankSpec(rank=1, local_rank=0, gpu=0, previous_nodes=["n2"])
    assert set(first.to_dict()) == {"rank", "local_rank", "gpu"}
    assert moved.to_dict()["previous_nodes"] == ["n2"]
    for spec in (first, moved):
        assert RankSpec.from_json(spec.to_json()) == spec


@pytest.fixture(autouse=True)
def _no_unknown_field_warned_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Warnings are remembered for the whole process, and other tests (the fuzz) may have used them up."""
    monkeypatch.setattr(types_module, "_warned_unknown", set())


def _newer_field() -> str:
    """A field name no other record of the test used."""
    return f"zz_{uuid.uuid4().hex[:8]}"


def _unknown_field_warnings(logs: Iterable[Mapping[str, Any]]) -> list[tuple[str, str]]:
    return [(e["record"], e["field"]) for e in logs if e["event"].startswith("ignoring unknown record field")]


def test_a_daemons_record_with_a_field_a_newer_version_added_is_read_without_it() -> None:
    """Rolling upgrade: a newer coordinator's assignment (a new field in the node's record, in a task's,
    in a rank's) was refused whole by an older agent, which then launched nothing on its node; a newer
    agent's status was dropped by an older coordinator. Unknown fields are now skipped, as protobuf does."""
    a = TaskAssignment(task="t", generation=1, argv=["x"], env={}, world_size=1, ranks=[RankSpec(0, 0, 0)],
                       store_node="n0")
    assignment = NodeAssignment(node="n0", revision=3, tasks=[a])
    raw = assignment.to_dict()
    top, in_task, in_rank = _newer_field(), _newer_field(), _newer_field()
    raw[top] = {"anything": [1, 2]}
    raw["tasks"][0][in_task] = 7
    raw["tasks"][0]["ranks"][0][in_rank] = None
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):  # a record read again (a status, every second) warns no more
            assert NodeAssignment.from_json(json.dumps(raw)) == assignment
    assert sorted(_unknown_field_warnings(logs)) == sorted(
        [("NodeAssignment", top), ("TaskAssignment", in_task), ("RankSpec", in_rank)])
    status = NodeStatus(node="n0", ts=1.0, generation=1, task="t", gpu_health=[],
                        ranks=[RankStatus(task="t", generation=1, rank=0, pid=4, state="running", step=5)])
    assert NodeStatus.from_dict({**status.to_dict(), _newer_field(): 1}) == status
    # the rank <-> agent and agent <-> coordinator messages too (a rank's runtime is the job's version)
    iter_end = protocol.IterEnd(step=1, duration_s=0.5)
    assert protocol.parse({**iter_end.to_wire(), _newer_field(): "x"}) == iter_end
    assert link.parse({"type": "goodbye", "reason": "r", _newer_field(): 1}) == link.Goodbye(reason="r")


def test_a_known_field_of_the_wrong_type_is_still_refused_beside_an_unknown_one() -> None:
    raw = {**RankSpec(0, 0, 0).to_dict(), _newer_field(): 1, "gpu": "zero"}
    with pytest.raises(InvalidRecord, match=r"RankSpec\.gpu: bad value"):
        RankSpec.from_dict(raw)


def test_an_operators_injection_request_refuses_an_unknown_field_in_one_line() -> None:
    with pytest.raises(InvalidRecord, match=r"^Injection: unknown field\(s\) \['iteratoins'\]$"):
        Injection.from_dict({"fault": "slow", "delay_s": 2.0, "iteratoins": 5})


def test_unknown_field_warnings_are_bounded_whatever_names_a_writer_sends() -> None:
    """A forged or corrupted record with a fresh name each time must not grow the log without bound."""
    with structlog.testing.capture_logs() as logs:
        for _ in range(MAX_UNKNOWN_WARNINGS + 10):
            RankSpec.from_dict({**RankSpec(0, 0, 0).to_dict(), _newer_field(): 1})
    warned = _unknown_field_warnings(logs)
    assert 0 < len(warned) <= MAX_UNKNOWN_WARNINGS
    assert "further_unknown_fields" in [e for e in logs if "record" in e][-1]
