"""Hollow agents: the real agent with simulated GPUs and simulated ranks, many in one process, so that
one machine can hold a control plane of 1,000+ nodes (issue 16 item 4; Kubernetes' "hollow nodes").

What is real: :class:`agent.daemon.Agent`'s registration (``nodes/<node>`` created only if absent,
under the node's own lease, kept alive by its own thread), its status and result records
(``_write_status``, ``_on_assignment_event`` → ``_report_result``), and the link's hello
(:meth:`agent.link.LinkClient._connect`: token, welcome) and heartbeat messages on one TCP connection
per node. What is simulated: the GPUs (the simulated backend, no monitor threads) and the ranks: a
:class:`SimulatedTask` takes an assignment at once and its ranks "train" one step per ``iter_s``, so a
task placed on hollow nodes reaches RUNNING and its recoveries are confirmed the way real ones are.

What is shared, so that hundreds of nodes fit one process: one etcd client (:class:`Store`) for all;
one watch on ``assign/`` handing each record to its node's agent; one thread sending every node's
heartbeat each ``heartbeat_s`` (the messages are the real ones, one per node per interval) and another
(re)connecting the links; streams of 100 refreshing each node's own lease at TTL / 4 (as :class:`Lease`
does for one; a lease found expired is replaced as the agent does, by registering anew); a few threads
building each node's status record once per ``status_interval_s`` (the agent's own ``_write_status``),
written many per etcd transaction, as are the agents' assignment results (the records and their
leases are the real ones; a thread and a call per record and per lease cost more CPU than the
coordinator's). :class:`FleetProcesses` splits a
fleet over several such processes: at 1,000 nodes one process's GIL let leases lapse.

The fleet is not the agent: its shared heartbeat thread may itself be starved (a process of 250 nodes
answering an Assign over every node, on a machine of 2 cores). It stamps every gap between two sends
to a node longer than ``late_s`` (:meth:`HollowFleet.late_sends`), so that a node loss the coordinator
declares can be told the harness's fault (nothing was sent to the node for the whole timeout) or the
coordinator's (:func:`fleet_silent`).
"""

from __future__ import annotations

import collections
import contextlib
import math
import multiprocessing
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, cast

from agent.daemon import Agent
from agent.link import LinkClient
from agent.reconciler import Outcome
from agent.settings import AgentSettings
from agent.supervisor import ProcStatus
from unicron.kernel import link, wire
from unicron.kernel import log as ulog
from unicron.kernel.errors import PermanentError, StartFailed, StoreUnavailable
from unicron.kernel.etcd import MAX_TXN_OPS, Lease, PrefixWatch, Store, WatchEvent
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.types import RankStatus, TaskAssignment

log = ulog.get(__name__)

KEEPALIVE_BATCH = 100  # leases refreshed per stream
#: gaps between two heartbeats sent to a node kept for :meth:`HollowFleet.late_sends` (the latest)
LATE_SENDS_KEPT = 10_000

#: a gap in the heartbeats the fleet sent to one node: (node, wall time of the send before, of the send after)
SendGap = tuple[str, float, float]


def fleet_silent(gaps: Iterable[SendGap], node: str, ts: float, timeout_s: float) -> float | None:
    """The fleet's send gap that explains ``node``'s heartbeat timeout declared at ``ts`` (wall time),
    or None: the harness is to blame only when it sent the node nothing for the whole ``timeout_s``
    before ``ts`` (its last send at or before ``ts - timeout_s``, its next one at or after ``ts``).
    Otherwise the coordinator lost a node that was fed in time."""
    for n, start, end in gaps:
        if n == node and start <= ts - timeout_s and end >= ts:
            return end - start
    return None


