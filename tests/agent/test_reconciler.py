"""One task's reconciler against a recording host and real rank processes: what goes wrong on its own
thread (an OSError, a rank that dies before it was counted healthy) must never leave the task unmanaged."""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent import errorfile, reconciler
from agent import supervisor as sup
from agent.daemon import Agent
from agent.iterations import HangWatcher, IterationMonitor, IterationSettings
from agent.metrics import AgentMetrics
from agent.prefork import Prefork
from agent.progress import PHASE_CHECKPOINT, Progress
from agent.reconciler import RankState, TaskReconciler, TaskState
from agent.sidecar import StoreSidecar
from unicron.kernel import protocol
from unicron.kernel.errors import TemporaryError
from unicron.kernel.etcd import WatchEvent
from unicron.kernel.inject import Fault, Injection
from unicron.kernel.types import (
    DetectionMethod,
    ErrorKind,
    RankSet,
    RankSpec,
    Report,
    StoreAddress,
    TaskAssignment,
)

SLEEPER = [sys.executable, "-c", "import time; time.sleep(1000)"]
CRASH = [sys.executable, "-c", "import sys; sys.exit(3)"]


@dataclass
class RecordingHost:
    """What a reconciler needs from its agent (``TaskHost``), recorded; log paths can be made to fail."""

    log_dir: str
    node: str = "n0"
    advertise_host: str = "127.0.0.1"
    progress_regex: str = ""
    reports: list[Report] = field(default_factory=list)
    launched: list[int] = field(default_factory=list)
    full_disk_for: set[int] = field(default_factory=set)
    events: list[str] = field(default_factory=list)  # marks and launches, in order
    phases: list[str] = field(default_factory=list)  # the phases of rank_progress calls, in order
    lock: threading.Lock = field(default_factory=threading.Lock)

    def rank_env(self, a: TaskAssignment, spec: RankSpec, store: StoreAddress, error_file: str) -> dict[str, str]:
        return {**os.environ, "RANK": str(spec.rank), "MASTER_ADDR": store.host, "MASTER_PORT": str(store.port),
                "TORCHELASTIC_ERROR_FILE": error_file}

    def rank_log_path(self, task: str, rank: int) -> str:
        if rank in self.full_disk_for:
            raise OSError(28, "No space left on device")  # what os.makedirs raises on a full disk
        return os.path.join(self.log_dir, f"{task}-{rank}.log")

    def publish_store(self, addr: StoreAddress) -> int:
        return 1

    def withdraw_store(self, addr: StoreAddress, revision: int) -> None:
        pass

    def report(self, method: DetectionMethod, kind: ErrorKind, message: str, *, task: str | None = None,
               rank: int | None = None, gpu: int | None = None, step: int | None = None,
               source_ts: float | None = None, handled: bool = False, generation: int | None = None) -> Report:
        r = Report(method=method, kind=kind, node=self.node, message=message, task=task, rank=rank)
        with self.lock:
            self.reports.append(r)
        return r

    def mark_failed(self, store: StoreAddress, rank: int, wait_s: float = 0.0) -> bool:
        with self.lock:
            self.events.append(f"mark {rank}" + (" and wait" if wait_s > 0 else ""))
        return True

    def forget_rank(self, task: str, rank: int, monitor: IterationMonitor | None) -> None:
        pass

    def stderr_matched(self, task: str, rank: int, kind: ErrorKind, line: str, ts: float, *, generation: int,
                       pid: int) -> None:
        pass

    def rank_progress(self, task: str, rank: int, progress: Progress | None, phase: str | None, ts: float,
                      pid: int) -> None:
        if phase is not None:
            with self.lock:
                self.phases.append(phase)

    def send_to_rank(self, task: str, rank: int, msg: protocol.Message) -> bool:
        return False

    def rank_launched(self, task: str, rank: int, restart: bool) -> None:
        with self.lock:
            self.launched.append(rank)
            self.events.append(f"launch {rank}")


def assignment(ranks: list[int], argv: list[str] = SLEEPER, store_node: str = "other",
               recovery: str = "inprocess") -> TaskAssignment:
    return TaskAssignment(task="t", generation=1, argv=argv, env={}, world_size=len(ranks),
                          ranks=[RankSpec(rank=r, local_rank=i, gpu=i) for i, r in enumerate(ranks)],
                          store_node=store_node, recovery=recovery)


