"""The coordinator's gRPC API and the CLI commands on top of it, over real gRPC on loopback.

Under test: the servicer (validation before any change, errors -> status codes, JSON round trip)
and the CLI (address from --api or the etcd leader key, failover following, tables/JSON, clean
errors). The daemon is not: it sits behind the ControlPlane protocol, played here by a small
in-memory test double.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from coordinator.api import AlreadyExists, ControlPlane, NotFound, serve, stop
from coordinator.tasks import MAX_SPEC_BYTES, TaskSpec
from unicron.cli import inject as inject_cli
from unicron.cli import main as cli
from unicron.cli.tasks import error_from_status
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel import log as ulog
from unicron.kernel.errors import NotLeader, PermanentError, StoreUnavailable, TemporaryError
from unicron.kernel.etcd import Store
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.net import free_port
from unicron.kernel.proto import coordinator_pb2 as pb
from unicron.kernel.proto import coordinator_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "task.json"


class FakeControlPlane:
    """In-memory ControlPlane: keeps what it is told, and raises ``fail`` from every call if set."""

    def __init__(self, cluster_gpus: int = 8, gpus_per_node: int = 4) -> None:
        self.specs: dict[str, TaskSpec] = {}
        self.node_names = ["n1", "n2"]
        self.drained: set[str] = set()
        self.gpus, self.per_node = cluster_gpus, gpus_per_node
        self.incident_log = [{"incident_id": f"i{k}", "kind": "cuda_error", "node": "n1"} for k in range(5)]
        self.fail: Exception | None = None
        self._lock = threading.Lock()

    def _check(self) -> None:
        if self.fail is not None:
            raise self.fail

    def submit(self, spec: TaskSpec) -> bool:
        self._check()
        with self._lock:
            if self.specs.get(spec.name) == spec:
                return False  # as the daemon: a retry of what landed
            if spec.name in self.specs:
                raise AlreadyExists(f"task {spec.name!r} already exists; cancel it or pick another name")
            self.specs[spec.name] = spec
            return True

    def update(self, spec: TaskSpec) -> None:
        self._check()
        with self._lock:
            if spec.name not in self.specs:
                raise NotFound(f"no active task {spec.name!r} to update; submit it instead")
            self.specs[spec.name] = spec

    def cancel(self, name: str) -> None:
        self._check()
        with self._lock:
            if self.specs.pop(name, None) is None:
                raise NotFound(f"no task named {name!r}")

    def tasks(self) -> list[dict[str, Any]]:
        self._check()
        with self._lock:
            return [{"name": s.name, "phase": "pending", "weight": s.weight, "min_gpus": s.min_gpus,
                     "gpus": 0, "generation": 0, "nodes": [], "restarts": 0, "step": None,
                     "reason": "waiting for GPUs"} for s in self.specs.values()]

    def nodes(self) -> list[dict[str, Any]]:
        self._check()
        return [{"node": n, "gpus": self.per_node, "drained": n in self.drained} for n in self.node_names]

    def _known(self, node: str) -> None:
        if node not in self.node_names:
            raise NotFound(f"no node named {node!r}")

    def drain(self, node: str) -> None:
        self._check()
        self._known(node)
        self.drained.add(node)

    def undrain(self, node: str) -> None:
        self._check()
        self._known(node)
        self.drained.discard(node)

    def forget(self, node: str) -> None:
        self._check()
        self._known(node)
        if node not in self.drained:  # the daemon's refusal of a node in service, in one line
            raise PermanentError(f"node {node} is up; drain it and stop its agent first")
        self.node_names.remove(node)
        self.drained.discard(node)

    def incidents(self, limit: int) -> list[dict[str, Any]]:
        self._check()
        return self.incident_log[-limit:] if limit else list(self.incident_log)

    def cluster_gpus(self) -> int | None:
        return self.gpus

    def gpus_per_node(self) -> int | None:
        return self.per_node


@pytest.fixture(scope="module", autouse=True)
def _logs_to_stderr() -> None:
    # the servicer logs; keep it off stdout, where the CLI's JSON output is checked
    ulog.configure("INFO", stream=sys.__stderr__)


@pytest.fixture
def plane() -> FakeControlPlane:
    return FakeControlPlane()


@pytest.fixture
def api(plane: FakeControlPlane) -> Iterator[str]:
    control_plane: ControlPlane = plane  # the double must satisfy the protocol the daemon implements
    server, address = serve(control_plane, "127.0.0.1", 0)
    try:
        yield address
    finally:
        stop(server, 0.1)


@pytest.fixture
def stub(api: str) -> Iterator[Any]:
    with grpc.insecure_channel(api) as channel:
        yield pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]


@pytest.fixture
def spec() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(EXAMPLE.read_text())
    return data


@pytest.fixture
def unicron(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Any:
    """Run the real ``unicron`` entry point; returns (exit code, stdout, stderr)."""
    if "unicron.cli.tasks" not in cli.COMMAND_MODULES:  # until the lead registers the module
        monkeypatch.setattr(cli, "COMMAND_MODULES", (*cli.COMMAND_MODULES, "unicron.cli.tasks"))
    monkeypatch.delenv("UNICRON_API", raising=False)

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


# --- the servicer ----------------------------------------------------------------------------


def test_submit_round_trips_the_spec(stub: Any, plane: FakeControlPlane, spec: dict[str, Any]) -> None:
    reply = stub.Submit(pb.SubmitRequest(spec_json=json.dumps(spec)), timeout=5)
    accepted = json.loads(reply.task_json)
    assert accepted == plane.specs[spec["name"]].to_dict()
    assert accepted["model"] == spec["model"] and accepted["command"] == spec["command"]

    listed = [json.loads(t) for t in stub.ListTasks(pb.ListTasksRequest(), timeout=5).task_json]
    assert listed == plane.tasks()
    one = stub.ListTasks(pb.ListTasksRequest(name=spec["name"]), timeout=5).task_json
    assert [json.loads(t)["name"] for t in one] == [spec["name"]]


@pytest.mark.parametrize(("change", "field"), [
    ({"gpus": 4}, "unknown field"),
    ({"weight": 2.5}, "task.weight"),
    ({"min_gpus": 16}, "task.min_gpus"),  # the double's cluster has 8 GPUs
    ({"command": None}, "task.command"),
    ({"tp_size": 8, "min_gpus": 8}, "task.tp_size"),  # 8 does not divide 4 GPUs per node
])
def test_bad_spec_is_invalid_argument_naming_the_field(
    stub: Any, plane: FakeControlPlane, spec: dict[str, Any], change: dict[str, Any], field: str,
) -> None:
    bad = copy.deepcopy(spec)
    bad.update(change)
    if change.get("command", "") is None:
        del bad["command"]
    with pytest.raises(grpc.RpcError) as err:
        stub.Submit(pb.SubmitRequest(spec_json=json.dumps(bad)), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    assert plane.specs == {}


def test_not_json_is_invalid_argument(stub: Any, plane: FakeControlPlane) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Submit(pb.SubmitRequest(spec_json="{name: x"), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not valid JSON" in err.value.details()
    assert plane.specs == {}


def test_refusals_map_to_their_status_codes(stub: Any, spec: dict[str, Any]) -> None:
    stub.Submit(pb.SubmitRequest(spec_json=json.dumps(spec)), timeout=5)
    # the same name with another spec (the same spec again is a retry, answered as done)
    again = pb.SubmitRequest(spec_json=json.dumps({**spec, "weight": 2.0 if spec.get("weight") != 2.0 else 1.0}))
    retried = stub.Submit(pb.SubmitRequest(spec_json=json.dumps(spec)), timeout=5)
    assert retried.already_submitted
    calls: list[tuple[Callable[[], Any], Any]] = [
        (lambda: stub.Submit(again, timeout=5), grpc.StatusCode.ALREADY_EXISTS),
        (lambda: stub.Cancel(pb.CancelRequest(name="nope"), timeout=5), grpc.StatusCode.NOT_FOUND),
        (lambda: stub.Cancel(pb.CancelRequest(name=""), timeout=5), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.Drain(pb.NodeRequest(node="n9"), timeout=5), grpc.StatusCode.NOT_FOUND),
        (lambda: stub.Forget(pb.NodeRequest(node="n9"), timeout=5), grpc.StatusCode.NOT_FOUND),
        (lambda: stub.Forget(pb.NodeRequest(node=""), timeout=5), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.Forget(pb.NodeRequest(node="n1"), timeout=5), grpc.StatusCode.FAILED_PRECONDITION),
        (lambda: stub.ListTasks(pb.ListTasksRequest(name="nope"), timeout=5), grpc.StatusCode.NOT_FOUND),
    ]
    for rpc, code in calls:
        with pytest.raises(grpc.RpcError) as err:
            rpc()
        assert err.value.code() == code, err.value.details()


@pytest.mark.parametrize(("exc", "code"), [
    (NotLeader("deposed"), grpc.StatusCode.UNAVAILABLE),
    (StoreUnavailable("etcd down"), grpc.StatusCode.UNAVAILABLE),
    (PermanentError("cannot"), grpc.StatusCode.FAILED_PRECONDITION),
    (RuntimeError("bug"), grpc.StatusCode.INTERNAL),
])
def test_daemon_errors_map_to_status_and_server_keeps_serving(
    stub: Any, plane: FakeControlPlane, exc: Exception, code: grpc.StatusCode,
) -> None:
    plane.fail = exc
    with pytest.raises(grpc.RpcError) as err:
        stub.ListNodes(pb.ListNodesRequest(), timeout=5)
    assert err.value.code() == code
    assert str(exc) in err.value.details()
    plane.fail = None
    nodes = [json.loads(n) for n in stub.ListNodes(pb.ListNodesRequest(), timeout=5).node_json]
    assert [n["node"] for n in nodes] == plane.node_names


def test_drain_undrain_and_incident_limit(stub: Any, plane: FakeControlPlane) -> None:
    stub.Drain(pb.NodeRequest(node="n2"), timeout=5)
    assert plane.drained == {"n2"}
    stub.Undrain(pb.NodeRequest(node="n2"), timeout=5)
    assert plane.drained == set()
    newest = stub.ListIncidents(pb.ListIncidentsRequest(limit=2), timeout=5).incident_json
    got = [json.loads(i) for i in newest]
    assert got == plane.incident_log[-2:]
    everything = stub.ListIncidents(pb.ListIncidentsRequest(), timeout=5).incident_json
    assert len(everything) == len(plane.incident_log)


def test_cli_forget_removes_a_node_and_a_refusal_is_one_line(
    unicron: Any, api: str, plane: FakeControlPlane,
) -> None:
    code, out, err = unicron("forget", "n1", "--api", api)
    assert (code, out) == (1, "") and err == "unicron forget: node n1 is up; drain it and stop its agent first\n"
    assert unicron("drain", "n1", "--api", api)[0] == 0
    code, out, err = unicron("forget", "n1", "--api", api, "--json")
    assert code == 0 and json.loads(out) == {"node": "n1", "forgotten": True}, err
    assert plane.node_names == ["n2"]
    code, _, err = unicron("forget", "n1", "--api", api)
    assert code == 1 and "no node named 'n1'" in err and "\n" not in err.rstrip("\n")
    with pytest.raises(SystemExit) as usage:
        unicron("forget", "--api", api)
    assert usage.value.code == 2


def test_serve_refuses_a_taken_port(plane: FakeControlPlane, api: str) -> None:
    port = int(api.rsplit(":", 1)[1])
    with pytest.raises(PermanentError, match="cannot listen"):
        serve(plane, "127.0.0.1", port)


def test_committed_generated_code_matches_the_proto(tmp_path: Path) -> None:
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True,
                   capture_output=True, timeout=60)
    for name in ("coordinator_pb2.py", "coordinator_pb2.pyi", "coordinator_pb2_grpc.py"):
        committed = (ROOT / "unicron" / "kernel" / "proto" / name).read_text()
        assert (tmp_path / name).read_text() == committed, f"{name} is stale: run scripts/gen_proto.sh"


# --- the CLI ---------------------------------------------------------------------------------


def test_cli_submit_tasks_drain_update_cancel(
        unicron: Any, api: str, plane: FakeControlPlane, tmp_path: Path) -> None:
    code, out, err = unicron("submit", str(EXAMPLE), "--api", api)
    assert code == 0, err
    assert "submitted task gpt-1p3b" in out and "gpt-1p3b" in plane.specs

    code, out, _ = unicron("tasks", "--api", api, "--json")
    assert code == 0 and json.loads(out) == plane.tasks()
    code, out, _ = unicron("tasks", "--api", api)
    header, row = out.splitlines()
    assert header.split()[:3] == ["NAME", "PHASE", "WEIGHT"] and row.split()[:2] == ["gpt-1p3b", "pending"]

    assert unicron("drain", "n1", "--api", api)[0] == 0 and plane.drained == {"n1"}
    code, out, _ = unicron("undrain", "n1", "--api", api, "--json")
    assert code == 0 and json.loads(out) == {"node": "n1", "drained": False} and plane.drained == set()

    updated = tmp_path / "task.json"
    updated.write_text(json.dumps({**json.loads(EXAMPLE.read_text()), "weight": 2.0}))
    code, out, err = unicron("update", str(updated), "--api", api)
    assert code == 0 and out.strip() == "updated task gpt-1p3b", err
    assert plane.specs["gpt-1p3b"].weight == 2.0

    assert unicron("cancel", "gpt-1p3b", "--api", api)[0] == 0 and plane.specs == {}
    code, out, err = unicron("update", str(updated), "--api", api)
    assert code == 1 and "no active task 'gpt-1p3b' to update" in err and "Traceback" not in err
    code, out, err = unicron("cancel", "gpt-1p3b", "--api", api)
    assert code == 1 and "no task named 'gpt-1p3b'" in err and "Traceback" not in err


class UpdatePlane(FakeControlPlane):
    """Answers ListTasks as the daemon does after an update: ``outcomes`` is what each call shows as the
    update's outcome and phase, the last one for good (None: a coordinator without the field)."""

    def __init__(self, outcomes: list[tuple[str | None, str] | None]) -> None:
        super().__init__()
        self.outcomes = outcomes
        self.listed = 0

    def tasks(self) -> list[dict[str, Any]]:
        rows = super().tasks()
        shown = self.outcomes[min(self.listed, len(self.outcomes) - 1)]
        self.listed += 1
        for row in rows:
            row.update(generation=4, step=17, reason="relaunching it")
            if shown is not None:
                outcome, row["phase"] = shown
                row.update(update=outcome, update_reason="task x: update failed (command): rank 0 exited" if
                           outcome == "rolled_back" else "")
        return rows


