"""Cause detection (coordinator.causes): observed records -> the decision core's events.

States come from the real decision core driven by events, so the tests follow its counters.
"""

from __future__ import annotations

import dataclasses

import pytest

from coordinator import causes
from coordinator import decision as d
from coordinator.tasks import parse_task_spec
from tests.kernel.test_severity import PAPER_TABLE1
from unicron.kernel.protocol import (
    PHASE_CHECKPOINT,
    PHASE_COLLECTIVE,
    PHASE_DATA,
    PHASE_EVAL,
    PHASE_REGROUP,
    PHASE_TRAIN,
)
from unicron.kernel.types import (
    AssignmentResult,
    DetectionMethod,
    ErrorKind,
    NodeStatus,
    RankStatus,
    Report,
    Severity,
    TaskResult,
)

CORE = d.DecisionCore()


@pytest.mark.parametrize(("method", "kind", "severity"), PAPER_TABLE1)
def test_classify_each_row(method: DetectionMethod, kind: ErrorKind, severity: Severity) -> None:
    report = Report(
        method=method,
        kind=kind,
        node="n1",
        task="job",
        rank=3,
        step=7,
        message="boom",
        source_ts=10.0,
        agent_ts=10.5,
    )
    incident = causes.classify(report, detected_ts=11.0, incident_id="inc-1")
    assert incident.severity is severity
    assert (incident.node, incident.task, incident.rank, incident.step, incident.message) == (
        "n1",
        "job",
        3,
        7,
        "boom",
    )
    assert incident.report_id == report.report_id and incident.incident_id == "inc-1"
    assert incident.detection_latency_s == pytest.approx(1.0)


def running_task() -> tuple[d.CoreState, dict[str, list[int]]]:
    """Task ``t`` on two nodes, one rank each, its assignment outstanding."""
    state = CORE.initial_state()
    for i, node in enumerate(("n0", "n1")):
        state, _ = CORE.handle(state, d.NodeJoined(ts=float(i), node=node, gpus=1))
    spec = parse_task_spec({"name": "t", "command": ["python", "x.py"], "min_gpus": 2}, None)
    state, _ = CORE.handle(state, d.TaskSubmitted(ts=2.0, spec=spec))
    entry = state.tasks["t"]
    assert entry.outstanding is not None and entry.outstanding.kind is d.ActionKind.ASSIGN
    return state, entry.placement


def rank(node_ranks: list[int], generation: int, **fields: object) -> list[RankStatus]:
    base: dict[str, object] = {"state": "running", "pid": 1}
    return [RankStatus.from_dict({"task": "t", "generation": generation, "rank": r, **base, **fields})
            for r in node_ranks]


def status(node: str, ranks: list[RankStatus]) -> NodeStatus:
    return NodeStatus(node=node, ts=0.0, generation=None, task=None, ranks=ranks, gpu_health=[])


def result(node: str, ok: bool, generation: int, ranks: dict[str, str], restart_epoch: int = 0,
           detail: str = "applied", cannot_start: str = "") -> AssignmentResult:
    tasks = {"t": TaskResult(generation=generation, restart_epoch=restart_epoch, regroup_epoch=0, ranks=ranks,
                             cannot_start=cannot_start)}
    return AssignmentResult(node=node, revision=1, ok=ok, detail=detail, tasks=tasks, ts=0.0)


def test_incident_id_follows_the_report_so_a_replayed_report_is_one_incident() -> None:
    report = Report(method=DetectionMethod.PROCESS_SUPERVISION, kind=ErrorKind.EXITED_ABNORMALLY, node="n0",
                    task="t", rank=1, source_ts=1.0, agent_ts=1.0)
    a, b = causes.incident(report, detected_ts=2.0), causes.incident(report, detected_ts=9.0)
    assert a.incident_id == b.incident_id == f"r-{report.report_id}"
    raised = causes.raised(a, generation=3)
    assert isinstance(raised, d.IncidentRaised) and raised.generation == 3 and raised.incident is a
    handled = causes.incident(Report(method=report.method, kind=report.kind, node="n0", handled=True), 2.0)
    assert causes.raised(handled, None) is None


