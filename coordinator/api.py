"""The coordinator's gRPC API (``unicron/kernel/proto/coordinator.proto``; docs/api.md).

The servicer knows nothing of the daemon: it talks to a :class:`ControlPlane`, which the daemon
implements. Its jobs are the boundary ones: validate task specs (:func:`parse_task_spec`, against the
cluster's size) before anything is changed, turn records into JSON and back, and map the project's
exceptions to gRPC status codes, so that a client sees "INVALID_ARGUMENT: task.weight: ..." rather
than a traceback.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, Protocol, TypeVar

import grpc

from coordinator.tasks import TaskSpec, load_spec_json, parse_task_spec
from unicron.kernel import log as ulog
from unicron.kernel import tls
from unicron.kernel.address import ip_literal
from unicron.kernel.errors import ConfigError, InvalidRecord, NotLeader, PermanentError, TemporaryError
from unicron.kernel.net import WILDCARDS
from unicron.kernel.proto import coordinator_pb2 as pb
from unicron.kernel.proto import coordinator_pb2_grpc as pb_grpc

log = ulog.get(__name__)

T = TypeVar("T")


class NotFound(PermanentError):
    """The named task or node does not exist (gRPC NOT_FOUND)."""


class AlreadyExists(PermanentError):
    """A task of that name is already in the task set (gRPC ALREADY_EXISTS)."""


class ControlPlane(Protocol):
    """What the API needs from the coordinator. The daemon implements it.

    Every method is called from one of the server's worker threads, concurrently with the daemon's
    own loop, so an implementation must be thread-safe (e.g. hand the request to the loop thread and
    wait for its answer). Errors are raised as :mod:`unicron.kernel.errors` exceptions (or :class:`NotFound`
    / :class:`AlreadyExists`); the servicer maps them to status codes (see :func:`status_for`).
    """

    def submit(self, spec: TaskSpec) -> bool:
        """Add a validated task to the task set; True. False, changing nothing, when the active task of
        that name has this very spec (a retried submit whose first try landed); :class:`AlreadyExists`
        when it has another."""

    def update(self, spec: TaskSpec) -> None:
        """Replace the spec of the active task of that name (:class:`NotFound` if there is none). A
        change of how its ranks are launched (command, env, recovery, TP x PP, micro-batch size)
        relaunches it from an on-demand snapshot; the runtime reshards that snapshot into a new TP."""

    def cancel(self, name: str) -> None:
        """Remove a task from the task set, stopping its ranks. :class:`NotFound` if unknown."""

    def tasks(self) -> list[dict[str, Any]]:
        """Every task with its state: name, phase, weight, min_gpus, gpus, generation, nodes, restarts,
        step, reason, incidents, recovery_s, transition_s (measured D_transition, None until a
        reconfiguration was measured), achieved_flops (measured, None until measured) (JSON-serialisable values)."""

    def nodes(self) -> list[dict[str, Any]]:
        """Every node as the coordinator sees it (JSON-serialisable values, "node" = its name)."""

    def drain(self, node: str) -> None:
        """Stop scheduling on ``node`` and move its tasks off. :class:`NotFound` if unknown. Idempotent."""

    def undrain(self, node: str) -> None:
        """Schedule on ``node`` again. :class:`NotFound` if unknown. Idempotent."""

    def forget(self, node: str) -> None:
        """Remove ``node`` for good (retired, renamed): its state entry and records go.
        :class:`NotFound` if unknown; :class:`PermanentError` (one line saying what to do) while it is
        registered or up, or a task still holds it."""

    def incidents(self, limit: int) -> list[dict[str, Any]]:
        """The newest ``limit`` incidents (``Incident.to_dict()``), oldest first; 0 means all kept."""

    def cluster_gpus(self) -> int | None:
        """GPUs a task's ``min_gpus`` is checked against (None: not known, skip the check)."""

    def gpus_per_node(self) -> int | None:
        """GPUs per node when all nodes have the same count, for the ``tp_size`` check (None: skip)."""


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code a client sees for ``exc`` (see coordinator.proto)."""
    # Order matters: NotLeader and InvalidRecord are PermanentErrors with a more specific meaning.
    if isinstance(exc, tls.Unauthorized):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(exc, InvalidRecord):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, NotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, AlreadyExists):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(exc, NotLeader | TemporaryError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, PermanentError):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


def _dumps(record: dict[str, Any]) -> str:
    # default=str: an enum or timestamp type a record forgot to convert must not fail the whole list
    return json.dumps(record, default=str, sort_keys=True)


#: the RPCs that change the cluster: only an operator certificate may call them (with TLS)
MUTATING_RPCS = frozenset({"Submit", "Cancel", "Drain", "Undrain", "Forget"})


def authorize(tls_config: tls.TLSConfig, context: Any, rpc: str) -> tls.Peer:
    """The caller's verified, unrevoked certificate, if it may call ``rpc``: the mutating RPCs take an
    operator, the read-only ones any role the cluster CA issued (a dashboard on a node may list tasks)."""
    peer = tls_config.peer_of_grpc(context)
    if rpc in MUTATING_RPCS:
        tls.require(peer, tls.Role.OPERATOR, rpc)
    return peer


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, control_plane: ControlPlane, tls_config: tls.TLSConfig | None = None) -> None:
        self.cp = control_plane
        #: set when the server runs with mutual TLS: every call is authorized by its certificate
        self.tls_config = tls_config

    def _run(self, context: Any, rpc: str, fn: Callable[[], T]) -> T:
        try:
            if self.tls_config is not None:
                authorize(self.tls_config, context, rpc)
            return fn()
        except Exception as exc:
            code = status_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("API call failed", rpc=rpc)
                message = f"internal error in {rpc} ({type(exc).__name__}: {exc}); see the coordinator's log"
            else:
                log.info("API call refused", rpc=rpc, code=code.name, error=str(exc))
                message = str(exc)
            _abort(context, code, one_line(message))

    def Submit(self, request: pb.SubmitRequest, context: Any) -> pb.SubmitReply:
        def submit() -> pb.SubmitReply:
            data = load_spec_json(request.spec_json)
            spec = parse_task_spec(data, self.cp.cluster_gpus(), self.cp.gpus_per_node())
            if request.update:
                self.cp.update(spec)
                log.info("task updated", task=spec.name, weight=spec.weight, min_gpus=spec.min_gpus)
            elif self.cp.submit(spec):
                log.info("task submitted", task=spec.name, weight=spec.weight, min_gpus=spec.min_gpus)
            else:
                return pb.SubmitReply(task_json=_dumps(spec.to_dict()), already_submitted=True)
            return pb.SubmitReply(task_json=_dumps(spec.to_dict()))

        return self._run(context, "Submit", submit)

    def Cancel(self, request: pb.CancelRequest, context: Any) -> pb.CancelReply:
        def cancel() -> pb.CancelReply:
            self.cp.cancel(_required(request.name, "name"))
            log.info("task cancelled", task=request.name)
            return pb.CancelReply()

        return self._run(context, "Cancel", cancel)

    def ListTasks(self, request: pb.ListTasksRequest, context: Any) -> pb.TaskList:
        def list_tasks() -> pb.TaskList:
            tasks = self.cp.tasks()
            if request.name:
                tasks = [t for t in tasks if t.get("name") == request.name]
                if not tasks:
                    raise NotFound(f"no task named {request.name!r} (see 'unicron tasks')")
            return pb.TaskList(task_json=[_dumps(t) for t in tasks])

        return self._run(context, "ListTasks", list_tasks)

    def ListNodes(self, request: pb.ListNodesRequest, context: Any) -> pb.NodeList:
        return self._run(
            context, "ListNodes", lambda: pb.NodeList(node_json=[_dumps(n) for n in self.cp.nodes()])
        )

    def Drain(self, request: pb.NodeRequest, context: Any) -> pb.NodeReply:
        def drain() -> pb.NodeReply:
            self.cp.drain(_required(request.node, "node"))
            log.info("node drained", node=request.node)
            return pb.NodeReply()

        return self._run(context, "Drain", drain)

    def Undrain(self, request: pb.NodeRequest, context: Any) -> pb.NodeReply:
        def undrain() -> pb.NodeReply:
            self.cp.undrain(_required(request.node, "node"))
            log.info("node undrained", node=request.node)
            return pb.NodeReply()

        return self._run(context, "Undrain", undrain)

    def Forget(self, request: pb.NodeRequest, context: Any) -> pb.NodeReply:
        def forget() -> pb.NodeReply:
            self.cp.forget(_required(request.node, "node"))
            log.info("node forgotten", node=request.node)
            return pb.NodeReply()

        return self._run(context, "Forget", forget)

    def ListIncidents(self, request: pb.ListIncidentsRequest, context: Any) -> pb.IncidentList:
        return self._run(
            context, "ListIncidents",
            lambda: pb.IncidentList(incident_json=[_dumps(i) for i in self.cp.incidents(request.limit)]),
        )


def _abort(context: Any, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("grpc context.abort returned")  # it raises; this keeps the type checker honest


#: the most of an error message a client gets (the whole of it is in the coordinator's log)
MAX_MESSAGE_CHARS = 500


def one_line(message: str) -> str:
    """``message`` as one line of bounded length: a client prints it as is, e.g. after "unicron submit: "."""
    text = " ".join(message.split())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def _required(value: str, field: str) -> str:
    if not value:
        raise InvalidRecord(f"{field}: missing")
    return value


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised(host: str, port: int) -> str:
    """The address clients should dial: a wildcard listen address is replaced by this host's name."""
    if host in WILDCARDS:
        host = socket.gethostname()
    return join_host_port(host, port)