def store_of(a: TaskAssignment) -> StoreAddress:
    return StoreAddress(task=a.task, generation=a.generation, node="other", host="127.0.0.1", port=1)


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def reconcilers() -> Iterator[list[TaskReconciler]]:
    made: list[TaskReconciler] = []
    yield made
    for rec in made:
        rec.supervisor.terminate_all(0.5)


def test_an_oserror_launching_a_rank_fails_the_start_and_a_stop_still_stops_the_others(
        tmp_path: Path, reconcilers: list[TaskReconciler]) -> None:
    """Before, the OSError killed the reconciler's thread: no outcome (no ``results/<node>``), the later
    stop never carried out, rank 0 leaked, and the next generation waited for ``stopped`` for ever."""
    rec = TaskReconciler(assignment([0, 1]), RecordingHost(str(tmp_path), full_disk_for={1}), None, stop_grace_s=1.0)
    reconcilers.append(rec)
    rec.offer_store(store_of(rec.latest))
    assert rec.started.wait(10) and not rec.started.ok and "No space left" in rec.started.detail
    assert rec.rank_state(1) is RankState.FAILED
    pids = [p.pid for p in rec.processes().values()]
    assert rec.stop("no longer assigned").wait(10) and rec.stopped.is_set()
    assert not any(running(p) for p in pids)


def test_a_store_that_cannot_bind_fails_the_start_instead_of_the_thread(
        tmp_path: Path, reconcilers: list[TaskReconciler]) -> None:
    host = RecordingHost(str(tmp_path), advertise_host="203.0.113.7")  # not this host's: the bind fails
    rec = TaskReconciler(assignment([0], store_node="n0"), host, None, stop_grace_s=1.0)
    reconcilers.append(rec)
    assert rec.started.wait(10) and not rec.started.ok
    assert rec.stop("end").wait(10) and rec.stopped.is_set()


def test_a_rank_that_dies_before_it_is_counted_healthy_stays_failed_and_unwatched(
        tmp_path: Path, reconcilers: list[TaskReconciler], monkeypatch: pytest.MonkeyPatch) -> None:
    """The process exits between its launch and the reconciler taking its lock (here: the launch returns
    only once the exit was handled). Before, the rank turned HEALTHY afterwards and got an iteration
    monitor for the dead process, which later judged it hung."""
    launch = sup.Supervisor.launch

    def launch_then_die(self: sup.Supervisor, rank: int, *args: object, **kw: object) -> sup.RankProcess:
        proc = launch(self, rank, *args, **kw)  # type: ignore[arg-type]
        proc.exited.wait(10)
        assert proc.waiter is not None
        proc.waiter.join(10)
        return proc

    monkeypatch.setattr(sup.Supervisor, "launch", launch_then_die)
    host = RecordingHost(str(tmp_path))
    rec = TaskReconciler(assignment([0], argv=CRASH), host, None, stop_grace_s=1.0)
    reconcilers.append(rec)
    rec.offer_store(store_of(rec.latest))
    assert rec.started.wait(10)
    assert [r.kind for r in host.reports] == [ErrorKind.EXITED_ABNORMALLY]
    assert rec.rank_state(0) is RankState.FAILED and rec.state() is TaskState.FAILED
    assert host.launched == [] and rec.monitor(0, lambda: IterationMonitor(IterationSettings()))[0] is None