def test_progress_counts_only_the_current_generation_and_new_steps() -> None:
    state, placement = running_task()
    gen = state.tasks["t"].generation
    st = status("n0", rank(placement["n0"], gen, step=7) + rank(placement["n0"], gen - 1, step=99))
    [made] = causes.progress(st, state, {}, ts=5.0)
    assert (made.task, made.step, made.generation) == ("t", 7, gen)
    assert causes.progress(st, state, {("t", gen): 7}, ts=5.0) == []


def restarting(step: int, node: str) -> tuple[d.CoreState, dict[str, list[int]], int]:
    """Task ``t`` running at ``step``, then its rank on ``node`` exits abnormally: a restart is pending.
    Returns the state, the placement and the generation."""
    state, placement = running_task()
    gen = state.tasks["t"].generation
    state, _ = CORE.handle(state, d.ProgressMade(ts=3.0, task="t", step=step, generation=gen))
    assert state.tasks["t"].phase is d.TaskPhase.RUNNING
    report = Report(method=DetectionMethod.PROCESS_SUPERVISION, kind=ErrorKind.EXITED_ABNORMALLY, node=node,
                    task="t", rank=placement[node][0], source_ts=4.0, agent_ts=4.0)
    state, _ = CORE.handle(state, d.IncidentRaised(ts=4.0, incident=causes.incident(report, 4.0), generation=gen))
    assert state.tasks["t"].phase is d.TaskPhase.RESTARTING
    return state, placement, gen


def test_a_stale_step_does_not_confirm_a_restart() -> None:
    """Issue #19 item 1: during a restart, only processes launched at its epoch show recovery."""
    state, placement, gen = restarting(step=10, node="n1")
    assert state.tasks["t"].restart_epoch == 1
    # the survivor on n0 (launched at epoch 0) is ahead of what the coordinator saw: not a recovery
    survivor = status("n0", rank(placement["n0"], gen, step=12, restart_epoch=0))
    assert causes.progress(survivor, state, {("t", gen): 10}, ts=5.0) == []
    # the relaunched rank's own step does count
    relaunched = status("n1", rank(placement["n1"], gen, step=11, restart_epoch=1))
    [made] = causes.progress(relaunched, state, {("t", gen): 10}, ts=5.0)
    assert made.step == 11


def test_a_node_speaks_only_for_the_ranks_placed_on_it() -> None:
    """A status listing another node's rank (its relaunched process, at the restart's epoch, advanced)
    confirmed the restart, and would reset the task's restart budget or confirm a suspicion, for a task
    the writing node may not even host."""
    state, placement, gen = restarting(step=10, node="n1")
    forged = status("n0", rank(placement["n1"], gen, step=11, restart_epoch=1, advanced=True))
    assert causes.progress(forged, state, {("t", gen): 10}, ts=5.0) == []
    own = status("n1", rank(placement["n1"], gen, step=11, restart_epoch=1, advanced=True))
    [made] = causes.progress(own, state, {("t", gen): 10}, ts=5.0)
    assert made.restart_epoch == 1


def test_a_failed_reconcile_fails_the_assignment_without_naming_the_node() -> None:
    state, _ = running_task()
    entry = state.tasks["t"]
    assert entry.outstanding is not None
    bad = result("n0", ok=False, generation=entry.generation, ranks={},
                 detail="PermanentError: rank 0: cannot start '/nonexistent'")
    [failed] = causes.outcomes(bad, {"n0": bad}, state, ts=3.0)
    assert isinstance(failed, d.ActionFailed)
    assert failed.action_id == entry.outstanding.action_id and failed.node is None
    assert "cannot start" in failed.reason
    assert failed.cause is d.FailureCause.NODE  # the result does not say whose fault it is
    # an older generation's failure says nothing about this assignment
    old = result("n0", ok=False, generation=entry.generation - 1, ranks={})
    assert causes.outcomes(old, {"n0": old}, state, ts=3.0) == []


