"""``unicron submit|update|cancel|tasks|drain|undrain|forget``: the task set, drains and retired nodes, through the coordinator's API.

These commands go through the leading coordinator's gRPC API (docs/api.md), because the coordinator
validates specs against the cluster and acts on the change. Its address is the ``api`` field of the
leader key in etcd, or ``--api host:port`` / ``UNICRON_API`` to skip etcd. When the address came from
etcd, a coordinator that is unreachable or no longer leads (a failover) is retried against the new
leader until ``--timeout``. ``nodes``, ``status`` and ``incidents`` (unicron.cli.cluster) read etcd
directly instead, so they work while no coordinator runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc

from coordinator.tasks import MAX_SPEC_BYTES, load_spec_json
from unicron.cli.common import add_cluster_flags, at_least, emit, one_line, open_store, tls_config
from unicron.kernel import jsontext, tls
from unicron.kernel.address import host_port
from unicron.kernel.config import finite_float
from unicron.kernel.errors import ConfigError, InvalidRecord, PermanentError, TemporaryError, UnicronError
from unicron.kernel.etcd import Store
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.proto import coordinator_pb2 as pb
from unicron.kernel.proto import coordinator_pb2_grpc as pb_grpc

TASK_COLUMNS = (
    "name", "phase", "weight", "min_gpus", "gpus", "nodes", "generation", "restarts", "step", "incidents",
    "recovery_s", "transition_s", "achieved_flops", "reason",
)
_RETRY_PAUSE_S = 0.3
#: ``--timeout`` of the API commands, and of ``update --wait`` (a relaunch's ranks start, restore and step)
API_TIMEOUT_S = 10.0
UPDATE_WAIT_S = 300.0
#: how often ``update --wait`` asks for the task's state
_WAIT_POLL_S = 0.5


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("submit", help="add a task to the task set (JSON spec; see docs/api.md)")
    add_api_flags(p)
    p.add_argument("file", metavar="FILE", help="the task spec, a JSON object; '-' reads standard input")
    p.set_defaults(func=cmd_submit)
    p = sub.add_parser("update", help="replace an active task's spec: a new command, env, TP size or micro-batch "
                       "size relaunches its ranks from an on-demand snapshot (resharded to a new TP); a new "
                       "weight or GPU bounds re-plans")
    add_api_flags(p, timeout_help=f"give up after this long, following failovers meanwhile (default "
                  f"{API_TIMEOUT_S:g}; with --wait {UPDATE_WAIT_S:g}, the wait included)")
    p.add_argument("file", metavar="FILE", help="the task's new spec, a JSON object; '-' reads standard input")
    p.add_argument("--wait", action="store_true",
                   help="wait for the outcome: exit 0 once the new spec's ranks completed a step; 1 with the "
                        "reason if the update was rolled back (the new command failed before its first step), "
                        "the task failed or ended, or --timeout passed")
    p.set_defaults(func=cmd_update, timeout=None)  # None: per --wait, resolved by cmd_update
    p = sub.add_parser("cancel", help="remove a task from the task set, stopping its ranks")
    add_api_flags(p)
    p.add_argument("name", metavar="NAME", help="the task")
    p.set_defaults(func=cmd_cancel)
    p = sub.add_parser("tasks", help="list the task set with each task's state")
    add_api_flags(p)
    p.add_argument("name", metavar="NAME", nargs="?", help="only this task")
    p.set_defaults(func=cmd_tasks)
    p = sub.add_parser("drain", help="stop scheduling on a node and move its tasks off it")
    add_api_flags(p)
    p.add_argument("node", metavar="NODE")
    p.set_defaults(func=cmd_drain)
    p = sub.add_parser("undrain", help="schedule on a drained node again")
    add_api_flags(p)
    p.add_argument("node", metavar="NODE")
    p.set_defaults(func=cmd_undrain)
    p = sub.add_parser("forget", help="remove a node retired for good (hardware swapped, renamed): lost, isolated "
                       "or drained, its agent stopped, no task on it; a node of that name that registers later is new")
    add_api_flags(p)
    p.add_argument("node", metavar="NODE")
    p.set_defaults(func=cmd_forget)


def add_api_flags(p: argparse.ArgumentParser, timeout_help: str = "") -> None:
    add_cluster_flags(p)
    p.add_argument("--api", default=os.environ.get("UNICRON_API") or None, metavar="HOST:PORT",
                   help="coordinator API address (env: UNICRON_API; default: from the leader key in etcd)")
    p.add_argument("--timeout", type=at_least(finite_float, 0.0, above=True), default=API_TIMEOUT_S,
                   metavar="SECONDS",
                   help=timeout_help or f"give up after this long, following failovers meanwhile (default "
                                        f"{API_TIMEOUT_S:g})")


# --- the client ------------------------------------------------------------------------------


class ApiClient:
    """Calls one RPC of the leading coordinator. ``resolve`` returns the address to dial; with
    ``follow`` it is asked again after an UNAVAILABLE answer, so a call survives a failover."""

    def __init__(self, resolve: Callable[[], str], timeout_s: float, follow: bool,
                 tls_config: tls.TLSConfig | None = None) -> None:
        self.resolve = resolve
        self.timeout_s = timeout_s
        self.follow = follow
        self.tls_config = tls_config

    def _channel(self, address: str) -> grpc.Channel:
        if self.tls_config is None:
            return grpc.insecure_channel(address)
        return grpc.secure_channel(address, self.tls_config.grpc_channel_credentials())

    def call(self, rpc: str, request: Any) -> Any:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self._call_once(rpc, request, deadline)
            except TemporaryError:
                # a coordinator that did not answer may still have acted (it died after its write): the
                # next leader answers a retried submit of what landed as done (daemon.Coordinator._submit)
                if not self.follow or time.monotonic() + _RETRY_PAUSE_S >= deadline:
                    raise
            time.sleep(_RETRY_PAUSE_S)

    def _call_once(self, rpc: str, request: Any, deadline: float) -> Any:
        address = self.resolve()
        with self._channel(address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]  # generated, unannotated
            method = getattr(stub, rpc)
            try:
                return method(request, timeout=max(0.05, deadline - time.monotonic()))
            except grpc.RpcError as exc:
                raise error_from_status(exc.code(), exc.details() or "", address) from None


def error_from_status(code: grpc.StatusCode, details: str, address: str) -> UnicronError:
    """The project's exception for a gRPC status (the inverse of coordinator.api.status_for).

    Only UNAVAILABLE and DEADLINE_EXCEEDED are temporary (the coordinator did not act, or did not
    answer in time; another leader may): every other status is the coordinator's or gRPC's final
    word on this request, and repeating it would get the same answer.
    """
    details = one_line(details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRecord(details)
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION):
        return PermanentError(details)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PermanentError(f"the coordinator at {address} refused this certificate: {details}")
    if code == grpc.StatusCode.UNAVAILABLE:
        return TemporaryError(
            f"the coordinator's API at {address} is unavailable ({details}); check that unicron-coordinator "
            "runs, or pass --api / UNICRON_API"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TemporaryError(
            f"no answer from the coordinator's API at {address} in time; retry or raise --timeout"
        )
    return PermanentError(f"the coordinator's API at {address} failed ({code.name}): {details}")


def leader_api(store: Store, keys: Keyspace) -> str:
    """The API address the leading coordinator published in the leader key."""
    kv = store.get(keys.leader())
    if kv is None:
        raise TemporaryError(
            f"no coordinator leads the cluster under prefix {keys.prefix!r} (no leader key); start "
            "unicron-coordinator, check --prefix, or pass --api"
        )
    try:
        value = json.loads(kv.value)
    except ValueError as exc:
        raise InvalidRecord(f"leader key {keys.leader()}: not JSON ({exc})") from exc
    api = value.get("api") if isinstance(value, dict) else None
    if not isinstance(api, str) or not api:
        raise PermanentError(
            f"leader key {keys.leader()}: the leading coordinator publishes no API address ('api' field); "
            "it is too old or was started without its API"
        )
    if host_port(api) is None:
        raise InvalidRecord(f"leader key {keys.leader()}: its API address {api!r} is not host:port (port 1-65535)")
    return api


def api_flag(args: argparse.Namespace) -> str | None:
    """``--api`` / UNICRON_API (None: not given), refused unless host:port with a port in 1-65535."""
    if args.api and host_port(str(args.api)) is None:
        raise ConfigError(f"--api / UNICRON_API: bad address {args.api!r}: expected host:port with a port in "
                          "1-65535")
    return str(args.api) if args.api else None


def call(args: argparse.Namespace, rpc: str, request: Any) -> Any:
    """Call ``rpc`` on the coordinator chosen by ``--api`` or the leader key."""
    api = api_flag(args)
    if api is not None:
        return ApiClient(lambda: api, args.timeout, follow=False, tls_config=tls_config(args)).call(rpc, request)
    store, keys = open_store(args)
    try:
        return ApiClient(lambda: leader_api(store, keys), args.timeout, follow=True,
                         tls_config=tls_config(args)).call(rpc, request)
    finally:
        store.close()


# --- the commands ----------------------------------------------------------------------------


def read_spec(path: str) -> str:
    """The spec file's text, checked to be a JSON spec's size, depth and syntax, so that a problem
    names the file (and line) before anything is sent."""
    where = "standard input" if path == "-" else path
    if path == "-" and sys.stdin is None:  # started with fd 0 closed (cron, systemd, '<&-')
        raise PermanentError("standard input: closed, so there is no spec to read; give the spec as FILE")
    try:
        # one byte over the limit is enough to say it is too big; a huge file is not read whole
        with (open(sys.stdin.fileno(), "rb", closefd=False) if path == "-" else open(path, "rb")) as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise PermanentError(f"{where}: cannot read the task spec ({exc.strerror})") from exc
    if len(raw) > MAX_SPEC_BYTES:
        raise InvalidRecord(f"{where}: the spec is over the limit of {MAX_SPEC_BYTES} bytes (MAX_SPEC_BYTES); "
                            "pass large inputs to the command in a file instead")
    text = jsontext.decode(raw, where)
    load_spec_json(text, where)
    return text


def _done(args: argparse.Namespace, message: str, record: dict[str, Any]) -> int:
    if args.json:
        json.dump(record, sys.stdout, indent=2)
        print()
    else:
        print(message)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    reply = call(args, "Submit", pb.SubmitRequest(spec_json=read_spec(args.file)))
    spec = json.loads(reply.task_json)
    done = (f"task {spec['name']} already submitted, same spec" if reply.already_submitted
            else f"submitted task {spec['name']}")
    summary = (f"{done} (weight {spec['weight']}, min_gpus {spec['min_gpus']}, "
               f"tp {spec['tp_size']} x pp {spec['pp_size']})")
    return _done(args, summary, spec)


def cmd_update(args: argparse.Namespace) -> int:
    if args.timeout is None:
        args.timeout = UPDATE_WAIT_S if args.wait else API_TIMEOUT_S
    deadline = time.monotonic() + args.timeout  # --wait: the update's call and the wait share it
    reply = call(args, "Submit", pb.SubmitRequest(spec_json=read_spec(args.file), update=True))
    spec = json.loads(reply.task_json)
    name = str(spec["name"])
    if not args.wait:
        return _done(args, f"updated task {name}", spec)
    row = _wait_for_update(args, name, deadline)
    outcome = row.get("update")
    if outcome is None:
        message = f"updated task {name}; it relaunched no rank, so there is no launch to wait for"
    else:
        message = (f"updated task {name}; its ranks completed step {row.get('step')} under the new spec "
                   f"(generation {row.get('generation')})")
    return _done(args, message, {"task": spec, "update": outcome, "generation": row.get("generation"),
                                 "step": row.get("step")})


def _wait_for_update(args: argparse.Namespace, name: str, deadline: float) -> dict[str, Any]:
    """Task ``name``'s ListTasks row once the update just made has succeeded (confirmed, or nothing
    to wait for); raises with the reason when it was rolled back, the task left the task set, or
    ``deadline`` passed. A coordinator that is unavailable meanwhile (a failover) is asked again."""
    last = "no answer from the coordinator yet"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TemporaryError(f"timed out after {args.timeout:g} s waiting for task {name}'s updated ranks to "
                                 f"complete a step ({last}); see 'unicron tasks {name}'")
        try:
            row = _task_row(args, name, remaining)
        except TemporaryError as exc:
            last = str(exc)
            row = None
        if row is not None:
            if "update" not in row:
                raise PermanentError("the coordinator does not report an update's outcome (ListTasks has no "
                                     "'update' field): it is older than this CLI; drop --wait")
            outcome, phase = row["update"], row.get("phase")
            if outcome == "rolled_back":
                raise PermanentError(f"update of task {name} rolled back: {row.get('update_reason') or 'no reason'}")
            if outcome in (None, "confirmed"):
                return row
            if phase in ("failed", "cancelled", "finished"):
                raise PermanentError(f"task {name} {phase} before the updated spec completed a step: "
                                     f"{row.get('reason') or 'no reason given'}")
            last = f"{phase}: {row.get('reason')}" if row.get("reason") else f"{phase}"
        time.sleep(max(0.0, min(_WAIT_POLL_S, deadline - time.monotonic())))


def _task_row(args: argparse.Namespace, name: str, timeout_s: float) -> dict[str, Any]:
    """Task ``name``'s ListTasks row, asked within ``timeout_s``; a task gone from the task set (an
    ended one retired) is an error."""
    polling = argparse.Namespace(**{**vars(args), "timeout": timeout_s})
    reply = call(polling, "ListTasks", pb.ListTasksRequest(name=name))
    rows = [json.loads(t) for t in reply.task_json]
    row = next((r for r in rows if isinstance(r, dict) and r.get("name") == name), None)
    if row is None:
        raise PermanentError(f"task {name} is no longer in the task set; see 'unicron tasks'")
    return dict(row)


def cmd_cancel(args: argparse.Namespace) -> int:
    call(args, "Cancel", pb.CancelRequest(name=args.name))
    return _done(args, f"cancelled task {args.name}", {"task": args.name, "cancelled": True})


def cmd_drain(args: argparse.Namespace) -> int:
    call(args, "Drain", pb.NodeRequest(node=args.node))
    return _done(args, f"drained node {args.node}; its tasks are moved off it",
                 {"node": args.node, "drained": True})


def cmd_undrain(args: argparse.Namespace) -> int:
    call(args, "Undrain", pb.NodeRequest(node=args.node))
    return _done(args, f"undrained node {args.node}", {"node": args.node, "drained": False})


def cmd_forget(args: argparse.Namespace) -> int:
    call(args, "Forget", pb.NodeRequest(node=args.node))
    return _done(args, f"forgot node {args.node}", {"node": args.node, "forgotten": True})


def _cell(value: Any) -> Any:
    return ",".join(map(str, value)) if isinstance(value, list | tuple) else value


def cmd_tasks(args: argparse.Namespace) -> int:
    reply = call(args, "ListTasks", pb.ListTasksRequest(name=args.name or ""))
    tasks = [json.loads(t) for t in reply.task_json]
    if args.json:
        return emit(args, tasks, [])
    rows = [{c: _cell(t.get(c)) for c in TASK_COLUMNS} for t in tasks]
    return emit(args, rows, TASK_COLUMNS)
