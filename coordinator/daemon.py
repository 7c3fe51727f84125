"""The coordinator daemon: consolidates node status, reports and reconcile results from etcd, turns
them into the decision core's events (:mod:`coordinator.causes`) and carries out its decisions
(paper Figure 7).

Threads: etcd watches and the agent link push typed inputs onto one queue; a single loop thread
consumes it, so classification, incident records and decisions happen in order without locks around
the state. A decision is a transaction: the core's new state and the node records are computed on
copies, written in one fenced etcd transaction (see :mod:`coordinator.leader`), and adopted only
once that write landed. A failed write leaves memory as it was, and the input is retried.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hmac
import itertools
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import grpc

from coordinator import api, causes, compaction
from coordinator import decision as d
from coordinator.alerts import AlertMessage, WebhookNotifier
from coordinator.allocation import WafAllocator
from coordinator.costs import CostTracker
from coordinator.executor import Executor
from coordinator.grounding import Grounding
from coordinator.leader import KeyPresent, Leadership
from coordinator.link import LinkServer
from coordinator.lookup import PlanLookup
from coordinator.metrics import CoordinatorMetrics
from coordinator.settings import CoordinatorSettings, advertise_host
from coordinator.statestore import read_state, state_writes, steps_only, stored_entries
from coordinator.statuses import StatusReader
from coordinator.tasks import TaskSpec
from unicron.kernel import log as ulog
from unicron.kernel import metrics as umetrics
from unicron.kernel import tls
from unicron.kernel.errors import (
    InvalidRecord,
    NotLeader,
    PermanentError,
    StoreClosed,
    StoreUnavailable,
    TemporaryError,
    UnicronError,
)
from unicron.kernel.etcd import KeyValue, Lease, PrefixWatch, Store, WatchEvent, connect_with_retry
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.types import (
    AssignmentResult,
    Incident,
    NodeInfo,
    NodeStatus,
    Report,
    Severity,
)

log = ulog.get(__name__)

T = TypeVar("T")

# --- the loop's inputs ------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeChanged:
    """``nodes/<node>`` put (an agent registered) or deleted (its lease is gone)."""

    ev: WatchEvent
    ts: float


@dataclass(frozen=True)
class ReportSeen:
    """``reports/<id>``: an agent's report, to classify into an incident."""

    ev: WatchEvent
    ts: float


@dataclass(frozen=True)
class StatusChanged:
    """``status/<node>``: the node's ranks, their steps and exits."""

    ev: WatchEvent
    ts: float


@dataclass(frozen=True)
class ResultSeen:
    """``results/<node>``: what an agent found after reconciling its assignment."""

    ev: WatchEvent
    ts: float


@dataclass(frozen=True)
class LinkLost:
    node: str
    reason: str
    ts: float


@dataclass(frozen=True)
class LinkGoodbye:
    """The node's agent said goodbye: a planned stop."""

    node: str
    reason: str
    ts: float


@dataclass(frozen=True)
class LinkConnected:
    node: str
    ts: float


@dataclass(frozen=True)
class CoreEvent:
    """An event for the core that needs no detection (clock ticks)."""

    event: d.Event


@dataclass(frozen=True)
class Call:
    """An API call run on the loop thread; its answer goes to ``future``."""

    fn: Callable[[], object]
    future: Future[object]


@dataclass(frozen=True)
class Reelected:
    """Leadership was lost and won again: wakes the loop, which reloads what a leader in between may
    have written before it decides anything queued (``Leadership.must_reload``)."""


@dataclass(frozen=True)
class Stop:
    pass


WatchInput = NodeChanged | ReportSeen | StatusChanged | ResultSeen
Input = WatchInput | LinkLost | LinkGoodbye | LinkConnected | CoreEvent | Call | Reelected | Stop


EXIT_DEPOSED = 75  # EX_TEMPFAIL
GOODBYE_DRAIN = '"goodbye"'  # drain/<node> of a node whose agent stopped on purpose ("1": an operator's drain)
WIDE_WRITE_OPS = 100  # a decision write with more operations is logged ("decision written")
SLOW_WRITE_S = 0.1  # as is one that took longer
KEEP_INCIDENTS = 1000  # newest incidents that led to an action (or lost a node) kept in etcd; all are in the JSON log
#: newest of the others (handled in place, merged into a recovery under way, recorded only) kept, apart:
#: one crash of a W-rank job files W-1 such echoes, which in one FIFO evicted the whole actioned history
KEEP_QUIET_INCIDENTS = 250
CALL_WAIT_S = 10.0  # how long an API call waits for the decision loop to start it


