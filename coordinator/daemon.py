"""The coordinator daemon: consolidates node status and reports from etcd, classifies them into
incidents (paper Table 1), and feeds them to the decision core (paper Figure 7).

Threads: etcd watches and the agent link push inputs onto one queue; a single loop thread consumes
it, so classification, incident records and decisions happen in order without locks around the
state. Every write is fenced by the leadership token (see :mod:`coordinator.leader`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from coordinator import api
from coordinator import decision as d
from coordinator.allocation import WafAllocator
from coordinator.classify import classify
from coordinator.executor import Executor
from coordinator.leader import Leadership
from coordinator.link import LinkServer
from coordinator.settings import CoordinatorSettings
from coordinator.tasks import TaskSpec
from unicron.kernel import log as ulog
from unicron.kernel.errors import InvalidRecord, NotLeader, StoreUnavailable
from unicron.kernel.etcd import KeyValue, PrefixWatch, Store, WatchEvent, connect_with_retry
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.types import DetectionMethod, ErrorKind, Incident, NodeInfo, Report, new_id

log = ulog.get("unicron.coordinator")


@dataclass(frozen=True)
class _Input:
    """One item for the loop thread: ``kind`` names the handler, ``data`` its argument."""

    kind: str
    data: Any
    ts: float


EXIT_DEPOSED = 75  # EX_TEMPFAIL
KEEP_INCIDENTS = 1000  # newest incidents kept in etcd; older ones are in the JSON log


class Coordinator:
    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.keys = Keyspace(settings.prefix)
        self.stop_event = threading.Event()
        self.ready = threading.Event()
        self.store: Store | None = None
        self.leadership: Leadership | None = None
        self.link: LinkServer | None = None
        self._inbox: queue.Queue[_Input] = queue.Queue()
        self._watches: list[PrefixWatch] = []
        self._nodes: dict[str, NodeInfo] = {}
        self._lost_nodes: set[str] = set()
        self.recent_incidents: collections.deque[Incident] = collections.deque(maxlen=KEEP_INCIDENTS)
        self._incident_keys: collections.deque[str] = collections.deque()
        self.deposed = False
        self.core = d.DecisionCore(
            d.DecisionSettings(reattempt_deadline_s=settings.reattempt_deadline_s,
                               restart_deadline_s=settings.restart_deadline_s),
            WafAllocator(settings.gpu_type),
        )
        self.state = self.core.initial_state()
        self.executor = Executor(self.keys, self._spec, lambda n: self._nodes[n].gpus if n in self._nodes else 0)
        self._steps: dict[str, int] = {}
        self._last_handled: dict[str, float] = {}  # task -> when a rank last recovered in place
        self._api_server: Any = None

    # --- lifecycle ---------------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped. Returns the process exit code."""
        self.store = connect_with_retry(self.settings.etcd, self.settings.etcd_timeout_s, self.stop_event,
                                        "coordinator")
        if self.store is None:
            return 0
        self.link = LinkServer(
            self.settings.listen_host, self.settings.link_port, self.settings.heartbeat_timeout_s,
            on_lost=self._on_link_lost, on_connected=self._on_link_connected,
        ).start()
        self._api_server, api_address = api.serve(self, self.settings.listen_host, self.settings.api_port)
        address = json.dumps({"link": self.link.address, "api": api_address, "pid": os.getpid()})
        self.leadership = Leadership(self.store, self.keys, address, self.settings.leader_ttl_s,
                                     on_deposed=self._on_deposed)
        if not self.leadership.campaign(self.stop_event):
            return 0
        self._load_state()
        self._start_watches()
        threading.Thread(target=self._ticker, name="ticker", daemon=True).start()
        self.ready.set()
        log.info("coordinator leading", link=self.link.address)
        self._loop()
        self._shutdown()
        # Non-zero when deposed, so systemd's Restart=on-failure brings us back as a standby.
        return EXIT_DEPOSED if self.deposed else 0

    def stop(self) -> None:
        self.stop_event.set()
        self._inbox.put(_Input("stop", None, time.time()))

    def _on_deposed(self) -> None:
        self.deposed = True
        log.error("deposed: another coordinator leads now; exiting so systemd restarts us as a standby")
        self.stop()

    def _shutdown(self) -> None:
        if self._api_server is not None:
            api.stop(self._api_server)
        for w in self._watches:
            w.stop()
        if self.link is not None:
            self.link.stop()
        if self.leadership is not None:
            self.leadership.resign()
        if self.store is not None:
            self.store.close()

    def _start_watches(self) -> None:
        assert self.store is not None
        for prefix, kind in ((self.keys.nodes(), "node"), (self.keys.reports(), "report"),
                             (self.keys.statuses(), "status")):
            kvs, rev = self.store.get_prefix(prefix)
            for kv in kvs:
                self._inbox.put(_Input(kind, WatchEvent("put", kv.key, kv.value, kv.mod_revision), time.time()))
            self._watches.append(
                self.store.watch_prefix(
                    prefix, functools.partial(self._enqueue, kind), start_revision=rev + 1,
                    on_resync=functools.partial(self._resync, kind),
                )
            )

    def _enqueue(self, kind: str, ev: WatchEvent) -> None:
        self._inbox.put(_Input(kind, ev, time.time()))

    def _resync(self, kind: str, kvs: list[KeyValue]) -> None:
        for kv in kvs:
            self._inbox.put(_Input(kind, WatchEvent("put", kv.key, kv.value, kv.mod_revision), time.time()))

    # --- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        handlers: dict[str, Callable[[Any, float], None]] = {
            "node": self._handle_node_event,
            "report": self._handle_report_event,
            "link_lost": self._handle_link_lost,
            "link_connected": self._handle_link_connected,
            "status": self._handle_status_event,
            "event": lambda ev, ts: self._decide(ev),
            "call": self._handle_call,
        }
        while not self.stop_event.is_set():
            try:
                item = self._inbox.get(timeout=0.5)
            except queue.Empty:
                continue
            handler = handlers.get(item.kind)
            if handler is None:
                continue
            try:
                handler(item.data, item.ts)
            except NotLeader:
                return
            except StoreUnavailable as exc:
                # Nothing is lost: the report stays in etcd and is replayed once etcd is back.
                log.warning("etcd unavailable while handling input; will retry", kind=item.kind, error=str(exc))
                self.stop_event.wait(0.2)
                self._inbox.put(item)
            except Exception:
                log.exception("handler failed; input dropped", kind=item.kind)

    # --- inputs ------------------------------------------------------------------------------

    def _on_link_lost(self, node: str, reason: str, ts: float) -> None:
        self._inbox.put(_Input("link_lost", (node, reason), ts))

    def _on_link_connected(self, node: str, ts: float) -> None:
        self._inbox.put(_Input("link_connected", node, ts))

    def _handle_link_connected(self, node: str, ts: float) -> None:
        self._lost_nodes.discard(node)

    def _handle_link_lost(self, data: tuple[str, str], ts: float) -> None:
        node, reason = data
        self._node_lost(node, f"agent {reason}", ts)

    def _handle_node_event(self, ev: WatchEvent, ts: float) -> None:
        node = self.keys.tail(ev.key, self.keys.nodes())
        if ev.kind == "delete":
            self._node_lost(node, "agent lease expired", ts)
            self._nodes.pop(node, None)
            return
        try:
            info = NodeInfo.from_dict(json.loads(ev.value))
        except (InvalidRecord, ValueError) as exc:
            log.warning("ignoring garbage node record", key=ev.key, error=str(exc))
            return
        previous = self._nodes.get(node)
        self._nodes[node] = info
        self._lost_nodes.discard(node)
        if previous is None or previous.agent_pid != info.agent_pid or previous.started_ts != info.started_ts:
            log.info("node registered", node=node, gpus=info.gpus, backend=info.gpu_backend)
            self._decide(d.NodeJoined(ts=ts, node=node, gpus=info.gpus))

    def _node_lost(self, node: str, reason: str, ts: float) -> None:
        if node in self._lost_nodes:
            log.info("node loss already recorded", node=node, reason=reason)
            return
        self._lost_nodes.add(node)
        report = Report(method=DetectionMethod.NODE_HEALTH, kind=ErrorKind.LOST_CONNECTION, node=node,
                        message=reason, source_ts=ts, agent_ts=ts)
        self._record(report, report_key=None)

    def _handle_report_event(self, ev: WatchEvent, ts: float) -> None:
        if ev.kind == "delete":
            return
        try:
            report = Report.from_dict(json.loads(ev.value))
        except (InvalidRecord, ValueError) as exc:
            log.warning("deleting garbage report", key=ev.key, error=str(exc))
            assert self.leadership is not None
            self.leadership.write(deletes=[ev.key])
            return
        self._record(report, report_key=ev.key)

    def _is_regroup_consequence(self, report: Report) -> bool:
        """A hang reported shortly after a rank of the same task recovered in place: its peers sat in
        a collective while the ranks regrouped."""
        if report.kind is not ErrorKind.TASK_HANG or report.task is None:
            return False
        since = self._last_handled.get(report.task)
        return since is not None and report.source_ts - since <= self.settings.regroup_grace_s

    def _record(self, report: Report, report_key: str | None) -> None:
        if report.handled and report.task is not None:
            self._last_handled[report.task] = max(report.source_ts, self._last_handled.get(report.task, 0.0))
        elif self._is_regroup_consequence(report):
            report = dataclasses.replace(report, handled=True, message=f"{report.message} (during an in-place regroup)")
        incident = classify(report, detected_ts=time.time(), incident_id=new_id())
        assert self.leadership is not None
        key = self.keys.incident(incident.incident_id)
        expired = [self._incident_keys.popleft() for _ in range(max(0, len(self._incident_keys) + 1 - KEEP_INCIDENTS))]
        self.leadership.write(
            puts={key: json.dumps(incident.to_dict())},
            deletes=([report_key] if report_key else []) + expired,
        )
        self._incident_keys.append(key)
        log.warning(
            "incident", incident=incident.incident_id, severity=str(incident.severity) if incident.severity else None,
            method=incident.method.value, kind=incident.kind.value, task=incident.task, node=incident.node,
            gpu=incident.gpu, rank=incident.rank, step=incident.step, message=incident.message,
            source_ts=incident.source_ts, detected_ts=incident.detected_ts,
            detection_latency_s=round(incident.detection_latency_s, 4), handled=incident.handled,
        )
        self.recent_incidents.append(incident)
        if incident.handled:
            log.info("incident handled in place by the runtime; no action", incident=incident.incident_id)
            return
        self._decide(d.IncidentRaised(ts=incident.detected_ts, incident=incident, generation=report.generation))

    # --- the decision core ----------------------------------------------------------------------

    def _load_state(self) -> None:
        """Resume what a previous leader decided: the core's state and the nodes' assignments."""
        assert self.store is not None
        kv = self.store.get(self.keys.state())
        if kv is not None:
            try:
                self.state = d.CoreState.from_dict(json.loads(kv.value))
            except (InvalidRecord, ValueError) as exc:
                log.error("ignoring unreadable decision state; starting afresh", error=str(exc))
        kvs, _ = self.store.get_prefix(self.keys.assignments())
        self.executor.load({kv.key: kv.value for kv in kvs})
        kvs, _ = self.store.get_prefix(self.keys.incidents())
        self._incident_keys.extend(kv.key for kv in sorted(kvs, key=lambda kv: kv.create_revision))

    def _spec(self, task: str) -> TaskSpec | None:
        entry = self.state.tasks.get(task)
        return entry.spec if entry is not None else None

    def _node_host(self, node: str) -> str:
        info = self._nodes.get(node)
        if info is None or info.host == os.uname().nodename:
            return "127.0.0.1"
        return info.host

    def _ticker(self) -> None:
        while not self.stop_event.wait(1.0):
            self._inbox.put(_Input("event", d.Tick(ts=time.time()), time.time()))

    def _decide(self, event: Any) -> None:
        """Feed one event to the core, persist its state with the resulting node records, log."""
        self.state, actions, edges = self.core.explain(self.state, event)
        for edge in edges:
            log.info("transition", edge=str(edge))
        changed: set[str] = set()
        for action in actions:
            changed |= self.executor.apply(action)
            log.warning("action", action=type(action).__name__, **{
                k: v for k, v in d.to_dict(action).items() if k != "type" and isinstance(v, str | int | float)})
        if not edges and not actions and isinstance(event, d.Tick | d.ProgressMade):
            # Clock ticks and plain progress decided nothing; the clock and last step are re-observed
            # by a successor, so they are not worth a write per event.
            return
        puts = dict(self.executor.record(node) for node in sorted(changed))
        puts[self.keys.state()] = json.dumps(self.state.to_dict())
        assert self.leadership is not None
        self.leadership.write(puts=puts)

    def _handle_status_event(self, ev: WatchEvent, ts: float) -> None:
        """Iterations completed by a task's ranks are its progress (confirms a pending recovery)."""
        if ev.kind == "delete":
            return
        try:
            status = json.loads(ev.value)
            ranks = [r for r in status.get("ranks", []) if isinstance(r, dict)]
        except (ValueError, AttributeError):
            return
        best: dict[tuple[str, int], int] = {}
        for r in ranks:
            task, step, gen = r.get("task"), r.get("step"), r.get("generation")
            if isinstance(task, str) and isinstance(step, int) and isinstance(gen, int):
                best[(task, gen)] = max(step, best.get((task, gen), -1))
        for (task, gen), step in best.items():
            entry = self.state.tasks.get(task)
            if entry is None or gen != entry.generation or step <= self._steps.get(f"{task}/{gen}", -1):
                continue
            self._steps[f"{task}/{gen}"] = step
            self._decide(d.ProgressMade(ts=ts, task=task, step=step, generation=gen))

    # --- the API (coordinator.api.ControlPlane), run on the loop thread ---------------------

    def _call(self, fn: Callable[[], Any]) -> Any:
        if not self.ready.is_set():
            raise NotLeader("this coordinator is not the leader (yet); ask the one in the leader key")
        fut: Future[Any] = Future()
        self._inbox.put(_Input("call", (fn, fut), time.time()))
        return fut.result(timeout=10.0)

    def _handle_call(self, data: tuple[Callable[[], Any], Future[Any]], ts: float) -> None:
        fn, fut = data
        try:
            fut.set_result(fn())
        except Exception as exc:
            fut.set_exception(exc)

    def submit(self, spec: TaskSpec) -> None:
        def run() -> None:
            old = self.state.tasks.get(spec.name)
            if old is not None and old.phase in d.ACTIVE_PHASES:
                raise api.AlreadyExists(f"task {spec.name!r} is active; cancel it first or pick another name")
            assert self.leadership is not None
            self.leadership.write(puts={self.keys.task(spec.name): json.dumps(spec.to_dict())})
            self._decide(d.TaskSubmitted(ts=time.time(), spec=spec))
        self._call(run)

    def cancel(self, name: str) -> None:
        def run() -> None:
            entry = self.state.tasks.get(name)
            if entry is None or entry.phase not in d.ACTIVE_PHASES:
                raise api.NotFound(f"no active task {name!r}; see 'unicron tasks'")
            self._decide(d.TaskCancelled(ts=time.time(), task=name))
            assert self.leadership is not None
            self.leadership.write(deletes=[self.keys.task(name)])
        self._call(run)

    def tasks(self) -> list[dict[str, Any]]:
        def run() -> list[dict[str, Any]]:
            return [{
                "name": name, "phase": e.phase.value, "weight": e.spec.weight, "min_gpus": e.spec.min_gpus,
                "gpus": len(e.all_ranks()), "generation": e.generation, "nodes": sorted(e.placement),
                "restarts": e.restarts, "step": e.last_step, "reason": e.reason,
            } for name, e in sorted(self.state.tasks.items())]
        result: list[dict[str, Any]] = self._call(run)
        return result

    def nodes(self) -> list[dict[str, Any]]:
        def run() -> list[dict[str, Any]]:
            return [{"node": n, "gpus": e.gpus, "state": e.status.value, "reason": e.reason}
                    for n, e in sorted(self.state.nodes.items())]
        result: list[dict[str, Any]] = self._call(run)
        return result

    def _node_event(self, node: str, event: Any) -> None:
        if node not in self.state.nodes:
            raise api.NotFound(f"no node {node!r}; see 'unicron nodes'")
        assert self.leadership is not None
        if isinstance(event, d.NodeDrained):
            self.leadership.write(puts={self.keys.drain(node): "1"})
        else:
            self.leadership.write(deletes=[self.keys.drain(node)])
        self._decide(event)

    def drain(self, node: str) -> None:
        self._call(lambda: self._node_event(node, d.NodeDrained(ts=time.time(), node=node)))

    def undrain(self, node: str) -> None:
        self._call(lambda: self._node_event(node, d.NodeUndrained(ts=time.time(), node=node)))

    def incidents(self, limit: int) -> list[dict[str, Any]]:
        items = [i.to_dict() for i in list(self.recent_incidents)]
        return items[-limit:] if limit > 0 else items

    def cluster_gpus(self) -> int | None:
        return sum(e.gpus for e in self.state.nodes.values()) or None

    def gpus_per_node(self) -> int | None:
        sizes = {e.gpus for e in self.state.nodes.values()}
        return sizes.pop() if len(sizes) == 1 else None
