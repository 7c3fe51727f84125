"""The agent daemon: one per node (paper §3.1).

It registers the node in etcd under a lease, keeps a persistent connection to the coordinator,
runs one monitoring thread per GPU, launches and supervises the node's training ranks, receives
their exceptions and iteration timings, and publishes every abnormal status as a ``Report`` under
``reports/<node>/``. It reconciles the node's desired assignment (``assign/<node>``), one
:class:`agent.reconciler.TaskReconciler` per task, hosts the rendezvous store sidecar of the tasks
whose ``store_node`` it is (publishing ``stores/<task>``), and executes fault injections
(``inject/<node>/``). Its registration (``nodes/<node>``) is created only if absent: a second agent
with the same node name refuses to start.

Nothing here may take the daemon down: bad messages are skipped, etcd outages are retried (reports
wait in memory and are published once etcd is back), and the ranks keep running meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence

from agent import launchenv, logcap, marker, sidecar
from agent.fence import Contact, Fence
from agent.gpu.api import GpuEvent, GpuHealth
from agent.gpu.factory import open_backend
from agent.gpu.monitor import GpuMonitor
from agent.gpu.simulated import SimulatedBackend
from agent.iterations import (
    BOUNDED_PHASES,
    Finding,
    HangWatcher,
    IterationMonitor,
    IterationSettings,
    wall_time_of,
)
from agent.link import Coordinators, LinkClient
from agent.marker import FailureMarker
from agent.metrics import AgentMetrics
from agent.prefork import Prefork, with_torchrun_threads
from agent.progress import LogProgress, Progress
from agent.rankgroups import RankGroups
from agent.ranks import RankServer, Sender
from agent.reconciler import Outcome, TaskReconciler
from agent.settings import AgentSettings
from ckpt.placement import replica_targets, restore_order
from ckpt.replica import ReplicaServer
from unicron.kernel import log as ulog
from unicron.kernel import metrics as umetrics
from unicron.kernel import parentdeath, patterns, protocol, severity, tls
from unicron.kernel.errors import ConfigError, InvalidRecord, PermanentError, StoreUnavailable, UnicronError
from unicron.kernel.etcd import (
    KeyValue,
    Lease,
    PrefixWatch,
    Store,
    WatchEvent,
    connect_with_retry,
    parse_endpoints,
)
from unicron.kernel.inject import Fault, Injection
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.net import interface_of, route_address
from unicron.kernel.procs import pid_alive
from unicron.kernel.types import (
    FAULT_KINDS,
    AssignmentResult,
    DetectionMethod,
    ErrorKind,
    NodeAssignment,
    NodeInfo,
    NodeStatus,
    RankSpec,
    RankStatus,
    Report,
    StoreAddress,
    TaskAssignment,
    TaskResult,
)

log = ulog.get(__name__)

#: the agent's own torch-using helpers, forked from its warm spawner too
HELPER_MODULES = (sidecar.MODULE, marker.MODULE)


class ReportPublisher:
    """Publishes reports to etcd in order; while etcd is down they wait here, none is dropped."""

    def __init__(self, store: Store, keys: Keyspace, stop: threading.Event,
                 on_retry: Callable[[], None] | None = None) -> None:
        self.store = store
        self.keys = keys
        self.stop = stop
        self.on_retry = on_retry
        self._queue: queue.Queue[Report] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="report-publisher", daemon=True)
        self._thread.start()

    def publish(self, report: Report) -> None:
        self._queue.put(report)

    def pending(self) -> int:
        return self._queue.qsize()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                report = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            backoff = 0.05
            while not self.stop.is_set():
                try:
                    self.store.put(self.keys.report(report.node, report.report_id), report.to_json())
                    break
                except StoreUnavailable as exc:
                    log.warning("report waits for etcd", report=report.report_id, error=str(exc))
                    if self.on_retry is not None:
                        self.on_retry()
                    self.stop.wait(backoff)
                    backoff = min(backoff * 2, 2.0)
                except PermanentError as exc:  # refused or shutting down: retrying cannot help
                    log.error("report dropped", report=report.report_id, error=str(exc))
                    break


class NodeNameTaken(ConfigError):
    """Another live agent holds this node's registration."""


def _link_address(record: bytes) -> str | None:
    """The link address in a coordinator's address record (the leader key, ``coordinators/``)."""
    try:
        link = json.loads(record)["link"]
    except (ValueError, KeyError, TypeError):
        return None
    return link if isinstance(link, str) and link else None


def run_dir_error(run_dir: str, exc: OSError) -> str:
    """The one line an agent that cannot use its run directory exits with."""
    return (f"--run-dir / UNICRON_RUN_DIR {run_dir!r}: {exc.strerror or exc}"
            f"{f' ({exc.filename})' if exc.filename and exc.filename != run_dir else ''}; name a directory "
            "this user can write, with free space and inodes")


def default_advertise_host(etcd: str) -> str:
    """This host's address on its route to etcd: the network the other nodes share with it. (Not the
    hostname's address: /etc/hosts often maps it to loopback, 127.0.1.1 on a stock Debian, 127.0.0.1
    on this CI machine, which no other node can reach.)"""
    host, port = parse_endpoints(etcd)[0]
    try:
        return route_address(host, port)
    except OSError as exc:
        raise ConfigError(f"no route to etcd ({host}:{port}: {exc}) to pick this node's address from: "
                          "set --advertise-host / UNICRON_ADVERTISE_HOST") from exc


def fenced_placement(a: TaskAssignment, fenced: Mapping[str, tuple[int, int]]) -> bool:
    """``a`` places ranks here no later than the fence killed them (``fenced``: task -> generation
    and membership epoch they ran at). A newer generation, or a newer membership of the same one (an
    in-place task resized around this node once it was taken for lost, and placed on it again: its
    ranks join the running ones), is a placement made since."""
    return (a.generation, a.membership_epoch) <= fenced.get(a.task, (-1, -1))


#: replica servers a rank's restore is given (``UNICRON_CKPT_RESTORE_PEERS``): one environment string
#: may hold 128 KiB (Linux's MAX_ARG_STRLEN; past it the rank cannot be exec'd), and each restore lists
#: every server named. The holders of the rank's replicas (its previous placement's) come first, so
#: the bound drops only the farthest of the rest.
MAX_RESTORE_PEERS = 1024
#: ``RankSpec.previous_nodes`` whose replica holders a restore asks (the coordinator names two)
PREVIOUS_NODES_ASKED = 4