def test_a_ranks_stderr_goes_into_its_tasks_log(tmp_path: Path, reconcilers: list[TaskReconciler]) -> None:
    """Before, the reconciler's supervisor forwarded a rank's stderr to the agent's stderr only, with no
    task named: the traceback of a failed rank was in none of its task's files."""
    host = RecordingHost(str(tmp_path))
    argv = [sys.executable, "-c", "import sys; print('Traceback: ValueError: boom', file=sys.stderr); sys.exit(2)"]
    rec = TaskReconciler(assignment([0], argv=argv), host, None, stop_grace_s=1.0)
    reconcilers.append(rec)
    rec.offer_store(store_of(rec.latest))
    assert rec.started.wait(10)
    assert rec.supervisor.wait(0, 10) is not None
    err = tmp_path / "t-0.err"
    deadline = time.monotonic() + 10  # the stderr reader may finish after the exit was handled
    while (not err.exists() or not err.read_text()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert err.read_text() == "Traceback: ValueError: boom\n"


def test_each_launch_gets_a_fresh_error_file_in_its_tasks_log_directory(
        tmp_path: Path, reconcilers: list[TaskReconciler]) -> None:
    """The rank sees TORCHELASTIC_ERROR_FILE under the task's log directory, with no earlier launch's
    file there: what the agent reads after its failure is its own."""
    host = RecordingHost(str(tmp_path))
    a = assignment([0], argv=[sys.executable, "-c", "import os, sys; p = os.environ['TORCHELASTIC_ERROR_FILE'];"
                                                    " print(p, os.path.exists(p)); sys.exit(0)"])
    stale = Path(errorfile.path_for(str(tmp_path), a, 0))
    stale.parent.mkdir(parents=True)
    stale.write_text('{"message": "an earlier launch\'s"}')
    rec = TaskReconciler(a, host, None, stop_grace_s=1.0)
    reconcilers.append(rec)
    rec.offer_store(store_of(rec.latest))
    assert rec.started.wait(10)
    assert rec.supervisor.wait(0, 10) is not None
    out = tmp_path / "t-0.log"
    deadline = time.monotonic() + 10  # the stdout reader may finish after the exit was handled
    while not out.read_text() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert out.read_text() == f"{stale} False\n"


def test_a_restart_loop_keeps_only_the_current_and_previous_launchs_error_file_directories(
        tmp_path: Path, reconcilers: list[TaskReconciler]) -> None:
    """Each launch's TORCHELASTIC_ERROR_FILE directory (``gen<G>/attempt_<E>/rank<R>``) stayed for good:
    a restart loop added one per rank and restart to the run dir (memory under systemd). Now a launch
    removes its rank's older ones, keeping the previous launch's (its exit may still be read), also
    across a new generation of the task."""
    host = RecordingHost(str(tmp_path))
    a = assignment([0, 1])
    rec = TaskReconciler(a, host, None, stop_grace_s=1.0)
    reconcilers.append(rec)
    rec.offer_store(store_of(a))
    assert rec.started.wait(10) and rec.started.ok
    for epoch in range(1, 6):
        assert rec.apply(dataclasses.replace(a, restart_epoch=epoch, restart_ranks=[0, 1])).wait(20)

    def dirs(pattern: str) -> list[str]:
        return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob(pattern))

    assert dirs("gen*/attempt_*/rank*") == ["gen1/attempt_4/rank0", "gen1/attempt_4/rank1",
                                            "gen1/attempt_5/rank0", "gen1/attempt_5/rank1"]
    assert dirs("gen*/attempt_*") == ["gen1/attempt_4", "gen1/attempt_5"]  # no empty ones left behind
    assert rec.stop("reconfigured").wait(10)
    nxt = TaskReconciler(dataclasses.replace(a, generation=2), host, None, previous=rec, stop_grace_s=1.0)
    reconcilers.append(nxt)
    nxt.offer_store(store_of(nxt.latest))
    assert nxt.started.wait(10) and nxt.started.ok
    assert dirs("gen*/attempt_*/rank*") == ["gen1/attempt_5/rank0", "gen1/attempt_5/rank1",
                                            "gen2/attempt_0/rank0", "gen2/attempt_0/rank1"]
    assert dirs("gen*") == ["gen1", "gen2"]


def test_an_abnormal_exit_is_reported_with_the_exception_its_error_file_names(
        tmp_path: Path, reconcilers: list[TaskReconciler]) -> None:
    """Before, the report said only "rank 0 exited abnormally (exit code 1)": the exception a ``@record``
    main wrote (torch's format, here written by hand) was never read. Table 1's patterns classify it as
    they classify stderr lines."""
    code = ("import json, os, sys\n"
            "data = {'message': {'message': 'RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1\\nunhandled system"
            " error', 'extraInfo': {'py_callstack': 'Traceback', 'timestamp': '1'}}}\n"
            "json.dump(data, open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w'))\n"
            "sys.exit(1)\n")
    host = RecordingHost(str(tmp_path))
    rec = TaskReconciler(assignment([0], argv=[sys.executable, "-c", code]), host, None, stop_grace_s=1.0)
    reconcilers.append(rec)
    rec.offer_store(store_of(rec.latest))
    assert rec.started.wait(10)
    assert rec.supervisor.wait(0, 10) is not None
    assert [(r.kind, r.message) for r in host.reports] == [
        (ErrorKind.EXITED_ABNORMALLY, "rank 0 exited abnormally (exit code 1): RuntimeError: NCCL error in: "
                                      "ProcessGroupNCCL.cpp:1 unhandled system error; error file showed "
                                      "other_network_error")]


