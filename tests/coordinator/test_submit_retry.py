"""A Submit retried after a failover, on real coordinators, real etcd and the real ``unicron`` CLI.

The CLI retries a call answered UNAVAILABLE or DEADLINE_EXCEEDED on whoever leads next
(unicron.cli.tasks.ApiClient), and a leader that dies between its fenced write and its answer leaves
exactly that: the task is in etcd, the client never heard so. The retry used to be answered
ALREADY_EXISTS ("cancel it first"), and an operator who did so lost the task's progress. A retry of
the same spec is now a success that changes nothing; another spec under that name is still refused.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import grpc
import pytest

from coordinator.daemon import Coordinator
from coordinator.settings import CoordinatorSettings
from unicron.cli import main as cli
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.etcd import Store
from unicron.kernel.net import free_port
from unicron.kernel.proto import coordinator_pb2 as pb
from unicron.kernel.proto import coordinator_pb2_grpc as pb_grpc

SPEC = {"name": "job", "command": ["python", "-c", "pass"], "weight": 1.0}


def _start(etcd: EtcdServer, prefix: str) -> tuple[Coordinator, threading.Thread, str]:
    port = free_port()
    c = Coordinator(CoordinatorSettings(etcd=etcd.endpoint, prefix=prefix, api_port=port))
    thread = threading.Thread(target=c.run, name=f"coordinator-{port}", daemon=True)
    thread.start()
    return c, thread, f"127.0.0.1:{port}"


def _stop(c: Coordinator, thread: threading.Thread) -> None:
    c.stop()
    thread.join(15.0)
    assert not thread.is_alive()


def test_a_submit_retried_on_the_next_leader_is_answered_as_done(
    etcd_server: EtcdServer, store: Store, prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    first, first_thread, first_api = _start(etcd_server, prefix)
    second: Coordinator | None = None
    try:
        assert first.ready.wait(15.0), "the first coordinator did not lead"
        # the leader writes the task; its answer is what the failover loses
        with grpc.insecure_channel(first_api) as channel:
            stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
            stub.Submit(pb.SubmitRequest(spec_json=json.dumps(SPEC)), timeout=10)
        second, second_thread, _ = _start(etcd_server, prefix)
        _stop(first, first_thread)
        assert second.ready.wait(15.0), "the standby did not take over"
        keys = second.keys
        generation = second.state.tasks["job"].generation
        revisions = [kv.mod_revision for kv in (store.get(keys.task("job")), store.get(keys.state_task("job")))
                     if kv is not None]
        assert len(revisions) == 2

        # the client's retry, through the leader key as `unicron submit` does after a failover
        path = tmp_path / "job.json"
        path.write_text(json.dumps(SPEC))
        flags = ["--etcd", etcd_server.endpoint, "--prefix", prefix, "--timeout", "10"]
        code = cli.main(["submit", str(path), *flags])
        out, err = capsys.readouterr()
        assert (code, err) == (0, ""), err
        assert "already submitted, same spec" in out
        # nothing was decided again: not restarted, not a second generation, no write
        assert second.state.tasks["job"].generation == generation
        after = [kv.mod_revision for kv in (store.get(keys.task("job")), store.get(keys.state_task("job")))
                 if kv is not None]
        assert after == revisions

        # another spec under the active task's name is still refused
        path.write_text(json.dumps({**SPEC, "weight": 2.0}))
        code = cli.main(["submit", str(path), *flags])
        out, err = capsys.readouterr()
        assert code == 1 and out == ""
        assert "task 'job' is active" in err
        assert second.state.tasks["job"].spec.weight == 1.0
    finally:
        if first_thread.is_alive():
            _stop(first, first_thread)
        if second is not None:
            _stop(second, second_thread)