class SimulatedTask:
    """Stands in for :class:`agent.reconciler.TaskReconciler`: the assignment is applied at once and
    each rank makes one step per ``iter_s`` from its launch (a restart relaunches the named ranks)."""

    def __init__(self, a: TaskAssignment, iter_s: float) -> None:
        self.task = a.task
        self.latest = self.applied = a
        self.iter_s = iter_s
        now = time.time()
        self._launched = {r.rank: now for r in a.ranks}
        self._membership = {r.rank: a.membership_epoch for r in a.ranks}
        # each rank's own launch epoch, as the reconciler reports it: a restart's progress counts only
        # the ranks it relaunched (coordinator/causes.py), so survivors must keep the epoch they ran under
        self._epoch = {r.rank: a.restart_epoch for r in a.ranks}
        self.started = self._done(f"started {len(a.ranks)} simulated rank(s)")

    def _done(self, detail: str) -> Outcome:
        out = Outcome(self.task)
        out.set(True, detail)
        return out

    def apply(self, a: TaskAssignment) -> Outcome:
        restarted = a.restart_epoch != self.applied.restart_epoch
        now = time.time()
        for gone in set(self._membership) - {r.rank for r in a.ranks}:  # it left (an in-place shrink)
            del self._membership[gone]
        for r in a.ranks:
            joiner = r.rank not in self._membership  # an in-place grow re-hosted it here
            if joiner or (restarted and (not a.restart_ranks or r.rank in a.restart_ranks)):
                self._launched[r.rank] = now
                self._membership[r.rank] = a.membership_epoch
                self._epoch[r.rank] = a.restart_epoch
        self.latest = self.applied = a
        return self._done("applied")

    def stop(self, reason: str) -> Outcome:
        return self._done(f"stopped: {reason}")

    def rank_statuses(self) -> list[RankStatus]:
        now = time.time()
        a = self.applied
        steps = {r.rank: int((now - self._launched.get(r.rank, now)) / self.iter_s) for r in a.ranks}
        return [RankStatus(task=a.task, generation=a.generation, rank=r.rank, pid=0, state="running",
                           step=steps[r.rank], restart_epoch=self._epoch[r.rank],
                           membership_epoch=self._membership.get(r.rank, 0), advanced=steps[r.rank] > 0)
                for r in a.ranks]

    def processes(self) -> dict[int, ProcStatus]:
        return {r.rank: ProcStatus(rank=r.rank, pid=0, state="running", returncode=None, requested=False)
                for r in self.applied.ranks}

    def cannot_start(self) -> str:
        return ""

    def hosts_store(self) -> bool:
        return False