def test_an_assignment_succeeds_once_every_node_runs_its_ranks() -> None:
    state, placement = running_task()
    entry = state.tasks["t"]
    assert entry.outstanding is not None
    gen = entry.generation
    r0 = result("n0", ok=True, generation=gen, ranks={str(r): "running" for r in placement["n0"]})
    assert causes.outcomes(r0, {"n0": r0}, state, ts=3.0) == []  # n1 has not reported yet
    r1 = result("n1", ok=True, generation=gen, ranks={str(r): "running" for r in placement["n1"]})
    [ok] = causes.outcomes(r1, {"n0": r0, "n1": r1}, state, ts=3.0)
    assert ok == d.ActionSucceeded(ts=3.0, action_id=entry.outstanding.action_id)
    # the core takes it: the task runs
    state, _ = CORE.handle(state, ok)
    assert state.tasks["t"].phase is d.TaskPhase.RUNNING


def test_a_relaunched_process_that_completed_an_iteration_proves_the_restart_below_the_steps_seen() -> None:
    """A job resumed from its checkpoint redoes steps the coordinator saw before the failure."""
    state, placement, gen = restarting(step=500, node="n1")
    epoch = state.tasks["t"].restart_epoch
    seen = {("t", gen): 500}
    # begun at its checkpoint's step, nothing completed yet: no proof
    begun = status("n1", rank(placement["n1"], gen, step=400, restart_epoch=epoch))
    assert causes.progress(begun, state, seen, ts=5.0) == []
    # a survivor that completed iterations proves nothing about the restart
    survivor = status("n0", rank(placement["n0"], gen, step=450, restart_epoch=epoch - 1, advanced=True))
    assert causes.progress(survivor, state, seen, ts=5.0) == []
    done = status("n1", rank(placement["n1"], gen, step=401, restart_epoch=epoch, advanced=True))
    [made] = causes.progress(done, state, seen, ts=5.0)
    assert (made.step, made.restart_epoch) == (401, epoch)
    state, _ = CORE.handle(state, made)
    assert state.tasks["t"].phase is d.TaskPhase.RUNNING and state.tasks["t"].outstanding is None
    # once confirmed, redone steps are no news
    assert causes.progress(done, state, seen, ts=6.0) == []


def test_a_relaunched_rank_does_not_by_itself_confirm_a_restart() -> None:
    state, placement, gen = restarting(step=1, node="n0")
    ok = result("n0", ok=True, generation=gen, restart_epoch=1, ranks={str(r): "running" for r in placement["n0"]})
    assert causes.outcomes(ok, {"n0": ok}, state, ts=5.0) == []
    bad = result("n0", ok=False, generation=gen, restart_epoch=1, ranks={}, detail="cannot start")
    [failed] = causes.outcomes(bad, {"n0": bad}, state, ts=5.0)
    assert isinstance(failed, d.ActionFailed)


def test_a_task_finishes_when_every_rank_exited_0() -> None:
    state, placement = running_task()
    gen = state.tasks["t"].generation
    done = {n: status(n, rank(r, gen, state="exited", returncode=0)) for n, r in placement.items()}
    assert causes.ended(done, state, ts=9.0) == [d.TaskFinished(ts=9.0, task="t")]
    # one rank still running, one failed, one stopped on request, or an older generation: not finished
    for spoil in ({"state": "running", "returncode": None}, {"returncode": 1},
                  {"returncode": 0, "requested": True}):
        fields: dict[str, object] = {"state": "exited", **spoil}
        partly = {**done, "n1": status("n1", rank(placement["n1"], gen, **fields))}
        assert causes.ended(partly, state, ts=9.0) == []
    old = {n: status(n, rank(r, gen - 1, state="exited", returncode=0)) for n, r in placement.items()}
    assert causes.ended(old, state, ts=9.0) == []
    assert causes.ended({"n0": done["n0"]}, state, ts=9.0) == []
    # told which node's status arrived: the same answers, looking at that node's tasks only
    assert causes.ended(done, state, ts=9.0, changed="n1") == [d.TaskFinished(ts=9.0, task="t")]
    assert causes.ended(partly, state, ts=9.0, changed="n0") == []
    assert causes.ended(done, state, ts=9.0, changed="elsewhere") == []  # no task of it can have ended


