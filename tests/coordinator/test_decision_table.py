"""Every edge of the Figure 7 transition table, each reached and triggered through real events."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

import pytest

from coordinator.decision import (
    BUDGETED,
    TRANSITIONS,
    Action,
    ActionFailed,
    ActionSucceeded,
    Alert,
    Assign,
    DecisionSettings,
    FailureCause,
    IsolateNode,
    MarkTaskFailed,
    NodeDrained,
    NodeUndrained,
    Reattempt,
    ResizeInPlace,
    Response,
    RestartRanks,
    RestartTask,
    StopTask,
    TaskCancelled,
    TaskFinished,
    TaskPhase,
    TaskStopped,
    TaskUpdated,
    Transition,
    Trigger,
)
from coordinator.tasks import TaskSpec
from tests.coordinator.test_decision import SEV1_KIND, SEV2_KIND, SEV3_KIND, STORE_LOST_KIND, Sim

#: responses whose re-plan moves the task as it can: in place (the survivors go on) or a new generation
RESHAPED = {Response.ESCALATE}
P = TaskPhase
T = Trigger
R = Response
JOB = "job"

#: what each response must emit for the task (consequences such as the re-plan included)
EMITS: dict[Response, set[type[Action]]] = {
    R.MERGE: set(),
    R.REATTEMPT: {Reattempt},
    R.RESTART: {RestartRanks},
    R.RESTART_ALL: {RestartTask},
    R.RECONFIGURE: {Assign},
    R.ESCALATE: {IsolateNode},  # + the re-plan's move (RESHAPED below)
    R.REASSIGN: {Assign},
    R.ASSIGN: {Assign},
    R.RESIZE: {ResizeInPlace},
    R.STOP: {StopTask},
    R.RECOVERED: set(),
    R.FAIL: {StopTask, MarkTaskFailed, Alert},
    R.RELAUNCH: {Assign, Alert},
    R.RELEASE: set(),
    R.STOP_RELEASE: {StopTask},
    R.WITHDRAW: set(),
    R.RELAUNCH_UPDATED: {Assign},
    R.ROLLBACK: {Assign, Alert},
}


def _settings(phase: TaskPhase, trigger: Trigger) -> DecisionSettings:
    """Budgets that make the budget-exhaustion triggers reachable."""
    if trigger is T.NO_PROGRESS:
        # RESTARTING needs one restart to get there; everywhere else the very next one is over budget
        return DecisionSettings(max_restarts_without_progress=1 if phase is P.RESTARTING else 0)
    if trigger is T.REATTEMPTS_SPENT and phase is P.RUNNING:
        return DecisionSettings(max_reattempts=0)
    if trigger is T.ACTION_FAILED and phase is P.REATTEMPTING:
        return DecisionSettings(max_reattempts=2)  # a second reattempt is still allowed
    if trigger is T.SEV1:
        # the lost node's task would shrink in place (a replica survives; its own edge is tested):
        # here the re-plan that follows the sev1's reconfigure is a new generation
        return DecisionSettings(in_place_resize=False)
    return DecisionSettings()


def _in_phase(phase: TaskPhase, settings: DecisionSettings, recovery: str = "inprocess") -> Sim:
    """Two 8-GPU nodes; ``job`` (8 GPUs minimum, spread over both) brought into ``phase`` by events."""
    sim = Sim(settings)
    sim.join("n1")
    sim.join("n2")
    if phase is P.PENDING:
        sim.submit(JOB, min_gpus=24, recovery=recovery)
        return sim
    # a "restart" task is elastic (spread over both nodes) only when it says so
    sim.submit(JOB, min_gpus=8, recovery=recovery, **({"max_gpus": 16} if recovery == "restart" else {}))
    if phase is P.RECONFIGURING:
        return sim
    sim.feed(ActionSucceeded(ts=sim.ts(), action_id=sim.outstanding(JOB)))
    sim.progress(JOB, 5)
    if phase is P.REATTEMPTING:
        sim.incident("n1", SEV3_KIND, task=JOB)
    elif phase is P.RESTARTING:
        sim.incident("n1", SEV2_KIND, task=JOB)
    assert sim.phase(JOB) is phase
    return sim


def _action_failed(sim: Sim) -> list[Action]:
    return sim.feed(ActionFailed(ts=sim.ts(), action_id=sim.outstanding(JOB), reason="refused"))


def _drive(phase: TaskPhase, trigger: Trigger) -> Callable[[Sim], list[Action]]:
    """The event(s) that deliver ``trigger`` to a task in ``phase``."""
    if trigger is T.SEV3:
        return lambda sim: sim.incident("n1", SEV3_KIND, task=JOB)
    if trigger is T.SEV2:
        return lambda sim: sim.incident("n1", SEV2_KIND, task=JOB)
    if trigger is T.RESIZE_ECHO:
        return _resize_echo
    if trigger is T.SEV1:
        return lambda sim: sim.incident("n1", SEV1_KIND)
    if trigger is T.TASK_FAULT:  # a "restart" task's rank on n2 dies (a sev2 like any other)
        return lambda sim: sim.incident("n2", SEV2_KIND, task=JOB, rank=sim.state.tasks[JOB].ranks_on("n2")[0])
    if trigger is T.PEER_DIED:  # the restart is on n1; a rank on n2 dies
        return lambda sim: sim.incident("n2", SEV2_KIND, task=JOB, rank=sim.state.tasks[JOB].ranks_on("n2")[0])
    if trigger is T.RESTART_DIED:  # the process the restart launched on n1 dies
        return lambda sim: sim.incident("n1", SEV2_KIND, task=JOB, rank=sim.state.tasks[JOB].relaunching["n1"][0],
                                        generation=sim.state.tasks[JOB].generation,
                                        restart_epoch=sim.state.tasks[JOB].restart_epoch)
    if trigger is T.LAUNCH_FAULT:  # a rank of the Assign not yet confirmed dies
        return lambda sim: sim.incident("n1", SEV2_KIND, task=JOB, rank=sim.state.tasks[JOB].ranks_on("n1")[0],
                                        generation=sim.state.tasks[JOB].generation)
    if trigger is T.ACTION_OK:
        return lambda sim: sim.feed(ActionSucceeded(ts=sim.ts(), action_id=sim.outstanding(JOB)))
    if trigger is T.ACTION_FAILED:
        return _action_failed
    if trigger is T.TASK_ERROR:
        return lambda sim: sim.feed(
            ActionFailed(
                ts=sim.ts(), action_id=sim.outstanding(JOB), reason="cannot start", cause=FailureCause.TASK
            )
        )
    if trigger is T.UPDATE_FAILED:  # running: no action is out, the updated ranks started and one died
        return _update_crashed if phase is P.RUNNING else _update_cannot_start
    if trigger is T.PROGRESS:
        return lambda sim: sim.progress(JOB, 100)
    if trigger is T.REATTEMPTS_SPENT:
        # RUNNING with no reattempts allowed: a sev3; REATTEMPTING: the one reattempt failed
        return (
            _action_failed
            if phase is P.REATTEMPTING
            else (lambda sim: sim.incident("n1", SEV3_KIND, task=JOB))
        )
    if trigger is T.NO_PROGRESS:
        if phase in (P.RUNNING, P.REATTEMPTING):
            return lambda sim: sim.incident("n1", SEV2_KIND, task=JOB)
        return _action_failed
    if trigger is T.RESIZED:
        return lambda sim: sim.join("n3")
    if trigger is T.RESIZED_IN_PLACE:
        return _resize_in_place if phase is P.RECONFIGURING else _drain_n2
    if trigger is T.STORE_LOST:
        return _store_lost_in_a_resize if phase is P.RECONFIGURING else _store_lost
    if trigger is T.UNPLACED:
        return lambda sim: sim.submit("vip", min_gpus=16, weight=2.0)
    if trigger is T.FINISHED:
        return lambda sim: sim.feed(TaskFinished(ts=sim.ts(), task=JOB))
    if trigger is T.STOPPED:
        return lambda sim: sim.feed(TaskStopped(ts=sim.ts(), task=JOB, step=7, reason="stopped unasked"))
    if trigger is T.UPDATED:
        return _new_command
    if trigger is T.CANCELLED:
        return lambda sim: sim.feed(TaskCancelled(ts=sim.ts(), task=JOB))
    raise AssertionError(f"no driver for {trigger}")


def _resize_echo(sim: Sim) -> list[Action]:
    """A survivor's sev3 from the iteration in flight at an in-place resize made at step 5 (the resize
    is put on record directly: reaching it by events would leave the phase under test)."""
    sim.state.tasks[JOB].resized_step = 5
    return sim.incident("n1", SEV3_KIND, task=JOB, step=6)


def _new_command(sim: Sim) -> list[Action]:
    old = sim.state.tasks[JOB].spec
    new = TaskSpec(**{**{f.name: getattr(old, f.name) for f in fields(old)}, "command": (*old.command, "--new")})
    return sim.feed(TaskUpdated(ts=sim.ts(), spec=new))


def _update_cannot_start(sim: Sim) -> list[Action]:
    """The outstanding action fails to launch an updated spec not yet stepped (the update is put on
    record directly: reaching it by events would leave the phase under test)."""
    old = sim.state.tasks[JOB].spec
    sim.state.tasks[JOB].spec = TaskSpec(**{**{f.name: getattr(old, f.name) for f in fields(old)},
                                            "command": (*old.command, "--new")})
    sim.state.tasks[JOB].previous_spec = old
    acts = sim.feed(ActionFailed(ts=sim.ts(), action_id=sim.outstanding(JOB), reason="cannot start",
                                 cause=FailureCause.TASK))
    assert sim.state.tasks[JOB].spec == old
    return acts


def _update_crashed(sim: Sim) -> list[Action]:
    """A rank of the current generation running an updated spec not yet stepped dies (the update is put
    on record directly, as above)."""
    old = sim.state.tasks[JOB].spec
    sim.state.tasks[JOB].spec = TaskSpec(**{**{f.name: getattr(old, f.name) for f in fields(old)},
                                            "command": (*old.command, "--new")})
    sim.state.tasks[JOB].previous_spec = old
    acts = sim.incident("n1", SEV2_KIND, task=JOB, generation=sim.state.tasks[JOB].generation)
    assert sim.state.tasks[JOB].spec == old
    return acts


def _drain_n2(sim: Sim) -> list[Action]:
    """``job`` (ranks 0-7 on n1, 8-15 on n2) shrinks in place to n1: rank 0's node keeps it."""
    return sim.feed(NodeDrained(ts=sim.ts(), node="n2"))