class _StatusBatch:
    """Status records waiting to be written, many per etcd transaction."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, tuple[str | bytes, Lease | None]] = {}

    def add(self, key: str, value: str | bytes, lease: Lease | None) -> None:
        with self._lock:
            self._items[key] = (value, lease)

    def take(self) -> list[tuple[str, str | bytes, Lease | None]]:
        with self._lock:
            items, self._items = self._items, {}
        return [(k, v, lease) for k, (v, lease) in items.items()]


class _FleetStore(Store):
    """The fleet's one etcd client as a hollow agent sees it: its status and result puts join a batch
    (the agent's own ``_write_status`` and ``_write_result`` build and "write" them). Everything else
    goes to etcd at once."""

    def __init__(self, shared: Store, batch: _StatusBatch, prefixes: tuple[str, ...]) -> None:
        self.__dict__.update(shared.__dict__)  # the same client and settings, not a second connection
        self._batch = batch
        self._prefixes = prefixes

    def put(self, key: str, value: str | bytes, lease: Lease | None = None) -> int:
        if key.startswith(self._prefixes):
            self._batch.add(key, value, lease)
            return 0
        return super().put(key, value, lease)


class HollowAgent(Agent):
    """The real agent without processes: see the module doc for what is real and what is simulated."""

    def __init__(self, settings: AgentSettings, store: Store, iter_s: float) -> None:
        super().__init__(settings)
        self.store = store
        self.iter_s = iter_s
        # the real client, used for its hello; the fleet sends the heartbeats
        self.link_client = LinkClient(self.node, settings.heartbeat_s, self.coordinators.candidates,
                                      token=self.link_token)
        self.alive = True

    def start(self) -> None:
        self._register()
        if self.lease is not None:
            self.lease.stop()  # the fleet keeps every node's lease alive, over one stream
        self.ready.set()

    def reconcile(self, desired: list[TaskAssignment], isolated: bool = False) -> list[Outcome]:
        # simulated ranks: killed or stopped alike
        wanted = {a.task: a for a in desired}
        outcomes: list[Outcome] = []
        with self._tasks_lock:
            tasks = cast(dict[str, SimulatedTask], self._tasks)
            for name in [n for n in tasks if n not in wanted]:
                outcomes.append(tasks.pop(name).stop("no longer assigned to this node"))
            for name, a in wanted.items():
                rec = tasks.get(name)
                if rec is not None and rec.latest.generation == a.generation:
                    outcomes.append(rec.apply(a))
                    continue
                tasks[name] = SimulatedTask(a, self.iter_s)
                outcomes.append(tasks[name].started)
        return outcomes

    def die(self) -> None:
        """What the node's death leaves behind: no lease refresh, no status (the fleet closes its link)."""
        self.alive = False
        self.stop_event.set()
        if self.lease is not None:
            self.lease.stop()


class HollowFleet:
    """``n`` hollow agents named ``<name><i>`` in this process, against a real etcd and coordinator."""

    def __init__(self, etcd: str, n: int, gpus: int, prefix: str = "/unicron", name: str = "hollow",
                 heartbeat_s: float = 0.1, status_interval_s: float = 1.0, iter_s: float = 1.0,
                 status_threads: int = 4, run_dir: str | None = None, first: int = 0,
                 late_s: float = 0.5) -> None:
        """Nodes ``<name><first>`` .. ``<name><first + n - 1>`` (``first``: this slice of a fleet
        split over processes, :class:`FleetProcesses`); a gap between two heartbeats sent to a node
        longer than ``late_s`` is stamped (:meth:`late_sends`)."""
        self.keys = Keyspace(prefix)
        self.store = Store(etcd)
        # the keepalives' own client: a call that times out marks its client's endpoint failed for a
        # while, and the fleet's result and status writes must not take every node's lease down with
        # them (each real agent has a client of its own; seen at 1,000 nodes after the wide Assign)
        self._lease_store = Store(etcd)
        self._batch = _StatusBatch()
        # results too: 1,000 nodes answering the wide Assign at once, a put each on one client, timed
        # out by the hundred and took the client's endpoint down with them
        node_store = _FleetStore(self.store, self._batch, (self.keys.statuses(), self.keys.results()))
        self.heartbeat_s = heartbeat_s
        self.late_s = late_s
        self._last_send: dict[str, float] = {}  # node -> wall time of its last heartbeat send
        self._late: collections.deque[SendGap] = collections.deque(maxlen=LATE_SENDS_KEPT)
        self.status_interval_s = status_interval_s
        self.status_threads = status_threads
        self._own_run_dir = not run_dir  # made here: removed by stop()
        self.run_dir = run_dir or tempfile.mkdtemp(prefix="unicron-hollow-")
        self.agents = {
            f"{name}{i:04d}": HollowAgent(AgentSettings(
                node=f"{name}{i:04d}", etcd=etcd, prefix=prefix, gpu_backend="simulated", gpus=gpus,
                heartbeat_s=heartbeat_s, status_interval_s=status_interval_s, run_dir=self.run_dir,
                replica_budget_mb=0, prefork="", advertise_host="127.0.0.1"), node_store, iter_s)
            for i in range(first, first + n)
        }
        self._conns: dict[str, wire.LineSocket] = {}
        self._hung: set[str] = set()
        self._reregistering: set[str] = set()
        self._reregister_wake = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch: PrefixWatch | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> HollowFleet:
        # the keepalives first: each node stops its lease's own refresh once registered, and a slice of
        # 250 took longer than the 3 s TTL to register beside three others (their first leases lapsed)
        self._spawn(self._keepalives, "hollow-keepalives")
        self._spawn(self._reregistrar, "hollow-reregister")
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(HollowAgent.start, self.agents.values()))
        kvs, rev = self.store.get_prefix(self.keys.assignments())
        for kv in kvs:
            self._on_assignment(WatchEvent("put", kv.key, kv.value, kv.mod_revision))
        self._watch = self.store.watch_prefix(self.keys.assignments(), self._on_assignment, start_revision=rev + 1)
        self._spawn(self._heartbeats, "hollow-heartbeats")
        self._spawn(self._connector, "hollow-connector")
        self._spawn(self._flush_statuses, "hollow-status-writer")
        names = sorted(self.agents)
        for i in range(self.status_threads):
            self._spawn(lambda part=names[i::self.status_threads]: self._statuses(part), f"hollow-status-{i}")
        return self

    def _spawn(self, target: object, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)  # type: ignore[arg-type]
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        for t in self._threads:
            t.join(timeout=5.0)
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
        for c in conns:
            c.close()
        for a in self.agents.values():
            a.stop_event.set()  # a revoked lease is not lost: no re-registration
        for a in self.agents.values():
            if a.lease is not None and a.alive:
                with contextlib.suppress(StoreUnavailable):
                    a.lease.revoke()
        self.store.close()
        self._lease_store.close()
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # --- faults --------------------------------------------------------------------------------

    def kill(self, node: str) -> float:
        """The node's agent dies: its kernel closes the link, its lease is no longer refreshed.
        Returns the time of death."""
        agent = self.agents[node]
        with self._lock:
            conn = self._conns.pop(node, None)
            ts = time.time()
            agent.die()
        if conn is not None:
            conn.close()
        return ts

    def hang(self, node: str) -> float:
        """The node hangs: its link stays open but heartbeats stop, and so do lease and status."""
        agent = self.agents[node]
        with self._lock:
            self._hung.add(node)
            ts = time.time()
            agent.die()
        return ts

    def live(self) -> list[str]:
        return sorted(n for n, a in self.agents.items() if a.alive)

    def connected(self) -> int:
        with self._lock:
            return len(self._conns)

    def late_sends(self) -> list[SendGap]:
        """Every gap longer than ``late_s`` between two heartbeats this fleet sent to one node (the
        latest :data:`LATE_SENDS_KEPT`), and the gap still open now of each connected node that is not
        hung. A hung or killed node's silence is the fault injected, not lateness."""
        now = time.time()
        with self._lock:
            current = [n for n in self._conns if n not in self._hung]
        gaps = list(self._late)
        gaps += [(n, self._last_send[n], now) for n in current
                 if n in self._last_send and now - self._last_send[n] > self.late_s]
        return gaps

    # --- the shared loops ------------------------------------------------------------------------

    def _on_assignment(self, ev: WatchEvent) -> None:
        node = self.keys.tail(ev.key, self.keys.assignments())
        agent = self.agents.get(node)
        if agent is not None and agent.alive:
            agent._on_assignment_event(ev)

    def _connect(self, names: Iterable[str]) -> None:
        def one(node: str) -> None:
            found = self.agents[node].link_client._connect()
            if found is None:
                return
            _, conn = found
            with self._lock:
                if self.agents[node].alive and node not in self._conns:
                    self._conns[node] = conn
                    return
            conn.close()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, names))

    def _connector(self) -> None:
        """(Re)connects every live node without a link, apart from the heartbeats: a round of hellos
        refused while the coordinator has not yet seen the nodes' registrations must not delay the
        heartbeats of the nodes already connected (their 1 s timeout would fire)."""
        while not self._stop.wait(self.heartbeat_s):
            with self._lock:
                missing = [n for n, a in self.agents.items() if a.alive and n not in self._conns]
            if missing:
                self._connect(missing)

    def _heartbeats(self) -> None:
        beat = wire.encode(link.Heartbeat().to_wire())  # the same message every time: encoded once
        next_ts = time.monotonic()
        while not self._stop.is_set():
            with self._lock:
                conns = [(n, c) for n, c in self._conns.items() if n not in self._hung]
            for node, conn in conns:
                try:
                    conn.sock.sendall(beat)  # the fleet is the connection's only sender after the hello
                except OSError:
                    with self._lock:
                        if self._conns.get(node) is conn:
                            del self._conns[node]
                    conn.close()
                    continue
                sent = time.time()  # wall time: the coordinator's log stamps its losses in it
                before = self._last_send.get(node)
                if before is not None and sent - before > self.late_s:
                    self._late.append((node, before, sent))
                self._last_send[node] = sent
            next_ts += self.heartbeat_s
            self._stop.wait(max(0.0, next_ts - time.monotonic()))
            next_ts = max(next_ts, time.monotonic() - self.heartbeat_s)

    def _keepalives(self) -> None:
        """Every live node's lease refreshed as often as :class:`Lease` would (TTL / 4), all over one
        stream: a thread and a stream per lease cost more CPU than the coordinator at 1,000 nodes."""
        ttl = min(a.settings.lease_ttl_s for a in self.agents.values())
        while not self._stop.wait(max(0.1, ttl / 4)):
            with self._lock:
                skip = set(self._reregistering)
            leases = [(n, a.lease) for n, a in self.agents.items()
                      if a.alive and a.lease is not None and n not in skip]
            expired = []
            # 100 a stream: one stream of 1,000 exceeded the call's 2 s deadline (seen at 1,000 nodes)
            for i in range(0, len(leases), KEEPALIVE_BATCH):
                part = leases[i:i + KEEPALIVE_BATCH]
                try:
                    ttls = self._lease_store.refresh_leases([lease.lease_id for _, lease in part])
                except StoreUnavailable as exc:
                    log.warning("hollow keepalives failed; will retry", error=str(exc))
                    continue
                expired += [n for (n, _), t in zip(part, ttls, strict=True) if t <= 0]
            if expired:
                log.warning("hollow nodes' leases expired", nodes=expired[:10], count=len(expired))
                for node in expired:
                    self._reregister(node)

    def _reregister(self, node: str) -> None:
        """What the real agent does when its lease is lost (``Agent._on_lease_lost``): register anew
        under a fresh lease, which the fleet then keeps alive. Queued for one thread: a thread per
        node, each retrying against a busy etcd with a keepalive thread per attempt's lease, took the
        load average to 180 at 1,000 nodes."""
        with self._lock:
            self._reregistering.add(node)
        self._reregister_wake.set()

    def _reregistrar(self) -> None:
        while not self._stop.is_set():
            self._reregister_wake.wait(0.5)
            self._reregister_wake.clear()
            with self._lock:
                todo = sorted(self._reregistering)
            for node in todo:
                agent = self.agents[node]
                if agent.alive and not self._stop.is_set():
                    agent._reregister()
                    if agent.lease is not None:
                        agent.lease.stop()  # the fleet refreshes it
                with self._lock:
                    self._reregistering.discard(node)

    def _flush_statuses(self) -> None:
        while not self._stop.wait(0.1):
            items = self._batch.take()
            for i in range(0, len(items), MAX_TXN_OPS):
                try:
                    self.store.put_many(items[i:i + MAX_TXN_OPS])
                except StoreUnavailable as exc:
                    log.debug("hollow status writes skipped", error=str(exc))
                except PermanentError as exc:  # as the agent's own status write: logged, the next one tried
                    log.error("hollow status writes refused", error=str(exc))

    def _statuses(self, names: list[str]) -> None:
        gap = self.status_interval_s / max(1, len(names))
        while not self._stop.is_set():
            start = time.monotonic()
            for i, node in enumerate(names):
                agent = self.agents[node]
                if agent.alive:
                    agent._write_status()
                self._stop.wait(max(0.0, start + (i + 1) * gap - time.monotonic()))
                if self._stop.is_set():
                    return



