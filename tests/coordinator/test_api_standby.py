"""What docs/api.md promises about a standby coordinator's API port, checked on real coordinators.

Two coordinators on one real etcd: the first leads, the second waits as a standby with its API port
bound. The docs say a standby serves the port and answers UNAVAILABLE (so the CLI re-reads the leader
key); this pins that down so code and docs cannot drift apart again (issue 19 item 16).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from coordinator.daemon import Coordinator
from coordinator.settings import CoordinatorSettings
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.net import free_port
from unicron.kernel.proto import coordinator_pb2 as pb
from unicron.kernel.proto import coordinator_pb2_grpc as pb_grpc


def _start(etcd: EtcdServer, prefix: str, api_port: int) -> tuple[Coordinator, threading.Thread]:
    coordinator = Coordinator(CoordinatorSettings(etcd=etcd.endpoint, prefix=prefix, api_port=api_port))
    thread = threading.Thread(target=coordinator.run, name=f"coordinator-{api_port}", daemon=True)
    thread.start()
    return coordinator, thread


@pytest.fixture
def standby_api(etcd_server: EtcdServer, prefix: str) -> Iterator[str]:
    leader, leader_thread = _start(etcd_server, prefix, free_port())
    assert leader.ready.wait(15.0), "the first coordinator did not lead"
    port = free_port()
    standby, standby_thread = _start(etcd_server, prefix, port)
    try:
        yield f"127.0.0.1:{port}"
        assert not standby.ready.is_set()
    finally:
        for c, t in ((standby, standby_thread), (leader, leader_thread)):
            c.stop()
            t.join(15.0)


def test_a_standby_serves_the_api_port_and_answers_unavailable(standby_api: str) -> None:
    spec = json.dumps({"name": "a", "command": ["python", "-c", "pass"]})
    with grpc.insecure_channel(standby_api) as channel:
        grpc.channel_ready_future(channel).result(timeout=10.0)  # served: the port answers
        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        calls: dict[str, Callable[[], Any]] = {
            "Submit": lambda: stub.Submit(pb.SubmitRequest(spec_json=spec), timeout=5),
            "ListTasks": lambda: stub.ListTasks(pb.ListTasksRequest(), timeout=5),
            "ListNodes": lambda: stub.ListNodes(pb.ListNodesRequest(), timeout=5),
            "Drain": lambda: stub.Drain(pb.NodeRequest(node="n1"), timeout=5),
        }
        for rpc, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, rpc
            assert "not the leader" in err.value.details(), rpc


def test_a_standby_does_not_answer_list_incidents_with_an_empty_list(standby_api: str) -> None:
    with grpc.insecure_channel(standby_api) as channel:
        grpc.channel_ready_future(channel).result(timeout=10.0)
        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as err:
            stub.ListIncidents(pb.ListIncidentsRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