@pytest.mark.parametrize(("outcomes", "code", "said"), [
    ([("pending", "reconfiguring"), ("pending", "running"), ("confirmed", "running")], 0,
     "its ranks completed step 17 under the new spec (generation 4)"),
    ([(None, "running")], 0, "it relaunched no rank, so there is no launch to wait for"),
    ([("pending", "running"), ("rolled_back", "reconfiguring")], 1,
     "update of task gpt-1p3b rolled back: task x: update failed (command): rank 0 exited"),
    ([("pending", "running"), ("pending", "failed")], 1, "task gpt-1p3b failed before the updated spec completed"),
    ([("pending", "running")], 1, "timed out after 1.5 s waiting for task gpt-1p3b's updated ranks"),
    ([None], 1, "the coordinator does not report an update's outcome"),
])
def test_cli_update_wait_exits_with_the_updates_outcome(
    unicron: Any, outcomes: list[tuple[str | None, str] | None], code: int, said: str,
) -> None:
    """Before, 'unicron update' answered as soon as the spec was accepted: a script could not tell an
    update that trained from one rolled back. ``--wait`` polls ListTasks until the outcome is known:
    exit 0 once confirmed (or nothing was relaunched), else 1 with the reason in one line."""
    plane = UpdatePlane(outcomes)
    plane.specs["gpt-1p3b"] = TaskSpec.from_dict(json.loads(EXAMPLE.read_text()))
    server, address = serve(plane, "127.0.0.1", 0)
    try:
        got, out, err = unicron("update", str(EXAMPLE), "--api", address, "--wait", "--timeout", "1.5")
    finally:
        stop(server, 0.1)
    assert got == code and "Traceback" not in err, err
    if code == 0:
        assert out.startswith("updated task gpt-1p3b; ") and said in out, out
    else:
        _one_line(got, err, "update")
        assert said in err, err