def _serve_slice(conn: Connection, etcd: str, first: int, n: int, gpus: int, options: dict[str, Any]) -> None:
    """A fleet process: one :class:`HollowFleet` slice, answering its parent's calls over ``conn``
    until told to stop or until the parent goes (the pipe closes)."""
    fleet = HollowFleet(etcd, n, gpus, first=first, **options).start()
    calls: dict[str, Callable[..., object]] = {"kill": fleet.kill, "hang": fleet.hang, "live": fleet.live,
                                               "connected": fleet.connected, "late_sends": fleet.late_sends}
    conn.send(("ready", None))
    try:
        while True:
            try:
                op, args = conn.recv()
            except EOFError:
                return
            if op == "stop":
                return
            conn.send(("ok", calls[op](*args)))
    finally:
        fleet.stop()


def _await_ready(conn: Connection, proc: multiprocessing.process.BaseProcess, timeout_s: float) -> None:
    try:
        if conn.poll(timeout_s):
            conn.recv()
            return
        what = f"did not start in {timeout_s:.0f} s"
    except EOFError:  # it exited before its ready (its traceback is on stderr)
        proc.join(timeout=5.0)
        what = f"exited with {proc.exitcode} at start"
    raise StartFailed(f"hollow fleet process {proc.name} (pid {proc.pid}) {what}")