def _confirm_and_drain_n2(sim: Sim) -> None:
    """From a launch not yet confirmed (no in-place change: its ranks may never have run): confirm it
    and shrink in place: RECONFIGURING again, with the resize out."""
    sim.feed(ActionSucceeded(ts=sim.ts(), action_id=sim.outstanding(JOB)))
    _drain_n2(sim)
    assert sim.phase(JOB) is P.RECONFIGURING


def _store_lost(sim: Sim) -> list[Action]:
    """The task's store sidecar dies on n1 (rank 0's node hosts the store), the node still in service."""
    return sim.incident("n1", STORE_LOST_KIND, task=JOB)


def _store_lost_in_a_resize(sim: Sim) -> list[Action]:
    _confirm_and_drain_n2(sim)
    return _store_lost(sim)


def _resize_in_place(sim: Sim) -> list[Action]:
    """Shrunk in place with the resize out, then grown back in place."""
    _confirm_and_drain_n2(sim)
    return sim.feed(NodeUndrained(ts=sim.ts(), node="n2"))


EDGES = sorted(TRANSITIONS.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value))


@pytest.mark.parametrize(("edge", "target"), EDGES, ids=[f"{p.value}-{t.value}" for (p, t), _ in EDGES])
def test_edge(edge: tuple[TaskPhase, Trigger], target: tuple[TaskPhase, Response]) -> None:
    phase, trigger = edge
    next_phase, response = target
    settings = _settings(phase, trigger)
    # TASK_FAULT is what a sev2/sev3 is for a task with recovery "restart" (its restart is a RestartTask)
    sim = _in_phase(phase, settings, "restart" if trigger is T.TASK_FAULT else "inprocess")
    actions = _drive(phase, trigger)(sim)
    mine = [t for t in sim.transitions if t.task == JOB]
    assert mine, f"no transition for {JOB}; actions {actions}"
    first: Transition = mine[0]
    assert (first.phase, first.trigger, first.next_phase, first.response) == (
        phase,
        trigger,
        next_phase,
        response,
    )
    emitted = {type(a) for a in actions if getattr(a, "task", None) in (JOB, None)}
    assert EMITS[response] <= emitted, f"{response} should emit {EMITS[response]}, got {actions}"
    if response in RESHAPED:
        assert emitted & {Assign, ResizeInPlace}, f"{response} should re-plan the task, got {actions}"
    if response in (R.MERGE, R.RECOVERED, R.RELEASE, R.WITHDRAW):
        assert not [a for a in actions if getattr(a, "task", None) == JOB]
    if len(mine) == 1:  # no later edge in the same event (e.g. the re-plan after RECONFIGURE)
        assert sim.phase(JOB) is next_phase


def test_every_budget_has_its_exhaustion_edge_wherever_the_budgeted_response_is_used() -> None:
    for (phase, _), (_, response) in TRANSITIONS.items():
        if response in BUDGETED:
            assert (phase, BUDGETED[response]) in TRANSITIONS, (phase, response)


def test_final_phases_have_no_edges() -> None:
    final = {P.FINISHED, P.FAILED, P.CANCELLED}
    assert not [edge for edge in TRANSITIONS if edge[0] in final]
    sim = _in_phase(P.RUNNING, DecisionSettings())
    sim.feed(TaskFinished(ts=sim.ts(), task=JOB))
    assert sim.incident("n1", SEV2_KIND, task=JOB) == []
    assert sim.phase(JOB) is P.FINISHED
