"""The coordinator's loop against a real etcd whose writes fail on demand (issue #12 item 2, issue #19
items 8 and 9). The loop thread runs as in the daemon; inputs are the watch records agents write.

The store is a real :class:`Store` on a real etcd; only its fenced transaction can be told to raise
:class:`StoreUnavailable` for the next N calls, which is what a short etcd outage does to it.
"""

from __future__ import annotations

import json
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future

import pytest

from coordinator import daemon
from coordinator import decision as d
from coordinator.daemon import (
    Call,
    Coordinator,
    CoreClock,
    CoreEvent,
    Input,
    LinkLost,
    NodeChanged,
    Reelected,
    ReportSeen,
    ResultSeen,
    StatusChanged,
)
from coordinator.leader import Leadership
from coordinator.settings import CoordinatorSettings
from coordinator.statestore import read_state
from coordinator.tasks import TaskSpec, parse_task_spec
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.errors import StoreUnavailable
from unicron.kernel.etcd import Lease, Store, WatchEvent
from unicron.kernel.types import (
    AssignmentResult,
    DetectionMethod,
    ErrorKind,
    NodeAssignment,
    NodeInfo,
    NodeStatus,
    RankStatus,
    Report,
    Severity,
    TaskResult,
)


class FlakyStore(Store):
    """A real store whose next ``fail`` fenced transactions raise as if etcd were down."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.fail = 0
        self.on_fail: Callable[[], None] = lambda: None

    def guarded_txn(self, guard_key: str, guard_revision: int, puts: Mapping[str, str | bytes] = {},
                    deletes: Sequence[str] = (), lease: Lease | None = None, absent: Sequence[str] = ()) -> bool:
        if self.fail > 0:
            self.fail -= 1
            self.on_fail()
            raise StoreUnavailable("etcd unavailable (injected by the test)")
        return super().guarded_txn(guard_key, guard_revision, puts=puts, deletes=deletes, lease=lease,
                                   absent=absent)


@pytest.fixture
def coord(etcd_server: EtcdServer) -> Iterator[tuple[Coordinator, FlakyStore]]:
    yield from leading(CoordinatorSettings(etcd=etcd_server.endpoint, prefix="/tx"))


@pytest.fixture
def quick(etcd_server: EtcdServer) -> Iterator[tuple[Coordinator, FlakyStore]]:
    """A leader whose restarts have a deadline of 1 s."""
    yield from leading(CoordinatorSettings(etcd=etcd_server.endpoint, prefix="/tx", restart_deadline_s=1.0))


def leading(settings: CoordinatorSettings) -> Iterator[tuple[Coordinator, FlakyStore]]:
    c = Coordinator(settings)
    store = FlakyStore(settings.etcd)
    c.store = store
    c.leadership = Leadership(store, c.keys, "test", ttl_s=3, on_deposed=c.stop)
    assert c.leadership.campaign(threading.Event())
    loop = threading.Thread(target=c._loop, daemon=True)
    loop.start()
    try:
        yield c, store
    finally:
        c.stop()
        loop.join(5)
        c.leadership.resign()
        store.close()


def feed(c: Coordinator, item: Input) -> None:
    c._inbox.put(item)


def settle(c: Coordinator) -> None:
    """Wait until the loop has handled everything queued so far (the inbox is handled in order)."""
    fut: Future[object] = Future()
    c._inbox.put(Call(lambda: None, fut))
    fut.result(timeout=20)


def register(c: Coordinator, node: str, pid: int) -> None:
    info = NodeInfo(node=node, host="localhost", gpus=1, gpu_backend="simulated", agent_pid=pid, started_ts=float(pid))
    feed(c, NodeChanged(WatchEvent("put", c.keys.node(node), info.to_json().encode(), 0), time.time()))


def report_input(c: Coordinator, report: Report) -> ReportSeen:
    key = c.keys.report(report.node, report.report_id)
    value = report.to_json()
    assert c.store is not None
    c.store.put(key, value)
    return ReportSeen(WatchEvent("put", key, value.encode(), 0), time.time())


def running(c: Coordinator, recovery: str = "restart") -> None:
    """Two nodes, one task on both, confirmed by progress."""
    register(c, "n0", 1)
    register(c, "n1", 2)
    spec = parse_task_spec({"name": "t", "command": ["python", "x.py"], "min_gpus": 2, "recovery": recovery}, None)
    feed(c, CoreEvent(d.TaskSubmitted(ts=time.time(), spec=spec)))
    settle(c)
    gen = c.state.tasks["t"].generation
    feed(c, CoreEvent(d.ProgressMade(ts=time.time(), task="t", step=1, generation=gen)))
    settle(c)
    assert c.state.tasks["t"].phase is d.TaskPhase.RUNNING


def assignment(c: Coordinator, node: str) -> NodeAssignment:
    assert c.store is not None
    kv = c.store.get(c.keys.assignment(node))
    assert kv is not None
    return NodeAssignment.from_json(kv.value)


def argv(c: Coordinator, node: str) -> list[str]:
    """The command task ``t``'s record for ``node`` launches."""
    return next(a.argv for a in assignment(c, node).tasks if a.task == "t")