def test_cli_update_wait_bad_input_is_one_line(
    unicron: Any, api: str, plane: FakeControlPlane, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:  # argparse's refusal, before the API is dialled
        unicron("update", str(EXAMPLE), "--api", api, "--wait", "--timeout", "nan")
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.splitlines()[-1].endswith("--timeout: 'nan' is not a finite number")
    code, out, err = unicron("update", str(EXAMPLE), "--api", api, "--wait")  # no such task
    _one_line(code, err, "update")
    assert out == ""
    assert "no active task 'gpt-1p3b' to update" in err


def test_cli_bad_spec_exits_1_naming_the_field(
    unicron: Any, api: str, plane: FakeControlPlane, spec: dict[str, Any], tmp_path: Path,
) -> None:
    path = tmp_path / "task.json"
    path.write_text(json.dumps({**spec, "weight": 7}))
    code, out, err = unicron("submit", str(path), "--api", api)
    assert code == 1 and out == ""
    assert err.startswith("unicron submit: task.weight:") and "Traceback" not in err
    path.write_text('{"name": "x",\n "command": [}')
    code, _, err = unicron("submit", str(path), "--api", api)
    assert code == 1 and f"{path}: not valid JSON" in err and "line 2" in err
    assert plane.specs == {}


def test_cli_unreachable_api_is_a_clear_error(unicron: Any) -> None:
    code, _, err = unicron("tasks", "--api", f"127.0.0.1:{free_port()}", "--timeout", "2")
    assert code == 1 and "is unavailable" in err and "Traceback" not in err


def test_cli_finds_the_api_in_the_leader_key_and_follows_failover(
    unicron: Any, api: str, plane: FakeControlPlane, etcd_server: EtcdServer, store: Store, prefix: str,
) -> None:
    keys = Keyspace(prefix)
    flags = ("--etcd", etcd_server.endpoint, "--prefix", prefix)
    code, _, err = unicron("tasks", *flags, "--timeout", "0.5")
    assert code == 1 and "no coordinator leads" in err

    store.put(keys.leader(), json.dumps({"link": "127.0.0.1:1", "pid": 1}))
    code, _, err = unicron("tasks", *flags)
    assert code == 1 and "publishes no API address" in err

    store.put(keys.leader(), json.dumps({"link": "127.0.0.1:1", "pid": 1, "api": api}))
    code, out, err = unicron("drain", "n2", *flags, "--json")
    assert code == 0, err
    assert json.loads(out)["drained"] is True and plane.drained == {"n2"}

    # the published leader is dead; a new one takes over while the CLI retries
    store.put(keys.leader(), json.dumps({"link": "127.0.0.1:1", "pid": 1, "api": f"127.0.0.1:{free_port()}"}))
    timer = threading.Timer(0.8, lambda: store.put(keys.leader(), json.dumps({"pid": 2, "api": api})))
    timer.start()
    try:
        code, out, err = unicron("undrain", "n2", *flags, "--timeout", "10")
    finally:
        timer.join()
    assert code == 0, err
    assert plane.drained == set()


# --- issue 19: bad input is INVALID_ARGUMENT at once, errors are one line, permanent ones not retried --


class EtcdPlane(FakeControlPlane):
    """Stores each accepted spec in real etcd in one write, as the daemon does."""

    def __init__(self, store: Store, keys: Keyspace) -> None:
        super().__init__()
        self.store, self.keys = store, keys

    def submit(self, spec: TaskSpec) -> bool:
        self.store.put(self.keys.task(spec.name), json.dumps(spec.to_dict()))
        return super().submit(spec)


def _huge_spec(spec: dict[str, Any]) -> dict[str, Any]:
    # ~2 MB, as in the probe: above etcd's 1.5 MiB request limit
    return {**spec, "env": {f"V{i}": "x" * 1000 for i in range(2000)}}


def test_nul_in_the_command_is_invalid_argument(stub: Any, plane: FakeControlPlane) -> None:
    # the probe's spec: it was accepted and preempted a running task for ranks that could never start
    with pytest.raises(grpc.RpcError) as err:
        stub.Submit(pb.SubmitRequest(spec_json=json.dumps({"name": "b35", "command": ["python\u0000"]})), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("task.command[0]: contains a NUL byte")
    assert plane.specs == {}


def test_deep_nesting_is_invalid_argument_not_internal(stub: Any, plane: FakeControlPlane) -> None:
    for text in ("[" * 100_000, '{"name": ' * 20_000):
        with pytest.raises(grpc.RpcError) as err:
            stub.Submit(pb.SubmitRequest(spec_json=text), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "nested deeper than" in err.value.details()
    assert plane.specs == {}


def test_oversize_spec_is_refused_at_once_naming_the_limit(
    unicron: Any, etcd_server: EtcdServer, store: Store, prefix: str, spec: dict[str, Any], tmp_path: Path,
) -> None:
    keys = Keyspace(prefix)
    server, address = serve(EtcdPlane(store, keys), "127.0.0.1", 0)
    try:
        with grpc.insecure_channel(address) as channel:
            raw = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
            with pytest.raises(grpc.RpcError) as err:
                raw.Submit(pb.SubmitRequest(spec_json=json.dumps(_huge_spec(spec))), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"the limit is {MAX_SPEC_BYTES}" in err.value.details()

        # through the CLI and the leader key: before, etcd refused the write late (UNAVAILABLE), the CLI
        # retried it for its whole --timeout and printed a multi-line gRPC repr
        store.put(keys.leader(), json.dumps({"pid": 1, "api": address}))
        path = tmp_path / "huge.json"
        path.write_text(json.dumps(_huge_spec(spec)))
        t0 = time.monotonic()
        code, out, err_text = unicron("submit", str(path), "--etcd", etcd_server.endpoint, "--prefix", prefix,
                                      "--timeout", "10")
        assert code == 1 and out == ""
        assert time.monotonic() - t0 < 3.0
        assert err_text.count("\n") == 1 and f"the limit of {MAX_SPEC_BYTES} bytes" in err_text
        assert store.get(keys.task(spec["name"])) is None
    finally:
        stop(server, 0.1)


def test_multi_line_errors_reach_the_client_as_one_line(
    stub: Any, plane: FakeControlPlane, unicron: Any, api: str,
) -> None:
    plane.fail = StoreUnavailable("etcd put failed: <_InactiveRpcError of RPC that terminated with:\n"
                                  "\tstatus = StatusCode.INVALID_ARGUMENT\n\tdetails = \"too large\"\n>")
    with pytest.raises(grpc.RpcError) as err:
        stub.ListNodes(pb.ListNodesRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "\n" not in err.value.details() and "too large" in err.value.details()
    code, _, err_text = unicron("tasks", "--api", api, "--timeout", "1")
    assert code == 1 and err_text.count("\n") == 1 and "too large" in err_text


def test_cli_never_retries_a_permanent_error(
    unicron: Any, api: str, plane: FakeControlPlane, etcd_server: EtcdServer, store: Store, prefix: str,
) -> None:
    store.put(Keyspace(prefix).leader(), json.dumps({"pid": 1, "api": api}))
    plane.fail = PermanentError("cannot do that")
    t0 = time.monotonic()
    code, _, err = unicron("tasks", "--etcd", etcd_server.endpoint, "--prefix", prefix, "--timeout", "10")
    assert code == 1 and "cannot do that" in err and time.monotonic() - t0 < 3.0


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_only_unavailable_and_deadline_are_retried(code: grpc.StatusCode) -> None:
    error = error_from_status(code, "details\nmore", "127.0.0.1:1")
    temporary = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert isinstance(error, TemporaryError) is temporary
    assert isinstance(error, PermanentError) is not temporary
    assert "\n" not in str(error)


def test_cli_submit_of_a_file_that_is_not_a_spec_is_one_line(
    unicron: Any, api: str, plane: FakeControlPlane, tmp_path: Path,
) -> None:
    cases = {
        "latin1.json": ('{"name": "caf\xe9"}'.encode("latin-1"), "not UTF-8 text"),
        "deep.json": (b"[" * 100_000, "nested deeper than"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        code, out, err = unicron("submit", str(path), "--api", api)
        assert code == 1 and out == "", err
        assert err.startswith(f"unicron submit: {path}: ") and message in err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert plane.specs == {}


def test_cli_submit_from_a_closed_standard_input_is_one_line(
    unicron: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: ``unicron submit - <&-`` (cron, systemd) was an AttributeError traceback: Python sets
    sys.stdin to None when fd 0 is closed. Now: one line, before the API is dialled."""
    monkeypatch.setattr(sys, "stdin", None)
    code, out, err = unicron("submit", "-", "--api", f"127.0.0.1:{free_port()}")
    assert code == 1 and out == ""
    assert err == "unicron submit: standard input: closed, so there is no spec to read; give the spec as FILE\n"


@pytest.mark.parametrize(("argv", "flag"), [
    (("submit", "-", "--timeout", "nan"), "--timeout"),  # a NaN deadline used to retry forever
    (("submit", "-", "--timeout", "0"), "--timeout"),
    (("cancel", "t", "--timeout", "-1"), "--timeout"),
    (("nodes", "--timeout", "inf"), "--timeout"),
    (("incidents", "--limit", "-1"), "--limit"),
    (("inject", "slow", "--node", "n1", "--delay", "-1"), "--delay"),
    # finite, but the rank's time.sleep() overflowed on it (the rank died: a sev2 restart)
    (("inject", "slow", "--node", "n1", "--delay", "1e300"), "--delay"),
    (("inject", "slow", "--node", "n1", "--delay", "3601"), "--delay"),
    (("inject", "slow", "--node", "n1", "--iterations", "0"), "--iterations"),
    # a count the rank once expanded into a list of that length (a MemoryError ended its reader)
    (("inject", "slow", "--node", "n1", "--iterations", "100000000"), "--iterations"),
    (("inject", "kill-rank", "--node", "n1", "--rank", "x"), "--rank"),
    (("inject", "xid", "79", "--node", "n1", "--gpu", "-2"), "--gpu"),
])
def test_cli_bad_numbers_are_refused_naming_the_flag(
    unicron: Any, argv: tuple[str, ...], flag: str, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:  # argparse's refusal, before etcd or the API is dialled
        unicron(*argv, "--etcd", f"127.0.0.1:{free_port()}")
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    assert f"error: argument {flag}: '{argv[argv.index(flag) + 1]}' " in err.splitlines()[-1]
    if argv[-1] == "nan":
        assert err.endswith("argument --timeout: 'nan' is not a finite number\n")
    if argv[-1] in ("1e300", "3601"):
        assert err.endswith(f"argument --delay: '{argv[-1]}' must be <= 3600.0\n")


def test_cli_bad_etcd_endpoint_is_one_line(unicron: Any) -> None:
    code, out, err = unicron("tasks", "--etcd", "bad:port:x")
    assert code == 1 and out == ""
    assert err.startswith("unicron tasks: --etcd / UNICRON_ETCD: bad endpoint 'bad:port:x'") and err.count("\n") == 1


@pytest.mark.parametrize("argv", [("cancel", "t\udcff", "--api", "127.0.0.1:1"),
                                  ("drain", "n\udcff", "--api", "127.0.0.1:1"),
                                  ("undrain", "n\udcff", "--api", "127.0.0.1:1"),
                                  ("forget", "n\udcff", "--api", "127.0.0.1:1"),
                                  ("tasks", "t\udcff", "--api", "127.0.0.1:1"),
                                  ("inject", "kill-rank", "--node", "n\udcff", "--etcd", "127.0.0.1:1"),
                                  ("nodes", "--prefix", "/u\udcff", "--etcd", "127.0.0.1:1")],
                         ids=["cancel", "drain", "undrain", "forget", "tasks", "inject", "nodes-prefix"])
def test_cli_an_argument_that_is_not_utf8_is_one_line(unicron: Any, argv: tuple[str, ...]) -> None:
    """A byte the locale cannot decode (Python keeps it as a lone surrogate) failed with a traceback when
    the name was encoded into a request or an etcd key, or was blamed on a node's registration."""
    code, out, err = unicron(*argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and "is not UTF-8 text" in err and "\\xff" in err


def test_cli_a_file_path_that_is_not_utf8_is_still_read(unicron: Any, tmp_path: Path, spec: dict[str, Any]) -> None:
    """Only names, keys and addresses must be UTF-8: open() takes a path back as its bytes."""
    path = os.fsdecode(bytes(tmp_path) + b"/job\xe9.json")
    with open(path, "w") as fh:
        json.dump(spec, fh)
    code, _, err = unicron("submit", path, "--api", "127.0.0.1:1", "--timeout", "1")
    assert code == 1 and "the coordinator's API at 127.0.0.1:1 is unavailable" in err, err


def test_cli_a_malformed_api_address_is_an_error_not_a_coordinator_that_did_not_answer(unicron: Any) -> None:
    code, _, err = unicron("nodes", "--api", "not-an-address", "--etcd", "127.0.0.1:1")
    assert code == 1 and err.count("\n") == 1 and "--api / UNICRON_API: bad address" in err


@pytest.mark.parametrize("code", ["\u00b2", "9" * 5000, str(2**64)])
def test_cli_inject_xid_takes_only_ascii_digits_of_an_nvml_xid(unicron: Any, code: str) -> None:
    """5,000 digits were a traceback (int()'s digit limit); 2**64 is past NVML's unsigned 64-bit XID."""
    rc, _, err = unicron("inject", "xid", code, "--node", "n1", "--etcd", "127.0.0.1:1")
    assert rc == 1 and err.count("\n") == 1 and "xid needs a numeric XID code below 2**64" in err
    rc, _, err = unicron("inject", "xid", str(2**64 - 1), "--node", "n1", "--etcd", "127.0.0.1:1")
    assert "cannot reach etcd at 127.0.0.1:1" in err  # the largest XID passes the check


def test_cli_api_port_out_of_range_is_refused_not_wrapped_onto_another_port(
    unicron: Any, api: str, plane: FakeControlPlane, etcd_server: EtcdServer, store: Store, prefix: str,
) -> None:
    """Before: gRPC dialled a port over 65535 modulo 65536, so a typo'd --api (or leader key) reached
    whatever listened there, here the coordinator on port - 65536. Now: refused with one line."""
    host, port = api.rsplit(":", 1)
    wrapped = f"{host}:{int(port) + 65536}"
    code, out, err = unicron("submit", str(EXAMPLE), "--api", wrapped, "--timeout", "2")
    assert code == 1 and out == "" and plane.specs == {}
    assert err == (f"unicron submit: --api / UNICRON_API: bad address {wrapped!r}: expected host:port with a "
                   "port in 1-65535\n")
    keys = Keyspace(prefix)
    store.put(keys.leader(), json.dumps({"pid": 1, "api": wrapped}))
    code, out, err = unicron("submit", str(EXAMPLE), "--etcd", etcd_server.endpoint, "--prefix", prefix)
    assert code == 1 and out == "" and plane.specs == {}
    assert err == f"unicron submit: leader key {keys.leader()}: its API address {wrapped!r} is not host:port " \
                  "(port 1-65535)\n"


def test_cli_inject_on_an_unknown_node_is_refused_at_once(
    unicron: Any, etcd_server: EtcdServer, prefix: str,
) -> None:
    # before: the request went out and the CLI waited 5 s for an agent that does not exist
    code, _, err = unicron("inject", "kill-rank", "--node", "nope", "--etcd", etcd_server.endpoint, "--prefix", prefix)
    assert code == 1 and err == "unicron inject: node 'nope' is not registered (see 'unicron nodes')\n"


# --- issue 19 item 16: what `unicron nodes` and `unicron status` show -------------------------


class StatePlane(FakeControlPlane):
    """Answers ListNodes as the daemon does: each node's state and reason in the coordinator."""

    def __init__(self) -> None:
        super().__init__()
        self.node_names = ["n1", "n2", "n3"]
        self.states = {"n1": ("up", ""), "n2": ("isolated", "sev1 lost_connection on n2 (i7)"),
                       "n3": ("lost", "agent lease expired")}

    def nodes(self) -> list[dict[str, Any]]:
        return [{"node": n, "gpus": 2, "state": s, "reason": r} for n, (s, r) in self.states.items()]


def _register(store: Store, keys: Keyspace, node: str, **fields: Any) -> None:
    info = {"node": node, "host": "h", "gpus": 2, "gpu_backend": "simulated", "agent_pid": 4242,
            "started_ts": 1.0, "replica_addr": ""}
    store.put(keys.node(node), json.dumps({**info, **fields}))


def test_cli_nodes_shows_isolation_and_drain_from_the_coordinator(
    unicron: Any, etcd_server: EtcdServer, store: Store, prefix: str,
) -> None:
    keys = Keyspace(prefix)
    plane = StatePlane()
    plane.states["n1"] = ("drained", "drained by an operator")
    for node in ("n1", "n2"):  # n3's agent is gone: registered no more, but the coordinator knows it
        _register(store, keys, node)
    store.put(keys.drain("n1"), "1")
    server, address = serve(plane, "127.0.0.1", 0)
    flags = ("--etcd", etcd_server.endpoint, "--prefix", prefix)
    try:
        store.put(keys.leader(), json.dumps({"pid": 1, "api": address}))
        code, out, err = unicron("nodes", *flags, "--json")
        assert code == 0, err
        rows = {r["node"]: r for r in json.loads(out)}
        assert {n: (r["state"], r["reason"]) for n, r in rows.items()} == plane.states
        assert rows["n1"]["agent_pid"] == 4242 and rows["n3"]["agent_pid"] is None
        assert rows["n2"]["registered"] is True and rows["n3"]["registered"] is False
        code, out, _ = unicron("nodes", *flags)
        table = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:]}
        assert table == {"n1": "drained", "n2": "isolated", "n3": "lost"}
    finally:
        stop(server, 0.1)

    # no coordinator: etcd's view still answers, says what it cannot know, and shows drains
    code, out, err = unicron("nodes", *flags, "--json", "--timeout", "1")
    assert code == 0
    rows = {r["node"]: r for r in json.loads(out)}
    assert rows["n1"]["state"] == "drained" and rows["n2"]["state"] == "unknown" and "n3" not in rows
    assert "isolation" in err and err.count("\n") == 1


def test_cli_status_shows_each_ranks_own_generation(
    unicron: Any, etcd_server: EtcdServer, store: Store, prefix: str,
) -> None:
    keys = Keyspace(prefix)
    ranks = [{"task": "a", "generation": 3, "rank": 0, "pid": 11, "state": "running", "step": 9},
             {"task": "a", "generation": 5, "rank": 1, "pid": 12, "state": "running", "step": 9}]
    status = {"node": "n1", "ts": time.time(), "generation": 7, "task": "a", "ranks": ranks, "gpu_health": []}
    store.put(keys.status("n1"), json.dumps(status))
    code, out, err = unicron("status", "--etcd", etcd_server.endpoint, "--prefix", prefix, "--json")
    assert code == 0, err
    assert [(r["rank"], r["generation"]) for r in json.loads(out)] == [(0, 3), (1, 5)]


def test_cli_status_of_an_unknown_task_is_an_error_and_of_a_known_one_without_ranks_is_not(
    unicron: Any, etcd_server: EtcdServer, store: Store, prefix: str,
) -> None:
    """Before: a mistyped task name printed "(none)" and exited 0, as a task with no ranks does."""
    store.put(Keyspace(prefix).task("waiting"), json.dumps({"name": "waiting"}))
    code, _, err = unicron("status", "nosuch", "--etcd", etcd_server.endpoint, "--prefix", prefix)
    _one_line(code, err, "status")
    assert "no task named 'nosuch'" in err
    code, _, err = unicron("status", "waiting", "--etcd", etcd_server.endpoint, "--prefix", prefix)
    assert code == 0, err


@pytest.mark.parametrize("cmd", ["nodes", "status", "incidents"])
def test_cli_records_that_are_not_objects_do_not_crash_nodes_status_or_incidents(
    unicron: Any, etcd_server: EtcdServer, store: Store, prefix: str, cmd: str,
) -> None:
    """Before: a status record of valid JSON that is not an object ([] or 7), or a field of the wrong type,
    was a traceback (``.get`` on a list, ``len`` of a number, a string timestamp compared with a number).
    Now: such a record shows as no ranks, no health and no time; the rest of the table still answers."""
    keys = Keyspace(prefix)
    _register(store, keys, "n1")
    _register(store, keys, "n2")
    store.put(keys.status("n1"), "[]")
    store.put(keys.status("n2"), json.dumps({"node": "n2", "ranks": [7, {"task": "a", "rank": 0}], "gpu_health": 5}))
    store.put(keys.status("n3"), json.dumps({"node": "n3", "ranks": 7}))
    store.put(keys.incident("i1"), "[]")
    store.put(keys.incident("i2"), json.dumps({"kind": "hang", "detected_ts": "yesterday"}))
    store.put(keys.incident("i3"), json.dumps({"kind": "xid", "detected_ts": 5.0}))
    extra = ("--api", "127.0.0.1:1", "--timeout", "0.5") if cmd == "nodes" else ()
    code, out, err = unicron(cmd, "--etcd", etcd_server.endpoint, "--prefix", prefix, "--json", *extra)
    assert code == 0 and "Traceback" not in err, err
    rows = json.loads(out)
    if cmd == "nodes":
        assert {r["node"]: r["ranks"] for r in rows} == {"n1": 0, "n2": 1}
    elif cmd == "status":
        assert [(r["node"], r["task"]) for r in rows] == [("n2", "a")]
    else:
        assert [r.get("kind") for r in rows] == [None, "hang", "xid"]


@pytest.mark.parametrize("json_flag", [(), ("--json",)])
def test_cli_nodes_and_incidents_show_a_huge_timestamp_as_unknown(
    unicron: Any, etcd_server: EtcdServer, store: Store, prefix: str, json_flag: tuple[str, ...],
) -> None:
    """Before: a status or incident record with a huge integer timestamp (a damaged record, or any node
    writing its own status/<node>) was an OverflowError traceback in ``time.time() - ts`` (nodes) and in
    ``datetime.fromtimestamp`` or the latency (incidents). Now such a field shows as unknown and the
    rest of the record and of the table still answers."""
    keys = Keyspace(prefix)
    huge = "1" + "0" * 400
    for node in ("n1", "n2", "n3"):
        _register(store, keys, node)
    store.put(keys.status("n1"), '{"node": "n1", "ts": ' + huge + "}")
    store.put(keys.status("n2"), '{"node": "n2", "ts": NaN}')  # Python's json takes NaN and Infinity
    store.put(keys.status("n3"), json.dumps({"node": "n3", "ts": time.time() - 3}))
    store.put(keys.incident("i1"), '{"kind": "ecc_error", "detected_ts": 1' + "0" * 20 + ', "source_ts": 5.0}')
    store.put(keys.incident("i2"), '{"kind": "hang", "detected_ts": 7.5, "source_ts": ' + huge + "}")
    store.put(keys.incident("i3"), '{"kind": "xid", "detected_ts": 9.0, "source_ts": 8.5}')
    flags = ("--etcd", etcd_server.endpoint, "--prefix", prefix, *json_flag)
    code, out, err = unicron("nodes", *flags, "--api", "127.0.0.1:1", "--timeout", "0.5")
    assert code == 0 and "Traceback" not in err, err
    if json_flag:
        ages = {r["node"]: r["status_age_s"] for r in json.loads(out)}
        assert ages["n1"] is None and ages["n2"] is None and 2 <= ages["n3"] < 60
    else:
        assert [line.split()[0] for line in out.splitlines()[1:]] == ["n1", "n2", "n3"]
    code, out, err = unicron("incidents", *flags)
    assert code == 0 and "Traceback" not in err, err
    if json_flag:  # the records as stored, in order of a known detection time (unknown first)
        assert [r["kind"] for r in json.loads(out)] == ["ecc_error", "hang", "xid"]
    else:
        rows = [line.split() for line in out.splitlines()[1:]]
        assert [r[0] for r in rows] == ["info", "1970-01-01T00:00:07.500", "1970-01-01T00:00:09.000"]  # no time: blank
        assert "500.0" in rows[2] and not any("500.0" in r for r in rows[:2])


@pytest.mark.parametrize("kind", ["fenced", "degradation", "no_such_kind"])
def test_cli_inject_raise_takes_only_a_fault_kind(unicron: Any, kind: str) -> None:
    """``fenced`` and ``degradation`` are the agent's own findings: a rank raising one would be taken for them."""
    code, out, err = unicron("inject", "raise", kind, "--node", "n1", "--etcd", f"127.0.0.1:{free_port()}")
    assert code == 1 and out == ""
    assert err.startswith("unicron inject: raise needs an error kind, one of: lost_connection,") and err.count("\n") == 1
    assert "fenced" not in err and "degradation" not in err


def _one_line(code: int, err: str, cmd: str) -> None:
    assert code == 1 and "Traceback" not in err
    assert err.startswith(f"unicron {cmd}: ") and err.count("\n") == 1, err


class _FakeOs:
    """Stands in for ``os`` in unicron.cli.inject only (the test's own etcd must still be stoppable)."""

    def __init__(self, kill: Callable[[int, int], None]) -> None:
        self.kill = kill


@pytest.mark.parametrize("pid", [0, -1, 1, True])
def test_cli_inject_kill_node_signals_only_a_pid_that_can_be_one_agent(
    unicron: Any, etcd_server: EtcdServer, store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch, pid: Any,
) -> None:
    """Before: any int passed, so a record's agent_pid 0 SIGKILLed the operator's own process group, -1 every
    process it may signal, 1 init (True is 1). Now: refused with one line naming the node, nothing sent."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(inject_cli, "os", _FakeOs(lambda p, s: sent.append((p, s))))
    _register(store, Keyspace(prefix), "n1", agent_pid=pid)
    code, _, err = unicron("inject", "kill-node", "--node", "n1", "--etcd", etcd_server.endpoint, "--prefix", prefix)
    assert sent == []
    _one_line(code, err, "inject")
    assert "node 'n1' has no agent pid" in err


def test_cli_inject_on_an_agent_of_another_user_is_one_line(
    unicron: Any, etcd_server: EtcdServer, store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: the PermissionError of a non-root operator signalling a root agent (systemd) was a
    traceback. Now: one line saying it is not permitted."""

    def kill(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(inject_cli, "os", _FakeOs(kill))
    _register(store, Keyspace(prefix), "n1", **_this_process_as_agent())
    code, _, err = unicron("inject", "silence-node", "--node", "n1", "--etcd", etcd_server.endpoint, "--prefix", prefix)
    _one_line(code, err, "inject")
    assert f"agent pid {os.getpid()} of node n1: not permitted" in err


def _this_process_as_agent() -> dict[str, Any]:
    """Registration fields naming this test process, on this host, as a node's agent."""
    return {"agent_pid": os.getpid(), "hostname": socket.gethostname(), "started_ts": time.time()}


def test_cli_inject_kill_node_refuses_an_agent_of_another_host(
    unicron: Any, etcd_server: EtcdServer, store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: the pid of an agent on another host was signalled here, whatever local process had that
    number (etcd, the coordinator). Now: one line naming the agent's host, nothing sent."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(inject_cli, "os", _FakeOs(lambda p, s: sent.append((p, s))))
    _register(store, Keyspace(prefix), "n1", **{**_this_process_as_agent(), "hostname": "gpu-node-17"})
    code, _, err = unicron("inject", "kill-node", "--node", "n1", "--etcd", etcd_server.endpoint, "--prefix", prefix)
    assert sent == []
    _one_line(code, err, "inject")
    assert "node n1's agent runs on host gpu-node-17" in err


def test_cli_inject_kill_node_refuses_a_pid_reused_since_the_agent_registered(
    unicron: Any, etcd_server: EtcdServer, store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dead agent's pid may name a process started since: it is not signalled."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(inject_cli, "os", _FakeOs(lambda p, s: sent.append((p, s))))
    newer = subprocess.Popen(["sleep", "30"])
    try:
        _register(store, Keyspace(prefix), "n1", **{**_this_process_as_agent(), "agent_pid": newer.pid,
                                                     "started_ts": time.time() - 60.0})
        code, _, err = unicron("inject", "kill-node", "--node", "n1", "--etcd", etcd_server.endpoint, "--prefix", prefix)
        assert sent == []
        _one_line(code, err, "inject")
        assert f"pid {newer.pid} is no longer node n1's agent" in err
    finally:
        newer.kill()
        newer.wait()


@pytest.mark.parametrize("value", ["[]", "7", "not json"], ids=["list", "number", "garbage"])
def test_cli_inject_on_a_node_record_that_is_not_an_object_is_one_line(
    unicron: Any, etcd_server: EtcdServer, store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch, value: str,
) -> None:
    """Before: json.loads(...).get raised AttributeError or JSONDecodeError (a traceback). Now: one line."""
    monkeypatch.setattr(inject_cli, "os", _FakeOs(lambda p, s: None))
    store.put(Keyspace(prefix).node("n1"), value)
    code, _, err = unicron("inject", "kill-node", "--node", "n1", "--etcd", etcd_server.endpoint, "--prefix", prefix)
    _one_line(code, err, "inject")
    assert "node 'n1': its registration is not a JSON object" in err


def test_cli_incident_times_carry_their_date_unless_it_is_today() -> None:
    """The table printed only the time of day: on a run of weeks, yesterday's incident read as today's."""
    from unicron.cli.cluster import _when

    now = 1_795_977_681.0  # 2026-11-29 (UTC)
    assert _when(now - 60.0, now) == "18:40:21.000"
    assert _when(now - 86_400.0, now) == "2026-11-28T18:41:21.000"