class CoreClock:
    """The decision core's time: the wall clock's at an anchor, moved on by the monotonic clock since.

    A step of the host's wall clock (a bad NTP source, an operator) does not move it: stamped with
    ``time.time()``, a step forward and back left the core's clock (``max(now, event.ts)``) in the
    future for the step's length, so no deadline fired meanwhile, and a step forward alone expired
    every outstanding action at once. Records shown to people (an incident's detection time, an
    alert's) keep the wall clock. Thread-safe: the watch threads stamp their inputs with it."""

    def __init__(self, wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._wall, self._monotonic = wall, monotonic
        self._anchor = (wall(), monotonic())

    def anchor(self, at_least: float) -> None:
        """Anchor anew at the wall clock, or at ``at_least`` (a loaded state's clock) if that is later:
        the core's time never runs back, and re-anchored behind it, it would stand still again."""
        self._anchor = (max(self._wall(), at_least), self._monotonic())

    def __call__(self) -> float:
        wall, mono = self._anchor  # one tuple: a concurrent anchor() is seen whole or not at all
        return wall + (self._monotonic() - mono)


class Coordinator:
    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        #: the time of every event the decision core is given (and of the state's deadlines)
        self.clock = CoreClock()
        self.tls_config = tls.load(settings.tls_dir, settings.tls_name)
        self.tls_expiry = (tls.ExpiryWatch(self.tls_config, settings.tls_check_interval_s)
                           if self.tls_config is not None else None)
        if self.tls_expiry is not None:
            self.tls_expiry.check()
        self.keys = Keyspace(settings.prefix)
        self.stop_event = threading.Event()
        self.ready = threading.Event()
        self.store: Store | None = None
        self.leadership: Leadership | None = None
        self.link: LinkServer | None = None
        self._inbox: queue.Queue[Input] = queue.Queue()
        self._watches: list[PrefixWatch] = []
        self._nodes: dict[str, NodeInfo] = {}
        #: when the nodes of a loaded state that have not registered count as lost (None: checked)
        self._registrations_due: float | None = None
        #: each registered node's link token, read by the link threads (_verify_link)
        self._link_tokens: dict[str, str] = {}
        self._lost_nodes: set[str] = set()
        #: node -> (wall) time it was last seen alive in etcd (its status, a registration write): when a
        #: lease expiry or a missing registration finds it lost, its silence began then (Eq. 1 detection)
        self._last_alive: dict[str, float] = {}
        #: (wall) time since which this leader could see registrations: a node never seen registered
        #: has been silent since at least then
        self._registrations_since = time.time()
        self._statuses: dict[str, NodeStatus] = {}
        self._status_reader = StatusReader()  # reads a status that changed only in time and steps cheaply
        self._results: dict[str, AssignmentResult] = {}
        #: the kept incidents of both FIFOs, oldest first (trimmed with them)
        self.recent_incidents: collections.deque[Incident] = collections.deque()
        self._incident_keys: collections.deque[str] = collections.deque()  # actioned, oldest first
        self._quiet_incident_keys: collections.deque[str] = collections.deque()  # the others
        self._incident_set: set[str] = set()
        self.deposed = False
        self._leading = False  # campaign won: the link takes hellos from now on
        self._announcement: tuple[str, str] | None = None  # this coordinator's coordinators/ key and record
        self._announce_lease: Lease | None = None
        # plans for a node lost or joined are solved ahead, in a background thread (coordinator.lookup)
        self.lookup = PlanLookup(background=True)
        self.allocator = WafAllocator(settings.gpu_type, lookup=self.lookup)
        self.core = d.DecisionCore(
            d.DecisionSettings(reattempt_deadline_s=settings.reattempt_deadline_s,
                               restart_deadline_s=settings.restart_deadline_s,
                               flap_faults=settings.flap_faults, flap_window_s=settings.flap_window_s,
                               in_place_resize=settings.in_place_resize,
                               ended_tasks_kept=settings.ended_tasks_kept),
            self.allocator,
        )
        # the planner's inputs measured from adopted decisions (D_transition, failure rate, FLOP/s)
        self.grounding = Grounding(self.allocator.planner.reliability)
        self.state = self.core.initial_state()
        #: the state as etcd holds it (coordinator.statestore): a decision writes what differs from it
        self._written_state: d.CoreState | None = None
        #: the state entry keys etcd held at the load, while ``_written_state`` is unknown
        self._stored_entries: list[str] = []
        #: etcd outages seen (a decision or input that failed with StoreUnavailable), and how many of them
        #: the adopted state has given their grace (_decide): the count moves on, the grace is given once
        self._etcd_outages = 0
        self._outages_graced = 0
        self.executor = Executor(self.keys, self._spec, self._node_gpus,
                                 max_restarts=self.core.settings.max_restarts_without_progress,
                                 spare_stores=settings.spare_stores and settings.in_place_resize)
        self._seen: dict[tuple[str, int], int] = {}  # (task, generation) -> last step sent as progress
        self._last_handled: dict[str, causes.InPlaceRecovery] = {}  # task -> a rank's latest in-place recovery
        #: task -> the hang report last dismissed as a regroup echo, with when (monotonic) it stops counting:
        #: a status read after it that shows a rank of the task stopped makes it a hang after all
        self._echoes: dict[str, tuple[Report, float]] = {}
        self._api_server: grpc.Server | None = None
        self.metrics = CoordinatorMetrics()
        if self.tls_expiry is not None:
            self.metrics.registry.register(umetrics.TLSExpiry(self.tls_expiry.days_left))
        self._metrics_server: umetrics.MetricsServer | None = None
        self.costs = CostTracker()  # recovery cost per incident (Eq. 1); adopted with each decision
        self.alerts = (WebhookNotifier(settings.alert_webhook, settings.alert_webhook_timeout_s,
                                       on_failure=self.metrics.webhook_failures.inc)
                       if settings.alert_webhook else None)

    # --- lifecycle ---------------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped. Returns the process exit code."""
        if self.tls_config is None:
            log.warning(tls.plaintext_warning("this coordinator's API, its agent link or etcd"))
        if self.tls_expiry is not None:
            # a thread of its own: the ticker runs only while leading, and a standby runs for weeks too
            self.tls_expiry.start(self.stop_event)
        self.store = connect_with_retry(self.settings.etcd, self.settings.etcd_timeout_s, self.stop_event,
                                        "coordinator", tls_config=self.tls_config)
        if self.store is None:
            return 0
        self.store.on_error = self._etcd_error
        self._metrics_server = umetrics.serve(self.metrics.registry, self.settings.metrics_host,
                                              self.settings.metrics_port, "unicron-coordinator")
        if self.alerts is not None:
            self.alerts.start()
        self.link = LinkServer(
            self.settings.listen_host, self.settings.link_port, self.settings.heartbeat_timeout_s,
            on_lost=self._on_link_lost, on_connected=self._on_link_connected,
            verify=self._verify_link, on_goodbye=self._on_link_goodbye,
            on_heartbeat=self.metrics.heartbeat_gap.observe, tls_config=self.tls_config,
            accepting=lambda: self._leading and not self.deposed,
        ).start()
        self.metrics.watch_heartbeats(self.link.heartbeat_ages)
        advertise = advertise_host(self.settings)
        self._api_server, api_address = api.serve(self, self.settings.listen_host, self.settings.api_port,
                                                    tls_config=self.tls_config, advertise_host=advertise)
        link_address = api.join_host_port(advertise, int(self.link.address.rpartition(":")[2]))
        address = json.dumps({"link": link_address, "api": api_address, "pid": os.getpid()})
        self._announce(link_address, address)
        self.leadership = Leadership(self.store, self.keys, address, self.settings.leader_ttl_s,
                                     on_deposed=self._on_deposed,
                                     on_reelected=lambda: self._inbox.put(Reelected()))
        if not self.leadership.campaign(self.stop_event):
            self._withdraw()
            return 0
        self._leading = True
        if not (self._until_done("load state", self._load_state)
                and self._until_done("start watches", self._start_watches)):
            self._shutdown()
            return EXIT_DEPOSED if self.deposed else 0
        self.lookup.start()
        threading.Thread(target=self._ticker, name="ticker", daemon=True).start()
        if self.settings.etcd_history_s > 0:
            compactor = compaction.Compactor(self.store, self.settings.etcd_history_s)
            threading.Thread(target=compaction.run, args=(compactor, self.stop_event), name="compactor",
                             daemon=True).start()
        self.metrics.leader.set(1)
        self.metrics.state(self.state)
        self.ready.set()
        log.info("coordinator leading", link=link_address, api=api_address)
        self._loop()
        self._shutdown()
        # Non-zero when deposed, so systemd's Restart=on-failure brings us back as a standby.
        return EXIT_DEPOSED if self.deposed else 0

    def stop(self) -> None:
        self.stop_event.set()
        self._inbox.put(Stop())

    def _on_deposed(self) -> None:
        self.deposed = True
        log.error("deposed: another coordinator leads now; exiting so systemd restarts us as a standby")
        self.stop()

    def _shutdown(self) -> None:
        self.metrics.leader.set(0)
        self.lookup.stop()
        if self._api_server is not None:
            api.stop(self._api_server)
        if self._metrics_server is not None:
            self._metrics_server.stop()
        if self.alerts is not None:
            self.alerts.stop()
        for w in self._watches:
            w.stop()
        if self.link is not None:
            self.link.stop()
        if self.leadership is not None:
            self.leadership.resign()
        self._withdraw()
        if self.store is not None:
            self.store.close()

    def _announce(self, link_address: str, address: str) -> None:
        """Say where this coordinator is, leader or standby: agents that cannot read the leader key try
        every announced coordinator, and only the leader welcomes them (agent.link.Coordinators). Under a
        lease of its own: a crashed coordinator's entry goes with the TTL, while a whole-etcd outage does
        not end it (etcd renews its leases when it comes back), and the agents keep their copy meanwhile."""
        self._announcement = (self.keys.coordinator(link_address), address)
        threading.Thread(target=self._keep_announced, name="announce", daemon=True).start()

    def _keep_announced(self) -> None:
        """Announce, and again under a new lease whenever etcd reports the last one expired (this process
        was stopped or cut off for longer than the TTL)."""
        assert self.store is not None and self._announcement is not None
        key, address = self._announcement
        while not self.stop_event.is_set():
            lease: Lease | None = None
            try:
                lease = self.store.lease(self.settings.leader_ttl_s, on_lost=None)
                self.store.put(key, address, lease=lease)
            except (StoreUnavailable, StoreClosed) as exc:
                if lease is not None:
                    lease.stop()  # granted, but nothing under it: let it expire
                log.warning("could not announce this coordinator's address; retrying", error=str(exc))
                self.stop_event.wait(1.0)
                continue
            self._announce_lease = lease
            while not lease.lost.is_set() and not self.stop_event.wait(0.5):
                pass

    def _etcd_error(self, exc: UnicronError) -> None:
        """The store's ``on_error`` (any thread): counted in the metrics only. A call that failed and
        was retried (a keepalive, a watch's resubscription, one load-shed request) is no outage: taken
        for one, it gave every deadline a new grace, and errors every few seconds kept an unconfirmed
        restart from ever escalating. An outage is a decision or input that failed (``run``)."""
        self.metrics.etcd.error(exc)

    def _withdraw(self) -> None:
        lease = self._announce_lease
        if lease is not None:
            lease.revoke()  # deletes the entry with it

    def _until_done(self, what: str, step: Callable[[], None]) -> bool:
        """A new leader's start-up step, retried while etcd is unavailable: an outage just after the
        election killed the leader while its lease still held the key. False: stopped meanwhile."""
        while not self.stop_event.is_set():
            try:
                step()
                return True
            except StoreUnavailable as exc:
                log.warning("etcd unavailable while taking the lead; will retry", step=what, error=str(exc))
                self.metrics.etcd.retry(what)
                self.stop_event.wait(0.5)
        return False

    def _start_watches(self) -> None:
        assert self.store is not None
        kinds: tuple[tuple[str, Callable[[WatchEvent, float], WatchInput]], ...] = (
            (self.keys.nodes(), NodeChanged), (self.keys.reports(), ReportSeen),
            (self.keys.statuses(), StatusChanged), (self.keys.results(), ResultSeen),
        )
        for prefix, make in kinds[len(self._watches):]:  # a retry after an outage starts the rest
            kvs, rev = self.store.get_prefix(prefix)
            self._resync(make, kvs)
            self._watches.append(
                self.store.watch_prefix(
                    prefix, functools.partial(self._enqueue, make), start_revision=rev + 1,
                    on_resync=functools.partial(self._resync, make), known=[kv.key for kv in kvs],
                )
            )
        self._expect_registrations()

    def _expect_registrations(self) -> None:
        """Registrations can be seen from now on (etcd answers, the node watch runs): the state's nodes
        get a grace to register (an agent whose lease an outage expired registers again) before the
        ones that have not count as lost."""
        if self._registrations_due is None:  # a retry's grace does not restart the silence
            self._registrations_since = time.time()
        self._registrations_due = time.monotonic() + self.settings.registration_grace_s

    def _enqueue(self, make: Callable[[WatchEvent, float], WatchInput], ev: WatchEvent) -> None:
        if make is NodeChanged:
            self._learn_token(ev)
        self._inbox.put(make(ev, self.clock()))

    def _resync(self, make: Callable[[WatchEvent, float], WatchInput], kvs: list[KeyValue]) -> None:
        for kv in kvs:
            self._enqueue(make, WatchEvent("put", kv.key, kv.value, kv.mod_revision))

    def _learn_token(self, ev: WatchEvent) -> None:
        """On the watch's thread, in etcd's order: the token a node's link hello must carry. Not on the
        loop, which retries an input whose write failed before any input behind it: with etcd down
        after a takeover, a node whose registration waited behind it had its hello refused and fenced
        its ranks (the link must be verifiable without etcd, chaos seed 97)."""
        node = self.keys.tail(ev.key, self.keys.nodes())
        if ev.kind == "delete":
            self._link_tokens.pop(node, None)
            return
        with contextlib.suppress(InvalidRecord):  # the loop logs it
            self._link_tokens[node] = NodeInfo.from_json(ev.value).link_token

    # --- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        retry: Input | None = None
        while not self.stop_event.is_set():
            if retry is not None:
                item, retry = retry, None
            else:
                try:
                    item = self._inbox.get(timeout=0.5)
                except queue.Empty:
                    continue
            try:
                if self.leadership is not None and self.leadership.must_reload:
                    self._reload()  # before any input queued meanwhile is decided on the old state
                self._handle(item)
            except NotLeader:
                return
            except StoreUnavailable as exc:
                # Nothing was adopted (see _decide) and the input is still ours: try it again.
                log.warning("etcd unavailable while handling input; will retry", input=type(item).__name__,
                            error=str(exc))
                self.metrics.etcd.retry("input")
                self._etcd_outages += 1  # the next decision that lands gives the deadlines a grace (_decide)
                self.stop_event.wait(0.2)
                # Next, not behind what came meanwhile: a lease's loss retried after the node's new
                # registration left the registered node lost.
                retry = item
            except PermanentError as exc:
                # Retrying cannot help (e.g. the executor refused a placement): drop it, memory unchanged.
                log.error("input refused; dropped", input=type(item).__name__, error=str(exc))
            except Exception:
                # A bug: never retried as an outage, and it must not end the loop of a leader that keeps its lease.
                log.exception("handler failed; input dropped", input=type(item).__name__)

    def _handle(self, item: Input) -> None:
        match item:
            case NodeChanged():
                self._on_node(item.ev, item.ts)
            case ReportSeen():
                self._on_report(item.ev)
            case StatusChanged():
                self._on_status(item.ev, item.ts)
            case ResultSeen():
                self._on_result(item.ev, item.ts)
            case LinkLost():
                self._node_lost(item.node, f"agent {item.reason}", item.ts)
            case LinkConnected():
                self._lost_nodes.discard(item.node)
            case LinkGoodbye():
                self._handle_link_goodbye(item.node, item.reason, item.ts)
            case CoreEvent():
                if isinstance(item.event, d.Tick):
                    self._check_registrations(item.event.ts)
                    self._forget_old_runs()
                self._decide(item.event)
            case Call():
                self._run_call(item)
            case Reelected():
                pass  # it woke the loop, which reloads first (_reload)
            case Stop():
                pass

    def _reload(self) -> None:
        log.warning("leadership regained after losing its lease; reloading the decision state")
        assert self.leadership is not None
        losses = self.leadership.losses
        self._load_state()
        self._expect_registrations()
        self.leadership.state_reloaded(losses)

    # --- inputs ------------------------------------------------------------------------------

    def _on_link_lost(self, node: str, reason: str, ts: float) -> None:
        self._inbox.put(LinkLost(node, reason, ts))

    def _on_link_connected(self, node: str, ts: float) -> None:
        self._inbox.put(LinkConnected(node, ts))

    def _link_alive(self, node: str) -> bool:
        return self.link is not None and node in self.link.connected_nodes()

    # --- who may speak for a node, and a node that leaves on purpose (issue 19 items 13, 6) ---

    def _verify_link(self, node: str, token: str) -> bool:
        """On a link thread: a hello must carry the token of ``nodes/<node>`` (until the link has TLS)."""
        known = self._link_tokens.get(node)
        if known != token:
            info = self._read_node(node)  # the watch may not have delivered a fresh registration yet
            known = info.link_token if info is not None else None
        if not known:
            return False
        return hmac.compare_digest(known.encode(), token.encode())

    def _read_node(self, node: str) -> NodeInfo | None:
        try:
            kv = self.store.get(self.keys.node(node)) if self.store is not None else None
            return NodeInfo.from_json(kv.value) if kv is not None else None
        except (StoreUnavailable, StoreClosed, InvalidRecord):
            return None

    def _on_link_goodbye(self, node: str, reason: str, ts: float) -> None:
        self._inbox.put(LinkGoodbye(node, reason, self.clock()))  # a core event's time (the link's is wall)

    def _handle_link_goodbye(self, node: str, reason: str, ts: float) -> None:
        """A planned stop is a drain, not a failure: the node's tasks move without an incident, and
        the lease revocation that follows is no loss. The drain is lifted when the node registers
        again (a restart or upgrade is not a decision to keep it out; an operator who wants that
        drains it, and that drain outlives agent restarts as before)."""
        entry = self.state.nodes.get(node)
        if entry is None or entry.status is not d.NodeState.UP:
            self._lost_nodes.add(node)
            log.info("node left on purpose", node=node, reason=reason, state=entry.status.value if entry else None)
            return
        log.info("node left on purpose; draining it", node=node, reason=reason)
        self._decide(d.NodeDrained(ts=ts, node=node, reason=f"agent stopped on purpose ({reason})"),
                     puts={self.keys.drain(node): GOODBYE_DRAIN})
        # only once drained: a drain that was refused leaves the lease's end to count as the node's loss
        # (taken as already lost, its tasks stayed placed on a host that had stopped)
        self._lost_nodes.add(node)

    def _lift_goodbye_drain(self, node: str, ts: float) -> None:
        entry = self.state.nodes.get(node)
        if entry is None or entry.status is not d.NodeState.DRAINED:
            return
        assert self.store is not None
        kv = self.store.get(self.keys.drain(node))
        if kv is not None and kv.value.decode(errors="replace") == GOODBYE_DRAIN:
            log.info("node back after a planned stop; lifting its drain", node=node)
            self._node_event(node, d.NodeUndrained(ts=ts, node=node))

    def _on_node(self, ev: WatchEvent, ts: float) -> None:
        node = self.keys.tail(ev.key, self.keys.nodes())
        if ev.kind == "delete":
            self._registration_gone(node, causes.LEASE_EXPIRED, "lease expired", ts, silent_since=ts)
            self._nodes.pop(node, None)
            return
        try:
            info = NodeInfo.from_json(ev.value)
        except InvalidRecord as exc:
            log.warning("ignoring garbage node record", key=ev.key, error=str(exc))
            return
        previous = self._nodes.get(node)
        if previous is None or previous.agent_pid != info.agent_pid or previous.started_ts != info.started_ts:
            log.info("node registered", node=node, gpus=info.gpus, backend=info.gpu_backend)
            joined = causes.rejoin(node, info.gpus, self.state, ts)
            if joined is None:
                log.warning("isolated node re-registered; it stays isolated until an operator undrains it",
                            node=node)
            else:
                self._decide(joined)
                self._lift_goodbye_drain(node, ts)
        self._nodes[node] = info
        self._lost_nodes.discard(node)
        self._last_alive[node] = max(ts, self._last_alive.get(node, ts))

    def _registration_gone(self, node: str, reason: str, metric: str, ts: float, silent_since: float) -> None:
        """``silent_since``: when the node was last known alive, if this leader saw no sign of life of it."""
        lost = causes.lease_gone(node, self._link_alive(node), node in self._lost_nodes, ts, reason)
        if lost is not None:
            # Recorded as a sev1 incident like a lost link (an agent killed before its link reached
            # a new leader is found only so; the chaos suite saw such a loss with no incident). Its
            # source time is the node's last sign of life: the silence before is detection time.
            since = min(ts, self._last_alive.get(node, silent_since))
            self._record(causes.node_lost_report(node, lost.reason, since), report_key=None, event=lost)
            self._last_alive.pop(node, None)  # once recorded: a write that failed is retried with it
            self.metrics.node_losses.labels(metric).inc()
            self._lost_nodes.add(node)
        elif node not in self._lost_nodes:
            log.info("node not registered while its link is alive: not a node loss", node=node, reason=reason)

    def _forget_old_runs(self) -> None:
        """Progress and in-place-recovery memory of what the state no longer runs (a retired task, an
        older generation): only the current generation's steps count, and a leader runs for months."""
        tasks = self.state.tasks
        self._seen = {k: v for k, v in self._seen.items() if (e := tasks.get(k[0])) is not None and k[1] >= e.generation}
        for task in [t for t in self._last_handled if t not in tasks]:
            del self._last_handled[task]
        for task in [t for t in self._echoes if t not in tasks]:
            del self._echoes[task]

    def _check_registrations(self, ts: float) -> None:
        """Once, a grace after this leader could first see registrations: the state's nodes in service
        that still have none are lost. Read from etcd, not from the watch's inputs (one still queued,
        or retried after an etcd error, is a registration all the same)."""
        due = self._registrations_due
        if due is None or time.monotonic() < due:
            return
        assert self.store is not None
        try:
            kvs, _ = self.store.get_prefix(self.keys.nodes())
        except StoreUnavailable as exc:  # the agents' leases may expire meanwhile: a grace from its end
            log.warning("etcd unavailable while checking the nodes' registrations; checking later", error=str(exc))
            self._expect_registrations()
            return
        registered = {self.keys.tail(kv.key, self.keys.nodes()) for kv in kvs}
        for node in causes.unregistered(self.state, registered):
            self._registration_gone(node, causes.NEVER_REGISTERED, "not registered", ts,
                                    silent_since=self._registrations_since)
        self._registrations_due = None  # only once every loss is recorded: a failed write retries the tick

    def _node_lost(self, node: str, reason: str, ts: float) -> None:
        if node in self._lost_nodes:
            log.info("node loss already recorded", node=node, reason=reason)
            return
        self._record(causes.node_lost_report(node, reason, ts), report_key=None)
        self._lost_nodes.add(node)
        self.metrics.node_losses.labels(reason).inc()

    def _on_report(self, ev: WatchEvent) -> None:
        if ev.kind == "delete":
            return
        try:
            report = Report.from_json(ev.value)
            causes.speaks_for(self.keys.tail(ev.key, self.keys.reports()).partition("/")[0], report.node, "report")
        except InvalidRecord as exc:
            log.warning("deleting garbage report", key=ev.key, error=str(exc))
            assert self.leadership is not None
            self.leadership.write(deletes=[ev.key])
            return
        self._record(report, report_key=ev.key)

    def _record(self, report: Report, report_key: str | None, event: d.Event | None = None) -> None:
        """Record the report's incident and decide on it, in one fenced write. ``event``: what the core
        decides on instead of the incident itself (a lease gone is a ``NodeLost``)."""
        last = self._last_handled.get(report.task) if report.task is not None else None
        if report.handled and report.task is not None:
            self._last_handled[report.task] = (last or causes.InPlaceRecovery(report.source_ts, report.step)).after(report)
        elif causes.regroup_echo(report, last, self.settings.regroup_grace_s, self._statuses):
            assert report.task is not None
            self._echoes[report.task] = (report, time.monotonic() + self.settings.regroup_grace_s)
            report = dataclasses.replace(report, handled=True, message=f"{report.message} (during an in-place regroup)")
        elif (held := causes.held_by_phase(report, self._statuses)) is not None:
            report = dataclasses.replace(report, handled=True, message=f"{report.message} ({held})")
        else:
            report = causes.hang_culprit(report, self._statuses)
        incident = causes.incident(report, detected_ts=time.time())
        key = self.keys.incident(incident.incident_id)
        assert self.leadership is not None
        if key in self._incident_set:
            # Seen again (a watch replay after an etcd outage): recorded and decided already.
            log.info("report already recorded", incident=incident.incident_id, report=report.report_id)
            if report_key:
                self.leadership.write(deletes=[report_key])
            return
        # Whether the decision issues an action is known only after it, and the expiry goes in its write:
        # room is made in both FIFOs for one not handled (a handled one leads to no decision, no action).
        expired_actioned = [] if incident.handled else _oldest_over(self._incident_keys, KEEP_INCIDENTS)
        expired_quiet = _oldest_over(self._quiet_incident_keys, KEEP_QUIET_INCIDENTS)
        expired = expired_actioned + expired_quiet
        puts = {key: incident.to_json()}
        deletes = ([report_key] if report_key else []) + expired
        if event is None:
            event = causes.raised(incident, report.generation, report.restart_epoch)
            if event is not None:  # the core's time, not the incident's (wall-clock) detection time
                event = dataclasses.replace(event, ts=self.clock())
        if event is None:
            self.leadership.write(puts=puts, deletes=deletes)
        else:
            # the decision stamps the action the incident led to (coordinator.costs)
            incident = self._decide(event, puts=puts, deletes=deletes, incident=incident).get(
                incident.incident_id, incident)
        self.metrics.incident(incident)
        for _ in expired_actioned:
            self._incident_keys.popleft()
        for _ in expired_quiet:
            self._quiet_incident_keys.popleft()
        if expired:
            gone = set(expired)
            self._incident_set -= gone
            self.recent_incidents = collections.deque(
                i for i in self.recent_incidents if self.keys.incident(i.incident_id) not in gone)
        (self._incident_keys if _actioned(incident) else self._quiet_incident_keys).append(key)
        self._incident_set.add(key)
        self.recent_incidents.append(incident)
        log.warning(
            "incident", incident=incident.incident_id, severity=str(incident.severity) if incident.severity else None,
            method=incident.method.value, kind=incident.kind.value, task=incident.task, node=incident.node,
            gpu=incident.gpu, rank=incident.rank, step=incident.step, message=incident.message,
            source_ts=incident.source_ts, detected_ts=incident.detected_ts,
            detection_latency_s=round(incident.detection_latency_s, 4), handled=incident.handled,
        )
        if event is None:
            log.info("incident handled in place by the runtime; no action", incident=incident.incident_id)

    def _on_status(self, ev: WatchEvent, ts: float) -> None:
        """A node's ranks: their steps are progress (which may confirm a recovery), their exits may
        finish a task."""
        node = self.keys.tail(ev.key, self.keys.statuses())
        if ev.kind == "delete":
            self._statuses.pop(node, None)
            self._status_reader.forget(node)
            return
        try:
            status = self._status_reader.read(node, ev.value)
            causes.speaks_for(node, status.node, "status")
        except InvalidRecord as exc:
            log.warning("ignoring garbage node status", key=ev.key, error=str(exc))
            return
        self._statuses[node] = status
        self._last_alive[node] = max(status.ts, self._last_alive.get(node, status.ts))
        self._recheck_echoes(status)
        for made in causes.progress(status, self.state, self._seen, ts):
            self._decide(made)
            assert made.generation is not None
            key = (made.task, made.generation)
            self._seen[key] = max(made.step, self._seen.get(key, -1))  # a redone step is below it
        for ended in causes.ended(self._statuses, self.state, ts, changed=node):
            if isinstance(ended, d.TaskStopped):
                log.warning("every rank of the task stopped before its end, unasked", task=ended.task,
                            step=ended.step, reason=ended.reason)
            else:
                log.info("every rank of the task exited 0: finished", task=ended.task)
            self._decide(ended)

    def _recheck_echoes(self, status: NodeStatus) -> None:
        """A hang report dismissed as a regroup echo is a hang after all when a status read after it
        shows a rank of its task stopped (a SIGSTOP within the grace): the report can reach this
        leader before the status that shows the frozen rank (statuses come every second), and
        dismissed it held the task at a fraction of its ranks until ``hang_repeat_s`` reported it again."""
        for task, (report, until) in list(self._echoes.items()):
            if time.monotonic() > until:
                del self._echoes[task]
            elif any(r.task == task and report.generation in (None, r.generation) and r.state == "stopped"
                     for r in status.ranks):
                log.warning("a hang taken for a regroup echo is a hang: a rank of its task is stopped",
                            task=task, node=status.node, report=report.report_id)
                self._record(dataclasses.replace(report, report_id=f"{report.report_id}-stopped"), report_key=None)
                del self._echoes[task]  # only once recorded: a failed write retries this status, and it again

    def _on_result(self, ev: WatchEvent, ts: float) -> None:
        """An agent's reconcile result: the outcome of the actions it carried out."""
        if ev.kind == "delete":
            return
        try:
            result = AssignmentResult.from_json(ev.value)
            causes.speaks_for(self.keys.tail(ev.key, self.keys.results()), result.node, "result")
        except InvalidRecord as exc:
            log.warning("ignoring garbage reconcile result", key=ev.key, error=str(exc))
            return
        self._results[result.node] = result
        for outcome in causes.outcomes(result, self._results, self.state, ts):
            self._decide(outcome)

    # --- the decision core ----------------------------------------------------------------------

    def _load_state(self) -> None:
        """Resume what a previous leader decided: the core's state and the nodes' assignments."""
        assert self.store is not None and self.leadership is not None
        # a wide write a previous leader committed but did not finish is part of the state to load
        self.leadership.recover()
        self._written_state = None  # what etcd holds is not known entry by entry: the next write writes all
        try:
            stored, split, unreadable = read_state(self.store, self.keys)
            if stored is not None:
                self.state = stored
                # an entry left out is deleted by the first write (which then writes every entry)
                self._written_state = stored if split and not unreadable else None
            for bad in unreadable:
                log.error("unreadable decision state entry left out: its node re-registers, its task's ranks "
                          "are stopped; resubmit the task from the stored value if it should run",
                          key=bad.key, error=bad.error, value=bad.value[:2000])
        except InvalidRecord as exc:
            log.error("ignoring unreadable decision state; starting afresh", error=str(exc))
        self._stored_entries = stored_entries(self.store, self.keys) if self._written_state is None else []
        kvs, _ = self.store.get_prefix(self.keys.assignments())
        self.executor.load({kv.key: kv.value for kv in kvs})
        kvs, _ = self.store.get_prefix(self.keys.incidents())
        kvs.sort(key=lambda kv: kv.create_revision)
        self._incident_keys.clear()
        self._quiet_incident_keys.clear()
        self._incident_set = {kv.key for kv in kvs}
        # A new leader answers `unicron tasks` (recovery cost per task) from what its predecessors recorded.
        self.recent_incidents.clear()
        for kv in kvs:
            try:
                inc = Incident.from_json(kv.value)
            except InvalidRecord as exc:
                log.warning("ignoring unreadable incident record", key=kv.key, error=str(exc))
                self._quiet_incident_keys.append(kv.key)  # teaches nothing: the first to go
                continue
            self.recent_incidents.append(inc)
            (self._incident_keys if _actioned(inc) else self._quiet_incident_keys).append(kv.key)
        # measured transitions survive a leader change: they are in the incident records
        self.grounding.seed(self.recent_incidents, self.state)
        self.grounding.apply(self.allocator)
        # the agents' confirmations of the gap are read once the watches start: the registration grace
        self.clock.anchor(self.state.now)
        self.state = self.state.resumed(self.clock() + self.settings.registration_grace_s)

    def _spec(self, task: str) -> TaskSpec | None:
        entry = self.state.tasks.get(task)
        return entry.spec if entry is not None else None

    def _ticker(self) -> None:
        while not self.stop_event.wait(1.0):
            self._inbox.put(CoreEvent(d.Tick(ts=self.clock())))

    def _node_gpus(self, node: str) -> int:
        return _gpus_in(self.state, node)

    def _decide(self, event: d.Event, puts: Mapping[str, str] | None = None,
                deletes: Sequence[str] = (), incident: Incident | None = None,
                absent: Sequence[str] = ()) -> dict[str, Incident]:
        """Feed one event to the core; write its state, the changed node records, the incidents whose
        recovery cost changed and ``puts`` / ``deletes`` in one fenced transaction; adopt the new
        state only once that write landed. Returns those incidents by id. ``incident``: the one the
        event stands for when it is not an ``IncidentRaised`` (a lease gone is a ``NodeLost``), so its
        action is costed and it counts as a failure all the same. ``absent``: keys the write requires
        absent (:class:`~coordinator.leader.KeyPresent` otherwise; an event that is not a tick or
        progress, so that its decision is written)."""
        outages = self._etcd_outages
        base = self.state
        if outages != self._outages_graced:
            # etcd was unreachable since the last adopted decision. A leader that kept its lease through
            # it is in a new leader's place: what confirms the outstanding actions (the ranks' statuses,
            # the agents' results) waits in the agents' retries and the watches' resumption, and the
            # first decision after the outage (the retried tick) expired a restart whose ranks had
            # stepped all along. The grace is part of this decision: written with it, adopted with it.
            base = base.resumed(self.clock() + self.settings.registration_grace_s)
        state, actions, edges = self.core.explain(base, event)
        draft, changed = execute(self.executor, state, actions)
        writes = dict(puts or {})
        forgotten = event.node if isinstance(event, d.NodeForgotten) and event.node not in state.nodes else None
        if forgotten is not None:
            # its records go with its state entry, in this very write; none may be written back later
            draft.forget(forgotten)
            changed.discard(forgotten)
            deletes = [*deletes, self.keys.assignment(forgotten), self.keys.result(forgotten),
                       self.keys.drain(forgotten)]
        # a retired task's spec record goes with its state entry (DecisionSettings.ended_tasks_kept)
        retired = {self.keys.task(t) for t in self.state.tasks.keys() - state.tasks.keys()}
        deletes = [*deletes, *sorted(retired - set(deletes))]
        for t, e in state.tasks.items():
            # a task's spec record follows its entry: a failed update rolled back must show the spec that runs
            was, key = self.state.tasks.get(t), self.keys.task(t)
            if was is not None and was.spec is not e.spec and was.spec != e.spec and key not in writes:
                writes[key] = json.dumps(e.spec.to_dict())
        raised = event.incident if isinstance(event, d.IncidentRaised) else incident
        costs, costed = self.costs.step(self.state, state, event.ts, raised)
        for inc in costed:
            key = self.keys.incident(inc.incident_id)
            # only records still kept (not expired, not deleted by this very write)
            if (key in self._incident_set or key in writes) and key not in deletes:
                writes[key] = inc.to_json()
        quiet = (not edges and not actions and not changed and not writes and not deletes
                 and isinstance(event, d.Tick | d.ProgressMade) and steps_only(self.state, state))
        if not quiet:
            # Clock ticks and plain progress that decided nothing are not worth a write per event:
            # a successor re-observes the clock and the last step (not a reset restart budget, say).
            writes.update(draft.record(node) for node in sorted(changed))
            state_puts, state_deletes = state_writes(self.keys, self._written_state, state, self._stored_entries)
            writes.update(state_puts)
            deletes = [*deletes, *state_deletes]
            assert self.leadership is not None
            started = time.monotonic()
            self.leadership.write(puts=writes, deletes=deletes, absent=absent)
            self._written(event, len(writes) + len(deletes), time.monotonic() - started)
            self._written_state, self._stored_entries = state, []
        draft.specs, draft.node_gpus = self._spec, self._node_gpus
        resized = self._check_returning(self.state, state, event.ts)
        self.state, self.executor, self.costs = state, draft, costs
        self._outages_graced = outages
        if forgotten is not None:
            self._forget_records(forgotten)
        for edge in edges:
            log.info("transition", edge=str(edge))
        for action in actions:
            log.warning("action", action=type(action).__name__, **{
                k: v for k, v in d.to_dict(action).items() if k != "type" and isinstance(v, str | int | float)})
            if isinstance(action, d.Alert):
                self._alert(action, time.time())  # for people: the wall clock
        self._observe(state, event, actions, costed, raised)
        for joined in resized:
            try:
                self._decide(joined)
            except StoreUnavailable:  # this decision is adopted: the loop retries only the correction
                self._inbox.put(CoreEvent(joined))
        return {inc.incident_id: inc for inc in costed}

    def _check_returning(self, old: d.CoreState, new: d.CoreState, ts: float) -> list[d.NodeJoined]:
        """A node back in service that no agent holds (an isolated node's agent died meanwhile, and
        an isolated node's loss changes nothing in the state) must be found lost again: its
        registration is checked after the grace, as a new leader checks every node's. Returns a
        ``NodeJoined`` for each node back from isolation (in service or drained) whose registration has
        another GPU count than the core's: an isolated node's registration never reaches the core
        (``causes.rejoin``), and planned with the count from before its isolation, the executor handed
        out GPUs the node no longer has. Not a lost node: only its NodeJoined, with its registration's
        count, brings it back (decided before ``_nodes`` holds that registration)."""
        back: list[str] = []
        resized: list[d.NodeJoined] = []
        for n, e in new.nodes.items():
            o = old.nodes.get(n)
            if o is None or o is e:  # copy on write: an entry the decision did not touch is the same object
                continue
            if e.status is d.NodeState.UP and o.status is not d.NodeState.UP and n not in self._nodes:
                back.append(n)
            info = self._nodes.get(n)
            if (o.status is d.NodeState.ISOLATED and e.status in (d.NodeState.UP, d.NodeState.DRAINED)
                    and info is not None and info.gpus != e.gpus):
                resized.append(d.NodeJoined(ts=ts, node=n, gpus=info.gpus))
        if back:
            self._lost_nodes.difference_update(back)
            if self._registrations_due is None:  # one pending covers these too: never postpone it
                self._expect_registrations()
        return resized

    def _written(self, event: d.Event, ops: int, write_s: float) -> None:
        """Log a wide or slow decision write (a reconfiguration spanning many nodes): bench/scale.py reads it."""
        if ops > WIDE_WRITE_OPS or write_s > SLOW_WRITE_S:
            log.info("decision written", decision=type(event).__name__, ops=ops, write_s=round(write_s, 4))

    def _observe(self, state: d.CoreState, event: d.Event, actions: Sequence[d.Action],
                 costed: Sequence[Incident], raised: Incident | None) -> None:
        """Metrics, the in-memory incident list and the planner's measured inputs after an adopted
        decision (never before: a decision whose write failed teaches the planner nothing)."""
        self.grounding.decided(state, event, costed)
        try:
            self.grounding.apply(self.allocator)
        except InvalidRecord as exc:  # a measurement the planner refuses: the decision stands, adopted
            log.error("planner refused a measured input; planning on without it", error=str(exc))
        self.metrics.state(state)
        plan = self.core.allocator.last_plan if isinstance(self.core.allocator, WafAllocator) else None
        if actions:  # no plan: the last one fell back to an even split (an unmodelled task), none stands
            self.metrics.planned(*((plan.throughput, plan.waf) if plan is not None else ({}, {})))
        for inc in costed:
            if raised is not None and inc.incident_id == raised.incident_id:
                continue  # new: _record appends it and counts it
            for i, old in enumerate(self.recent_incidents):
                if old.incident_id == inc.incident_id:
                    self.recent_incidents[i] = inc
                    self.metrics.cost_changed(old, inc)
                    log.info("recovery cost", incident=inc.incident_id, action=inc.action, tasks=inc.tasks,
                             detection_s=inc.detection_s, transition_s=inc.transition_s,
                             sub_healthy_s=inc.sub_healthy_s)
                    break

    def _alert(self, action: d.Alert, ts: float) -> None:
        self.metrics.alerts.inc()
        if self.alerts is not None:
            self.alerts.send(AlertMessage(alert_id=action.action_id, message=action.message, task=action.task,
                                          node=action.node, ts=ts, cluster=self.settings.prefix))

    # --- the API (coordinator.api.ControlPlane), run on the loop thread ---------------------

    def _call(self, fn: Callable[[], T]) -> T:
        if not self.ready.is_set():
            raise NotLeader("this coordinator is not the leader (yet); ask the one in the leader key")
        fut: Future[object] = Future()
        self._inbox.put(Call(fn, fut))
        try:
            return cast(T, fut.result(timeout=CALL_WAIT_S))
        except TimeoutError:
            if fut.done():  # fn's own TimeoutError
                raise
            # Not started yet: cancelled, so the loop drops it and "not done, retry" is the truth (it
            # stayed queued and ran later: a Submit or Cancel the client saw fail took effect anyway).
            if fut.cancel():
                raise TemporaryError(f"the decision loop did not take this call within {CALL_WAIT_S:g}s; "
                                     "nothing was done, retry") from None
            return cast(T, fut.result())  # already running: its outcome is the answer

    @staticmethod
    def _run_call(call: Call) -> None:
        if not call.future.set_running_or_notify_cancel():
            return  # its caller gave up before the loop took it: never run
        try:
            call.future.set_result(call.fn())
        except Exception as exc:  # the caller's error, answered to the API client, not ours to handle
            call.future.set_exception(exc)

    def submit(self, spec: TaskSpec) -> bool:
        return self._call(lambda: self._submit(spec))

    def _submit(self, spec: TaskSpec) -> bool:
        """Whether ``spec`` was added (False: the active task of that name has this very spec)."""
        old = self.state.tasks.get(spec.name)
        if old is not None and old.phase in d.ACTIVE_PHASES:
            if old.spec == spec:
                # A client's retry after a failover (or a lost answer) whose first try landed: the
                # client retries UNAVAILABLE and DEADLINE_EXCEEDED, which a leader dying after its
                # write also answers. Refused, an operator told to cancel would lose the task's progress.
                log.info("task already submitted, same spec", task=spec.name)
                return False
            raise api.AlreadyExists(f"task {spec.name!r} is active; cancel it first or pick another name")
        self._decide(d.TaskSubmitted(ts=self.clock(), spec=spec),
                     puts={self.keys.task(spec.name): json.dumps(spec.to_dict())})
        return True

    def update(self, spec: TaskSpec) -> None:
        def run() -> None:
            old = self.state.tasks.get(spec.name)
            if old is None or old.phase not in d.ACTIVE_PHASES:
                raise api.NotFound(f"no active task {spec.name!r} to update; submit it instead")
            self._decide(d.TaskUpdated(ts=self.clock(), spec=spec),
                         puts={self.keys.task(spec.name): json.dumps(spec.to_dict())})
        self._call(run)

    def cancel(self, name: str) -> None:
        def run() -> None:
            entry = self.state.tasks.get(name)
            if entry is None or entry.phase not in d.ACTIVE_PHASES:
                raise api.NotFound(f"no active task {name!r}; see 'unicron tasks'")
            self._decide(d.TaskCancelled(ts=self.clock(), task=name), deletes=[self.keys.task(name)])
        self._call(run)

    def tasks(self) -> list[dict[str, Any]]:
        def run() -> list[dict[str, Any]]:
            costs = recovery_by_task(self.recent_incidents)
            return [{
                "name": name, "phase": e.phase.value, "weight": e.spec.weight, "min_gpus": e.spec.min_gpus,
                "gpus": len(e.all_ranks()), "generation": e.generation, "nodes": sorted(e.placement),
                "restarts": e.restarts, "step": e.last_step, "reason": e.reason,
                # the last relaunching update's outcome, which 'unicron update --wait' waits for
                "update": None if e.update is None else e.update.value, "update_reason": e.update_reason,
                "incidents": costs.get(name, (0, 0.0))[0], "recovery_s": round(costs.get(name, (0, 0.0))[1], 3),
                # measured (None until measured): the planner's D_transition and T(t, x) inputs
                "transition_s": _rounded(self.grounding.transition_s.get(name)),
                "achieved_flops": _rounded(self.grounding.achieved_flops(name)),
            } for name, e in sorted(self.state.tasks.items())]
        return self._call(run)

    def nodes(self) -> list[dict[str, Any]]:
        def run() -> list[dict[str, Any]]:
            return [{"node": n, "gpus": e.gpus, "state": e.status.value, "reason": e.reason}
                    for n, e in sorted(self.state.nodes.items())]
        return self._call(run)

    def _node_event(self, node: str, event: d.NodeDrained | d.NodeUndrained) -> None:
        if node not in self.state.nodes:
            raise api.NotFound(f"no node {node!r}; see 'unicron nodes'")
        if isinstance(event, d.NodeDrained):
            self._decide(event, puts={self.keys.drain(node): "1"})
        else:
            self._decide(event, deletes=[self.keys.drain(node)])

    def drain(self, node: str) -> None:
        self._call(lambda: self._node_event(node, d.NodeDrained(ts=self.clock(), node=node)))

    def forget(self, node: str) -> None:
        self._call(lambda: self._forget(node))

    def _forget(self, node: str) -> None:
        """A node retired for good leaves the state, its ``assign/``, ``results/`` and ``drain/``
        records in the same write. Only a node no agent holds: registered, it would come back as the
        node it was (its agent's results read against a forgotten record). The core refuses an up
        node, and one a task still names."""
        entry = self.state.nodes.get(node)
        if entry is None:
            raise api.NotFound(f"no node {node!r}; see 'unicron nodes'")
        if entry.status is d.NodeState.UP:
            still = PermanentError(f"node {node} is up; drain it and stop its agent first")
        else:
            still = PermanentError(f"node {node} is {entry.status.value} but its agent is still registered; "
                                   "stop its agent first")
        if node in self._nodes or self._link_alive(node):
            raise still
        try:
            # etcd's word, at the write itself: a registration the watch has not delivered yet, or one
            # landing after any check made here (a read, then the write, forgot it anyway), refuses it
            self._decide(d.NodeForgotten(ts=self.clock(), node=node), absent=[self.keys.node(node)])
        except KeyPresent:
            raise still from None

    def _forget_records(self, node: str) -> None:
        """What this leader remembers of a forgotten node: a node of that name registering later is
        a new node, judged on nothing of the old one's."""
        self._nodes.pop(node, None)
        self._link_tokens.pop(node, None)
        self._last_alive.pop(node, None)
        self._lost_nodes.discard(node)
        self._statuses.pop(node, None)
        self._status_reader.forget(node)
        self._results.pop(node, None)

    def undrain(self, node: str) -> None:
        self._call(lambda: self._node_event(node, d.NodeUndrained(ts=self.clock(), node=node)))

    def incidents(self, limit: int) -> list[dict[str, Any]]:
        if not self.ready.is_set():
            raise NotLeader("this coordinator is not the leader (yet); ask the one in the leader key")
        items = [i.to_dict() for i in list(self.recent_incidents)]
        return items[-limit:] if limit > 0 else items

    def cluster_gpus(self) -> int | None:
        return sum(e.gpus for e in self.state.nodes.values()) or None

    def gpus_per_node(self) -> int | None:
        sizes = {e.gpus for e in self.state.nodes.values()}
        return sizes.pop() if len(sizes) == 1 else None


def _oldest_over(keys: collections.deque[str], bound: int) -> list[str]:
    """The oldest keys to delete so that one more fits within ``bound``."""
    return list(itertools.islice(keys, max(0, len(keys) + 1 - bound)))


def _actioned(inc: Incident) -> bool:
    """Kept under ``KEEP_INCIDENTS``: it led to an action (its Eq. 1 transition is what the planner
    measures) or is a sev1 (a node lost or isolated: the failure history)."""
    return inc.action is not None or inc.severity is Severity.SEV1


def recovery_by_task(incidents: Iterable[Incident]) -> dict[str, tuple[int, float]]:
    """task -> (incidents that led to an action for it, their Eq. 1 seconds summed): the incidents
    the coordinator still keeps (the newest ``KEEP_INCIDENTS`` that led to an action)."""
    out: dict[str, tuple[int, float]] = {}
    for inc in incidents:
        for task in inc.tasks:
            n, total = out.get(task, (0, 0.0))
            out[task] = (n + 1, total + inc.recovery_s)
    return out


def _rounded(value: float | None) -> float | None:
    """Four significant digits (FLOP/s and seconds alike), None kept."""
    return None if value is None else float(f"{value:.4g}")


def _gpus_in(state: d.CoreState, node: str) -> int:
    """A node's GPUs as its registration told the core (0 for a node the core does not know)."""
    entry = state.nodes.get(node)
    return entry.gpus if entry is not None else 0


def _spec_in(state: d.CoreState, task: str) -> TaskSpec | None:
    entry = state.tasks.get(task)
    return entry.spec if entry is not None else None


def execute(executor: Executor, state: d.CoreState, actions: Sequence[d.Action]) -> tuple[Executor, set[str]]:
    """A draft of ``executor`` with one decision (its new ``state`` and ``actions``) applied, and the
    nodes whose record changed; ``executor`` itself is unchanged. The draft reads task specs and GPU
    counts from the new state (a node joining in this decision has its GPUs)."""
    draft = executor.draft()
    draft.specs = functools.partial(_spec_in, state)
    draft.node_gpus = functools.partial(_gpus_in, state)
    # Released first: an Assign in the same decision may reuse the GPUs of a task that just finished.
    changed = _release(draft, state)
    changed |= draft.apply_all(actions)
    return draft, changed


def _release(draft: Executor, state: d.CoreState) -> set[str]:
    """Node records follow the core's placements: a task the core no longer places anywhere (it
    finished, say, which stops nothing by itself) leaves every node's desired state."""
    placed = {name for name, e in state.tasks.items() if e.placement}
    stale = sorted({t for tasks in draft.desired.values() for t in tasks if t not in placed})
    changed: set[str] = set()
    for task in stale:
        changed |= draft.apply(d.StopTask(action_id="release", task=task, reason="no longer placed"))
    return changed
