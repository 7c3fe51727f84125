"""The fuzz properties, shared by the CI tests (tests/fuzz/) and the benchmark (bench/fuzz.py).

Property of every target: an input is either accepted as a valid typed value (every field of the
type its annotation says, finite numbers, and it survives a JSON round trip) or rejected with the
project's InvalidRecord/PermanentError whose message is one line and, for a mutated field, names it.
Any other exception, a server that stops answering, or a case slower than ``HANG_S`` is a crash.

``Fuzz`` counts the cases it actually executed (not the configured ``max_examples``). In the tests it
raises at the first crash (Hypothesis then shrinks it); in the benchmark it records crashes and goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import os
import socket
import tempfile
import threading
import time
import traceback
import types
import typing
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from agent.ranks import RankServer
from coordinator.daemon import Coordinator
from coordinator.decision.state import CoreState, TaskEntry
from coordinator.link import LinkServer
from coordinator.settings import CoordinatorSettings
from coordinator.tasks import NAME_RE, TaskSpec, load_spec_json, parse_task_spec
from tests.fuzz import strategies as fs
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel import link, protocol, wire
from unicron.kernel.errors import PermanentError
from unicron.kernel.inject import Injection
from unicron.kernel.net import free_port
from unicron.kernel.proto import coordinator_pb2 as pb
from unicron.kernel.proto import coordinator_pb2_grpc as pb_grpc
from unicron.kernel.types import (
    AssignmentResult,
    Incident,
    NodeAssignment,
    NodeInfo,
    NodeStatus,
    RankSpec,
    RankStatus,
    Record,
    Report,
    StoreAddress,
    TaskAssignment,
    TaskResult,
)

HANG_S = 5.0
MAX_MESSAGE = 2000
#: every record a daemon reads from etcd
ETCD_RECORDS: tuple[type[Record], ...] = (
    Report, Incident, NodeInfo, StoreAddress, RankStatus, NodeStatus, RankSpec, TaskAssignment,
    NodeAssignment, TaskResult, AssignmentResult, Injection,
)


class Violation(AssertionError):
    """The property does not hold for one input."""


class Fuzz:
    def __init__(self, raise_on_crash: bool) -> None:
        self.raise_on_crash = raise_on_crash
        self.cases: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()
        self.crashes: list[dict[str, str]] = []
        self.max_case_s = 0.0
        self._lock = threading.Lock()

    def crash(self, target: str, what: str, example: Any) -> None:
        with self._lock:
            self.crashes.append({"target": target, "error": what[:2000], "input": repr(example)[:300]})

    def case(self, target: str, fn: Callable[[], bool], example: Any) -> None:
        """Run one case of ``target``: ``fn`` returns whether the input was accepted."""
        self.cases[target] += 1
        start = time.monotonic()
        try:
            if fn():
                self.accepted[target] += 1
        except Exception as exc:
            self.crash(target, "".join(traceback.format_exception_only(exc)).strip(), example)
            if self.raise_on_crash:
                raise
        finally:
            elapsed = time.monotonic() - start
            self.max_case_s = max(self.max_case_s, elapsed)
            if elapsed > HANG_S:
                self.crash(target, f"hang: the case took {elapsed:.1f}s", example)
                if self.raise_on_crash:
                    raise Violation(f"{target}: a case took {elapsed:.1f}s")

    def summary(self) -> dict[str, Any]:
        return {
            "fuzz_cases": sum(self.cases.values()),
            "fuzz_crashes": len(self.crashes),
            "per_target": {t: {"cases": n, "accepted": self.accepted[t]} for t, n in sorted(self.cases.items())},
            "max_case_s": round(self.max_case_s, 3),
            "crashes": self.crashes[:20],
        }


def run(fuzz_fn: Callable[..., None], strategy: st.SearchStrategy[Any], examples: int) -> None:
    """Run ``fuzz_fn`` on ``examples`` inputs drawn from ``strategy`` (no example database: CI and the
    benchmark start from nothing; no deadline: ``Fuzz`` judges hangs by its own clock)."""
    test = settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck),
                    phases=(Phase.explicit, Phase.generate, Phase.shrink))(given(strategy)(fuzz_fn))
    test()


# --- the oracle: what "accepted as a valid typed value" means -------------------------------------------


def typed(value: Any, hint: Any, where: str) -> None:
    """Raise Violation unless ``value`` is an in-memory value of ``hint`` (independent of the parser)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            with contextlib.suppress(Violation):
                typed(value, arg, where)
                return
        raise Violation(f"{where}: {value!r:.80} is none of {hint}")
    ok: bool
    if hint is type(None):
        ok = value is None
    elif hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and _finite(value)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(hint, type) and issubclass(hint, enum.Enum | Record):
        ok = isinstance(value, hint)
        if ok and dataclasses.is_dataclass(value):
            typed_fields(value, where)
    elif origin in (list, tuple):
        ok = isinstance(value, origin)
        for i, v in enumerate(value if ok else ()):
            typed(v, args[0], f"{where}[{i}]")
    elif origin is dict:
        ok = isinstance(value, dict)
        for k, v in value.items() if ok else ():
            typed(k, args[0], f"{where} key")
            typed(v, args[1], f"{where}[{k!r}]")
    elif hint in (dict, list):
        ok = isinstance(value, hint)
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise Violation(f"accepted with a wrong type: {where} = {value!r:.80} (expected {hint})")


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def typed_fields(obj: Any, where: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.name in hints and not (isinstance(obj, TaskEntry) and f.name == "spec"):
            typed(getattr(obj, f.name), hints[f.name], f"{where or type(obj).__name__}.{f.name}")


def _rejected(exc: PermanentError, names: list[str]) -> bool:
    """Check a rejection's message: one line, bounded, naming one of ``names`` (the mutated path)."""
    msg = str(exc)
    if not msg or "\n" in msg or "\r" in msg:
        raise Violation(f"rejection is not one line: {msg!r:.300}")
    if len(msg) > MAX_MESSAGE:
        raise Violation(f"rejection message of {len(msg)} characters")
    if names and not any(n in msg for n in names):
        raise Violation(f"rejection does not name the field {names}: {msg}")
    return False


def _names(field: str, value: Any) -> list[str]:
    return [n for n in field.split(",") if n]


def judge(parse: Callable[[], Any], oracle: Callable[[Any], None], names: list[str]) -> bool:
    try:
        value = parse()
    except PermanentError as exc:
        return _rejected(exc, names)
    oracle(value)
    return True


# --- pure targets -----------------------------------------------------------------------------------


def _encode(kind: str, value: Any) -> bytes:
    return value if kind == "bytes" else json.dumps(value).encode()


def _message_oracle(parse_back: Callable[[dict[str, Any]], Any]) -> Callable[[Any], None]:
    def oracle(msg: Any) -> None:
        typed_fields(msg)
        again = parse_back(wire.decode(wire.encode(msg.to_wire())))
        if again != msg:
            raise Violation(f"round trip changed {msg!r:.200} into {again!r:.200}")
    return oracle


def rank_protocol_case(fuzz: Fuzz, example: tuple[str, Any, str]) -> None:
    kind, value, field = example
    line = _encode(kind, value)
    fuzz.case("rank_protocol", lambda: judge(lambda: protocol.parse(wire.decode(line)),
                                             _message_oracle(protocol.parse), _names(field, value)), example)


def link_messages_case(fuzz: Fuzz, example: tuple[str, Any, str]) -> None:
    kind, value, field = example
    line = _encode(kind, value)
    fuzz.case("link_messages", lambda: judge(lambda: link.parse(wire.decode(line)),
                                             _message_oracle(link.parse), _names(field, value)), example)


def _spec_oracle(spec: TaskSpec) -> None:
    if not NAME_RE.fullmatch(spec.name) or not spec.command or not 0.5 <= spec.weight <= 2.0:
        raise Violation(f"accepted an invalid spec {spec!r:.200}")
    if spec.min_gpus % spec.unit or any(not isinstance(a, str) for a in spec.command):
        raise Violation(f"accepted an inconsistent spec {spec!r:.200}")
    again = parse_task_spec(json.loads(json.dumps(spec.to_dict())), None)
    if again != spec:
        raise Violation(f"spec round trip changed {spec!r:.200}")


def _spec_text(kind: str, value: Any) -> str:
    return value.decode("utf-8", "replace") if kind == "bytes" else json.dumps(value)


def task_spec_case(fuzz: Fuzz, example: tuple[str, Any, str]) -> None:
    kind, value, field = example
    text = _spec_text(kind, value)
    fuzz.case("task_spec", lambda: judge(lambda: parse_task_spec(load_spec_json(text), None),
                                         _spec_oracle, _names(field, value)), example)


def etcd_record_case(fuzz: Fuzz, example: tuple[type[Record], tuple[str, Any, str]]) -> None:
    cls, (kind, value, field) = example
    raw = _encode(kind, value)

    def oracle(rec: Any) -> None:
        typed_fields(rec)
        if type(rec).from_json(rec.to_json()) != rec:
            raise Violation(f"record round trip changed {rec!r:.200}")

    fuzz.case("etcd_records", lambda: judge(lambda: cls.from_json(raw), oracle, _names(field, value)),
              (cls.__name__, example[1]))


def core_state_case(fuzz: Fuzz, example: tuple[str, Any, str]) -> None:
    kind, value, field = example

    def parse() -> CoreState:
        return CoreState.from_dict(json.loads(_encode(kind, value)) if kind != "bytes" else _json_or_none(value))

    def oracle(state: CoreState) -> None:
        typed(state.now, float, "now")
        typed(state.counter, int, "counter")
        for e in [*state.nodes.values(), *state.tasks.values()]:
            typed_fields(e)
            if isinstance(e, TaskEntry) and e.outstanding is not None:
                typed_fields(e.outstanding)
        if CoreState.from_dict(json.loads(json.dumps(state.to_dict()))) != state:
            raise Violation("decision state round trip changed it")

    fuzz.case("core_state", lambda: judge(parse, oracle, _names(field, value)), example)


def _json_or_none(raw: bytes) -> Any:
    """The decision state is read with json.loads before from_dict; garbage bytes never reach it."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def etcd_record_strategy() -> st.SearchStrategy[Any]:
    return st.sampled_from(ETCD_RECORDS).flatmap(
        lambda cls: st.tuples(st.just(cls), fs.inputs(fs.record(cls).map(lambda r: r.to_dict())))
    )


PURE_TARGETS: dict[str, tuple[Callable[[Fuzz, Any], None], Callable[[], st.SearchStrategy[Any]]]] = {
    "rank_protocol": (rank_protocol_case, lambda: fs.inputs(fs.RANK_MESSAGES)),
    "link_messages": (link_messages_case, lambda: fs.inputs(fs.LINK_MESSAGES)),
    "task_spec": (task_spec_case, lambda: fs.inputs(fs.SPECS)),
    "etcd_records": (etcd_record_case, etcd_record_strategy),
    "core_state": (core_state_case, lambda: fs.inputs(fs.CORE_STATES)),
}


def run_pure(fuzz: Fuzz, target: str, examples: int) -> None:
    case, strategy = PURE_TARGETS[target]
    run(lambda example: case(fuzz, example), strategy(), examples)


# --- real servers --------------------------------------------------------------------------------------


def _payload(example: tuple[str, Any, str]) -> bytes:
    kind, value, _ = example
    return _encode(kind, value)


class _Inbox:
    """What a server's callbacks saw, waited on by the cases."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.cond = threading.Condition()

    def put(self, item: Any) -> None:
        with self.cond:
            self.items.append(item)
            self.cond.notify_all()

    def wait(self, pred: Callable[[Any], bool], timeout_s: float = HANG_S) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: any(pred(i) for i in self.items), timeout=timeout_s)


