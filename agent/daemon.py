"""The agent daemon: one per node (paper §3.1).

It registers the node in etcd under a lease, keeps a persistent connection to the coordinator,
runs one monitoring thread per GPU, launches and supervises the node's training ranks, receives
their exceptions and iteration timings, and publishes every abnormal status as a ``Report`` under
``reports/<node>/``. It reconciles the node's desired assignment (``assign/<node>``) and executes
fault injections (``inject/<node>/``).

Nothing here may take the daemon down: bad messages are skipped, etcd outages are retried (reports
wait in memory and are published once etcd is back), and the ranks keep running meanwhile.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import secrets
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from agent.gpu.api import GpuEvent, GpuHealth
from agent.gpu.factory import open_backend
from agent.gpu.monitor import GpuMonitor
from agent.gpu.simulated import SimulatedBackend
from agent.iterations import HangWatcher, IterationMonitor, IterationSettings
from agent.link import LinkClient
from agent.marker import FailureMarker
from agent.prefork import Prefork, with_torchrun_threads
from agent.ranks import RankServer
from agent.settings import AgentSettings
from agent.supervisor import RankExit, Supervisor
from ckpt.placement import replica_targets
from ckpt.replica import ReplicaServer
from unicron.kernel import log as ulog
from unicron.kernel import parentdeath, patterns, protocol
from unicron.kernel.errors import InvalidRecord, StoreUnavailable
from unicron.kernel.etcd import Lease, PrefixWatch, Store, WatchEvent, connect_with_retry
from unicron.kernel.inject import Fault, Injection, parse_injection
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.types import (
    AssignmentResult,
    DetectionMethod,
    ErrorKind,
    NodeAssignment,
    NodeInfo,
    NodeStatus,
    RankStatus,
    Report,
    TaskAssignment,
    TaskResult,
)

log = ulog.get("unicron.agent")


class ReportPublisher:
    """Publishes reports to etcd in order; while etcd is down they wait here, none is dropped."""

    def __init__(self, store: Store, keys: Keyspace, stop: threading.Event) -> None:
        self.store = store
        self.keys = keys
        self.stop = stop
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
                    self.store.put(self.keys.report(report.node, report.report_id), json.dumps(report.to_dict()))
                    break
                except StoreUnavailable as exc:
                    log.warning("report waits for etcd", report=report.report_id, error=str(exc))
                    self.stop.wait(backoff)
                    backoff = min(backoff * 2, 2.0)


class _RunningTask:
    """The agent's view of one task's processes on this node."""

    def __init__(self, assignment: TaskAssignment, supervisor: Supervisor) -> None:
        self.assignment = assignment
        self.supervisor = supervisor
        self.monitors: dict[int, IterationMonitor] = {}
        self.steps: dict[int, int] = {}
        self.launched_epoch: dict[int, int] = {}  # rank -> restart epoch its current process was launched at
        self.store_proc: Any = None


class Agent:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.node = settings.node
        self.keys = Keyspace(settings.prefix)
        self.stop_event = threading.Event()
        self.ready = threading.Event()
        self.store: Store | None = None
        self.lease: Lease | None = None
        self.publisher: ReportPublisher | None = None
        self._tasks: dict[str, _RunningTask] = {}
        self._tasks_lock = threading.RLock()
        self._applied_revision = -1
        self._watches: list[PrefixWatch] = []
        self.iteration_settings = IterationSettings(
            hang_factor=settings.hang_factor, warmup_iterations=settings.warmup_iterations
        )
        self.hang_watcher = HangWatcher(self._on_finding)
        self.backend = open_backend(settings.gpu_backend, simulated_gpus=settings.gpus)
        self.gpu_monitor = GpuMonitor(self.backend, on_event=self._on_gpu_event, on_health=self._on_gpu_health,
                                      health_interval_s=settings.health_interval_s)
        self.socket_path = os.path.join(settings.run_dir, f"{settings.node}.sock")
        self.rank_server = RankServer(self.socket_path, self._on_rank_message)
        self._link: Any = None
        self.link_token = secrets.token_hex(16)  # proves on the link that this process registered the node
        self.marker = FailureMarker(preexec=parentdeath.preexec(signal.SIGKILL))
        modules = [m.strip() for m in settings.prefork.split(",") if m.strip()]
        self.prefork = (Prefork(modules, os.path.join(settings.run_dir, f"{settings.node}.pf"),
                                preexec=parentdeath.preexec(signal.SIGKILL)) if modules else None)
        # Peers' in-memory checkpoint replicas (GEMINI-style): ranks elsewhere push their snapshots here.
        self.replicas: ReplicaServer | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    def run(self) -> int:
        store = connect_with_retry(self.settings.etcd, self.settings.etcd_timeout_s, self.stop_event,
                                   f"agent of node {self.node}")
        if store is None:
            return 0
        self.store = store
        self.publisher = ReportPublisher(store, self.keys, self.stop_event)
        self.rank_server.start()
        self.marker.start()
        if self.prefork is not None:
            self.prefork.start()
        if self.settings.replica_budget_mb > 0:
            self.replicas = ReplicaServer(f"{self.settings.replica_host}:0",
                                          self.settings.replica_budget_mb << 20).start()
        self.gpu_monitor.start()
        self.hang_watcher.start()
        self._register()
        self._link = LinkClient(self.node, self.settings.heartbeat_s, self._resolve_coordinator,
                                token=self.link_token).start()
        self._start_watches()
        self.ready.set()
        log.info("agent running", node=self.node, gpus=self.backend.device_count(), backend=self.backend.name,
                 socket=self.socket_path)
        while not self.stop_event.wait(self.settings.status_interval_s):
            self._write_status()
        self._shutdown()
        return 0

    def stop(self) -> None:
        self.stop_event.set()

    def _shutdown(self) -> None:
        for w in self._watches:
            w.stop()
        if self._link is not None:
            self._link.stop(goodbye="agent stopping")  # a planned stop: a drain, not a node failure
        with self._tasks_lock:
            for name in list(self._tasks):
                self._stop_task(name, "agent shutting down")
        self.hang_watcher.stop()
        self.gpu_monitor.stop()
        self.backend.close()
        self.rank_server.stop()
        self.marker.stop()
        if self.prefork is not None:
            self.prefork.close()
        if self.replicas is not None:
            self.replicas.stop()
        if self.lease is not None:
            with contextlib.suppress(StoreUnavailable):
                self.lease.revoke()
        if self.store is not None:
            self.store.close()

    def _register(self) -> None:
        """Put ``nodes/<node>`` under a fresh lease; retried until etcd answers."""
        assert self.store is not None
        backoff = 0.1
        while not self.stop_event.is_set():
            try:
                self.lease = self.store.lease(self.settings.lease_ttl_s, on_lost=self._on_lease_lost)
                info = NodeInfo(node=self.node, host=os.uname().nodename, gpus=self.backend.device_count(),
                                gpu_backend=self.backend.name, agent_pid=os.getpid(), started_ts=time.time(),
                                replica_addr=self.replicas.address if self.replicas is not None else "",
                                link_token=self.link_token)
                self.store.put(self.keys.node(self.node), json.dumps(info.to_dict()), lease=self.lease)
                log.info("registered", node=self.node, lease=f"{self.lease.lease_id:x}")
                return
            except StoreUnavailable as exc:
                log.warning("registration waits for etcd", node=self.node, error=str(exc))
                self.stop_event.wait(backoff)
                backoff = min(backoff * 2, 2.0)

    def _on_lease_lost(self) -> None:
        if not self.stop_event.is_set():
            log.warning("lease lost; re-registering (the coordinator has seen this node as lost)", node=self.node)
            threading.Thread(target=self._register, name="re-register", daemon=True).start()

    def _resolve_coordinator(self) -> str | None:
        assert self.store is not None
        try:
            kv = self.store.get(self.keys.leader())
            return str(json.loads(kv.value)["link"]) if kv is not None else None
        except (StoreUnavailable, ValueError, KeyError, TypeError):
            return None

    def _start_watches(self) -> None:
        assert self.store is not None
        for prefix, handler in (
            (self.keys.assignment(self.node), self._on_assignment_event),
            (self.keys.injections(self.node), self._on_injection_event),
        ):
            try:
                kvs, rev = self.store.get_prefix(prefix)
            except StoreUnavailable:
                kvs, rev = [], None
            for kv in kvs:
                handler(WatchEvent("put", kv.key, kv.value, kv.mod_revision))
            self._watches.append(
                self.store.watch_prefix(prefix, handler, start_revision=None if rev is None else rev + 1)
            )

    # --- reports -----------------------------------------------------------------------------

    def report(self, method: DetectionMethod, kind: ErrorKind, message: str, *, task: str | None = None,
               rank: int | None = None, gpu: int | None = None, step: int | None = None,
               source_ts: float | None = None, handled: bool = False) -> Report:
        generation = None
        if task is not None:
            with self._tasks_lock:
                rt = self._tasks.get(task)
                generation = rt.assignment.generation if rt else None
        report = Report(method=method, kind=kind, node=self.node, message=message[:2000], task=task, gpu=gpu,
                        rank=rank, step=step, generation=generation, handled=handled,
                        source_ts=source_ts or time.time())
        log.warning("report", node=self.node, task=task, rank=rank, gpu=gpu, step=step, kind=kind.value,
                    method=method.value, message=message[:200])
        assert self.publisher is not None
        self.publisher.publish(report)
        return report

    def _gpu_of(self, task: str, rank: int) -> int | None:
        with self._tasks_lock:
            rt = self._tasks.get(task)
            if rt is None:
                return None
            for spec in rt.assignment.rank_specs():
                if spec.rank == rank:
                    return spec.gpu
        return None

    # --- detection inputs --------------------------------------------------------------------

    def _on_gpu_event(self, event: GpuEvent) -> None:
        task, rank = self._rank_on_gpu(event.gpu)
        self.report(DetectionMethod.EXCEPTION_PROPAGATION, event.kind, event.message, task=task, rank=rank,
                    gpu=event.gpu, source_ts=event.ts)

    def _on_gpu_health(self, health: GpuHealth) -> None:
        pass  # kept by the monitor; summarised in the status record

    def _rank_on_gpu(self, gpu: int) -> tuple[str | None, int | None]:
        with self._tasks_lock:
            for name, rt in self._tasks.items():
                for spec in rt.assignment.rank_specs():
                    if spec.gpu == gpu:
                        return name, spec.rank
        return None, None

    def _on_exit(self, task: str, ex: RankExit) -> None:
        rank = ex.rank
        with self._tasks_lock:
            rt = self._tasks.get(task)
            if rt is not None:
                self.hang_watcher.remove((task, rank))
                rt.monitors.pop(rank, None)
        if not ex.abnormal:
            log.info("rank exited", task=task, rank=rank, returncode=ex.returncode, requested=ex.requested)
            return
        if rt is not None:
            self.marker.mark(rt.assignment.master_addr, rt.assignment.master_port, rank)
        what = f"signal {ex.signal}" if ex.signal else f"exit code {ex.returncode}"
        cause = f"; stderr showed {ex.stderr_kind.value}" if ex.stderr_kind else ""
        self.report(DetectionMethod.PROCESS_SUPERVISION, ErrorKind.EXITED_ABNORMALLY,
                    f"rank {rank} exited abnormally ({what}){cause}", task=task, rank=rank,
                    gpu=self._gpu_of(task, rank), step=rt.steps.get(rank) if rt else None, source_ts=ex.ts)

    def _on_stderr_match(self, task: str, rank: int, kind: ErrorKind, line: str, ts: float) -> None:
        self.report(DetectionMethod.EXCEPTION_PROPAGATION, kind, line, task=task, rank=rank,
                    gpu=self._gpu_of(task, rank), source_ts=ts)

    def _on_finding(self, key: Any, finding: Any) -> None:
        task, rank = key
        self.report(DetectionMethod.STATISTICAL_MONITORING, finding.kind, finding.message, task=task, rank=rank,
                    gpu=self._gpu_of(task, rank), step=finding.step, source_ts=finding.ts)

    def _monitor(self, task: str, rank: int) -> IterationMonitor | None:
        with self._tasks_lock:
            rt = self._tasks.get(task)
            if rt is None:
                return None
            mon = rt.monitors.get(rank)
            if mon is None:
                mon = rt.monitors[rank] = IterationMonitor(self.iteration_settings)
                self.hang_watcher.add((task, rank), mon)
            return mon

    def _on_rank_message(self, task: str, rank: int, msg: protocol.Message) -> None:
        mon = self._monitor(task, rank)
        if isinstance(msg, protocol.ExceptionReport):
            kind = self._exception_kind(msg)
            self.report(DetectionMethod.EXCEPTION_PROPAGATION, kind, msg.message, task=task, rank=rank,
                        gpu=self._gpu_of(task, rank), step=msg.step, source_ts=msg.ts, handled=not msg.fatal)
            if not msg.fatal and mon is not None:
                mon.reset()  # the rank is regrouping: this iteration's pause is recovery, not a hang
            return
        if mon is None:
            return
        if isinstance(msg, protocol.IterStart):
            mon.iter_start(msg.step, msg.ts)
            with self._tasks_lock:
                if task in self._tasks:
                    self._tasks[task].steps[rank] = msg.step
        elif isinstance(msg, protocol.IterEnd):
            mon.iter_end(msg.step, msg.duration_s, msg.ts)
        elif isinstance(msg, protocol.Phase):
            mon.phase(msg.name, msg.ts)
        elif isinstance(msg, protocol.RegroupDone):
            # A new membership changes each rank's share of micro-batches, so its iteration time.
            mon.reset()
            log.info("rank regrouped", task=task, rank=rank, epoch=msg.epoch, ok=msg.ok, detail=msg.detail)

    @staticmethod
    def _exception_kind(msg: protocol.ExceptionReport) -> ErrorKind:
        if msg.kind:
            try:
                return ErrorKind(msg.kind)
            except ValueError:
                pass
        return patterns.classify_text(f"{msg.message}\n{msg.traceback}")

    # --- status ------------------------------------------------------------------------------

    def _write_status(self) -> None:
        if self.store is None or self.lease is None:
            return
        with self._tasks_lock:
            ranks: list[RankStatus] = []
            task_name: str | None = None
            generation: int | None = None
            for name, rt in self._tasks.items():
                task_name, generation = name, rt.assignment.generation
                for r, st in rt.supervisor.status().items():
                    ranks.append(RankStatus(task=name, generation=rt.assignment.generation, rank=st.rank, pid=st.pid,
                                            state=st.state, returncode=st.returncode, requested=st.requested,
                                            step=rt.steps.get(r), restart_epoch=rt.launched_epoch.get(r, 0)))
        status = NodeStatus(node=self.node, ts=time.time(), generation=generation, task=task_name, ranks=ranks,
                            gpu_health=[h.to_dict() for h in self.gpu_monitor.latest_health()])
        try:
            self.store.put(self.keys.status(self.node), json.dumps(status.to_dict()), lease=self.lease)
        except StoreUnavailable as exc:
            log.debug("status write skipped", error=str(exc))

    # --- desired state -------------------------------------------------------------------------

    def _on_assignment_event(self, ev: WatchEvent) -> None:
        desired: list[TaskAssignment] = []
        revision = self._applied_revision + 1
        if ev.kind == "put":
            try:
                assignment = NodeAssignment.from_dict(json.loads(ev.value))
                desired = assignment.task_assignments()
            except (InvalidRecord, ValueError) as exc:
                log.error("ignoring malformed assignment", key=ev.key, error=str(exc))
                return
            if assignment.revision <= self._applied_revision:
                log.info("ignoring stale assignment", revision=assignment.revision, applied=self._applied_revision)
                return
            revision = assignment.revision
        ok, detail = True, "applied"
        try:
            self.reconcile(desired)
        except Exception as exc:
            log.exception("reconcile failed", revision=revision)
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        self._applied_revision = revision
        self._write_result(revision, ok, detail)

    def _write_result(self, revision: int, ok: bool, detail: str) -> None:
        assert self.store is not None
        with self._tasks_lock:
            tasks = {
                name: TaskResult(
                    generation=rt.assignment.generation, restart_epoch=rt.assignment.restart_epoch,
                    regroup_epoch=rt.assignment.regroup_epoch,
                    ranks={str(r): st.state for r, st in rt.supervisor.status().items()},
                )
                for name, rt in self._tasks.items()
            }
        result = AssignmentResult(node=self.node, revision=revision, ok=ok, detail=detail, tasks=tasks)
        try:
            self.store.put(self.keys.result(self.node), json.dumps(result.to_dict()))
        except StoreUnavailable as exc:
            log.warning("could not write assignment result", error=str(exc))

    def reconcile(self, desired: list[TaskAssignment]) -> None:
        """Make the node's processes match ``desired`` (level-triggered: safe to repeat)."""
        wanted = {a.task: a for a in desired}
        with self._tasks_lock:
            for name in [n for n in self._tasks if n not in wanted]:
                self._stop_task(name, "no longer assigned to this node")
            for name, a in wanted.items():
                rt = self._tasks.get(name)
                if rt is None or rt.assignment.generation != a.generation:
                    if rt is not None:
                        self._stop_task(name, f"reconfigured to generation {a.generation}")
                    self._start_task(a)
                    continue
                if a.restart_epoch > rt.assignment.restart_epoch:
                    self._restart_ranks(rt, a)
                if a.regroup_epoch > rt.assignment.regroup_epoch:
                    self._send_regroup(a)
                rt.assignment = a

    def _rank_env(self, a: TaskAssignment, spec: Any) -> dict[str, str]:
        env = with_torchrun_threads(os.environ)
        env.update(a.env)
        env.update({
            "RANK": str(spec.rank), "LOCAL_RANK": str(spec.local_rank), "WORLD_SIZE": str(a.world_size),
            "LOCAL_WORLD_SIZE": str(len(a.ranks)), "MASTER_ADDR": a.master_addr, "MASTER_PORT": str(a.master_port),
            protocol.ENV_SOCKET: self.socket_path, "UNICRON_TASK": a.task, "UNICRON_GENERATION": str(a.generation),
            "UNICRON_NODE": self.node, "CUDA_VISIBLE_DEVICES": str(spec.gpu),
        })
        if self.backend.name == "simulated":
            env.pop("CUDA_VISIBLE_DEVICES")
        peers = self._replica_peers()
        if peers:
            env["UNICRON_CKPT_PEERS"] = ",".join(peers)
        return env

    def _replica_peers(self) -> list[str]:
        """Replica servers of the next node(s) on the GEMINI ring: losing this node never loses both
        copies of a rank's in-memory snapshot."""
        assert self.store is not None
        try:
            kvs, _ = self.store.get_prefix(self.keys.nodes())
        except StoreUnavailable:
            return []
        addrs: dict[str, str] = {}
        for kv in kvs:
            try:
                info = NodeInfo.from_dict(json.loads(kv.value))
            except (InvalidRecord, ValueError):
                continue
            if info.replica_addr:
                addrs[info.node] = info.replica_addr
        if self.node not in addrs:
            return []
        return [addrs[n] for n in replica_targets(self.node, addrs)]

    def _start_task(self, a: TaskAssignment) -> None:
        supervisor = Supervisor(
            on_exit=functools.partial(self._on_exit, a.task),
            on_stderr_match=functools.partial(self._on_stderr_match, a.task),
            prefork=self.prefork,
        )
        rt = _RunningTask(a, supervisor)
        self._tasks[a.task] = rt
        if a.host_store:
            rt.store_proc = self._start_store(a)
        for spec in a.rank_specs():
            self._launch(rt, spec)
        log.info("task started", task=a.task, generation=a.generation, ranks=[s.rank for s in a.rank_specs()])

    def _launch(self, rt: _RunningTask, spec: Any) -> None:
        a = rt.assignment
        log_dir = os.path.join(self.settings.run_dir, "logs", a.task)
        os.makedirs(log_dir, exist_ok=True)
        rt.launched_epoch[spec.rank] = a.restart_epoch
        rt.supervisor.launch(spec.rank, a.argv, self._rank_env(a, spec),
                             stdout_path=os.path.join(log_dir, f"rank{spec.rank}.log"))

    def _start_store(self, a: TaskAssignment) -> Any:
        import subprocess
        import sys

        # Dies with the agent like the ranks do (an orphaned store would hold the port).
        proc = subprocess.Popen(
            [sys.executable, "-m", "unicron.runtime.store", "--host", a.master_addr, "--port", str(a.master_port)],
            start_new_session=True, preexec_fn=parentdeath.preexec(signal.SIGKILL),
        )
        return proc

    def _restart_ranks(self, rt: _RunningTask, a: TaskAssignment) -> None:
        specs = {s.rank: s for s in a.rank_specs()}
        for rank in a.restart_ranks:
            if rank not in specs:
                continue
            rt.supervisor.kill(rank, signal.SIGKILL)
            rt.supervisor.wait(rank, timeout_s=5.0)
            rt.assignment = a
            self._launch(rt, specs[rank])
            log.info("rank restarted", task=a.task, rank=rank, restart_epoch=a.restart_epoch)

    def _send_regroup(self, a: TaskAssignment) -> None:
        msg = protocol.Regroup(epoch=a.regroup_epoch, members=a.regroup_members, failed=a.regroup_failed)
        for spec in a.rank_specs():
            self.rank_server.send(a.task, spec.rank, msg)

    def _stop_task(self, name: str, reason: str) -> None:
        rt = self._tasks.pop(name, None)
        if rt is None:
            return
        for rank in list(rt.monitors):
            self.hang_watcher.remove((name, rank))
        rt.supervisor.close(grace_s=2.0)
        if rt.store_proc is not None:
            rt.store_proc.kill()
            rt.store_proc.wait()
        log.info("task stopped", task=name, reason=reason)

    # --- fault injection ---------------------------------------------------------------------

    def _on_injection_event(self, ev: WatchEvent) -> None:
        if ev.kind == "delete":
            return
        try:
            req = parse_injection(ev.value)
        except InvalidRecord as exc:
            log.warning("ignoring malformed injection", key=ev.key, error=str(exc))
            return
        if req.executed_ts is not None:
            return
        try:
            answer = req.answered(ok=True, detail=self.inject(req))
        except (KeyError, ValueError, LookupError) as exc:
            answer = req.answered(ok=False, detail=f"{type(exc).__name__}: {exc}")
        assert self.store is not None
        with contextlib.suppress(StoreUnavailable):
            self.store.put(ev.key, json.dumps(answer.to_dict()))

    def inject(self, req: Injection) -> str:
        """Execute one fault-injection request (see ``unicron inject``). Returns what was done."""
        handlers: dict[Fault, Callable[[Injection], str]] = {
            Fault.XID: self._inject_xid, Fault.KILL_RANK: self._inject_kill_rank,
            Fault.STALL: self._inject_stall, Fault.RAISE: self._inject_raise,
            Fault.SLOW: self._inject_slow,
        }
        return handlers[req.fault](req)

    def _find_rank(self, req: Injection) -> tuple[_RunningTask, int]:
        with self._tasks_lock:
            task = req.task or next(iter(self._tasks), None)
            if task is None or task not in self._tasks:
                raise LookupError(f"no task {task!r} running on node {self.node}")
            rt = self._tasks[task]
            ranks = [s.rank for s in rt.assignment.rank_specs()]
            rank = ranks[0] if req.rank is None else req.rank
            if rank not in ranks:
                raise LookupError(f"rank {rank} of task {task} is not on node {self.node} (has {ranks})")
            return rt, rank

    def _inject_xid(self, req: Injection) -> str:
        if not isinstance(self.backend, SimulatedBackend):
            raise ValueError("xid injection needs the simulated GPU backend")
        if req.code is None:
            raise ValueError("xid injection needs a code")
        gpu, code = req.gpu, req.code
        self.backend.inject_xid(gpu, code)
        return f"XID {code} on simulated GPU {gpu}"

    def _inject_kill_rank(self, req: Injection) -> str:
        rt, rank = self._find_rank(req)
        # Signalled directly, not through Supervisor.kill: an injected kill must look like a crash.
        pid = rt.supervisor.status()[rank].pid
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL rank {rank} (pid {pid}) of task {rt.assignment.task}"

    def _inject_stall(self, req: Injection) -> str:
        rt, rank = self._find_rank(req)
        rt.supervisor.stop(rank)
        return f"SIGSTOP rank {rank} (pid {rt.supervisor.status()[rank].pid}) of task {rt.assignment.task}"

    def _inject_raise(self, req: Injection) -> str:
        rt, rank = self._find_rank(req)
        kind = req.kind or ErrorKind.OTHER_SOFTWARE_ERROR
        if not self.rank_server.send(rt.assignment.task, rank, protocol.InjectRaise(kind=kind.value)):
            raise LookupError(f"rank {rank} is not connected to the agent socket")
        return f"raise {kind.value} in rank {rank} of task {rt.assignment.task}"

    def _inject_slow(self, req: Injection) -> str:
        rt, rank = self._find_rank(req)
        delay, n = req.delay_s, req.iterations
        if not self.rank_server.send(rt.assignment.task, rank, protocol.InjectSlow(delay_s=delay, iterations=n)):
            raise LookupError(f"rank {rank} is not connected to the agent socket")
        return f"slow {n} iteration(s) of rank {rank} by {delay}s"