def incidents(c: Coordinator) -> int:
    assert c.store is not None
    return len(c.store.get_prefix(c.keys.incidents())[0])


def sev2(node: str) -> Report:
    return Report(method=DetectionMethod.PROCESS_SUPERVISION, kind=ErrorKind.EXITED_ABNORMALLY, node=node,
                  task="t", rank=1 if node == "n1" else 0, generation=1, source_ts=time.time())


def test_a_failed_write_leaves_memory_as_it_was_and_the_restart_is_written_later(
        coord: tuple[Coordinator, FlakyStore]) -> None:
    c, store = coord
    running(c)
    node = next(n for n, r in c.state.tasks["t"].placement.items() if r)
    before = assignment(c, node)
    seen: list[tuple[d.TaskPhase, int, int]] = []

    def observe() -> None:  # what the coordinator believes while its write fails
        e = c.state.tasks["t"]
        desired = c.executor.desired[node]["t"]
        seen.append((e.phase, e.restart_epoch, desired.restart_epoch))

    store.on_fail = observe
    store.fail = 3  # three attempts fail: etcd is "down" for about 0.6 s
    feed(c, report_input(c, sev2(node)))
    deadline = time.monotonic() + 20
    while assignment(c, node).tasks[0].restart_epoch == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = assignment(c, node)
    assert len(seen) == 3 and all(s == (d.TaskPhase.RUNNING, 0, 0) for s in seen), seen
    assert after.tasks[0].restart_epoch == 1 and after.revision > before.revision
    assert c.state.tasks["t"].phase is d.TaskPhase.RESTARTING and c.state.tasks["t"].restart_epoch == 1
    assert incidents(c) == 1


def test_a_restart_outlasting_an_etcd_outage_gets_a_grace_after_it(quick: tuple[Coordinator, FlakyStore]) -> None:
    """A leader that keeps its lease through an etcd outage is in a new leader's place when etcd returns:
    the relaunched ranks' statuses are still in their agents' retries. Before, the retried tick, the
    first decision written after the outage, expired the restart and isolated a healthy node."""
    c, store = quick
    running(c)
    node = next(n for n, r in c.state.tasks["t"].placement.items() if r)
    feed(c, report_input(c, sev2(node)))
    settle(c)
    assert c.state.tasks["t"].phase is d.TaskPhase.RESTARTING
    store.fail = 1_000_000  # etcd goes down ...
    time.sleep(1.2)  # ... for longer than the restart's deadline
    feed(c, CoreEvent(d.Tick(ts=time.time())))  # the ticker's tick: its decision cannot be written, retried
    time.sleep(0.5)
    store.fail = 0  # etcd is back
    time.sleep(1.0)  # the loop retries its input every 0.2 s
    settle(c)
    back = time.time()
    entry = c.state.tasks["t"]
    assert entry.phase is d.TaskPhase.RESTARTING, entry.reason
    assert c.state.nodes[node].status is d.NodeState.UP
    assert entry.outstanding is not None and entry.outstanding.deadline > back + 5.0  # the registration grace
    stored, _, _ = read_state(store, c.keys)  # written with the decision that adopted it: a successor loads it
    assert stored is not None and stored.tasks["t"].outstanding == entry.outstanding
    feed(c, CoreEvent(d.ProgressMade(ts=time.time(), task="t", step=2, generation=entry.generation,
                                     restart_epoch=entry.restart_epoch)))  # the statuses arrive
    settle(c)
    assert c.state.tasks["t"].phase.value == "running"  # (mypy narrowed the enum above)
    assert c.state.tasks["t"].outstanding is None