def test_a_task_whose_ranks_stopped_before_its_end_is_stopped_not_finished() -> None:
    """Ranks SIGTERMed by somebody else stop work-conservingly and exit 0 unasked; the one that says it
    stopped (``stopped_at``) makes it a stop, at the lowest iteration said."""
    state, placement = running_task()
    gen = state.tasks["t"].generation
    n0, n1 = sorted(placement)
    ended = {n0: status(n0, rank(placement[n0], gen, state="exited", returncode=0, stopped_at=12)),
             n1: status(n1, rank(placement[n1][:1], gen, state="exited", returncode=0, stopped_at=11)
                        + rank(placement[n1][1:], gen, state="exited", returncode=0))}
    [got] = causes.ended(ended, state, ts=9.0)
    assert isinstance(got, d.TaskStopped) and got.task == "t" and got.step == 11
    assert f"rank {placement[n1][0]} stopped at iteration 11" in got.reason
    # asked to stop (a cancel, a relaunch), or a rank still running: neither finished nor stopped
    asked = {**ended, n1: status(n1, rank(placement[n1], gen, state="exited", returncode=0, requested=True,
                                          stopped_at=11))}
    assert causes.ended(asked, state, ts=9.0) == []
    running = {**ended, n1: status(n1, rank(placement[n1], gen))}
    assert causes.ended(running, state, ts=9.0) == []


def test_a_lease_gone_is_a_node_loss_only_when_the_link_is_silent() -> None:
    assert causes.lease_gone("n0", link_alive=False, already_lost=False, ts=1.0) == d.NodeLost(
        ts=1.0, node="n0", reason="agent lease expired")
    assert causes.lease_gone("n0", link_alive=True, already_lost=False, ts=1.0) is None  # issue #19 item 3
    assert causes.lease_gone("n0", link_alive=False, already_lost=True, ts=1.0) is None


def test_only_nodes_in_service_without_a_registration_are_unregistered() -> None:
    state = d.CoreState(nodes={"up": d.NodeEntry(1), "back": d.NodeEntry(1), "lost": d.NodeEntry(1, d.NodeState.LOST),
                               "drained": d.NodeEntry(1, d.NodeState.DRAINED),
                               "isolated": d.NodeEntry(1, d.NodeState.ISOLATED)})
    assert causes.unregistered(state, registered={"back"}) == ["up"]


def test_an_isolated_node_does_not_rejoin_by_registering_again() -> None:
    state, _ = running_task()
    assert causes.rejoin("n0", 1, state, ts=5.0) == d.NodeJoined(ts=5.0, node="n0", gpus=1)
    report = Report(method=DetectionMethod.EXCEPTION_PROPAGATION, kind=ErrorKind.ECC_ERROR, node="n0",
                    source_ts=4.0, agent_ts=4.0)
    state, _ = CORE.handle(state, d.IncidentRaised(ts=4.0, incident=causes.incident(report, 4.0)))
    assert state.nodes["n0"].status is d.NodeState.ISOLATED
    assert causes.rejoin("n0", 1, state, ts=5.0) is None  # issue #19 item 8


def test_a_command_the_os_refused_to_execute_is_the_tasks_fault() -> None:
    """The agent says its exec failed: the task fails at once (task_error), no node is blamed, and the
    task is not re-placed on every node in turn until the restart budget runs out (which took four
    placements, each starting a store sidecar, ~20 s on the 2-core CI machine)."""
    state, _ = running_task()
    entry = state.tasks["t"]
    why = "rank 0: cannot start '/nonexistent': [Errno 2] No such file or directory"
    bad = result("n0", ok=False, generation=entry.generation, ranks={}, detail=f"PermanentError: {why}",
                 cannot_start=why)
    [failed] = causes.outcomes(bad, {"n0": bad}, state, ts=3.0)
    assert isinstance(failed, d.ActionFailed) and failed.cause is d.FailureCause.TASK
    state, actions = CORE.handle(state, failed)
    assert state.tasks["t"].phase is d.TaskPhase.FAILED
    assert "cannot start" in state.tasks["t"].reason
    assert not [a for a in actions if isinstance(a, d.IsolateNode)]


def hang(node: str, rank_: int, generation: int = 1) -> Report:
    return Report(method=DetectionMethod.STATISTICAL_MONITORING, kind=ErrorKind.TASK_HANG, node=node, task="t",
                  gpu=0, rank=rank_, step=7, generation=generation, restart_epoch=0, message="no iteration")