class Agent:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.node = settings.node
        self.tls_config = tls.load(settings.tls_dir, settings.node)
        self.tls_expiry = (tls.ExpiryWatch(self.tls_config, settings.tls_check_interval_s)
                           if self.tls_config is not None else None)
        if self.tls_expiry is not None:
            self.tls_expiry.check()
        self.advertise_host = settings.advertise_host or default_advertise_host(settings.etcd)
        self._gloo_ifname = interface_of(self.advertise_host)
        self.keys = Keyspace(settings.prefix)
        self.stop_event = threading.Event()
        self.ready = threading.Event()
        self.store: Store | None = None
        self.lease: Lease | None = None
        self.publisher: ReportPublisher | None = None
        # Guards only the two dicts below; never held across a blocking call (see agent.reconciler).
        self._tasks_lock = threading.Lock()
        self._tasks: dict[str, TaskReconciler] = {}
        self._retired: dict[str, TaskReconciler] = {}  # task -> its last stopped reconciler
        self._stores: dict[str, StoreAddress] = {}  # task -> its published store address
        self._applied_revision = -1
        # results/<node>: the newest result not yet written (latest wins), retried until etcd answers
        # by one writer thread, so an older revision's result never overwrites a newer one
        self._result_cond = threading.Condition()
        self._result_next: AssignmentResult | None = None
        self._result_revision = -1  # the newest revision whose result was taken for writing
        self._assign_lock = threading.Lock()  # the watch and the fence's restore both apply assignments
        #: task -> (generation, membership epoch) its ranks here ran at when the fence killed them: that
        #: placement is never launched again (see _fence_kill, fenced_placement)
        self._fenced: dict[str, tuple[int, int]] = {}
        self._fenced_for = 0.0  # seconds the node had been cut off when the fence killed its ranks
        self._watches: list[PrefixWatch] = []
        self.fence: Fence | None = None
        self.iteration_settings = IterationSettings(
            hang_factor=settings.hang_factor, warmup_iterations=settings.warmup_iterations,
            warmup_hang_s=settings.warmup_hang_s, phase_hang_s=settings.phase_hang_s,
        )
        self.hang_watcher = HangWatcher(self._on_finding)
        self.progress_regex = settings.progress_regex
        self._progress_lock = threading.Lock()
        self._progress: dict[tuple[str, int], LogProgress] = {}  # (task, rank) -> its log-line feeder
        # Tasks whose ranks talk to the agent's socket: only their relaunched ranks must report within
        # warmup_hang_s (a Megatron script read from its log never does, and its other ranks print nothing).
        self._reporting_tasks: set[str] = set()
        self.backend = open_backend(settings.gpu_backend, simulated_gpus=settings.gpus)
        self.gpu_monitor = GpuMonitor(self.backend, on_event=self._on_gpu_event, on_health=self._on_gpu_health,
                                      health_interval_s=settings.health_interval_s)
        self.socket_path = settings.socket_path
        self.rank_groups = RankGroups(settings.rank_groups_dir)
        # Bound only once this agent holds the node's registration: a duplicate must not take it over.
        self.rank_server: RankServer | None = None
        self._link: LinkClient | None = None
        self.coordinators = Coordinators(self._read_leader_link)  # where the link looks for the leader
        self.link_token = secrets.token_hex(16)  # proves on the link that this process registered the node
        modules = [m.strip() for m in settings.prefork.split(",") if m.strip()]
        helpers = [m for m in HELPER_MODULES if m not in modules]
        self.prefork = (Prefork([*modules, *helpers], settings.prefork_path,
                                preexec=parentdeath.preexec(signal.SIGKILL), warm_wait_s=settings.prefork_wait_s)
                        if modules else None)
        self.marker = FailureMarker(preexec=parentdeath.preexec(signal.SIGKILL), prefork=self.prefork)
        # Peers' in-memory checkpoint replicas (GEMINI-style): ranks elsewhere push their snapshots here.
        self.replicas: ReplicaServer | None = None
        self.metrics = AgentMetrics()
        self.metrics.sample("unicron_agent_report_queue_depth", "reports waiting to be published (etcd down)",
                            lambda: float(self.publisher.pending()) if self.publisher is not None else 0.0)
        self.metrics.sample("unicron_agent_unhealthy_gpus", "GPUs whose last health poll found a fault",
                            lambda: float(sum(not h.ok for h in self.gpu_monitor.latest_health())))
        if self.tls_expiry is not None:
            self.metrics.registry.register(umetrics.TLSExpiry(self.tls_expiry.days_left))
        self._metrics_server: umetrics.MetricsServer | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    def run(self) -> int:
        if self.tls_config is None:
            log.warning(tls.plaintext_warning("this agent's replica server or link, or etcd"), node=self.node)
        try:  # before registering: a node the coordinator sees can take ranks
            os.makedirs(self._logs_dir(), exist_ok=True)
            # A file made and removed: the socket bound once registered needs an inode there too, and a
            # full filesystem failed that bind only after the node had registered (a traceback, the
            # node flapping under systemd). (Not the socket itself: bound before the registration is
            # held, a second agent of the node would replace the running one's.)
            fd, probe = tempfile.mkstemp(prefix=".probe-", dir=self.settings.run_dir)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise ConfigError(run_dir_error(self.settings.run_dir, exc)) from exc
        # Before etcd: the ranks' children a SIGKILLed predecessor left running train on as duplicates
        # of the ranks the coordinator relaunched elsewhere (agent/rankgroups.py)
        self.rank_groups.kill_orphans()
        store = connect_with_retry(self.settings.etcd, self.settings.etcd_timeout_s, self.stop_event,
                                   f"agent of node {self.node}", tls_config=self.tls_config)
        if store is None:
            return 0
        self.store = store
        store.on_error = self.metrics.etcd.error
        if self.settings.replica_budget_mb > 0:
            self.replicas = ReplicaServer(f"{self.settings.replica_host or self.advertise_host}:0",
                                          self.settings.replica_budget_mb << 20, tls_config=self.tls_config).start()
        # Served before registering: a node the coordinator sees is one an operator can scrape.
        self._metrics_server = umetrics.serve(self.metrics.registry, self.settings.metrics_host,
                                              self.settings.metrics_port, f"unicron-agent {self.node}")
        try:
            self._register()
        except NodeNameTaken as exc:
            log.error("refusing to start", node=self.node, reason=str(exc))
            print(f"unicron-agent: {exc}", file=sys.stderr, flush=True)
            self._release()
            return 2
        try:
            self.rank_server = RankServer(self.socket_path, self._on_rank_message).start()
        except OSError as exc:  # the probe passed (the disk filled since, or the path is a directory)
            self._release()  # its registration too: no node that cannot take ranks stays registered
            raise ConfigError(run_dir_error(self.settings.run_dir, exc)) from exc
        self.publisher = ReportPublisher(store, self.keys, self.stop_event,
                                         on_retry=lambda: self.metrics.etcd.retry("report"))
        threading.Thread(target=self._result_writer, name="result-writer", daemon=True).start()
        self.marker.start()
        if self.prefork is not None:
            self.prefork.start()
        self.gpu_monitor.start()
        self.hang_watcher.start()
        self._link = LinkClient(self.node, self.settings.heartbeat_s, self.coordinators.candidates,
                                token=self.link_token, tls_config=self.tls_config,
                                on_sent=self.metrics.heartbeat_interval.observe,
                                superseded=self.coordinators.superseded,
                                on_linked=self.coordinators.linked).start()
        self._start_watches()
        with self._assign_lock:  # with the node's assignment applied: its tasks are known
            self._prune_task_logs()
        self.fence = Fence(self.settings.fence_s, self._contact, self._fence_kill, self._fence_restored,
                           self.stop_event).start()
        self.ready.set()
        log.info("agent running", node=self.node, gpus=self.backend.device_count(), backend=self.backend.name,
                 socket=self.socket_path, advertise_host=self.advertise_host)
        while not self.stop_event.wait(self.settings.status_interval_s):
            self._write_status()
            if self.tls_expiry is not None:
                self.tls_expiry.poll()  # weeks of running: warned again as the end nears
            if self.settings.rank_log_max_mb:
                logcap.cap_all(self._logs_dir(), self._live_tasks(), self.settings.rank_log_max_mb << 20)
        self._shutdown()
        return 0

    def stop(self) -> None:
        self.stop_event.set()

    def _release(self) -> None:
        """Stop the servers, revoke the registration (if there is one) and close etcd: the end of a
        stop, and all there is to undo of a start that gave up."""
        if self.replicas is not None:
            self.replicas.stop()
        if self._metrics_server is not None:
            self._metrics_server.stop()
        if self.lease is not None:
            with contextlib.suppress(StoreUnavailable):
                self.lease.revoke()
        if self.store is not None:
            self.store.close()

    def _shutdown(self) -> None:
        for w in self._watches:
            w.stop()
        if self._link is not None:
            self._link.stop(goodbye="agent stopping")  # a planned stop: a drain, not a node failure
        with self._tasks_lock:
            stopping = [rec.stop("agent shutting down") for rec in self._tasks.values()]
            self._tasks.clear()
        for outcome in stopping:
            outcome.wait(30.0)
        self.hang_watcher.stop()
        self.gpu_monitor.stop()
        self.backend.close()
        if self.rank_server is not None:
            self.rank_server.stop()
        self.marker.stop()
        if self.prefork is not None:
            self.prefork.close()
        self._release()

    def _register(self) -> None:
        """Create ``nodes/<node>`` under a fresh lease; retried until etcd answers. Raises
        NodeNameTaken while another live agent holds the name."""
        assert self.store is not None
        backoff = 0.1
        while not self.stop_event.is_set():
            lease: Lease | None = None
            try:
                lease = self.store.lease(self.settings.lease_ttl_s, on_lost=self._on_lease_lost)
                info = NodeInfo(node=self.node, host=self.advertise_host, gpus=self.backend.device_count(),
                                gpu_backend=self.backend.name, agent_pid=os.getpid(), started_ts=time.time(),
                                replica_addr=self.replicas.address if self.replicas is not None else "",
                                hostname=os.uname().nodename, link_token=self.link_token)
                key = self.keys.node(self.node)
                # Created only if absent: one name, one agent (issue #19 item 7).
                if self.store.put_if_absent(key, info.to_json(), lease=lease):
                    self.lease = lease
                    log.info("registered", node=self.node, lease=f"{lease.lease_id:x}")
                    return
                lease.revoke()
                self._check_holder(key)
                continue  # the holder was our dead predecessor, now removed
            except StoreUnavailable as exc:
                if lease is not None:
                    # Revoked, not abandoned: etcd may have committed the create whose answer was lost,
                    # and the record under this lease would otherwise stand until the TTL ran out.
                    lease.revoke()
                log.warning("registration waits for etcd", node=self.node, error=str(exc))
                self.stop_event.wait(backoff)
                backoff = min(backoff * 2, 1.0)

    def _check_holder(self, key: str) -> None:
        """``key`` exists: remove it if it is this process's own (a create etcd committed but whose
        answer was lost) or a dead agent's of this machine, else raise NodeNameTaken."""
        assert self.store is not None
        kv = self.store.get(key)
        if kv is None:
            return
        try:
            holder = NodeInfo.from_json(kv.value)
        except InvalidRecord:
            holder = None
        if holder is not None and holder.link_token == self.link_token:
            # Ours, under a lease given up after the lost answer: not another agent (its pid is ours).
            log.info("removing this agent's own registration from a create whose answer was lost", node=self.node)
            self.store.delete_if_unchanged(key, kv.mod_revision)
            return
        if holder is not None and holder.hostname == os.uname().nodename and not pid_alive(holder.agent_pid):
            log.info("removing the registration of this node's dead agent", node=self.node, pid=holder.agent_pid)
            self.store.delete_if_unchanged(key, kv.mod_revision)
            return
        who = f"pid {holder.agent_pid} on {holder.hostname or holder.host}" if holder else "an unreadable record"
        raise NodeNameTaken(f"node name {self.node!r} is held by another running agent ({who}); "
                            "stop that agent or pick another --node")

    def _on_lease_lost(self) -> None:
        if not self.stop_event.is_set():
            log.warning("lease lost; re-registering (the coordinator has seen this node as lost)", node=self.node)
            threading.Thread(target=self._reregister, name="re-register", daemon=True).start()

    def _reregister(self) -> None:
        try:
            self._register()
        except NodeNameTaken as exc:
            log.error("another agent took this node's name while our lease was lost; stopping", reason=str(exc))
            self.stop()
            return
        lease = self.lease
        with self._tasks_lock:
            hosted = [rec for rec in self._tasks.values() if rec.hosts_store()]
        # Their addresses went with the old lease, and the task's other nodes launch nothing without
        # them: retried until etcd takes them (one failed put right after an outage lost one for good),
        # while this lease lasts (a newer one's re-registration republishes them itself).
        backoff = 0.1
        while hosted and self.lease is lease and not self.stop_event.is_set():
            hosted = [rec for rec in hosted if not rec.republish()]
            if hosted:
                self.metrics.etcd.retry("store")
                self.stop_event.wait(backoff)
                backoff = min(backoff * 2, 2.0)

    def _read_leader_link(self) -> str | None:
        """The leader key's link address; raises StoreUnavailable/StoreClosed when etcd cannot say."""
        assert self.store is not None
        kv = self.store.get(self.keys.leader())
        return _link_address(kv.value) if kv is not None else None

    def _start_watches(self) -> None:
        assert self.store is not None
        # Stores first: an assignment found at start may need an address that is already published.
        for prefix, handler in (
            (self.keys.coordinators(), self._on_coordinator_event),
            (self.keys.leader(), self._on_leader_event),
            (self.keys.stores(), self._on_store_event),
            (self.keys.assignment(self.node), self._on_assignment_event),
            (self.keys.injections(self.node), self._on_injection_event),
        ):
            listed = self._list(prefix)
            if listed is None:  # stopping
                return
            kvs, rev = listed
            for kv in kvs:
                handler(WatchEvent("put", kv.key, kv.value, kv.mod_revision))
            self._watches.append(
                self.store.watch_prefix(prefix, handler, start_revision=rev + 1, known=[kv.key for kv in kvs])
            )

    def _list(self, prefix: str) -> tuple[list[KeyValue], int] | None:
        """Every record under ``prefix`` and the revision it was read at, retried until etcd answers
        (None: stopping). A watch started "from now" after one failed listing never delivered the
        records already there: the node ignored its assignment (or the store address its ranks wait
        for) until the coordinator happened to rewrite it."""
        assert self.store is not None
        backoff = 0.1
        while not self.stop_event.is_set():
            try:
                return self.store.get_prefix(prefix)
            except StoreUnavailable as exc:
                log.warning("listing waits for etcd", prefix=prefix, error=str(exc))
                self.metrics.etcd.retry("listing")
                self.stop_event.wait(backoff)
                backoff = min(backoff * 2, 2.0)
        return None

    # --- reports -----------------------------------------------------------------------------

    def report(self, method: DetectionMethod, kind: ErrorKind, message: str, *, task: str | None = None,
               rank: int | None = None, gpu: int | None = None, step: int | None = None,
               source_ts: float | None = None, handled: bool = False, generation: int | None = None) -> Report:
        rec = self._task(task) if task is not None else None
        if rec is not None and generation is None:
            generation = rec.latest.generation
        # the rank's launch epoch only in the generation the node runs now: a process of the previous
        # one (stopping) is not the rank's current process
        current = rec is not None and rank is not None and generation == rec.latest.generation
        report = Report(method=method, kind=kind, node=self.node, message=message[:2000], task=task, gpu=gpu,
                        rank=rank, step=step, generation=generation, handled=handled,
                        restart_epoch=rec.launch_epoch(rank) if current and rec is not None and rank is not None
                        else None, source_ts=source_ts or time.time())
        log.warning("report", node=self.node, task=task, rank=rank, gpu=gpu, step=step, kind=kind.value,
                    method=method.value, message=message[:200])
        assert self.publisher is not None
        self.publisher.publish(report)
        self.metrics.reports.labels(method.value, kind.value).inc()
        return report

    def _task(self, task: str) -> TaskReconciler | None:
        with self._tasks_lock:
            return self._tasks.get(task)

    def _gpu_of(self, task: str, rank: int) -> int | None:
        rec = self._task(task)
        if rec is None:
            return None
        return next((s.gpu for s in rec.latest.ranks if s.rank == rank), None)

    # --- detection inputs --------------------------------------------------------------------

    def _on_gpu_event(self, event: GpuEvent) -> None:
        self.metrics.gpu_events.labels(event.kind.value).inc()
        task, rank = self._rank_on_gpu(event.gpu)
        self.report(DetectionMethod.EXCEPTION_PROPAGATION, event.kind, event.message, task=task, rank=rank,
                    gpu=event.gpu, source_ts=event.ts)

    def _on_gpu_health(self, health: GpuHealth) -> None:
        pass  # kept by the monitor; summarised in the status record

    def _rank_on_gpu(self, gpu: int) -> tuple[str | None, int | None]:
        with self._tasks_lock:
            recs = list(self._tasks.values())
        for rec in recs:
            for spec in rec.latest.ranks:
                if spec.gpu == gpu:
                    return rec.task, spec.rank
        return None, None

    # TaskHost: called by the reconcilers, outside their locks.

    def forget_rank(self, task: str, rank: int, monitor: IterationMonitor | None) -> None:
        # Only this process's monitor: an old generation's rank that exits after the new
        # generation's rank registered must not take the new one off the watcher (seen in the chaos
        # suite: a SIGSTOPped rank was never reported as hung).
        self.hang_watcher.remove((task, rank), monitor)
        with self._progress_lock:
            self._progress.pop((task, rank), None)

    def mark_failed(self, store: StoreAddress, rank: int, wait_s: float = 0.0) -> bool:
        return self.marker.mark(store.host, store.port, rank, wait_s)

    def stderr_matched(self, task: str, rank: int, kind: ErrorKind, line: str, ts: float, *, generation: int,
                       pid: int) -> None:
        if not self._from_current(task, rank, generation, (pid,), kind, line, ts):
            return
        # the rank's last step: a line says none, and without one the coordinator cannot tell the echo
        # of an in-place resize (a survivor's broken call to the old store) from a new fault
        rec = self._task(task)
        self.report(severity.method_of(DetectionMethod.EXCEPTION_PROPAGATION, kind), kind, line, task=task,
                    rank=rank, gpu=self._gpu_of(task, rank), step=rec.step_of(rank) if rec is not None else None,
                    source_ts=ts, generation=generation)

    def _from_current(self, task: str, rank: int, generation: int, pids: tuple[int, ...], kind: ErrorKind,
                      message: str, ts: float, handled: bool = False) -> bool:
        """Whether a rank's error comes from its current process. One of the generation stopping here (it
        fails on its way out: its peers are gone) is published as that generation's, which the
        coordinator takes for stale; it was credited to the new generation, a launch fault against a
        healthy task. One of a replaced process of this generation is dropped: the relaunch answered it."""
        rec = self._task(task)
        if rec is None:
            return True  # a task no longer here: published as before, with no generation to blame
        if generation != rec.latest.generation:
            self.report(severity.method_of(DetectionMethod.EXCEPTION_PROPAGATION, kind), kind, message, task=task,
                        rank=rank, source_ts=ts, handled=handled, generation=generation)
            return False
        if rec.has_rank(rank) and not rec.has_rank(rank, *pids):
            log.info("dropped a replaced process's error", task=task, rank=rank, pids=list(pids), kind=kind.value)
            return False
        return True

    def rank_progress(self, task: str, rank: int, progress: Progress | None, phase: str | None, mono: float,
                      pid: int) -> None:
        rec = self._task(task)
        if rec is None or not rec.has_rank(rank, pid):  # a line its relaunched rank's predecessor wrote
            return
        if phase is not None:
            # Megatron prints its checkpoint lines on rank 0 and progress on the last rank: the phase
            # holds for every rank of the task on this node, and its status shows it to the coordinator,
            # which excuses the hang of a last rank on another node that waits for the save
            # (coordinator.causes.held_by_phase)
            deadline = self._phase_deadline(phase, mono)
            for spec in rec.latest.ranks:
                if (mon := self._phase_monitor(rec, spec.rank)) is not None:
                    mon.phase(phase, mono)
                rec.record_phase(spec.rank, phase, deadline)
            return
        mon = self._monitor(rec, rank)
        if progress is None or mon is None:
            return
        with self._progress_lock:
            tracker = self._progress.get((task, rank))
            if tracker is None or tracker.monitor is not mon:  # a relaunched rank has a new monitor
                tracker = self._progress[(task, rank)] = LogProgress(mon)
        tracker.feed(progress, mono)
        # a progress line follows the iterations it counts; pid: the rank may have been relaunched since
        rec.record_step(rank, progress.iteration, completed=True, pid=pid)

    def _phase_deadline(self, phase: str, mono: float) -> float | None:
        """When a rank that entered ``phase`` at ``mono`` is hung there by this node's bound, in wall-clock
        time for the status (None: a phase without one). The coordinator stops excusing other ranks' hangs
        as waits for the save then: Megatron's rank 0, which prints the save, has no monitor to judge it."""
        if phase not in BOUNDED_PHASES or not self.iteration_settings.phase_hang_s:
            return None
        return wall_time_of(mono) + self.iteration_settings.phase_hang_s

    def _phase_monitor(self, rec: TaskReconciler, rank: int) -> IterationMonitor | None:
        """The monitor a phase line in a log feeds: only that of a rank that reports of its own (its
        progress lines, or the agent's socket). Megatron's rank 0 prints the checkpoint lines and no
        progress: a monitor armed by them took its silence after every save for a hang (warmup_hang_s)."""
        if rec.task in self._reporting_tasks:
            return self._monitor(rec, rank)
        with self._progress_lock:
            tracker = self._progress.get((rec.task, rank))
        if tracker is None:
            return None
        mon = self._monitor(rec, rank)
        return mon if mon is tracker.monitor else None  # else a relaunched rank that has printed nothing yet

    def rank_launched(self, task: str, rank: int, restart: bool) -> None:
        self.metrics.rank_launches.labels(task).inc()
        if restart:
            self.metrics.rank_restarts.labels(task).inc()
        # Watched from its launch: a rank stopped before its first report is otherwise never judged.
        rec = self._task(task)
        if task in self._reporting_tasks and rec is not None and (mon := self._monitor(rec, rank)) is not None:
            mon.launched(time.monotonic())

    def send_to_rank(self, task: str, rank: int, msg: protocol.Message) -> bool:
        return self.rank_server is not None and self.rank_server.send(task, rank, msg)

    def _live_tasks(self) -> set[str]:
        """The tasks whose ranks may still write their logs here: those assigned, and those retired whose
        ranks are still stopping."""
        with self._tasks_lock:
            return {*self._tasks, *(n for n, rec in self._retired.items() if not rec.stopped.is_set())}

    def _prune_task_logs(self) -> None:
        """Remove the logs of the tasks that left the node longest ago, past ``ended_task_logs_kept``.
        Caller holds ``_assign_lock``: no task is placed here meanwhile (its directory made while the old
        one is removed), and ``_fenced`` names the tasks still assigned whose ranks the fence killed."""
        logcap.prune_ended(self._logs_dir(), self.node, self._live_tasks() | set(self._fenced),
                           self.settings.ended_task_logs_kept)

    def _logs_dir(self) -> str:
        return os.path.join(self.settings.run_dir, "logs")

    def rank_log_path(self, task: str, rank: int) -> str:
        log_dir = os.path.join(self._logs_dir(), task)
        os.makedirs(log_dir, exist_ok=True)
        logcap.mark_in_use(log_dir, self.node)
        return os.path.join(log_dir, f"rank{rank}.log")

    def publish_store(self, addr: StoreAddress) -> int:
        assert self.store is not None and self.lease is not None
        return self.store.put(self.keys.store(addr.task), addr.to_json(), lease=self.lease)

    def withdraw_store(self, addr: StoreAddress, revision: int) -> None:
        assert self.store is not None
        # Only our own record: the task's next generation may already have published its store.
        self.store.delete_if_unchanged(self.keys.store(addr.task), revision)

    def _on_finding(self, key: Hashable, finding: Finding) -> None:
        assert isinstance(key, tuple)
        task, rank = key
        self.report(DetectionMethod.STATISTICAL_MONITORING, finding.kind, finding.message, task=task, rank=rank,
                    gpu=self._gpu_of(task, rank), step=finding.step, source_ts=wall_time_of(finding.ts))

    def _monitor(self, rec: TaskReconciler, rank: int) -> IterationMonitor | None:
        mon, new = rec.monitor(rank, lambda: IterationMonitor(self.iteration_settings))
        if mon is not None and new:
            self.hang_watcher.add((rec.task, rank), mon)
        return mon

    def _on_rank_message(self, sender: Sender, msg: protocol.Message) -> None:
        task, rank = sender.task, sender.rank
        rec = self._task(task)
        if isinstance(msg, protocol.Stopped):
            self._on_stopped(rec, sender, msg)
            return
        if rec is None or not rec.has_rank(rank):
            # A rank of no task of ours (a stale process, or a forged message): nothing to report.
            log.warning("dropped a message from an unknown task or rank", node=self.node, task=task, rank=rank,
                        type=msg.TYPE)
            return
        if isinstance(msg, protocol.ExceptionReport):
            kind = self._exception_kind(msg)
            if not self._from_current(task, rank, sender.generation, sender.pids(), kind, msg.message, msg.ts,
                                      handled=not msg.fatal):
                return
        elif sender.generation != rec.latest.generation or not rec.has_rank(rank, *sender.pids()):
            # progress of a process the rank no longer runs: not its current process's (a relaunched
            # rank credited with its predecessor's step was taken for recovered)
            log.info("dropped a message from a replaced process", task=task, rank=rank, pid=sender.pid,
                     generation=sender.generation, type=msg.TYPE)
            return
        self._reporting_tasks.add(task)
        mon = self._monitor(rec, rank)
        if isinstance(msg, protocol.ExceptionReport):
            self.report(severity.method_of(DetectionMethod.EXCEPTION_PROPAGATION, kind), kind, msg.message, task=task, rank=rank,
                        gpu=self._gpu_of(task, rank), step=msg.step, source_ts=msg.ts, handled=not msg.fatal)
            if not msg.fatal and mon is not None:
                # the rank recovers in place: this iteration's pause is recovery, not a hang; what the
                # monitor learned stays (a reset left only the 30-minute warm-up bound for the next hang)
                mon.interrupted(time.monotonic())
            return
        if mon is None:
            return
        if isinstance(msg, protocol.IterStart):
            mon.iter_start(msg.step, msg.mono)
            rec.record_step(rank, msg.step)
        elif isinstance(msg, protocol.IterEnd):
            mon.iter_end(msg.step, msg.duration_s, msg.mono)
            rec.record_step(rank, msg.step, completed=True)
        elif isinstance(msg, protocol.Phase):
            mon.phase(msg.name, msg.mono)
            rec.record_phase(rank, msg.name, self._phase_deadline(msg.name, msg.mono))
        elif isinstance(msg, protocol.RegroupDone):
            # A new data-parallel size changes each rank's share of micro-batches, so its iteration time:
            # only then is the baseline forgotten (the same members after a transient fault keep the pace)
            dp = msg.dp if msg.ok and msg.dp > 0 else None
            forgot = mon.reconfigured(dp)
            log.info("rank regrouped", task=task, rank=rank, epoch=msg.epoch, ok=msg.ok, detail=msg.detail,
                     baseline="reset" if forgot else "kept")

    def _on_stopped(self, rec: TaskReconciler | None, sender: Sender, msg: protocol.Stopped) -> None:
        """Noted before the rank may exit: its exit 0 must never be published without it. A rank of a
        task this node no longer runs (we stopped it: its exit is asked for) is answered all the same,
        or it would wait out its timeout."""
        task, rank = sender.task, sender.rank
        if rec is not None and sender.generation == rec.latest.generation and rec.has_rank(rank, *sender.pids()):
            rec.record_stopped(rank, msg.step)
            log.info("rank stopped before its end", task=task, rank=rank, step=msg.step, snapshot=msg.snapshot)
        self.send_to_rank(task, rank, protocol.StopNoted(step=msg.step))

    @staticmethod
    def _exception_kind(msg: protocol.ExceptionReport) -> ErrorKind:
        if msg.kind in FAULT_KINDS:  # a rank cannot claim the agent's own findings (degradation, fenced)
            return ErrorKind(msg.kind)
        return patterns.classify_text(f"{msg.message}\n{msg.traceback}")

    # --- status ------------------------------------------------------------------------------

    def status_ranks(self) -> list[RankStatus]:
        """Every rank process of every assigned task (exited ones too, with their return code)."""
        with self._tasks_lock:
            recs = list(self._tasks.values())
        return [r for rec in recs for r in rec.rank_statuses()]

    def _write_status(self) -> None:
        if self.store is None or self.lease is None:
            return
        with self._tasks_lock:
            recs = list(self._tasks.values())
        ranks = [r for rec in recs for r in rec.rank_statuses()]
        task_name = recs[-1].task if recs else None
        generation = recs[-1].applied.generation if recs else None
        status = NodeStatus(node=self.node, ts=time.time(), generation=generation, task=task_name, ranks=ranks,
                            gpu_health=[h.to_dict() for h in self.gpu_monitor.latest_health()])
        try:
            self.store.put(self.keys.status(self.node), status.to_json(), lease=self.lease)
        except StoreUnavailable as exc:
            log.debug("status write skipped", error=str(exc))
        except PermanentError as exc:
            log.error("status write refused", error=str(exc))

    # --- desired state -------------------------------------------------------------------------

    def _on_coordinator_event(self, ev: WatchEvent) -> None:
        self.coordinators.announced(ev.key, _link_address(ev.value) if ev.kind == "put" else None)

    def _on_leader_event(self, ev: WatchEvent) -> None:
        if ev.key == self.keys.leader():
            self.coordinators.elected(_link_address(ev.value) if ev.kind == "put" else None)

    def _on_store_event(self, ev: WatchEvent) -> None:
        if ev.kind == "delete":  # withdrawn, or its lease gone: a reconciler made now waits for the next
            with self._tasks_lock:
                self._stores.pop(ev.key[len(self.keys.stores()):], None)
            return
        try:
            addr = StoreAddress.from_json(ev.value)
        except InvalidRecord as exc:
            log.warning("ignoring malformed store address", key=ev.key, error=str(exc))
            return
        with self._tasks_lock:
            self._stores[addr.task] = addr
            rec = self._tasks.get(addr.task)
        if rec is not None:
            rec.offer_store(addr)

    def _on_assignment_event(self, ev: WatchEvent) -> None:
        if ev.key != self.keys.assignment(self.node):
            return  # another node's whose name extends ours: n10's for n1
        self._apply_assignment(ev.key, ev.value if ev.kind == "put" else None)

    def _apply_assignment(self, key: str, value: bytes | None, again: bool = False) -> None:
        """Reconcile to the record ``value`` of ``key`` (None: deleted). ``again``: the record this node
        last applied is applied once more (after a fence killed what it runs)."""
        with self._assign_lock:
            desired: list[TaskAssignment] = []
            isolated = False
            revision = self._applied_revision + 1
            if value is not None:
                try:
                    assignment = NodeAssignment.from_json(value)
                    desired, isolated = assignment.task_assignments(), assignment.isolated
                except InvalidRecord as exc:
                    log.error("ignoring malformed assignment", key=key, error=str(exc))
                    return
                if assignment.revision < self._applied_revision + (0 if again else 1):
                    log.info("ignoring stale assignment", revision=assignment.revision,
                             applied=self._applied_revision)
                    return
                revision = assignment.revision
                if again:
                    self._report_fenced(desired)
            if not again:  # a task no longer placed here is over for this node: its fence record too
                listed = {a.task for a in desired}
                for name in [n for n in self._fenced if n not in listed]:
                    del self._fenced[name]
            desired = [a for a in desired if not fenced_placement(a, self._fenced)]
            outcomes = self.reconcile(desired, isolated)
            self._applied_revision = revision
            self._prune_task_logs()
        threading.Thread(target=self._report_result, args=(revision, outcomes), name=f"result-{revision}",
                         daemon=True).start()

    # --- the fence (agent/fence.py) ----------------------------------------------------------

    def _contact(self) -> Contact:
        lease, link_client = self.lease, self._link
        return Contact(lease_renewed_at=lease.renewed_at if lease is not None else None,
                       link_down_since=link_client.down_since if link_client is not None else None)

    def _fence_kill(self, cut_off_s: float) -> None:
        """Cut off: kill every rank here (as on an isolated node). Their generation is not launched here
        again: its store and its peers on other nodes are gone or fenced too, and relaunched into it the
        ranks waited on a dead store (seen: the coordinator and etcd down at once, every node fenced,
        the task stuck until the hang timeout). When contact returns the coordinator is told, and
        relaunches the task as a new generation (``_fence_restored``)."""
        self.metrics.fences.inc()
        with self._assign_lock:
            with self._tasks_lock:
                self._fenced.update({name: (rec.latest.generation, rec.latest.membership_epoch)
                                     for name, rec in self._tasks.items()})
            self.reconcile([], isolated=True)
        self._fenced_for = cut_off_s

    def _fence_restored(self) -> None:
        assert self.store is not None
        key = self.keys.assignment(self.node)
        kv = self.store.get(key)  # StoreUnavailable is temporary: the fence retries
        self._apply_assignment(key, kv.value if kv is not None else None, again=True)

    def _report_fenced(self, assigned: list[TaskAssignment]) -> None:
        """Still assigned here as when fenced: the coordinator never declared this node lost (it could
        not: it was down or cut off itself). Nothing else tells it these ranks are gone."""
        for a in assigned:
            if fenced_placement(a, self._fenced):
                self.report(DetectionMethod.PROCESS_SUPERVISION, ErrorKind.FENCED,
                            f"the node's ranks of task {a.task} were killed by its fence, after "
                            f"{self._fenced_for:.1f} s cut off from etcd and the coordinator", task=a.task,
                            generation=a.generation)

    def _report_result(self, revision: int, outcomes: list[Outcome]) -> None:
        """Write ``results/<node>`` once every task applied ``revision``, or at once when one failed."""
        pending = list(outcomes)
        while pending and not self.stop_event.is_set():
            failed = [o for o in pending if o.done and not o.ok]
            if failed:
                self._write_result(revision, False, "; ".join(f"{o.task}: {o.detail}" for o in failed))
                return
            pending = [o for o in pending if not o.done]
            if pending:
                pending[0].wait(0.05)
        if not self.stop_event.is_set():
            self._write_result(revision, True, "applied")

    def _write_result(self, revision: int, ok: bool, detail: str) -> None:
        assert self.store is not None
        with self._tasks_lock:
            recs = list(self._tasks.values())
        tasks = {
            rec.task: TaskResult(
                generation=rec.applied.generation, restart_epoch=rec.applied.restart_epoch,
                regroup_epoch=rec.applied.regroup_epoch, membership_epoch=rec.applied.membership_epoch,
                ranks={str(r): st.state for r, st in rec.processes().items()},
                cannot_start=rec.cannot_start(),
            )
            for rec in recs
        }
        result = AssignmentResult(node=self.node, revision=revision, ok=ok, detail=detail, tasks=tasks)
        if not ok:
            log.error("assignment failed", revision=revision, detail=detail)
        with self._result_cond:
            if revision < self._result_revision:  # a newer assignment's result was written or waits
                log.info("assignment result superseded", revision=revision, newer=self._result_revision)
                return
            self._result_revision, self._result_next = revision, result
            self._result_cond.notify()

    def _result_writer(self) -> None:
        """Writes ``results/<node>``, retried while etcd is down: the coordinator confirms an action
        only from it, and a result dropped in a short outage let the action expire (blaming this node
        though its ranks ran). A newer result replaces the one waiting."""
        assert self.store is not None
        while not self.stop_event.is_set():
            with self._result_cond:
                if self._result_next is None:
                    self._result_cond.wait(0.5)
                result, self._result_next = self._result_next, None
            backoff = 0.05
            while result is not None and not self.stop_event.is_set():
                try:
                    self.store.put(self.keys.result(self.node), result.to_json())
                    break
                except StoreUnavailable as exc:
                    log.warning("assignment result waits for etcd", revision=result.revision, error=str(exc))
                    self.metrics.etcd.retry("result")
                except PermanentError as exc:  # refused or shutting down: retrying cannot help
                    log.error("assignment result dropped", revision=result.revision, error=str(exc))
                    break
                self.stop_event.wait(backoff)
                backoff = min(backoff * 2, 2.0)
                with self._result_cond:
                    if self._result_next is not None:  # superseded while waiting: write the newer one
                        break

    def reconcile(self, desired: list[TaskAssignment], isolated: bool = False) -> list[Outcome]:
        """Make the node's processes match ``desired`` (level-triggered: safe to repeat). Returns at
        once; each task's reconciler does the work and sets its outcome. ``isolated``: the node is out
        of service (``NodeAssignment.isolated``), so a task no longer listed is killed, not stopped."""
        wanted = {a.task: a for a in desired}
        outcomes: list[Outcome] = []
        with self._tasks_lock:
            # Kept only for a successor of the same name to wait for their stop: once stopped, nothing
            # needs them (each uniquely named job left one here for good).
            for name in [n for n, rec in self._retired.items() if rec.stopped.is_set()]:
                del self._retired[name]
            for name in [n for n in self._tasks if n not in wanted]:
                reason = "node isolated" if isolated else "no longer assigned to this node"
                outcomes.append(self._retire(name, reason, kill=isolated))
                self._reporting_tasks.discard(name)
                self.metrics.task_left(name)
            for name, a in wanted.items():
                rec = self._tasks.get(name)
                if rec is not None and rec.latest.generation == a.generation:
                    epochs = (a.restart_epoch, a.regroup_epoch, a.membership_epoch)
                    if epochs != (rec.latest.restart_epoch, rec.latest.regroup_epoch, rec.latest.membership_epoch):
                        outcomes.append(rec.apply(a))
                    continue
                if rec is not None:
                    outcomes.append(self._retire(name, f"reconfigured to generation {a.generation}"))
                new = TaskReconciler(a, self, self.prefork, previous=self._retired.pop(name, None),
                                     stop_grace_s=self.settings.stop_grace_s, groups=self.rank_groups)
                self._tasks[name] = new
                new.offer_store(self._stores.get(name))
                outcomes.append(new.started)
        return outcomes

    def _retire(self, name: str, reason: str, kill: bool = False) -> Outcome:
        """Stop ``name``'s reconciler (caller holds ``_tasks_lock``; this only enqueues)."""
        rec = self._tasks.pop(name)
        for rank in rec.latest.ranks:
            self.hang_watcher.remove((name, rank.rank), rec.monitors.get(rank.rank))
        self._retired[name] = rec
        return rec.stop(reason, kill)

    def rank_env(self, a: TaskAssignment, spec: RankSpec, store: StoreAddress, error_file: str) -> dict[str, str]:
        env = launchenv.rank_env(with_torchrun_threads(os.environ), a, spec, store, node=self.node,
                                 socket_path=self.socket_path, set_cuda=self.backend.name != "simulated",
                                 error_file=error_file)
        if self._gloo_ifname and "GLOO_SOCKET_IFNAME" not in env:
            # gloo binds the address the hostname resolves to, often 127.0.0.1 (Debian's /etc/hosts):
            # peers on other hosts could not connect. The advertised address's interface is reachable.
            env["GLOO_SOCKET_IFNAME"] = self._gloo_ifname
        env.update(self._replica_env(spec.previous_nodes))
        if self.tls_config is not None:
            # the ranks reach peers' replica servers as this node (same host, same user as the agent)
            env[tls.ENV_DIR], env[tls.ENV_NAME] = self.settings.tls_dir, self.node
        return env

    def _replica_env(self, previous_nodes: Sequence[str] = ()) -> dict[str, str]:
        """A rank's checkpoint peers: ``UNICRON_CKPT_PEERS``, the replica servers of the next node(s)
        on the GEMINI ring (losing this node never loses both copies of a rank's in-memory snapshot),
        which its pushes go to; ``UNICRON_CKPT_RESTORE_PEERS``, which a restore also asks: this node's,
        then those holding the replicas it pushed from ``previous_nodes`` (a rank relaunched here after
        its node's loss has its replica on the successor of the node it ran on before, not on ours),
        then the rest nearest first, at most ``MAX_RESTORE_PEERS``."""
        addrs = self._replica_addrs()
        env: dict[str, str] = {}
        if self.node in addrs and (push := [addrs[n] for n in replica_targets(self.node, addrs)]):
            env["UNICRON_CKPT_PEERS"] = ",".join(push)
        if addrs:
            # a forged record's long list costs no more than the few the coordinator writes
            previous = previous_nodes[:PREVIOUS_NODES_ASKED]
            nodes = restore_order(self.node, addrs, previous, limit=MAX_RESTORE_PEERS)
            env["UNICRON_CKPT_RESTORE_PEERS"] = ",".join(addrs[n] for n in nodes)
        return env

    def _replica_addrs(self) -> dict[str, str]:
        """node -> the replica server address its registration gives (readable ones only)."""
        assert self.store is not None
        try:
            kvs, _ = self.store.get_prefix(self.keys.nodes())
        except StoreUnavailable:
            return {}
        addrs: dict[str, str] = {}
        for kv in kvs:
            try:
                info = NodeInfo.from_json(kv.value)
            except InvalidRecord as exc:  # a bad replica_addr among them: no peer for our ranks to crash on
                log.warning("a node's registration is unreadable; its replica server is no checkpoint peer",
                            key=kv.key, error=str(exc))
                continue
            if info.replica_addr:
                addrs[info.node] = info.replica_addr
        return addrs

    # --- fault injection ---------------------------------------------------------------------

    def _on_injection_event(self, ev: WatchEvent) -> None:
        if ev.kind == "delete":
            return
        try:
            req = Injection.from_json(ev.value)
        except InvalidRecord as exc:
            log.warning("ignoring malformed injection", key=ev.key, error=str(exc))
            return
        if req.executed_ts is not None:
            return
        try:
            answer = req.answered(ok=True, detail=self.inject(req))
        except (KeyError, ValueError, LookupError, OSError, UnicronError) as exc:  # answered, never left pending
            answer = req.answered(ok=False, detail=f"{type(exc).__name__}: {exc}")
        assert self.store is not None
        with contextlib.suppress(StoreUnavailable):
            # under the node's lease: an answer its asker died before deleting goes with this agent
            self.store.put(ev.key, answer.to_json(), lease=self.lease)

    def inject(self, req: Injection) -> str:
        """Execute one fault-injection request (see ``unicron inject``). Returns what was done."""
        handlers: dict[Fault, Callable[[Injection], str]] = {
            Fault.XID: self._inject_xid, Fault.KILL_RANK: self._inject_kill_rank,
            Fault.STALL: self._inject_stall, Fault.RAISE: self._inject_raise,
            Fault.SLOW: self._inject_slow,
        }
        return handlers[req.fault](req)

    def _find_rank(self, req: Injection) -> tuple[TaskReconciler, int]:
        with self._tasks_lock:
            task = req.task or next(iter(self._tasks), None)
            rec = self._tasks.get(task) if task is not None else None
        if rec is None:
            raise LookupError(f"no task {task!r} running on node {self.node}")
        ranks = [s.rank for s in rec.latest.ranks]
        rank = ranks[0] if req.rank is None else req.rank
        if rank not in ranks:
            raise LookupError(f"rank {rank} of task {task} is not on node {self.node} (has {ranks})")
        proc = rec.processes().get(rank)
        if proc is None or proc.state == "exited":  # its pid may belong to another process by now
            raise LookupError(f"rank {rank} of task {task} has no running process on node {self.node}")
        return rec, rank

    def _inject_xid(self, req: Injection) -> str:
        if not isinstance(self.backend, SimulatedBackend):
            raise ValueError("xid injection needs the simulated GPU backend")
        if req.code is None:
            raise ValueError("xid injection needs a code")
        gpu, code = req.gpu, req.code
        self.backend.inject_xid(gpu, code)
        return f"XID {code} on simulated GPU {gpu}"

    def _inject_kill_rank(self, req: Injection) -> str:
        rec, rank = self._find_rank(req)
        # Signalled directly, not through Supervisor.kill: an injected kill must look like a crash.
        pid = rec.processes()[rank].pid
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL rank {rank} (pid {pid}) of task {rec.task}"

    def _inject_stall(self, req: Injection) -> str:
        rec, rank = self._find_rank(req)
        rec.supervisor.stop(rank)
        return f"SIGSTOP rank {rank} (pid {rec.processes()[rank].pid}) of task {rec.task}"

    def _inject_raise(self, req: Injection) -> str:
        rec, rank = self._find_rank(req)
        kind = req.kind or ErrorKind.OTHER_SOFTWARE_ERROR
        if not self.send_to_rank(rec.task, rank, protocol.InjectRaise(kind=kind.value)):
            raise LookupError(f"rank {rank} is not connected to the agent socket")
        return f"raise {kind.value} in rank {rank} of task {rec.task}"

    def _inject_slow(self, req: Injection) -> str:
        rec, rank = self._find_rank(req)
        delay, n = req.delay_s, req.iterations
        if not self.send_to_rank(rec.task, rank, protocol.InjectSlow(delay_s=delay, iterations=n)):
            raise LookupError(f"rank {rank} is not connected to the agent socket")
        return f"slow {n} iteration(s) of rank {rank} by {delay}s"