@contextlib.contextmanager
def thread_crashes(fuzz: Fuzz, target: str) -> Iterator[None]:
    """A server thread that dies of an exception is a crash even when the server goes on."""
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        fuzz.crash(target, f"thread {args.thread.name if args.thread else '?'} died: {args.exc_type.__name__}: "
                           f"{args.exc_value}", "")
        previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def run_rank_server(fuzz: Fuzz, examples: int) -> None:
    """A real RankServer on a Unix socket: each case is a rank that says hello and sends one fuzzed line
    (before or after its hello), then an IterStart the server must still deliver."""
    inbox = _Inbox()
    with tempfile.TemporaryDirectory() as tmp, thread_crashes(fuzz, "rank_server"):
        path = os.path.join(tmp, "agent.sock")
        server = RankServer(path, lambda sender, msg: inbox.put((sender.task, sender.rank, msg))).start()
        marker = iter(range(10**9, 2 * 10**9))
        try:
            def one(example: tuple[str, Any, str], garbage_first: bool) -> None:
                step = next(marker)

                def case() -> bool:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.settimeout(HANG_S)
                    sock.connect(path)
                    conn = wire.LineSocket(sock)
                    try:
                        hello = wire.encode(protocol.Hello(rank=step, local_rank=0, pid=1, task="fuzz").to_wire())
                        lines = [_payload(example) + b"\n", hello] if garbage_first else [hello, _payload(example) + b"\n"]
                        for data in lines:
                            sock.sendall(data)
                        conn.send(protocol.IterStart(step=step).to_wire())
                        if not inbox.wait(lambda i: isinstance(i[2], protocol.IterStart) and i[2].step == step):
                            raise Violation("the rank server stopped reading the connection after the fuzzed line")
                    finally:
                        conn.close()
                    return True

                fuzz.case("rank_server", case, example)

            run(lambda pair: one(*pair), st.tuples(fs.inputs(fs.RANK_MESSAGES), st.booleans()), examples)
            _rank_server_still_answers(fuzz, server, path, inbox)
        finally:
            server.stop()