def test_a_hang_reported_by_a_waiting_peer_is_the_stopped_ranks() -> None:
    statuses = {"n0": status("n0", rank([0], 1)), "n1": status("n1", rank([1], 1, state="stopped", restart_epoch=2)),
                "n2": status("n2", rank([2], 1, state="stopped"))}
    report = hang("n0", 0)
    culprit = causes.hang_culprit(report, statuses)
    assert (culprit.node, culprit.rank, culprit.gpu, culprit.restart_epoch) == ("n1", 1, None, 2)  # the lowest
    assert "rank 1's process is stopped" in culprit.message and "reported on n0 for rank 0" in culprit.message
    assert culprit.report_id == report.report_id  # still one incident per report
    # the stopped rank's own report, and a stopped rank of another generation or task, change nothing
    own = hang("n2", 2)
    assert causes.hang_culprit(own, statuses) is own
    old = {"n1": status("n1", rank([1], 0, state="stopped"))}
    assert causes.hang_culprit(hang("n0", 0), old).node == "n0"
    other = {"n1": status("n1", [RankStatus(task="u", generation=1, rank=1, pid=1, state="stopped")])}
    assert causes.hang_culprit(hang("n0", 0), other).node == "n0"


def test_only_an_unhandled_hang_is_pointed_elsewhere() -> None:
    statuses = {"n1": status("n1", rank([1], 1, state="stopped"))}
    crash = dataclasses.replace(hang("n0", 0), kind=ErrorKind.CUDA_ERROR)
    handled = dataclasses.replace(hang("n0", 0), handled=True)
    assert causes.hang_culprit(crash, statuses) is crash and causes.hang_culprit(handled, statuses) is handled
    assert causes.hang_culprit(hang("n0", 0), {"n1": status("n1", rank([1], 1))}).node == "n0"  # none stopped


def waiting(ranks: list[int], step: int = 7, phase: str | None = PHASE_COLLECTIVE, **fields: object) -> list[RankStatus]:
    return rank(ranks, 1, step=step, phase=phase, **fields)


def test_a_hang_reported_by_a_rank_in_the_collective_is_the_ranks_outside_it() -> None:
    """A GPU hang (the process runs: no SIGSTOP to see) holds the peers in the gradient reduction;
    the rank still computing at the reporter's step is the one they wait for."""
    statuses = {"n0": status("n0", waiting([0, 1])),
                "n1": status("n1", waiting([2]) + waiting([3], phase=PHASE_TRAIN, restart_epoch=4))}
    report = hang("n0", 1)
    culprit = causes.hang_culprit(report, statuses)
    assert (culprit.node, culprit.rank, culprit.gpu, culprit.restart_epoch) == ("n1", 3, None, 4)
    assert "has not joined the collective (phase train, step 7)" in culprit.message
    assert culprit.report_id == report.report_id
    # the culprit's own report stays its own
    own = hang("n1", 3)
    assert causes.hang_culprit(own, statuses) is own
    # a data wait or a checkpoint holds the peers as well; the one furthest behind goes first
    stuck = {"n0": status("n0", waiting([0]) + waiting([1], phase=PHASE_CHECKPOINT, step=7)),
             "n1": status("n1", waiting([2], phase=PHASE_DATA, step=6))}
    assert causes.hang_culprit(hang("n0", 0), stuck).rank == 2


