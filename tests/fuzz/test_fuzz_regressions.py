"""The bugs the fuzz found, one deterministic case each (so they stay fixed whatever Hypothesis draws)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time

import pytest

from agent.ranks import RankServer
from coordinator.allocation import WafAllocator
from coordinator.decision.state import CoreState
from coordinator.tasks import load_spec_json, parse_task_spec
from unicron.kernel import protocol, wire
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.inject import Injection
from unicron.kernel.types import NodeInfo, RankSpec, Report, TaskAssignment

MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "seq_length": 128, "vocab_size": 100,
         "global_batch_size": 64}


@pytest.mark.parametrize("line", [b"[" * 100_000, b"1" * 5000])
def test_a_deeply_nested_or_overlong_number_line_is_an_invalid_record(line: bytes) -> None:
    # RecursionError / ValueError ended the reading thread of the rank socket and of the link before
    with pytest.raises(InvalidRecord, match="not a JSON line"):
        wire.decode(line)
    with pytest.raises(InvalidRecord, match="NodeInfo"):
        NodeInfo.from_json(line)
    with pytest.raises(InvalidRecord, match="task"):
        load_spec_json(line.decode())


def test_list_and_dict_elements_are_type_checked() -> None:
    with pytest.raises(InvalidRecord, match=r"Regroup\.members"):
        protocol.parse({"type": "regroup", "epoch": 1, "members": ["a"], "failed": []})
    base = {"task": "t", "generation": 1, "argv": ["python"], "env": {}, "world_size": 1, "ranks": [],
            "store_node": "n"}
    with pytest.raises(InvalidRecord, match=r"TaskAssignment\.env"):
        TaskAssignment.from_dict({**base, "env": {"A": 2}})
    with pytest.raises(InvalidRecord, match=r"TaskAssignment\.argv"):
        TaskAssignment.from_dict({**base, "argv": [1]})
    assert TaskAssignment.from_dict(base).argv == ["python"]
    # a nested record's rejection says where it sits
    with pytest.raises(InvalidRecord, match=r"TaskAssignment\.ranks: RankSpec\.gpu: bad value"):
        TaskAssignment.from_dict({**base, "ranks": [{"rank": 0, "local_rank": 0, "gpu": "0"}]})
    # a field it does not know (a newer coordinator's) is skipped, at any depth: see test_fuzz_parsers
    ranks = TaskAssignment.from_dict({**base, "ranks": [{"rank": 0, "local_rank": 0, "gpu": 0, "x": 1}]}).ranks
    assert ranks == [RankSpec(rank=0, local_rank=0, gpu=0)]


@pytest.mark.parametrize("number", ["NaN", "Infinity", "1e999"])
def test_a_float_field_refuses_what_is_not_a_finite_number(number: str) -> None:
    with pytest.raises(InvalidRecord, match=r"IterEnd\.duration_s"):
        protocol.parse(wire.decode(f'{{"type":"iter_end","step":1,"duration_s":{number}}}'.encode()))


def test_a_bad_enum_value_names_its_field() -> None:
    with pytest.raises(InvalidRecord, match=r"Injection\.kind"):
        Injection.from_dict({"fault": "raise", "kind": "nope"})
    with pytest.raises(InvalidRecord, match=r"Injection\.fault"):  # not optional: None is no fault
        Injection.from_dict({"fault": None})
    with pytest.raises(InvalidRecord, match=r"Report\.method"):
        Report.from_dict({"method": True, "kind": "task_hang", "node": "n"})


@pytest.mark.parametrize("field,value", [("weight", 10**400), ("min_gpus", 10**400)])
def test_a_huge_number_in_a_spec_is_an_invalid_record(field: str, value: int) -> None:
    # OverflowError (float conversion) escaped as an INTERNAL API error before
    with pytest.raises(InvalidRecord, match=f"task.{field}"):
        parse_task_spec({"name": "a", "command": ["x"], "tp_size": 3, field: value}, None)


def _state(**task: object) -> dict[str, object]:
    entry = {"spec": {"name": "a", "command": ["x"]}, "phase": "running", "placement": {}, "outstanding": None}
    return {"now": 0, "counter": 0, "nodes": {}, "tasks": {"a": {**entry, **task}}}


@pytest.mark.parametrize("task,field", [
    ({"generation": "x"}, "tasks.a.generation"),
    ({"placement": {"n": ["r"]}}, "tasks.a.placement"),
    ({"outstanding": {"action_id": "x", "kind": "assign", "deadline": 10**400, "node": None}},
     "tasks.a.outstanding.deadline"),
    ({"phase": "nope"}, "tasks.a.phase"),
    ({"spec": None}, "tasks.a.spec"),
])
def test_the_decision_state_validates_every_field_and_says_where(task: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRecord, match=field.replace(".", r"\.")):
        CoreState.from_dict(json.loads(json.dumps(_state(**task))))
    assert CoreState.from_dict(_state()).tasks["a"].generation == 0


def test_a_task_name_with_a_newline_keeps_the_rejection_one_line() -> None:
    state = _state(generation="x")
    state["tasks"] = {"a\nb": state["tasks"]["a"]}  # type: ignore[index]
    with pytest.raises(InvalidRecord) as err:
        CoreState.from_dict(state)
    assert "\n" not in str(err.value) and "generation" in str(err.value)


@pytest.mark.parametrize("gpus", [-1, 10**12])
def test_a_node_record_refuses_a_gpu_count_no_node_has(gpus: int) -> None:
    # a registration with -N GPUs made the coordinator refuse every valid submit afterwards
    info = {"node": "n", "host": "h", "gpus": gpus, "gpu_backend": "simulated", "agent_pid": 1, "started_ts": 0.0}
    with pytest.raises(InvalidRecord, match=r"NodeInfo\.gpus"):
        NodeInfo.from_dict(info)
    assert NodeInfo.from_dict({**info, "gpus": 8}).gpus == 8


@pytest.mark.parametrize("addr", ["10.0.0.2:\u00b2", "10.0.0.2:7000,10.0.0.9:7000", "10.0.0.2:0", "10.0.0.2:65536",
                                  "10.0.0.2", "h :7000", "[fe80::1%a,b]:7000", "[fe80::1%a b]:7000", "-h:7000",
                                  "10.0.0.2:" + "1" * 5000])
def test_a_node_record_refuses_a_replica_address_peers_cannot_dial(addr: str) -> None:
    # other nodes' agents pass it to their ranks in UNICRON_CKPT_PEERS: "10.0.0.2:²" crashed each of
    # them at launch, a comma added peers
    info = {"node": "n", "host": "h", "gpus": 8, "gpu_backend": "simulated", "agent_pid": 1, "started_ts": 0.0}
    with pytest.raises(InvalidRecord, match=r"^NodeInfo\.replica_addr: .* is not host:port"):
        NodeInfo.from_dict({**info, "replica_addr": addr})
    for good in ("", "10.0.0.2:7000", "[::1]:7001", "[fe80::1%eth0]:7002", "node-1.example:65535"):
        assert NodeInfo.from_dict({**info, "replica_addr": good}).replica_addr == good


def test_the_planner_with_no_usable_node_plans_nothing() -> None:
    # a valid spec with a model was refused ("cluster.gpus_per_node: must be >= 1") by a coordinator
    # with no node yet, and a modelled task made every decision fail once the last node was lost
    spec = parse_task_spec({"name": "m", "command": ["x"], "model": MODEL}, None)
    assert WafAllocator().allocate([spec], 0, 0, {}, set()) == {"m": 0}


def test_a_second_hello_does_not_leave_the_first_name_registered() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "agent.sock")
        server = RankServer(path, lambda sender, msg: None).start()
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            conn = wire.LineSocket(sock)
            conn.send(protocol.Hello(rank=0, local_rank=0, pid=1, task="t").to_wire())
            conn.send(protocol.Hello(rank=1, local_rank=0, pid=1, task="t").to_wire())
            deadline = time.monotonic() + 5
            while server.connected() != [("t", 1)] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.connected() == [("t", 1)]
            conn.close()
            while server.connected() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.connected() == []
        finally:
            server.stop()