def serve(control_plane: ControlPlane, host: str = "127.0.0.1", port: int = 0,
          workers: int = 4, tls_config: tls.TLSConfig | None = None,
          advertise_host: str = "") -> tuple[grpc.Server, str]:
    """Start the API server on ``host:port`` (port 0: any free port). Returns it and the address to dial
    (on ``advertise_host`` when given).

    With ``tls_config`` the server takes only clients whose certificate the cluster CA signed
    (``require_client_auth``) and authorizes each call by the certificate's role (:func:`authorize`)."""
    server = grpc.server(
        ThreadPoolExecutor(max_workers=workers, thread_name_prefix="unicron-api"),
        # without this, gRPC sets SO_REUSEPORT and a second coordinator on a fixed port would share it
        options=[("grpc.so_reuseport", 0)],
    )
    # the generated module has no annotations
    pb_grpc.add_CoordinatorServicer_to_server(  # type: ignore[no-untyped-call]
        CoordinatorServicer(control_plane, tls_config), server
    )
    listen = join_host_port(host, port)
    hint = "change --listen-host / UNICRON_COORDINATOR_HOST or --api-port / UNICRON_API_PORT"
    # gRPC's own refusal adds a line of its native log: ask the kernel first (a host name may resolve to
    # several addresses, any of which gRPC may bind: left to gRPC)
    ip = ip_literal(host)
    if port and ip is not None:
        try:
            socket.create_server((str(ip), port), family=socket.AF_INET6 if ip.version == 6 else socket.AF_INET).close()
        except OSError as exc:
            raise ConfigError(f"the API cannot listen on {listen} ({exc.strerror or exc}); {hint}") from exc
    try:
        if tls_config is None:
            bound = server.add_insecure_port(listen)
        else:
            bound = server.add_secure_port(listen, tls_config.grpc_server_credentials())
    except RuntimeError as exc:
        bound = 0
        reason = str(exc)
    else:
        reason = "port in use or address not local"
    if not bound:
        raise ConfigError(f"the API cannot listen on {listen} ({reason}); {hint}")
    server.start()
    address = join_host_port(advertise_host, bound) if advertise_host else advertised(host, bound)
    log.info("API serving", listen=join_host_port(host, bound), address=address, tls=tls_config is not None)
    return server, address


def stop(server: grpc.Server, grace_s: float = 1.0) -> None:
    """Stop accepting calls, let running ones finish for up to ``grace_s``, then cancel them."""
    server.stop(grace_s).wait()