def _rank_server_still_answers(fuzz: Fuzz, server: RankServer, path: str, inbox: _Inbox) -> None:
    def check() -> bool:
        deadline = time.monotonic() + HANG_S
        while server.connected() and time.monotonic() < deadline:  # every fuzz connection was closed
            time.sleep(0.01)
        if server.connected():
            raise Violation(f"closed connections still registered: {server.connected()[:5]}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        conn = wire.LineSocket(sock)
        conn.send(protocol.Hello(rank=7, local_rank=0, pid=1, task="after").to_wire())
        conn.send(protocol.IterEnd(step=42, duration_s=0.5).to_wire())
        try:
            if not inbox.wait(lambda i: i[0] == "after" and isinstance(i[2], protocol.IterEnd)):
                raise Violation("the rank server did not answer a valid rank after the fuzz")
            if not server.send("after", 7, protocol.Stop(reason="fuzz done")):
                raise Violation("the rank server cannot send to a valid rank after the fuzz")
            sock.settimeout(HANG_S)
            if protocol.parse(wire.decode(conn.recv_line() or b"")) != protocol.Stop(reason="fuzz done"):
                raise Violation("the rank did not get its instruction")
        finally:
            conn.close()
        return True

    fuzz.case("rank_server", check, "valid rank after the fuzz")


def run_link_server(fuzz: Fuzz, examples: int) -> None:
    """A real coordinator LinkServer: a fuzzed line as the hello (must be closed, never accepted), or after
    a valid hello (must be skipped: the heartbeat and goodbye after it still arrive, and no node is lost)."""
    lost, connected, goodbyes = _Inbox(), _Inbox(), _Inbox()
    with thread_crashes(fuzz, "link_server"):
        server = LinkServer("127.0.0.1", 0, 30.0, on_lost=lambda n, r, ts: lost.put((n, r)),
                            verify=lambda node, token: token == f"token-{node}",
                            on_connected=lambda n, ts: connected.put(n),
                            on_goodbye=lambda n, r, ts: goodbyes.put((n, r))).start()
        host, _, port = server.address.rpartition(":")
        marker = iter(range(10**9))
        try:
            def one(example: tuple[str, Any, str], as_hello: bool) -> None:
                node = f"fuzz-{next(marker)}"

                def case() -> bool:
                    conn = wire.LineSocket(socket.create_connection((host, int(port)), timeout=HANG_S))
                    try:
                        if as_hello:
                            return _garbage_hello(conn, _payload(example))
                        _garbage_after_hello(conn, node, _payload(example), goodbyes)
                        return True
                    finally:
                        conn.close()

                fuzz.case("link_server", case, example)

            run(lambda pair: one(*pair), st.tuples(fs.inputs(fs.LINK_MESSAGES), st.booleans()),
                examples)

            def after() -> bool:
                conn = wire.LineSocket(socket.create_connection((host, int(port)), timeout=HANG_S))
                try:
                    _garbage_after_hello(conn, "after", b'{"type":"hb"}', goodbyes)
                finally:
                    conn.close()
                if lost.items:
                    raise Violation(f"fuzzed lines lost nodes: {lost.items[:5]}")
                return True

            fuzz.case("link_server", after, "valid agent after the fuzz")
        finally:
            server.stop()


def _garbage_hello(conn: wire.LineSocket, payload: bytes) -> bool:
    conn.sock.sendall(payload + b"\n")
    try:
        line = conn.recv_line()
    except OSError:
        return False
    if line is None:
        return False
    raise Violation(f"a fuzzed hello was answered with {line[:80]!r}")


def _garbage_after_hello(conn: wire.LineSocket, node: str, payload: bytes, goodbyes: _Inbox) -> None:
    conn.send(link.LinkHello(node=node, token=f"token-{node}").to_wire())
    welcome = conn.recv_line()
    if welcome is None or link.parse(wire.decode(welcome)) != link.Welcome():
        raise Violation(f"a valid hello was not welcomed: {welcome!r:.80}")
    conn.sock.sendall(payload + b"\n")
    with contextlib.suppress(OSError):  # the payload may itself have been a goodbye
        conn.send(link.Heartbeat().to_wire())
        conn.send(link.Goodbye(reason="fuzz").to_wire())
    if not goodbyes.wait(lambda g: g[0] == node):
        raise Violation("the link server stopped reading the connection after the fuzzed line")


# --- the gRPC API of a real coordinator on real etcd --------------------------------------------------


@contextlib.contextmanager
def real_coordinator() -> Iterator[tuple[Coordinator, str]]:
    etcd = EtcdServer().start()
    port = free_port()
    coordinator = Coordinator(CoordinatorSettings(etcd=etcd.endpoint, prefix="/fuzz", api_port=port))
    thread = threading.Thread(target=coordinator.run, name="fuzz-coordinator", daemon=True)
    thread.start()
    try:
        if not coordinator.ready.wait(30.0):
            raise RuntimeError("the coordinator did not lead within 30 s")
        yield coordinator, f"127.0.0.1:{port}"
        if not thread.is_alive():
            raise Violation("the coordinator's main thread ended during the fuzz")
    finally:
        coordinator.stop()
        thread.join(15.0)
        etcd.cleanup()


#: the status codes a Submit may end with; anything else (INTERNAL, UNKNOWN, UNAVAILABLE, ...) is a crash
SUBMIT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS}