def test_tensor_parallel_partners_outside_the_collective_name_their_node_not_a_guess() -> None:
    """With TP = 2 the hung rank's partner waits in the model's own all-reduce, which reports no phase:
    both look equally behind. Picking the lower restarted the healthy partner, the task stayed stuck and
    the restart deadline isolated the node; now every rank of the task on that node restarts."""
    statuses = {"n0": status("n0", waiting([0, 1])),
                "n1": status("n1", waiting([2, 3], phase=PHASE_TRAIN, restart_epoch=1))}
    culprit = causes.hang_culprit(hang("n0", 0), statuses)
    assert (culprit.node, culprit.rank, culprit.gpu, culprit.restart_epoch) == ("n1", None, None, 1)
    assert "ranks 2 and 3' processes have not joined the collective (phase train, step 7)" in culprit.message
    # their own reports too: each looks as hung as the other
    own = causes.hang_culprit(hang("n1", 3), statuses)
    assert (own.node, own.rank) == ("n1", None) and "reported on n1 for rank 3" in own.message
    # one of them further behind is no tie; nor are ranks of other nodes at the same step
    ahead = {"n0": status("n0", waiting([0])), "n1": status("n1", waiting([2], phase=PHASE_TRAIN, step=6)
                                                            + waiting([3], phase=PHASE_TRAIN))}
    assert causes.hang_culprit(hang("n0", 0), ahead).rank == 2
    assert causes.hang_culprit(hang("n1", 2), ahead).rank == 2  # its own report, and nobody as far behind
    apart = {"n0": status("n0", waiting([0])), "n1": status("n1", waiting([1], phase=PHASE_TRAIN)),
             "n2": status("n2", waiting([2], phase=PHASE_TRAIN))}
    assert causes.hang_culprit(hang("n0", 0), apart).rank == 1


def test_a_rank_outside_the_collective_is_blamed_only_when_it_can_hold_the_reporter() -> None:
    report = hang("n0", 0)
    # the reporter is not in the collective (it computes, or reports no phases: a stock job)
    for phase in (PHASE_TRAIN, None):
        computing = {"n0": status("n0", waiting([0], phase=phase)),
                     "n1": status("n1", waiting([1], phase=PHASE_TRAIN))}
        assert causes.hang_culprit(report, computing) is report
    # everyone waits in the collective (a network fault, a dead peer): nobody else is to blame
    assert causes.hang_culprit(report, {"n0": status("n0", waiting([0, 1]))}) is report
    # a rank past the reporter's step, one regrouping (a joiner), one exited, one without a phase,
    # one of another generation: none of them holds a collective at step 7
    others = (waiting([1], step=8, phase=PHASE_TRAIN) + waiting([2], phase=PHASE_REGROUP)
              + waiting([3], phase=PHASE_TRAIN, state="exited", returncode=1) + waiting([4], phase=None)
              + rank([5], 0, step=7, phase=PHASE_TRAIN))
    assert causes.hang_culprit(report, {"n0": status("n0", waiting([0])), "n1": status("n1", others)}) is report
    # a stopped rank is the culprit before a computing one
    both = {"n0": status("n0", waiting([0])),
            "n1": status("n1", waiting([1], phase=PHASE_TRAIN) + waiting([2], phase=PHASE_TRAIN, state="stopped"))}
    assert causes.hang_culprit(report, both).rank == 2


def test_a_log_read_ranks_hang_while_another_nodes_rank_saves_is_a_wait_for_the_save() -> None:
    """Megatron read from its log: rank 0 (n0) prints the checkpoint lines, the last rank (n1) the
    progress. n1's monitor never hears of the save and judges the wait for it as a hang; the statuses
    show rank 0 saving, so the report is a wait, not a fault (restarting n1 lost the save)."""
    saving = {"n0": status("n0", waiting([0, 1], phase=PHASE_CHECKPOINT)), "n1": status("n1", waiting([2, 3], phase=None))}
    assert causes.held_by_phase(hang("n1", 3), saving) == "waits for rank 0's checkpoint on n0"
    evaluating = {**saving, "n0": status("n0", waiting([0, 1], phase=PHASE_EVAL))}
    assert causes.held_by_phase(hang("n1", 3), evaluating) == "waits for rank 0's eval on n0"
    # the save is over (its end line sets train), a rank exited, another generation: a hang is a hang
    for others in (waiting([0, 1], phase=PHASE_TRAIN), waiting([0], phase=PHASE_CHECKPOINT, state="exited"),
                   rank([0], 0, phase=PHASE_CHECKPOINT)):
        assert causes.held_by_phase(hang("n1", 3), {**saving, "n0": status("n0", others)}) is None
    # a rank that reports its phases is hang_culprit's: one stuck in a save is named, not excused
    reporting = {**saving, "n1": status("n1", waiting([2, 3]))}
    assert causes.held_by_phase(hang("n1", 3), reporting) is None
    named = causes.hang_culprit(hang("n1", 3), reporting)
    assert (named.node, named.rank) == ("n0", None)  # ranks 0 and 1 tie: their node
    # only an unhandled hang, of a rank the statuses know
    assert causes.held_by_phase(dataclasses.replace(hang("n1", 3), handled=True), saving) is None
    assert causes.held_by_phase(hang("n2", 9), saving) is None