class FleetProcesses:
    """A hollow fleet of ``n`` nodes split over ``procs`` processes, each a :class:`HollowFleet` of a
    slice of the names (``<name>0000`` ..): one process's GIL cannot keep 1,000 nodes' heartbeats,
    leases and status records on time (seen at 1,000 nodes: leases lapsed). Each node keeps its own
    lease, records and link connection as in one process; only the work is spread. Same calls as
    :class:`HollowFleet`, each answered by the process that owns the node."""

    def __init__(self, etcd: str, n: int, gpus: int, procs: int, **options: Any) -> None:
        if procs < 1:
            raise ValueError(f"procs: at least 1 fleet process, got {procs}")
        per = math.ceil(n / procs)
        self.name = str(options.get("name", "hollow"))
        self._slices = [(first, min(per, n - first)) for first in range(0, n, per)]
        # spawn, not fork: the parent holds gRPC channels, which do not survive a fork
        ctx = multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        for first, count in self._slices:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve_slice, args=(child, etcd, first, count, gpus, options),
                               name=f"hollow-fleet-{first}", daemon=True)
            self._conns.append(parent)
            self.processes.append(proc)
        self._lock = threading.Lock()

    def start(self, timeout_s: float = 300.0) -> FleetProcesses:
        """Start every process; :class:`StartFailed` naming one that exits or is not ready within
        ``timeout_s``, the others stopped (their nodes would stay registered, with nothing to stop them)."""
        for proc in self.processes:
            proc.start()
        try:
            for conn, proc in zip(self._conns, self.processes, strict=True):
                _await_ready(conn, proc, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    def _call(self, i: int, op: str, *args: str) -> Any:
        with self._lock:
            self._conns[i].send((op, args))
            _, result = self._conns[i].recv()
        return result

    def _owner(self, node: str) -> int:
        index = int(node.removeprefix(self.name))
        return next(i for i, (first, count) in enumerate(self._slices) if first <= index < first + count)

    def kill(self, node: str) -> float:
        return float(self._call(self._owner(node), "kill", node))

    def hang(self, node: str) -> float:
        return float(self._call(self._owner(node), "hang", node))

    def live(self) -> list[str]:
        return sorted(n for i in range(len(self._conns)) for n in self._call(i, "live"))

    def connected(self) -> int:
        return sum(int(self._call(i, "connected")) for i in range(len(self._conns)))

    def late_sends(self) -> list[SendGap]:
        """Every process's :meth:`HollowFleet.late_sends`."""
        return [(str(n), float(a), float(b)) for i in range(len(self._conns)) for n, a, b in self._call(i, "late_sends")]

    def stop(self) -> None:
        """Each process stops its slice (leases revoked), in parallel; one that does not is killed."""
        with self._lock:
            for conn, proc in zip(self._conns, self.processes, strict=True):
                if proc.is_alive():
                    with contextlib.suppress(OSError):
                        conn.send(("stop", ()))
            for proc in self.processes:
                proc.join(timeout=30.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            for conn in self._conns:
                conn.close()