def run_api(fuzz: Fuzz, examples: int) -> None:
    with real_coordinator() as (_, address), grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=15.0)
        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]

        def one(example: tuple[str, Any, str]) -> None:
            kind, value, field = example
            text = _spec_text(kind, value)
            fuzz.case("api_submit", lambda: _submit_case(stub, text, _names(field, value)), example)

        run(one, fs.inputs(fs.SPECS), examples)
        fuzz.case("api_submit", lambda: _valid_submit(stub), "valid spec after the fuzz")


def _submit_case(stub: Any, text: str, names: list[str]) -> bool:
    try:
        expected: Any = parse_task_spec(load_spec_json(text), None)
    except PermanentError as exc:
        expected = exc
    try:
        reply = stub.Submit(pb.SubmitRequest(spec_json=text), timeout=HANG_S)
    except grpc.RpcError as err:
        if err.code() not in SUBMIT_CODES:
            raise Violation(f"Submit answered {err.code().name}: {err.details()}") from None
        if err.code() is grpc.StatusCode.INVALID_ARGUMENT:
            if not isinstance(expected, PermanentError):
                raise Violation(f"the API refused a spec the parser accepts: {err.details()}") from None
            return _rejected(PermanentError(err.details()), names)
        return False
    if isinstance(expected, PermanentError):
        raise Violation(f"the API accepted a spec the parser refuses ({expected})")
    spec = parse_task_spec(json.loads(reply.task_json), None)
    if spec != expected:
        raise Violation(f"the API stored {spec!r:.200}, not {expected!r:.200}")
    stub.Cancel(pb.CancelRequest(name=spec.name), timeout=HANG_S)  # keeps the task set small
    return True