class _Answers:
    def __init__(self) -> None:
        self.puts: list[tuple[str, str, object]] = []

    def put(self, key: str, value: str, lease: object = None) -> int:
        self.puts.append((key, value, lease))
        return 1


def test_a_kill_injected_into_a_rank_that_already_exited_is_refused_not_left_unanswered(
        tmp_path: Path, reconcilers: list[TaskReconciler]) -> None:
    """Before, ``os.kill`` of the reaped pid raised ProcessLookupError past the handler: no answer (the
    requester timed out), and a reused pid would have been killed."""
    rec = TaskReconciler(assignment([0], argv=[sys.executable, "-c", "pass"]), RecordingHost(str(tmp_path)), None,
                         stop_grace_s=1.0)
    reconcilers.append(rec)
    rec.offer_store(store_of(rec.latest))
    assert rec.started.wait(10) and rec.supervisor.wait(0, 10) is not None
    agent = Agent.__new__(Agent)  # only what the injection handler reads
    answers = _Answers()
    agent._tasks_lock, agent._tasks, agent.node, agent.store = threading.Lock(), {"t": rec}, "n0", answers  # type: ignore[assignment]
    node_lease = agent.lease = object()  # type: ignore[assignment]  # the answer goes under the node's lease
    req = Injection(fault=Fault.KILL_RANK, task="t", rank=0)
    agent._on_injection_event(WatchEvent("put", "inject/n0/1", req.to_json().encode(), 1))
    (_, value, lease), = answers.puts
    assert lease is node_lease
    answer = Injection.from_json(value.encode() if isinstance(value, str) else value)
    assert answer.ok is False and "no running process" in str(answer.detail)
    rec.stop("end").wait(10)


def test_a_tasks_rank_counters_leave_the_agents_metrics_with_the_task() -> None:
    """unicron_agent_rank_launches_total{task} and ..._rank_restarts_total{task} kept a series for every
    task the node ever ran: an agent up for weeks through thousands of uniquely named jobs exported
    them all. Now a task's series go when it is no longer assigned to the node."""
    agent = Agent.__new__(Agent)  # only what reconcile() reads for a task that leaves
    leaving = types.SimpleNamespace(latest=types.SimpleNamespace(ranks=[]), monitors={},
                                    stop=lambda reason, kill: reconciler.Outcome("old-job"))
    agent._tasks_lock, agent._tasks, agent._retired = threading.Lock(), {"old-job": leaving}, {}  # type: ignore[dict-item]
    agent._reporting_tasks = set()
    agent.metrics = AgentMetrics()
    agent.metrics.rank_launches.labels("old-job").inc()
    agent.metrics.rank_restarts.labels("old-job").inc()
    agent.reconcile([])
    names = {s.labels.get("task") for f in agent.metrics.registry.collect() for s in f.samples}
    assert "old-job" not in names


class _StoresThatFail:
    """Store sidecars that listen at once except for the starts named in ``failing`` (1 = the first)."""

    def __init__(self, failing: set[int]) -> None:
        self.failing, self.starts = failing, 0

    def start(self, host: str, task: str, timeout_s: float = 60.0, prefork: Prefork | None = None) -> StoreSidecar:
        self.starts += 1
        if self.starts in self.failing:
            raise TemporaryError(f"task {task}: the store sidecar could not listen on {host}")
        return StoreSidecar(subprocess.Popen(SLEEPER), "127.0.0.1", 40000 + self.starts)

    def spawn(self, host: str, prefork: Prefork | None = None) -> StoreSidecar:
        raise OSError("no spare store in this test")