def test_failed_etcd_calls_the_store_retried_by_itself_give_no_grace(quick: tuple[Coordinator, FlakyStore]) -> None:
    """Only a decision or input that failed is an outage. Counted from the store's error observer (a
    keepalive, a watch's resubscription), one such error every few seconds gave every deadline a new
    grace, and an unconfirmed restart never escalated (diff review #2)."""
    c, _ = quick
    running(c)
    node = next(n for n, r in c.state.tasks["t"].placement.items() if r)
    feed(c, report_input(c, sev2(node)))
    settle(c)
    assert c.state.tasks["t"].phase is d.TaskPhase.RESTARTING  # deadline 1 s; nothing confirms it
    deadline = time.monotonic() + 8.0
    while c.state.nodes[node].status is d.NodeState.UP and time.monotonic() < deadline:
        c._etcd_error(StoreUnavailable("etcd lease keepalive failed: DEADLINE_EXCEEDED (one call)"))
        feed(c, CoreEvent(d.Tick(ts=c.clock())))
        settle(c)
        time.sleep(0.3)
    assert c.state.nodes[node].status is not d.NodeState.UP, "the unconfirmed restart was never escalated"


def test_a_wall_clock_step_on_the_leaders_host_holds_back_no_deadline(
        quick: tuple[Coordinator, FlakyStore], monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's clock steps forward an hour and back (a bad NTP source) while the leader ticks. Its
    events were stamped with the wall clock, so the core's clock stayed an hour ahead and a restart
    that never confirmed was not escalated at its deadline (nor for the hour)."""
    c, _ = quick
    running(c)
    offset = [0.0]
    real = time.time
    monkeypatch.setattr(daemon, "time", types.SimpleNamespace(time=lambda: real() + offset[0],
                                                              monotonic=time.monotonic))
    threading.Thread(target=c._ticker, daemon=True).start()  # ends with the coordinator
    offset[0] = 3600.0
    time.sleep(2.5)  # ticks meanwhile
    offset[0] = 0.0
    time.sleep(1.2)
    node = next(n for n, r in c.state.tasks["t"].placement.items() if r)
    feed(c, report_input(c, sev2(node)))
    settle(c)
    assert c.state.tasks["t"].phase is d.TaskPhase.RESTARTING
    deadline = time.monotonic() + 10  # the restart's deadline is 1 s; ticks come every 1 s
    while c.state.nodes[node].status is d.NodeState.UP and time.monotonic() < deadline:
        time.sleep(0.1)
    assert c.state.nodes[node].status is d.NodeState.ISOLATED, "the unconfirmed restart was not escalated"
    assert c.state.now < real() + 60


def test_the_cores_clock_follows_the_monotonic_clock_from_its_anchor() -> None:
    wall, mono = [1000.0], [5.0]
    clock = CoreClock(wall=lambda: wall[0], monotonic=lambda: mono[0])
    assert clock() == 1000.0
    mono[0] += 2.0
    wall[0] += 3600.0 + 2.0  # a step forward ...
    assert clock() == 1002.0
    wall[0] -= 3600.0  # ... and back
    mono[0] += 1.0
    assert clock() == 1003.0
    clock.anchor(at_least=0.0)  # a new anchor (a state loaded): the wall clock's time
    assert clock() == wall[0]
    clock.anchor(at_least=wall[0] + 50.0)  # never behind the loaded state's clock
    mono[0] += 1.0
    assert clock() == wall[0] + 51.0


def test_a_report_seen_twice_is_one_incident(coord: tuple[Coordinator, FlakyStore]) -> None:
    """Issue #19 item 9: a watch replay after an etcd outage delivers the report again."""
    c, _ = coord
    running(c)
    node = next(n for n, r in c.state.tasks["t"].placement.items() if r)
    item = report_input(c, sev2(node))
    feed(c, item)
    feed(c, item)
    settle(c)
    assert incidents(c) == 1
    assert c.state.tasks["t"].restart_epoch == 1


def test_an_isolated_node_stays_isolated_when_its_agent_registers_again(
        coord: tuple[Coordinator, FlakyStore]) -> None:
    """Issue #19 item 8: only an operator's undrain ends an isolation, not a reconnect."""
    c, _ = coord
    running(c)
    ecc = Report(method=DetectionMethod.EXCEPTION_PROPAGATION, kind=ErrorKind.ECC_ERROR, node="n0",
                 source_ts=time.time())
    feed(c, report_input(c, ecc))
    settle(c)
    assert c.state.nodes["n0"].status is d.NodeState.ISOLATED
    register(c, "n0", 99)  # the agent restarted (a new pid) and registered again
    settle(c)
    assert c.state.nodes["n0"].status is d.NodeState.ISOLATED
    feed(c, CoreEvent(d.NodeUndrained(ts=time.time(), node="n0")))
    settle(c)
    assert c.state.nodes["n0"].status.value == "up"  # (mypy narrowed the enum above)


def test_a_node_whose_lease_is_gone_while_no_link_runs_is_a_recorded_sev1(
        coord: tuple[Coordinator, FlakyStore]) -> None:
    """An agent killed before its link reached a newly elected leader is found only by its lease
    expiring (bench/chaos.py: fault 'agent_sigkill' right after 'leader_sigkill'); that loss is an
    incident like a lost link, not only a transition."""
    c, _ = coord
    running(c)
    node = next(n for n, r in c.state.tasks["t"].placement.items() if r)
    before = incidents(c)
    feed(c, NodeChanged(WatchEvent("delete", c.keys.node(node), b"", 0), time.time()))
    settle(c)
    assert incidents(c) == before + 1
    inc = c.recent_incidents[-1]
    assert (inc.node, inc.kind, inc.severity) == (node, ErrorKind.LOST_CONNECTION, Severity.SEV1), inc
    assert c.state.nodes[node].status is d.NodeState.LOST
    assert c.state.tasks["t"].phase is not d.TaskPhase.RUNNING  # its task moves off the node


def test_a_hang_reported_for_a_waiting_peer_restarts_the_stopped_rank(coord: tuple[Coordinator, FlakyStore]) -> None:
    """A stopped rank holds its peers in its collective; a peer's hang report, read first, must not
    restart the peer (bench/resize_soak.py, seed 11) but the rank its node's status shows stopped."""
    c, _ = coord
    running(c, recovery="inprocess")
    gen = c.state.tasks["t"].generation
    (waiting, waiting_rank), (frozen, frozen_rank) = sorted((n, r[0]) for n, r in c.state.tasks["t"].placement.items())
    for node, rank, state in ((waiting, waiting_rank, "running"), (frozen, frozen_rank, "stopped")):
        st = NodeStatus(node=node, ts=time.time(), generation=gen, task="t", gpu_health=[],
                        ranks=[RankStatus(task="t", generation=gen, rank=rank, pid=1, state=state, step=1)])
        feed(c, StatusChanged(WatchEvent("put", c.keys.status(node), st.to_json().encode(), 0), time.time()))
    hang = Report(method=DetectionMethod.STATISTICAL_MONITORING, kind=ErrorKind.TASK_HANG, node=waiting, task="t",
                  rank=waiting_rank, step=1, generation=gen, source_ts=time.time())
    feed(c, report_input(c, hang))
    settle(c)
    inc = c.recent_incidents[-1]
    assert (inc.node, inc.rank, inc.severity) == (frozen, frozen_rank, Severity.SEV2), inc
    assert assignment(c, frozen).tasks[0].restart_epoch == 1  # only the stopped rank relaunches
    assert assignment(c, waiting).tasks[0].restart_epoch == 0


def test_a_hang_after_an_in_place_recovery_is_acted_on_once_it_is_a_later_iterations(
        coord: tuple[Coordinator, FlakyStore]) -> None:
    """Hangs reported in the iteration a rank's in-place recovery broke are its echo (handled); a
    hang of a later iteration within the grace is a new fault and restarts its rank at once (before,
    the soak's rank_hang waited 60 s for the hang to be reported again)."""
    c, _ = coord
    running(c, recovery="inprocess")
    gen = c.state.tasks["t"].generation
    node, rank = sorted((n, r[0]) for n, r in c.state.tasks["t"].placement.items())[0]
    now = time.time()
    feed(c, report_input(c, Report(method=DetectionMethod.EXCEPTION_PROPAGATION, kind=ErrorKind.CONNECTION_REFUSED_RESET,
                                   node=node, task="t", rank=rank, step=5, generation=gen, handled=True,
                                   source_ts=now)))
    for step in (5, 9):
        feed(c, report_input(c, Report(method=DetectionMethod.STATISTICAL_MONITORING, kind=ErrorKind.TASK_HANG,
                                       node=node, task="t", rank=rank, step=step, generation=gen,
                                       source_ts=now + 1.0)))
        settle(c)
    echo, new = list(c.recent_incidents)[-2:]
    assert (echo.step, echo.handled) == (5, True) and "during an in-place regroup" in echo.message
    assert (new.step, new.handled, new.severity) == (9, False, Severity.SEV2), new
    assert assignment(c, node).tasks[0].restart_epoch == 1


def test_a_hang_taken_for_a_regroup_echo_restarts_the_rank_a_later_status_shows_stopped(
        coord: tuple[Coordinator, FlakyStore]) -> None:
    """A rank SIGSTOPped right after an in-place recovery: its peer's hang report can reach the leader
    before the status that shows the frozen rank, and was dismissed as the regroup's echo; the task
    then sat at a fraction of its ranks until the hang was reported again 60 s later. The status that
    shows the rank stopped now makes that report a hang: the stopped rank is restarted."""
    c, store = coord
    running(c, recovery="inprocess")
    gen = c.state.tasks["t"].generation
    (waiting, waiting_rank), (frozen, frozen_rank) = sorted((n, r[0]) for n, r in c.state.tasks["t"].placement.items())
    now = time.time()
    feed(c, report_input(c, Report(method=DetectionMethod.EXCEPTION_PROPAGATION, kind=ErrorKind.CONNECTION_REFUSED_RESET,
                                   node=waiting, task="t", rank=waiting_rank, step=5, generation=gen, handled=True,
                                   source_ts=now)))
    feed(c, report_input(c, Report(method=DetectionMethod.STATISTICAL_MONITORING, kind=ErrorKind.TASK_HANG,
                                   node=waiting, task="t", rank=waiting_rank, step=5, generation=gen,
                                   source_ts=now + 0.5)))
    settle(c)
    assert c.recent_incidents[-1].handled and assignment(c, frozen).tasks[0].restart_epoch == 0
    st = NodeStatus(node=frozen, ts=time.time(), generation=gen, task="t", gpu_health=[],
                    ranks=[RankStatus(task="t", generation=gen, rank=frozen_rank, pid=1, state="stopped", step=5)])
    store.fail = 1  # the first write of it fails (etcd briefly away): the retried status acts on it all the same
    feed(c, StatusChanged(WatchEvent("put", c.keys.status(frozen), st.to_json().encode(), 0), time.time()))
    settle(c)
    settle(c)
    assert store.fail == 0
    inc = c.recent_incidents[-1]
    assert (inc.node, inc.rank, inc.severity, inc.handled) == (frozen, frozen_rank, Severity.SEV2, False), inc
    assert assignment(c, frozen).tasks[0].restart_epoch == 1  # only the stopped rank relaunches
    assert assignment(c, waiting).tasks[0].restart_epoch == 0
    # once acted on, the report is not acted on again by the next status
    feed(c, StatusChanged(WatchEvent("put", c.keys.status(frozen), st.to_json().encode(), 0), time.time()))
    settle(c)
    assert assignment(c, frozen).tasks[0].restart_epoch == 1


def test_an_input_retried_after_a_failed_write_is_decided_before_the_inputs_queued_behind_it(
        coord: tuple[Coordinator, FlakyStore]) -> None:
    """A node's lease expires and its agent registers again; the loss's write fails (etcd briefly
    down). The retried loss went to the back of the inbox, behind the registration: decided after it,
    it left the registered node lost and its task moved off it for good."""
    c, store = coord
    running(c)
    node = next(n for n, r in c.state.tasks["t"].placement.items() if r)
    store.fail = 1
    store.on_fail = lambda: register(c, node, 99)  # the agent's new registration arrives meanwhile
    feed(c, NodeChanged(WatchEvent("delete", c.keys.node(node), b"", 0), time.time()))
    settle(c)
    settle(c)
    assert store.fail == 0
    assert c.state.nodes[node].status is d.NodeState.UP, c.state.nodes[node]


def test_a_registration_queued_behind_a_failing_input_is_verifiable_at_once(
        coord: tuple[Coordinator, FlakyStore], monkeypatch: pytest.MonkeyPatch) -> None:
    """Etcd down right after a takeover: the loop retries the input whose write failed before any behind
    it, and a node's registration queued behind it was not read, so its link hello was refused and the
    node fenced its ranks (test_failover, seed 97's double fault). The token is learnt as the watch
    delivers the record."""
    c, store = coord
    running(c)
    store.fail = 10**6  # every decision's write fails: the loop holds its first failing input
    monkeypatch.setattr(store, "get", lambda *a, **k: (_ for _ in ()).throw(StoreUnavailable("etcd down (test)")))
    feed(c, NodeChanged(WatchEvent("delete", c.keys.node("n1"), b"", 0), time.time()))  # n1's lease gone
    deadline = time.monotonic() + 10
    while store.fail == 10**6 and time.monotonic() < deadline:  # the loop is at it
        time.sleep(0.01)
    info = NodeInfo(node="n2", host="localhost", gpus=1, gpu_backend="simulated", agent_pid=7, started_ts=7.0,
                    link_token="t0k3n")
    c._enqueue(NodeChanged, WatchEvent("put", c.keys.node("n2"), info.to_json().encode(), 0))
    try:
        assert c._verify_link("n2", info.link_token)
        assert not c._verify_link("n2", "forged")
    finally:
        store.fail = 0


def test_a_restart_confirmed_while_no_coordinator_led_is_not_escalated_by_the_next_leader(
        etcd_server: EtcdServer) -> None:
    """The leader dies right after deciding a restart; the relaunched rank makes progress within the
    deadline, but the next leader takes the lead after it. Its first input advanced the clock past the
    deadline and expired the restart before the progress (already in etcd) was read: a healthy node
    isolated, the task reconfigured. Now a new leader gives outstanding actions its registration grace."""
    settings = CoordinatorSettings(etcd=etcd_server.endpoint, prefix="/fo", restart_deadline_s=3.0)
    a, b = Coordinator(settings), Coordinator(settings)
    a.store, b.store = Store(etcd_server.endpoint), Store(etcd_server.endpoint)
    a.leadership = Leadership(a.store, a.keys, "a", ttl_s=2, on_deposed=a.stop)
    assert a.leadership.campaign(threading.Event())
    loop = threading.Thread(target=a._loop, daemon=True)
    loop.start()
    try:
        running(a, recovery="inprocess")
        t = a.state.tasks["t"]
        node, rank = sorted((n, r[0]) for n, r in t.placement.items())[0]
        crash = Report(method=DetectionMethod.PROCESS_SUPERVISION, kind=ErrorKind.EXITED_ABNORMALLY, node=node,
                       task="t", rank=rank, step=1, generation=t.generation, source_ts=time.time())
        feed(a, report_input(a, crash))
        settle(a)
        assert a.state.tasks["t"].phase is d.TaskPhase.RESTARTING
        epoch = a.state.tasks["t"].restart_epoch
        a.stop()
        loop.join(5)
        a.leadership.resign()  # the leader is gone; the relaunched rank makes steps at once
        for n, r in sorted(t.placement.items()):
            status = NodeStatus(node=n, ts=time.time(), generation=t.generation, task="t", gpu_health=[], ranks=[
                RankStatus(task="t", generation=t.generation, rank=r[0], pid=1, state="running", step=5,
                           restart_epoch=epoch if n == node else 0, advanced=n == node)])
            a.store.put(a.keys.status(n), status.to_json())
        time.sleep(3.5)  # the restart's deadline passes before the next leader is elected
        b.leadership = Leadership(b.store, b.keys, "b", ttl_s=2, on_deposed=b.stop)
        assert b.leadership.campaign(threading.Event())
        b._load_state()
        b._start_watches()
        b_loop = threading.Thread(target=b._loop, daemon=True)
        b_loop.start()
        feed(b, CoreEvent(d.Tick(ts=time.time())))  # a clock tick first: it was what expired the restart
        deadline = time.monotonic() + 10
        while b.state.tasks["t"].phase is not d.TaskPhase.RUNNING and time.monotonic() < deadline:
            time.sleep(0.1)
        settle(b)
        assert b.state.nodes[node].status is d.NodeState.UP, b.state.nodes[node]
        assert b.state.tasks["t"].phase is d.TaskPhase.RUNNING
        assert b.state.tasks["t"].generation == t.generation  # recovered in place, not reconfigured
    finally:
        b.stop()
        if b.leadership is not None:
            b.leadership.resign()
        for w in b._watches:
            w.stop()
        a.store.close()
        b.store.close()


def test_a_leader_that_regains_its_lease_reloads_before_deciding_what_was_queued(etcd_server: EtcdServer) -> None:
    """A loses its lease; B leads meanwhile and the user cancels the task through it; A regains the
    key. A's reload was queued behind the inputs that arrived meanwhile, which it decided on its old
    state and wrote with its new, valid token: the task came back from the cancel. Now nothing is
    written until the state is reloaded, which runs before any queued input."""
    settings = CoordinatorSettings(etcd=etcd_server.endpoint, prefix="/rg")
    a, b = Coordinator(settings), Coordinator(settings)
    a.store, b.store = Store(etcd_server.endpoint), Store(etcd_server.endpoint)
    a.leadership = Leadership(a.store, a.keys, "a", ttl_s=2, on_deposed=a.stop,
                              on_reelected=lambda: a._inbox.put(Reelected()), poll_s=0.05)
    assert a.leadership.campaign(threading.Event())
    loop = threading.Thread(target=a._loop, daemon=True)
    loop.start()
    try:
        running(a, recovery="inprocess")
        gate: threading.Event = threading.Event()
        feed(a, Call(gate.wait, Future()))  # A's loop is held (cut off from etcd, say)
        lease = a.leadership.lease
        assert lease is not None
        lease.stop()
        a.store.client.revoke_lease(lease.lease_id)  # its lease is gone: B takes over
        b.leadership = Leadership(b.store, b.keys, "b", ttl_s=2, on_deposed=lambda: None)
        assert b.leadership.campaign(threading.Event())
        b._load_state()
        b._decide(d.TaskCancelled(ts=time.time(), task="t"), deletes=[b.keys.task("t")])
        b.leadership.resign()
        feed(a, LinkLost("n1", "link closed", time.time()))  # the agents followed B: a sev1 for A
        a.leadership._start_regain()
        deadline = time.monotonic() + 10
        while a.leadership.token is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.leadership.token is not None
        gate.set()
        settle(a)
        settle(a)
        assert a.state.tasks["t"].phase is d.TaskPhase.CANCELLED, "the user's cancel was undone"
        kv = a.store.get(a.keys.state_task("t"))
        assert kv is not None and '"cancelled"' in kv.value.decode()
    finally:
        a.stop()
        loop.join(5)
        a.leadership.resign()
        a.store.close()
        b.store.close()


def test_a_planned_stop_whose_drain_is_refused_still_counts_the_leases_end_as_a_loss(
        coord: tuple[Coordinator, FlakyStore], monkeypatch: pytest.MonkeyPatch) -> None:
    """The goodbye marked the node as already lost before its drain was decided; a drain refused
    (a PermanentError drops the input) left the node UP with its tasks placed on it, and the lease's
    end that followed was ignored. Now the node is marked only once drained."""
    from coordinator.daemon import LinkGoodbye
    from unicron.kernel.errors import PermanentError

    c, _ = coord
    running(c)
    decide = c._decide

    def refuse_drains(event: d.Event, *args: object, **kwargs: object) -> object:
        if isinstance(event, d.NodeDrained):
            raise PermanentError("the executor refused the placement (injected by the test)")
        return decide(event, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(c, "_decide", refuse_drains)
    feed(c, LinkGoodbye("n1", "systemctl stop", time.time()))
    settle(c)
    status = c.state.nodes["n1"].status
    assert status is d.NodeState.UP  # the drain was refused
    feed(c, NodeChanged(WatchEvent("delete", c.keys.node("n1"), b"", 0), time.time()))  # its lease ends
    settle(c)
    assert c.state.nodes["n1"].status is d.NodeState.LOST
    assert "n1" not in c.state.tasks["t"].placement


def test_a_lost_node_whose_link_drops_again_comes_back_when_its_agent_registers(
        coord: tuple[Coordinator, FlakyStore]) -> None:
    """The coordinator's own report of a lost link (sev1 lost_connection) made a node already lost
    isolated for good, as only a fault found after a loss should; its agent's registration was then
    refused until an operator undrained it."""
    from coordinator.daemon import LinkConnected

    c, _ = coord
    running(c)
    feed(c, NodeChanged(WatchEvent("delete", c.keys.node("n1"), b"", 0), time.time()))  # the lease is gone
    feed(c, LinkConnected("n1", time.time()))  # the agent is back: its link first, which drops
    feed(c, LinkLost("n1", "link closed", time.time()))
    settle(c)
    status = c.state.nodes["n1"].status
    assert status is d.NodeState.LOST
    register(c, "n1", 7)
    settle(c)
    assert c.state.nodes["n1"].status is d.NodeState.UP


def test_an_update_that_cannot_start_is_rolled_back_in_the_records_too(coord: tuple[Coordinator, FlakyStore]) -> None:
    """``unicron update`` with a command that cannot be executed: an agent's result says so. The task
    goes back to the spec it ran with, and so do its spec record (what operators read) and the
    relaunch's node records; before, the task failed and the record kept the spec that never ran."""
    c, store = coord
    running(c, recovery="inprocess")
    c.ready.set()  # the API's calls run on the loop, as a leader's do
    old = c.state.tasks["t"].spec
    c.update(TaskSpec.from_dict({**old.to_dict(), "command": ["pythn", "x.py"]}))
    t = c.state.tasks["t"]
    node = sorted(t.placement)[0]
    assert argv(c, node)[0] == "pythn"
    result = AssignmentResult(node=node, revision=assignment(c, node).revision, ok=False,
                              detail="task t: cannot execute 'pythn': no such file", tasks={
                                  "t": TaskResult(generation=t.generation, restart_epoch=0, regroup_epoch=0,
                                                  ranks={}, cannot_start="no such file: 'pythn'")})
    store.put(c.keys.result(node), result.to_json())
    feed(c, ResultSeen(WatchEvent("put", c.keys.result(node), result.to_json().encode(), 0), time.time()))
    settle(c)
    after = c.state.tasks["t"]
    assert after.phase is d.TaskPhase.RECONFIGURING and after.spec == old, after
    assert after.generation == t.generation + 1
    kv = store.get(c.keys.task("t"))
    assert kv is not None and TaskSpec.from_dict(json.loads(kv.value)) == old
    assert all(argv(c, n)[0] == "python" for n in after.placement)
    stored, _, _ = read_state(store, c.keys)
    assert stored is not None and stored.tasks["t"].spec == old  # a new leader resumes with the spec that runs