def _valid_submit(stub: Any) -> bool:
    spec = json.dumps({"name": "after-fuzz", "command": ["python", "-c", "pass"]})
    stub.Submit(pb.SubmitRequest(spec_json=spec), timeout=HANG_S)
    names = [json.loads(t)["name"] for t in stub.ListTasks(pb.ListTasksRequest(), timeout=HANG_S).task_json]
    if "after-fuzz" not in names:
        raise Violation(f"a valid task is not listed after the fuzz: {names[:10]}")
    return True




# --- records written into etcd under a real coordinator's watches ---------------------------------------

#: what the coordinator watches, and the key a record of that type lives at
_WATCHED: dict[type[Record], Callable[[Any, str], str]] = {
    NodeInfo: lambda keys, node: keys.node(node),
    Report: lambda keys, node: keys.report(node, "fuzz"),
    NodeStatus: lambda keys, node: keys.status(node),
    AssignmentResult: lambda keys, node: keys.result(node),
}


def run_coordinator_etcd(fuzz: Fuzz, examples: int) -> None:
    """Fuzzed values of the records a coordinator watches, written to etcd under their real keys: the
    coordinator skips or acts on them, and after each one still answers the API (its loop is alive)."""
    from unicron.kernel.etcd import Store

    with thread_crashes(fuzz, "coordinator_etcd"), real_coordinator() as (coordinator, address), \
            grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=15.0)
        stub = pb_grpc.CoordinatorStub(channel)  # type: ignore[no-untyped-call]
        store = Store(coordinator.settings.etcd)
        try:
            def one(example: tuple[type[Record], tuple[str, Any, str]], node: str) -> None:
                cls, (kind, value, _) = example

                def case() -> bool:
                    store.put(_WATCHED[cls](coordinator.keys, node), _encode(kind, value))
                    try:
                        stub.ListNodes(pb.ListNodesRequest(), timeout=HANG_S)
                    except grpc.RpcError as err:
                        raise Violation(f"ListNodes answered {err.code().name}: {err.details()}") from None
                    return True

                fuzz.case("coordinator_etcd", case, (cls.__name__, example[1]))

            strategy = st.sampled_from(list(_WATCHED)).flatmap(
                lambda cls: st.tuples(st.just(cls), fs.inputs(fs.record(cls).map(lambda r: r.to_dict())))
            )
            run(lambda pair: one(*pair), st.tuples(strategy, st.sampled_from(["n1", "n2", "n3"])), examples)
            fuzz.case("coordinator_etcd", lambda: _valid_submit(stub), "valid spec after the fuzz")
        finally:
            store.close()