def test_a_save_past_its_agents_phase_bound_holds_no_hang() -> None:
    """A save blocked for good (a hung NFS mount): rank 0 of a log-read job prints only the save, so no
    monitor judges it, and every hang of the last rank was held as a wait for it, for ever."""
    def saving(deadline: float | None) -> dict[str, NodeStatus]:
        return {"n0": status("n0", waiting([0, 1], phase=PHASE_CHECKPOINT, phase_deadline=deadline)),
                "n1": status("n1", waiting([2, 3], phase=None))}

    at = dataclasses.replace(hang("n1", 3), source_ts=5000.0)
    assert causes.held_by_phase(at, saving(5000.5)) == "waits for rank 0's checkpoint on n0"  # within its bound
    assert causes.held_by_phase(at, saving(4000.0)) is None  # began more than the bound ago: a hang
    named = causes.hang_culprit(at, saving(4000.0))  # ... of the rank in the save, not of the one waiting
    assert (named.node, named.rank) == ("n0", 0) and "checkpoint past its agent's bound" in named.message
    assert causes.hang_culprit(at, saving(5000.5)) == at  # (within it the report is held, above)
    assert causes.held_by_phase(at, saving(None)) is not None  # a status from before the bound: as it was
    # a status record carries the deadline only while a rank saves: most stay readable by older readers
    assert "phase_deadline" not in waiting([0])[0].to_dict()
    saved = waiting([0], phase=PHASE_CHECKPOINT, phase_deadline=5000.5)[0]
    assert RankStatus.from_dict(saved.to_dict()).phase_deadline == 5000.5


def test_a_hang_echoes_an_in_place_recovery_only_in_the_iteration_it_broke_and_within_the_grace() -> None:
    sev3 = dataclasses.replace(hang("n1", 1), kind=ErrorKind.CONNECTION_REFUSED_RESET, handled=True,
                               step=7, source_ts=100.0)
    last = causes.InPlaceRecovery(100.0, 7)
    for step, ts, echo in ((7, 101.0, True), (8, 105.0, True), (None, 105.0, True),  # the broken iteration
                           (9, 101.0, False),  # a later iteration: a new hang (the detectors reset at the regroup)
                           (7, 110.5, False)):  # past the grace
        report = dataclasses.replace(hang("n0", 0), step=step, source_ts=ts)
        assert causes.regroup_echo(report, last, grace_s=10.0, statuses={}) is echo, (step, ts)
    assert not causes.regroup_echo(hang("n0", 0), None, grace_s=10.0, statuses={})  # no recovery in place yet
    crash = dataclasses.replace(hang("n0", 0), kind=ErrorKind.CUDA_ERROR, source_ts=101.0)
    assert not causes.regroup_echo(crash, last, grace_s=10.0, statuses={})  # only hangs echo
    # later handled reports move the record on: the latest time, the highest step
    moved = last.after(dataclasses.replace(sev3, step=5, source_ts=103.0)).after(dataclasses.replace(sev3, step=None))
    assert moved == causes.InPlaceRecovery(103.0, 7)