def test_a_restart_whose_store_fails_reports_at_its_own_epoch_and_the_next_one_hosts_the_store(
        tmp_path: Path, reconcilers: list[TaskReconciler], monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``restart`` task's first restart stops its ranks, and its fresh store fails to start. Before,
    the failure was published at the old restart epoch (the coordinator took it for an older action's:
    no ActionFailed, the stopped ranks never relaunched), and the next restart waited for its own
    store's address for ever (hosting was judged by a sidecar running, which the failure had cleared)."""
    stores = _StoresThatFail(failing={2})
    monkeypatch.setattr(reconciler, "StoreSidecar", stores)
    a = assignment([0], store_node="n0", recovery="restart")
    rec = TaskReconciler(a, RecordingHost(str(tmp_path)), None, stop_grace_s=1.0)
    reconcilers.append(rec)
    assert rec.started.wait(10) and rec.started.ok, rec.started.detail
    first = rec.apply(dataclasses.replace(a, restart_epoch=1, restart_ranks=[0]))
    assert first.wait(20) and not first.ok
    assert rec.applied.restart_epoch == 1  # what results/<node> says
    second = rec.apply(dataclasses.replace(a, restart_epoch=2, restart_ranks=[0]))
    assert second.wait(20) and second.ok, second.detail
    assert rec.store_address() is not None and rec.store_address().port == 40003  # type: ignore[union-attr]
    assert rec.stop("end").wait(10)


def test_a_crashed_rank_is_relaunched_only_once_its_death_is_marked(
        tmp_path: Path, reconcilers: list[TaskReconciler]) -> None:
    """Its exit queues a mark without waiting; had the marker been slow, the mark would have landed
    after the successor counted itself in and raised ``failed`` to the successor's incarnation. The
    restart now waits for a mark of its own, which the helper answers after the queued one."""
    host = RecordingHost(str(tmp_path))
    a = assignment([0])
    rec = TaskReconciler(a, host, None, stop_grace_s=1.0)
    reconcilers.append(rec)
    rec.offer_store(store_of(a))
    assert rec.started.wait(10) and rec.started.ok
    os.kill(rec.processes()[0].pid, signal.SIGKILL)
    assert rec.supervisor.wait(0, 10) is not None
    assert rec.apply(dataclasses.replace(a, restart_epoch=1, restart_ranks=[0])).wait(20)
    assert host.events == ["launch 0", "mark 0", "mark 0 and wait", "launch 0"], host.events
    assert rec.stop("end").wait(10)


def test_a_joiner_whose_predecessor_never_left_is_not_relaunched_nor_blamed_on_the_task(
        tmp_path: Path, reconcilers: list[TaskReconciler], monkeypatch: pytest.MonkeyPatch) -> None:
    """A resize re-hosts rank 0 here as a joiner and its old process never dies (stuck in the GPU
    driver: here the kills are swallowed). Before, the joiner was launched over it anyway, and the
    supervisor's "already running" was taken for the task's command failing (``cannot_start``: the
    whole task failed, FailureCause.TASK) with the rank marked FAILED while it ran. Now the resize
    reports that the rank did not leave and launches nothing over it."""
    monkeypatch.setattr(reconciler, "LEAVE_WAIT_S", 0.2)
    monkeypatch.setattr(reconciler, "RESTART_WAIT_S", 0.1)
    host = RecordingHost(str(tmp_path))
    a = assignment([0])
    rec = TaskReconciler(a, host, None, stop_grace_s=0.1)
    reconcilers.append(rec)
    rec.offer_store(store_of(a))
    assert rec.started.wait(10) and rec.started.ok, rec.started.detail
    old_pid = rec.processes()[0].pid
    swallowed: list[int] = []
    monkeypatch.setattr(rec.supervisor, "kill", lambda rank, sig=9, grace_s=10.0: swallowed.append(sig))

    out = rec.apply(dataclasses.replace(a, membership_epoch=1, joiners=[0]))
    assert out.wait(10) and not out.ok
    assert swallowed and running(old_pid) and rec.processes()[0].pid == old_pid
    assert "did not leave" in out.detail and "already running" not in out.detail
    assert rec.cannot_start() == "" and rec.rank_state(0) is not RankState.FAILED
    assert host.launched == [0]
    monkeypatch.undo()  # the fixture's clean-up kills it for real


def test_a_kill_stop_is_not_held_behind_a_resize_waiting_for_a_leaver(
        tmp_path: Path, reconcilers: list[TaskReconciler], monkeypatch: pytest.MonkeyPatch) -> None:
    """A resize asks rank 1 to leave and waits up to LEAVE_WAIT_S (60 s) for it; a rank hung in a
    collective never reaches an iteration boundary. Before, the isolated node's stop (SIGKILL, so that
    its ranks do not outlive their relaunch elsewhere) waited behind the whole leave wait and its
    SIGTERM grace, the survivor running all along; now the wait ends as soon as the stop is asked."""
    monkeypatch.setattr(reconciler, "LEAVE_WAIT_S", 30.0)

    class Connected(RecordingHost):
        def send_to_rank(self, task: str, rank: int, msg: protocol.Message) -> bool:
            return True  # the Leave is delivered (and ignored by the hung rank)

    a = assignment([0, 1])
    rec = TaskReconciler(a, Connected(str(tmp_path)), None, stop_grace_s=1.0)
    reconcilers.append(rec)
    rec.offer_store(store_of(a))
    assert rec.started.wait(10) and rec.started.ok, rec.started.detail
    survivor = rec.processes()[0].pid
    rec.apply(dataclasses.replace(a, ranks=a.ranks[:1], membership_epoch=1, members=RankSet.of([0])))
    deadline = time.monotonic() + 5
    while rec.rank_state(1) is not RankState.STOPPING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rec.rank_state(1) is RankState.STOPPING  # the leave is under way
    t0 = time.monotonic()
    assert rec.stop("node isolated", kill=True).wait(5), f"the stop still waits after {time.monotonic() - t0:.1f} s"
    assert not running(survivor)


def test_a_dead_process_progress_line_does_not_count_for_its_relaunched_successor(
        tmp_path: Path, reconcilers: list[TaskReconciler], monkeypatch: pytest.MonkeyPatch) -> None:
    """An uninstrumented rank printed a progress line, hung, and was relaunched in place; its stdout
    reader (joined by nothing) handed the line on only after the relaunch (held here, as on a busy
    agent). Before, the line was recorded as the successor's step, ``advanced`` at the new restart
    epoch, which the coordinator takes as proof the restart worked (``coordinator.causes.progress``);
    now a line carries its process's pid and one of a predecessor is dropped."""
    got_line, release, handled = threading.Event(), threading.Event(), threading.Event()
    line_of = sup.Supervisor._line

    def slow_reader(self: sup.Supervisor, proc: sup.RankProcess, line: str, ts: float) -> None:
        if "iteration" not in line or got_line.is_set():
            return line_of(self, proc, line, ts)
        got_line.set()
        release.wait(10)
        try:
            line_of(self, proc, line, ts)
        finally:
            handled.set()

    monkeypatch.setattr(sup.Supervisor, "_line", slow_reader)
    agent = Agent.__new__(Agent)  # only what its rank_progress reads

    class ToTheAgent(RecordingHost):
        def rank_progress(self, task: str, rank: int, progress: Progress | None, phase: str | None, ts: float,
                          pid: int) -> None:
            agent.rank_progress(task, rank, progress, phase, ts, pid)

    line = "iteration       10/     100 | consumed samples:  640 | elapsed time per iteration (ms): 1234.5 |"
    flag = tmp_path / "printed"  # only the first process prints: its successor makes no step
    argv = [sys.executable, "-c", f"import os, time\nif not os.path.exists({str(flag)!r}):\n"
            f"    open({str(flag)!r}, 'w').close(); print({line!r}, flush=True)\ntime.sleep(1000)"]
    a = assignment([0], argv=argv)
    rec = TaskReconciler(a, ToTheAgent(str(tmp_path)), None, stop_grace_s=1.0)
    reconcilers.append(rec)
    agent._tasks_lock, agent._tasks, agent._progress_lock, agent._progress = threading.Lock(), {"t": rec}, threading.Lock(), {}
    agent.iteration_settings, agent.hang_watcher = IterationSettings(), HangWatcher(lambda key, finding: None)
    rec.offer_store(store_of(a))
    assert rec.started.wait(10) and rec.started.ok, rec.started.detail
    assert got_line.wait(10)  # the old process's line was read, and is on its way
    old_pid = rec.processes()[0].pid

    assert rec.apply(dataclasses.replace(a, restart_epoch=1, restart_ranks=[0])).wait(20)
    assert rec.launch_epoch(0) == 1 and rec.rank_state(0) is RankState.HEALTHY
    release.set()
    assert handled.wait(10)
    (st,) = rec.rank_statuses()
    assert st.restart_epoch == 1
    assert not st.advanced and st.step is None, f"successor credited with the dead process's step {st.step}"
    rec.record_step(0, 11, completed=True, pid=old_pid)  # one that passed the agent's check before the relaunch
    assert not rec.rank_statuses()[0].advanced


def test_a_restart_superseded_before_its_store_came_does_not_launch_its_ranks_on_the_next_attempts_store(
        tmp_path: Path, reconcilers: list[TaskReconciler]) -> None:
    """A ``restart`` task on a node without its store: attempt 1 stops the ranks and waits for its
    store, which never comes (its start failed on the store's node), and attempt 2 is ordered. Before,
    attempt 2's store woke attempt 1, which launched its ranks on it; attempt 2 then killed them and
    relaunched on the store their rendezvous keys now polluted (what a fresh store per attempt is
    for). Now a queued newer attempt ends the older one's wait, and only attempt 2 launches."""
    launches: list[tuple[int, int]] = []  # (the assignment's restart epoch, its store's)

    class Host(RecordingHost):
        def rank_env(self, a: TaskAssignment, spec: RankSpec, store: StoreAddress, error_file: str) -> dict[str, str]:
            launches.append((a.restart_epoch, store.restart_epoch))
            return super().rank_env(a, spec, store, error_file)

    a = assignment([0], recovery="restart")
    rec = TaskReconciler(a, Host(str(tmp_path)), None, stop_grace_s=0.5)
    reconcilers.append(rec)
    rec.offer_store(store_of(a))
    assert rec.started.wait(10) and rec.started.ok, rec.started.detail
    first = rec.apply(dataclasses.replace(a, restart_epoch=1, restart_ranks=[0]))
    assert rec.supervisor.wait(0, 10) is not None  # attempt 1 stopped the rank: it waits for its store
    second = rec.apply(dataclasses.replace(a, restart_epoch=2, restart_ranks=[0]))
    rec.offer_store(dataclasses.replace(store_of(a), port=2, restart_epoch=2))
    assert first.wait(10) and second.wait(20) and second.ok, second.detail
    assert launches == [(0, 0), (2, 2)]


def test_an_inprocess_restart_or_resize_without_a_store_is_not_reported_applied(
        tmp_path: Path, reconcilers: list[TaskReconciler], monkeypatch: pytest.MonkeyPatch) -> None:
    """The store of an ``inprocess`` task could not start here (its start failed: no rank runs). Before,
    a later restart (or resize) skipped its launches for want of a store, said nothing, and reported
    "applied": results/<node> claimed ranks that did not run. Now it fails, saying why."""
    monkeypatch.setattr(reconciler, "StoreSidecar", _StoresThatFail(failing={1}))
    a = assignment([0], store_node="n0")
    rec = TaskReconciler(a, RecordingHost(str(tmp_path)), None, stop_grace_s=1.0)
    reconcilers.append(rec)
    assert rec.started.wait(10) and not rec.started.ok
    restart = dataclasses.replace(a, restart_epoch=1, restart_ranks=[0])
    out = rec.apply(restart)
    assert out.wait(10) and not out.ok and "no store" in out.detail, out.detail
    out = rec.apply(dataclasses.replace(restart, membership_epoch=1, joiners=[0]))
    assert out.wait(10) and not out.ok and "no store" in out.detail, out.detail
    assert rec.processes() == {}


def test_a_stop_that_comes_during_an_inprocess_restart_is_not_preceded_by_the_relaunch(
        tmp_path: Path, reconcilers: list[TaskReconciler]) -> None:
    """A new generation (or the node's isolation) stops the task while an in-place restart of its ranks
    waits for the marker to write rank 0's death. Before, the restart went on: it relaunched rank 0,
    killed, marked and relaunched rank 1, and only then did the stop kill what it had just launched,
    the next generation waiting for their GPUs. Now the restart ends there, and the stop follows."""
    in_mark, release = threading.Event(), threading.Event()

    class SlowMarker(RecordingHost):
        def mark_failed(self, store: StoreAddress, rank: int, wait_s: float = 0.0) -> bool:
            if wait_s > 0 and not in_mark.is_set():
                in_mark.set()
                release.wait(10)
            return super().mark_failed(store, rank, wait_s)

    host = SlowMarker(str(tmp_path))
    a = assignment([0, 1])
    rec = TaskReconciler(a, host, None, stop_grace_s=1.0)
    reconcilers.append(rec)
    rec.offer_store(store_of(a))
    assert rec.started.wait(10) and rec.started.ok, rec.started.detail
    rec.apply(dataclasses.replace(a, restart_epoch=1, restart_ranks=[0, 1]))
    assert in_mark.wait(10)
    stop = rec.stop("reconfigured to generation 2")
    release.set()
    assert stop.wait(20)
    assert host.launched == [0, 1], f"launched after the stop was asked for: {host.launched[2:]}"


def test_a_fork_refused_for_want_of_process_slots_is_not_blamed_on_the_task(
        tmp_path: Path, reconcilers: list[TaskReconciler], monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork that fails with EAGAIN (the node's process limit, for the moment) was reported as the
    task's command that cannot be executed (``cannot_start``: the coordinator fails the whole task at
    once, FailureCause.TASK). Now it fails the start as this node's trouble, like a full disk."""

    def no_slots(*args: object, **kw: object) -> subprocess.Popen[bytes]:
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(subprocess, "Popen", no_slots)
    rec = TaskReconciler(assignment([0]), RecordingHost(str(tmp_path)), None, stop_grace_s=1.0)
    reconcilers.append(rec)
    rec.offer_store(store_of(rec.latest))
    assert rec.started.wait(10) and not rec.started.ok and "Resource temporarily unavailable" in rec.started.detail
    assert rec.cannot_start() == "" and rec.rank_state(0) is RankState.FAILED


MEGATRON_LINE = (" iteration {:8d}/     100 | consumed samples: 640 | elapsed time per iteration (ms): 100.0 |"
                 " lm loss: 1.04E+01 |")


def test_a_save_ends_at_a_later_progress_line_not_at_its_own_iterations(
        tmp_path: Path, reconcilers: list[TaskReconciler]) -> None:
    """Megatron's last rank prints iteration 10's line before rank 0 prints 'saving checkpoint at
    iteration 10'; read from two pipes, it may come second and must not end the save (its silence would
    be judged). A later iteration's line does end it: the job trains (a save whose end line had another
    format). With --async-save the 'scheduled' line ends it."""
    host = RecordingHost(str(tmp_path))
    rec = TaskReconciler(assignment([0, 1]), host, None, stop_grace_s=1.0)
    reconcilers.append(rec)
    rec._on_line(0, 1, " saving checkpoint at iteration      10 to /ckpt in torch_dist format", 1.0)
    rec._on_line(1, 2, MEGATRON_LINE.format(10), 1.1)
    assert host.phases == [PHASE_CHECKPOINT]
    rec._on_line(1, 2, MEGATRON_LINE.format(11), 1.2)
    assert host.phases == [PHASE_CHECKPOINT, protocol.PHASE_TRAIN]
    rec._on_line(0, 1, " saving checkpoint at iteration      20 to /ckpt in torch_dist format", 2.0)
    rec._on_line(0, 1, "  scheduled an async checkpoint save at iteration      20 to /ckpt", 2.1)
    rec._on_line(1, 2, MEGATRON_LINE.format(21), 2.2)  # training goes on: nothing more to end
    assert host.phases == [PHASE_CHECKPOINT, protocol.PHASE_TRAIN, PHASE_CHECKPOINT, protocol.PHASE_TRAIN]
    rec.stop("end").wait(10)


def test_a_hosted_store_sidecar_that_dies_is_reported_and_a_fresh_one_hosted_at_the_next_store_epoch(
        tmp_path: Path, reconcilers: list[TaskReconciler]) -> None:
    """Unreported, the ranks waited for a ``StoreMoved`` nobody sent; their waits and their stderr read
    as hangs and network faults, and restarts onto the dead store ended in this node isolated. A sidecar
    the agent stops itself (a move, the task's stop) is no loss."""
    host = RecordingHost(str(tmp_path))
    a = assignment([0], store_node="n0")
    rec = TaskReconciler(a, host, None, stop_grace_s=1.0)
    reconcilers.append(rec)
    assert rec.started.wait(90) and rec.started.ok, rec.started.detail
    first = rec.store_address()
    assert first is not None and rec._sidecar is not None
    os.kill(rec._sidecar.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not host.reports and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [(r.kind, r.task) for r in host.reports] == [(ErrorKind.STORE_LOST, "t")], host.reports
    fresh = dataclasses.replace(a, membership_epoch=1, store_epoch=1, members=RankSet.of([0]))
    assert rec.apply(fresh).wait(90) and rec.applied is fresh
    moved = rec.store_address()
    assert moved is not None and moved.store_epoch == 1 and moved.port != first.port
    assert rec._sidecar is not None and running(rec._sidecar.proc.pid)
    assert rec.stop("end").wait(10)
    time.sleep(0.5)  # the watcher of the sidecar the stop ended has seen its exit
    assert len(host.reports) == 1, host.reports