def test_a_hang_while_a_rank_of_the_task_is_stopped_is_no_regroup_echo() -> None:
    """A rank frozen (SIGSTOP) during a node-loss shrink: its peers' or its own hang report within the
    grace was dismissed as an echo, and the task trained on without it until ``hang_repeat_s``."""
    last = causes.InPlaceRecovery(100.0, 7)
    report = dataclasses.replace(hang("n0", 0), step=7, source_ts=101.0)
    frozen = {"n0": status("n0", rank([0], 1)), "n1": status("n1", rank([1], 1, state="stopped"))}
    assert causes.regroup_echo(report, last, grace_s=10.0, statuses={"n0": status("n0", rank([0], 1))})
    assert not causes.regroup_echo(report, last, grace_s=10.0, statuses=frozen)  # a peer is stopped
    assert causes.hang_culprit(report, frozen).rank == 1  # ... and the report goes to it
    own = dataclasses.replace(hang("n1", 1), step=7, source_ts=101.0)
    assert not causes.regroup_echo(own, last, grace_s=10.0, statuses=frozen)  # its own report
    # a stopped process of an older generation or of another task is no culprit of this hang
    old = {"n1": status("n1", rank([1], 0, state="stopped"))}
    other = {"n1": status("n1", [RankStatus(task="u", generation=1, rank=1, pid=1, state="stopped")])}
    assert causes.regroup_echo(report, last, grace_s=10.0, statuses=old)
    assert causes.regroup_echo(report, last, grace_s=10.0, statuses=other)


def test_a_pending_grows_joiners_are_named_once_their_own_process_completed_an_iteration() -> None:
    from tests.coordinator.test_resize_in_place import JOB, _grown_back

    sim, grow = _grown_back()
    state, gen, epoch = sim.state, grow.generation, grow.membership_epoch
    assert state.tasks[JOB].joining_since == epoch

    def joiner(rank: int, **fields: object) -> RankStatus:
        return RankStatus.from_dict({"task": JOB, "generation": gen, "rank": rank, "state": "running", "pid": 1,
                                     "step": 9, **fields})

    seen = {(JOB, gen): 9}
    # launched by the grow but not admitted yet; or an older process of the rank (before it left n3)
    for st in (joiner(4, membership_epoch=epoch), joiner(4, membership_epoch=0, advanced=True)):
        assert causes.progress(status("n3", [st]), state, seen, ts=5.0) == []
    # a survivor's completed iteration names no joiner
    survivor = RankStatus.from_dict({"task": JOB, "generation": gen, "rank": 0, "state": "running", "pid": 1,
                                     "step": 10, "advanced": True})
    [made] = causes.progress(status("n1", [survivor]), state, seen, ts=5.0)
    assert made.joined == ()
    both = [joiner(4, membership_epoch=epoch, advanced=True), joiner(5, membership_epoch=epoch, advanced=True)]
    [made] = causes.progress(status("n3", both), state, seen, ts=5.0)
    assert made.joined == (4, 5)
    state, _ = CORE.handle(state, made)
    assert state.tasks[JOB].phase is d.TaskPhase.RUNNING


def test_a_joiner_still_joining_when_a_restart_supersedes_its_grow_is_named_by_its_own_process() -> None:
    """Rank 4 of the grow died at its start and is being restarted; rank 5, launched by the grow before
    the restart (a lower restart epoch), still proves its own joining. Before, the restart's filter
    dropped its status and, with the relaunched process's proof, the task ran without it checked."""
    from tests.coordinator.test_resize_in_place import JOB, _grown_back

    sim, grow = _grown_back()
    sim.incident("n3", (DetectionMethod.PROCESS_SUPERVISION, ErrorKind.EXITED_ABNORMALLY), task=JOB, rank=4,
                 generation=grow.generation, step=6)
    state, gen, epoch = sim.state, grow.generation, grow.membership_epoch
    assert state.tasks[JOB].phase is d.TaskPhase.RESTARTING and state.tasks[JOB].restart_epoch == 1

    def rank(r: int, restart_epoch: int, **fields: object) -> RankStatus:
        return RankStatus.from_dict({"task": JOB, "generation": gen, "rank": r, "state": "running", "pid": 1,
                                     "step": 9, "advanced": True, "membership_epoch": epoch,
                                     "restart_epoch": restart_epoch, **fields})

    seen = {(JOB, gen): 9}
    [made] = causes.progress(status("n3", [rank(5, 0)]), state, seen, ts=5.0)
    assert made.joined == (5,) and made.restart_epoch is None
    # the relaunched rank 4: the restart's proof, and a joiner of its own
    [made] = causes.progress(status("n3", [rank(4, 1), rank(5, 0)]), state, seen, ts=5.0)
    assert made.joined == (4, 5) and made.restart_epoch == 1
    state, _ = CORE.handle(state, made)
    assert state.tasks[JOB].phase is d.TaskPhase.RUNNING
