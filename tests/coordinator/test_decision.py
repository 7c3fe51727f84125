"""Scenario tests of the decision core (paper Figure 7), driven only through events.

``Sim`` is a tiny driver with a simulated clock; the helpers here are shared with
test_decision_table.py.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from coordinator.causes import classify
from coordinator.decision import (
    Action,
    ActionFailed,
    ActionSucceeded,
    Alert,
    Assign,
    CoreState,
    DecisionCore,
    DecisionSettings,
    Event,
    FailureCause,
    IncidentRaised,
    IsolateNode,
    MarkTaskFailed,
    NodeDrained,
    NodeEntry,
    NodeJoined,
    NodeLost,
    NodeState,
    NodeUndrained,
    ProgressMade,
    Reattempt,
    ResizeInPlace,
    RestartRanks,
    RestartTask,
    StopTask,
    TaskCancelled,
    TaskFinished,
    TaskPhase,
    TaskStopped,
    TaskSubmitted,
    TaskUpdated,
    Tick,
    Transition,
    Trigger,
    UpdateOutcome,
    from_dict,
    to_dict,
)
from coordinator.tasks import TaskSpec, parse_task_spec
from unicron.kernel.errors import ConfigError, InvalidRecord, PermanentError
from unicron.kernel.types import DetectionMethod, ErrorKind, Report

M = DetectionMethod
K = ErrorKind
SEV3_KIND = (M.EXCEPTION_PROPAGATION, K.CONNECTION_REFUSED_RESET)
SEV2_KIND = (M.PROCESS_SUPERVISION, K.EXITED_ABNORMALLY)
SEV1_KIND = (M.EXCEPTION_PROPAGATION, K.ECC_ERROR)
STORE_LOST_KIND = (M.PROCESS_SUPERVISION, K.STORE_LOST)


def spec(name: str, **fields: Any) -> TaskSpec:
    # Unicron-runtime semantics (reattempt, single-rank restart) unless a test asks for "restart"
    return parse_task_spec({"name": name, "command": ["python", "pretrain_gpt.py"], "recovery": "inprocess", **fields},
                           None)


class Sim:
    """Feeds events with a clock that advances one second per event (or as told)."""

    def __init__(self, settings: DecisionSettings | None = None, core: DecisionCore | None = None) -> None:
        self.core = core or DecisionCore(settings)
        self.state = self.core.initial_state()
        self.t = 0.0
        self.incidents = 0
        self.events: list[Event] = []
        self.transitions: list[Transition] = []

    def feed(self, event: Event) -> list[Action]:
        self.events.append(event)
        given, as_given = self.state, self.state.to_dict()
        self.state, actions, self.transitions = self.core.explain(given, event)
        # the core is pure: the leader keeps the state it gave should the decision's write fail
        assert given.to_dict() == as_given, f"the core changed the state it was given: {event}"
        return actions

    def ts(self, advance: float = 1.0) -> float:
        self.t += advance
        return self.t

    # events
    def join(self, node: str, gpus: int = 8) -> list[Action]:
        return self.feed(NodeJoined(ts=self.ts(), node=node, gpus=gpus))

    def submit(self, name: str, **fields: Any) -> list[Action]:
        return self.feed(TaskSubmitted(ts=self.ts(), spec=spec(name, **fields)))

    def ok(self, action: Action) -> list[Action]:
        return self.feed(ActionSucceeded(ts=self.ts(), action_id=action.action_id))

    def fail(self, action: Action, node: str | None = None) -> list[Action]:
        return self.feed(
            ActionFailed(ts=self.ts(), action_id=action.action_id, reason="agent said no", node=node)
        )

    def incident(
        self,
        node: str,
        kind: tuple[DetectionMethod, ErrorKind],
        task: str | None = None,
        rank: int | None = None,
        generation: int | None = None,
        step: int | None = None,
        restart_epoch: int | None = None,
    ) -> list[Action]:
        self.incidents += 1
        ts = self.ts()
        report = Report(
            method=kind[0], kind=kind[1], node=node, task=task, rank=rank, source_ts=ts, agent_ts=ts, step=step
        )
        incident = classify(report, detected_ts=ts, incident_id=f"i{self.incidents}")
        return self.feed(IncidentRaised(ts=ts, incident=incident, generation=generation, restart_epoch=restart_epoch))

    def progress(self, task: str, step: int, current_generation: bool = True) -> list[Action]:
        gen = self.state.tasks[task].generation if current_generation else None
        return self.feed(ProgressMade(ts=self.ts(), task=task, step=step, generation=gen))

    # queries
    def phase(self, task: str) -> TaskPhase:
        return self.state.tasks[task].phase

    def gpus(self, task: str) -> dict[str, int]:
        return {n: len(r) for n, r in self.state.tasks[task].placement.items()}

    def outstanding(self, task: str) -> str:
        o = self.state.tasks[task].outstanding
        assert o is not None, f"{task} has no outstanding action"
        return o.action_id

    def confirm_all(self, actions: Sequence[Action]) -> None:
        for a in actions:
            if isinstance(a, Assign | Reattempt | RestartRanks):
                self.ok(a)


def only(actions: Sequence[Action], kind: type[Any]) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def one(actions: Sequence[Action], kind: type[Any], task: str | None = None) -> Any:
    found = [a for a in only(actions, kind) if task is None or a.task == task]
    assert len(found) == 1, f"expected one {kind.__name__} for {task}, got {actions}"
    return found[0]


def running_cluster(
    nodes: Mapping[str, int], tasks: Mapping[str, Mapping[str, Any]], sim: Sim | None = None
) -> Sim:
    """Join the nodes, submit the tasks and confirm every assignment until all run."""
    sim = sim or Sim()
    for node, gpus in nodes.items():
        sim.join(node, gpus)
    for name, fields in tasks.items():
        sim.submit(name, **fields)
    for name in tasks:
        if sim.phase(name) is TaskPhase.RECONFIGURING:
            sim.feed(ActionSucceeded(ts=sim.ts(), action_id=sim.outstanding(name)))
    return sim


# --- Figure 7 ①: sev3 -> reattempt ------------------------------------------------------------------


def test_sev3_reattempt_succeeds_and_task_runs_on() -> None:
    sim = running_cluster({"n1": 8}, {"job": {}})
    gen = sim.state.tasks["job"].generation
    acts = sim.incident("n1", SEV3_KIND, task="job", rank=3)
    r = one(acts, Reattempt, "job")
    assert (r.generation, r.node, r.failed_ranks, r.members) == (gen, "n1", (3,), tuple(range(8)))
    assert sim.phase("job") is TaskPhase.REATTEMPTING
    assert sim.ok(r) == []
    assert sim.phase("job") is TaskPhase.RUNNING
    assert sim.state.tasks["job"].generation == gen  # reattempt in place: same configuration


def test_sev3_reattempt_fails_then_restart_succeeds() -> None:
    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {}})
    r = one(sim.incident("n2", (M.STATISTICAL_MONITORING, K.NCCL_TIMEOUT), task="job"), Reattempt)
    restart = one(sim.fail(r), RestartRanks, "job")  # upgraded to sev2
    assert restart.node == "n2" and restart.ranks == tuple(sim.state.tasks["job"].placement["n2"])
    assert restart.restart_epoch == 1 and restart.generation == r.generation
    assert sim.phase("job") is TaskPhase.RESTARTING
    sim.ok(restart)
    assert sim.phase("job") is TaskPhase.RUNNING
    assert sim.state.nodes["n2"].status is NodeState.UP


def test_sev2_without_a_rank_restarts_the_nodes_ranks() -> None:
    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {}})
    restart = one(sim.incident("n1", SEV2_KIND, task="job"), RestartRanks)
    assert restart.node == "n1" and restart.ranks == tuple(sim.state.tasks["job"].placement["n1"])


def test_restart_fails_then_node_isolated_and_task_reconfigured() -> None:
    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {}})
    restart = one(sim.incident("n1", SEV2_KIND, task="job", rank=2), RestartRanks)
    assert restart.node == "n1" and restart.ranks == (2,)  # only the failed process (issue 3.5)
    acts = sim.fail(restart)  # upgraded to sev1
    assert one(acts, IsolateNode).node == "n1"
    # the survivors on n2 go on in place: the restart under way was on the node now isolated
    shrink = one(acts, ResizeInPlace, "job")
    assert set(shrink.placement) == {"n2"} and shrink.lost == tuple(range(8))
    assert sim.state.nodes["n1"].status is NodeState.ISOLATED
    assert sim.phase("job") is TaskPhase.RECONFIGURING
    sim.progress("job", 6)
    assert sim.phase("job") is TaskPhase.RUNNING


def test_node_lost_with_two_tasks_reconfigures_both() -> None:
    sim = running_cluster({"n1": 8, "n2": 8, "n3": 8}, {"a": {"min_gpus": 4}, "b": {"min_gpus": 4}})
    shared = [n for n in sim.state.nodes if sim.gpus("a").get(n) and sim.gpus("b").get(n)]
    assert shared, "the even split puts both tasks on one node"
    lost = shared[0]
    acts = sim.feed(NodeLost(ts=sim.ts(), node=lost, reason="lease expired"))
    # each task is re-planned: a new generation, or in place where rank 0's node and a replica survive
    moved = only(acts, Assign) + only(acts, ResizeInPlace)
    assert sorted(a.task for a in moved) == ["a", "b"]
    for a in moved:
        assert lost not in a.placement
    assert sum(len(r) for a in moved for r in a.placement.values()) == 16
    assert sim.state.nodes[lost].status is NodeState.LOST
    assert only(acts, Alert)


def test_join_reconfigures_and_hands_out_new_gpus() -> None:
    sim = running_cluster({"n1": 8}, {"a": {"min_gpus": 2}, "b": {"min_gpus": 2}})
    assert sim.gpus("a") == {"n1": 4} and sim.gpus("b") == {"n1": 4}
    acts = sim.join("n2")
    assert sum(a.world_size for a in only(acts, Assign)) == 16
    assert sum(sum(sim.gpus(t).values()) for t in ("a", "b")) == 16
    # both kept their GPUs on n1 (fewest moved workers) and grew onto n2
    assert sim.gpus("a")["n1"] == 4 and sim.gpus("b")["n1"] == 4


def test_finished_task_gpus_go_to_the_others() -> None:
    sim = running_cluster({"n1": 8, "n2": 8}, {"a": {}, "b": {}})
    assert sum(sim.gpus("b").values()) == 8
    acts = sim.feed(TaskFinished(ts=sim.ts(), task="a"))
    assert sim.phase("a") is TaskPhase.FINISHED
    assert one(acts, Assign, "b").world_size == 16
    assert not only(acts, StopTask)


def test_ended_tasks_past_the_kept_count_are_retired_and_their_names_start_above_them() -> None:
    """The task set keeps the newest ended tasks only; a name submitted again after its entry was
    retired starts above every retired generation, so the old run's late records stay stale."""
    sim = Sim(DecisionSettings(ended_tasks_kept=2))
    sim.join("n1")
    for name in ("a", "b", "c"):
        sim.ok(one(sim.submit(name, max_gpus=2), Assign, name))
    generations = {n: sim.state.tasks[n].generation for n in ("a", "b", "c")}
    sim.feed(TaskCancelled(ts=sim.ts(), task="b"))
    sim.feed(TaskFinished(ts=sim.ts(), task="a"))
    assert sorted(sim.state.tasks) == ["a", "b", "c"] and sim.state.tasks["a"].ended_at == sim.t
    sim.feed(TaskFinished(ts=sim.ts(), task="c"))
    assert sorted(sim.state.tasks) == ["a", "c"]  # b ended first
    assert sim.state.retired_generation == generations["b"] >= 1
    acts = sim.submit("b", max_gpus=2)
    assert one(acts, Assign, "b").generation > generations["b"]
    assert CoreState.from_dict(json.loads(json.dumps(sim.state.to_dict()))) == sim.state
    # the setting lowered (or a state kept from before retirement existed): the next tick retires
    lowered, _ = DecisionCore(DecisionSettings(ended_tasks_kept=1)).handle(sim.state, Tick(ts=sim.ts()))
    assert sorted(lowered.tasks) == ["b", "c"] and sorted(sim.state.tasks) == ["a", "b", "c"]


def stopped(sim: Sim, task: str, step: int) -> list[Action]:
    return sim.feed(TaskStopped(ts=sim.ts(), task=task, step=step,
                                reason=f"rank 3 stopped at iteration {step} on a SIGTERM Unicron did not send"))


def test_a_task_stopped_unasked_is_relaunched_where_it_was_as_a_new_generation() -> None:
    """Not finished (its GPUs stay), not resized in place (none of its ranks runs): a new Assign."""
    sim = running_cluster({"n1": 8, "n2": 8}, {"a": {}})
    sim.progress("a", 40)
    before = sim.state.tasks["a"]
    acts = stopped(sim, "a", 40)
    assign = one(acts, Assign, "a")
    assert assign.generation == before.generation + 1
    assert {n: len(r) for n, r in assign.placement.items()} == {n: len(r) for n, r in before.placement.items()}
    assert not only(acts, ResizeInPlace) and not only(acts, StopTask)
    assert "iteration 40" in one(acts, Alert, "a").message
    assert sim.phase("a") is TaskPhase.RECONFIGURING
    sim.ok(assign)
    assert sim.phase("a") is TaskPhase.RUNNING


def test_a_task_stopped_again_and_again_without_a_step_fails() -> None:
    settings = DecisionSettings()
    sim = running_cluster({"n1": 8}, {"a": {}}, Sim(settings))
    sim.progress("a", 40)
    relaunches = 0
    while sim.phase("a") is not TaskPhase.FAILED and relaunches <= settings.max_restarts_without_progress:
        acts = stopped(sim, "a", 40)
        if only(acts, Assign):
            relaunches += 1
            sim.confirm_all(acts)
    assert sim.phase("a") is TaskPhase.FAILED
    assert relaunches == settings.max_restarts_without_progress
    # with a step between the stops, the budget is never spent
    sim = running_cluster({"n1": 8}, {"b": {}}, Sim(settings))
    for step in range(10, 100, 10):
        sim.progress("b", step)
        sim.confirm_all(stopped(sim, "b", step))
    assert sim.phase("b") is TaskPhase.RUNNING


def updated(sim: Sim, task: str, **fields: Any) -> list[Action]:
    old = sim.state.tasks[task].spec.to_dict()
    return sim.feed(TaskUpdated(ts=sim.ts(), spec=parse_task_spec({**old, **fields}, None)))


def test_a_new_command_relaunches_the_task_as_a_new_generation_without_spending_its_budget() -> None:
    """The running ranks cannot take a new command (or micro-batch size): a new Assign of the same
    placement (never in place), which the agents carry out by a work-conserving stop."""
    sim = running_cluster({"n1": 8, "n2": 8}, {"a": {}})
    sim.progress("a", 40)
    before = sim.state.tasks["a"]
    acts = updated(sim, "a", command=["python", "pretrain_gpt.py", "--micro-batch-size", "1"])
    assign = one(acts, Assign, "a")
    assert assign.generation == before.generation + 1
    assert {n: len(r) for n, r in assign.placement.items()} == {n: len(r) for n, r in before.placement.items()}
    assert not only(acts, ResizeInPlace) and not only(acts, StopTask) and not only(acts, Alert)
    after = sim.state.tasks["a"]
    assert after.spec.command[-1] == "1" and after.restarts == before.restarts
    assert sim.transitions[0].trigger is Trigger.UPDATED and "command" in sim.transitions[0].reason
    sim.ok(assign)
    assert sim.phase("a") is TaskPhase.RUNNING


def test_a_new_weight_or_gpu_bound_only_re_plans() -> None:
    sim = running_cluster({"n1": 8, "n2": 8}, {"a": {}})
    gen = sim.state.tasks["a"].generation
    acts = updated(sim, "a", weight=2.0)
    assert acts == [] and sim.state.tasks["a"].spec.weight == 2.0 and sim.phase("a") is TaskPhase.RUNNING
    acts = updated(sim, "a", max_gpus=8)  # a smaller bound: the planner shrinks it, like any re-plan
    assert [t.trigger for t in sim.transitions] == [Trigger.RESIZED_IN_PLACE]  # even off the store's node
    assert one(acts, ResizeInPlace, "a").generation == gen and sum(sim.gpus("a").values()) == 8


def _cannot_start(sim: Sim, action: Action) -> list[Action]:
    return sim.feed(ActionFailed(ts=sim.ts(), action_id=action.action_id, reason="exec: 'pythn': not found",
                                 cause=FailureCause.TASK))


def test_an_update_whose_command_cannot_start_rolls_back_to_the_spec_the_task_ran_with() -> None:
    """A typo in an updated command failed the whole job (TASK_ERROR -> failed). The update's own
    relaunch failing to start is the update's failure: the task goes back to the spec it ran with and is
    relaunched (a new generation restoring the update's snapshot), with an Alert; the old spec failing
    to start in turn is not rolled back again (no loop)."""
    sim = running_cluster({"n1": 8, "n2": 8}, {"a": {}})
    sim.progress("a", 40)
    before = sim.state.tasks["a"]
    assign = one(updated(sim, "a", command=["pythn", "pretrain_gpt.py"], tp_size=2, min_gpus=2), Assign, "a")
    assert sim.state.tasks["a"].spec.tp_size == 2
    # a new leader taking over here keeps what to roll back to
    sim.state = CoreState.from_dict(json.loads(json.dumps(sim.state.to_dict())))
    acts = _cannot_start(sim, assign)
    assert not only(acts, MarkTaskFailed) and not only(acts, StopTask)
    relaunch = one(acts, Assign, "a")
    after = sim.state.tasks["a"]
    assert after.spec == before.spec and after.previous_spec is None
    assert relaunch.generation == assign.generation + 1 and sim.phase("a") is TaskPhase.RECONFIGURING
    assert after.restarts == before.restarts  # the update's failure is not the job's
    alert = one(acts, Alert, "a").message
    assert "update" in alert and "pythn" in alert and "rolled back" in alert
    assert sim.transitions[0].trigger is Trigger.UPDATE_FAILED
    # the spec it ran with cannot start either (its executable went away): failed as before, no loop
    acts = _cannot_start(sim, relaunch)
    assert one(acts, MarkTaskFailed, "a") and sim.phase("a") is TaskPhase.FAILED


def test_an_update_that_made_progress_is_not_rolled_back() -> None:
    """Once the updated command completed a step, its failures are ordinary ones: a later launch failure
    fails the task as any would (the update was confirmed)."""
    sim = running_cluster({"n1": 8, "n2": 8}, {"a": {}})
    sim.progress("a", 40)
    assign = one(updated(sim, "a", command=["python", "pretrain_gpt.py", "--new"]), Assign, "a")
    assert sim.state.tasks["a"].previous_spec is not None
    sim.progress("a", 40, current_generation=False)  # a step of no known generation confirms nothing
    assert sim.state.tasks["a"].previous_spec is not None
    sim.ok(assign)
    sim.progress("a", 41)
    assert sim.phase("a") is TaskPhase.RUNNING and sim.state.tasks["a"].previous_spec is None
    restart = one(sim.incident("n1", SEV2_KIND, task="a", rank=1), RestartRanks, "a")
    acts = _cannot_start(sim, restart)
    assert one(acts, MarkTaskFailed, "a") and sim.phase("a") is TaskPhase.FAILED
    assert sim.state.tasks["a"].spec.command[-1] == "--new"


@pytest.mark.parametrize("kind", [(M.STATISTICAL_MONITORING, K.NCCL_TIMEOUT),
                                  (M.EXCEPTION_PROPAGATION, K.CONNECTION_REFUSED_RESET),
                                  (M.EXCEPTION_PROPAGATION, K.CUDA_ERROR)], ids=["nccl", "reset", "cuda"])
def test_a_network_or_gpu_fault_before_an_updates_first_step_is_no_rollback(kind: tuple[DetectionMethod, ErrorKind]) -> None:
    """Before, every sev2/sev3 of the updated generation rolled a good update back (the relaunch, the
    restore and the first step take minutes on a big job): an NCCL timeout or a GPU's CUDA error is no
    fault of the new command. They take their usual way, and the GPU's counts for flapping."""
    sim = running_cluster({"n1": 8, "n2": 8}, {"a": {"min_gpus": 16, "max_gpus": 16}})
    sim.progress("a", 40)
    assign = one(updated(sim, "a", command=["python", "pretrain_gpt.py", "--micro-batch-size", "2"]), Assign, "a")
    sim.ok(assign)
    sim.incident("n2", kind, task="a", rank=9, generation=assign.generation)
    assert Trigger.UPDATE_FAILED not in [t.trigger for t in sim.transitions]
    assert sim.state.tasks["a"].spec.command[-1] == "2"  # the update stands
    if kind[1] is K.CUDA_ERROR:
        assert sim.state.nodes["n2"].sev2_faults


@pytest.mark.parametrize(("recovery", "confirmed"), [("inprocess", True), ("inprocess", False), ("restart", True)])
def test_an_update_whose_command_crashes_before_its_first_step_rolls_back(recovery: str, confirmed: bool) -> None:
    """The new command starts but its process dies before any step (an ImportError in the new script, a
    bad flag). Before, that was an ordinary rank failure: the broken spec was restarted (or, launching,
    relaunched) until the restart budget failed the job that trained fine before. Now it is the update's
    failure: back to the spec that ran, relaunched from the update's snapshot, with an Alert naming the
    crash; no restart counted, no failure counted for the planner, no node suspected."""
    sim = running_cluster({"n1": 8, "n2": 8}, {"a": {"recovery": recovery}})
    sim.progress("a", 40)
    before, failures = sim.state.tasks["a"], sim.state.failures
    assign = one(updated(sim, "a", command=["python", "pretrain_gpt.py", "--no-such-flag"]), Assign, "a")
    if confirmed:  # the ranks started (their agents confirmed the Assign), then one died
        sim.ok(assign)
        assert sim.phase("a") is TaskPhase.RUNNING
    crash = sim.incident("n1", SEV2_KIND, task="a", rank=0, generation=assign.generation)
    assert not only(crash, RestartRanks) and not only(crash, MarkTaskFailed) and not only(crash, IsolateNode)
    relaunch = one(crash, Assign, "a")
    after = sim.state.tasks["a"]
    assert after.spec == before.spec and after.previous_spec is None
    assert relaunch.generation == assign.generation + 1 and sim.phase("a") is TaskPhase.RECONFIGURING
    assert after.restarts == before.restarts and sim.state.failures == failures
    assert sim.transitions[0].trigger is Trigger.UPDATE_FAILED
    alert = one(crash, Alert, "a").message
    assert "update failed (command)" in alert and "exited_abnormally on n1" in alert and "rolled back" in alert
    # the crashed generation's other ranks dying too are leftovers: the rollback stands
    assert not sim.incident("n2", SEV2_KIND, task="a", rank=8, generation=assign.generation)
    # the spec put back crashing in turn is an ordinary failure (no loop back to the broken update)
    sim.ok(relaunch)
    again = sim.incident("n1", SEV2_KIND, task="a", rank=0, generation=relaunch.generation)
    assert sim.transitions[0].trigger is not Trigger.UPDATE_FAILED and sim.state.tasks["a"].spec == before.spec
    assert only(again, RestartRanks) or only(again, RestartTask)


def test_an_updates_outcome_is_pending_until_a_step_or_a_rollback_and_survives_a_new_leader() -> None:
    """What 'unicron update --wait' reads (ListTasks' ``update``): before, nothing told an update that
    trained from one rolled back. Pending until the new spec's ranks complete a step at the task's
    generation (a step of the replaced generation confirms nothing), then confirmed; rolled back with its
    reason when the new command crashed first; None for an update that relaunches nothing."""
    sim = running_cluster({"n1": 8, "n2": 8}, {"a": {}})
    sim.progress("a", 40)
    assert sim.state.tasks["a"].update is None
    assign = one(updated(sim, "a", command=["python", "pretrain_gpt.py", "--new"]), Assign, "a")
    assert sim.state.tasks["a"].update is UpdateOutcome.PENDING
    sim.progress("a", 41, current_generation=False)
    sim.feed(ProgressMade(ts=sim.ts(), task="a", step=42, generation=assign.generation - 1))
    sim.state = CoreState.from_dict(json.loads(json.dumps(sim.state.to_dict())))  # a new leader keeps it
    assert sim.state.tasks["a"].update is UpdateOutcome.PENDING
    sim.ok(assign)
    sim.progress("a", 43)
    assert sim.state.tasks["a"].update is UpdateOutcome.CONFIRMED
    updated(sim, "a", weight=2.0)  # relaunches nothing: the earlier outcome is not this update's
    assert sim.state.tasks["a"].update is None
    one(updated(sim, "a", command=["python", "pretrain_gpt.py", "--broken"]), Assign, "a")
    updated(sim, "a", weight=1.0)  # a pending one stays pending: its command is part of this spec
    assert sim.state.tasks["a"].update is UpdateOutcome.PENDING
    sim.incident("n1", SEV2_KIND, task="a", rank=0, generation=sim.state.tasks["a"].generation)
    entry = sim.state.tasks["a"]
    assert entry.update is UpdateOutcome.ROLLED_BACK and "update failed" in entry.update_reason
    assert CoreState.from_dict(json.loads(json.dumps(sim.state.to_dict()))).tasks["a"] == entry
    sim.progress("a", 44)  # the spec put back stepping does not make the update a success
    assert sim.state.tasks["a"].update is UpdateOutcome.ROLLED_BACK


def test_a_node_fault_during_an_update_is_the_nodes_not_the_updates() -> None:
    """A sev1 (or a store's loss) while the updated spec has not stepped says nothing of the spec: the
    task reconfigures as for any node fault and keeps the updated spec (and what to roll back to)."""
    sim = running_cluster({"n1": 8, "n2": 8, "n3": 8}, {"a": {"min_gpus": 16, "max_gpus": 16}})
    sim.progress("a", 40)
    assign = one(updated(sim, "a", command=["python", "pretrain_gpt.py", "--new"]), Assign, "a")
    sim.ok(assign)
    node = sorted(sim.state.tasks["a"].placement)[0]
    sim.incident(node, SEV1_KIND, generation=assign.generation)
    entry = sim.state.tasks["a"]
    assert entry.spec.command[-1] == "--new" and entry.previous_spec is not None
    assert Trigger.UPDATE_FAILED not in {t.trigger for t in sim.transitions}


def test_a_second_update_before_the_first_stepped_rolls_back_to_the_spec_that_ran() -> None:
    sim = running_cluster({"n1": 8}, {"a": {}})
    sim.progress("a", 40)
    ran = sim.state.tasks["a"].spec
    updated(sim, "a", command=["python", "pretrain_gpt.py", "--one"])
    assign = one(updated(sim, "a", command=["pythn", "pretrain_gpt.py"]), Assign, "a")
    one(_cannot_start(sim, assign), Assign, "a")
    assert sim.state.tasks["a"].spec == ran and sim.phase("a") is TaskPhase.RECONFIGURING
    # an update back to the spec that ran leaves nothing else to go back to: its failure is the task's
    updated(sim, "a", command=["python", "pretrain_gpt.py", "--one"])
    assign = one(updated(sim, "a", command=list(ran.command)), Assign, "a")
    assert sim.state.tasks["a"].previous_spec is None
    assert one(_cannot_start(sim, assign), MarkTaskFailed, "a")


def test_an_update_of_a_pending_task_replaces_its_spec_and_one_of_an_unknown_task_alerts() -> None:
    sim = running_cluster({"n1": 8}, {"big": {"min_gpus": 16}})
    assert sim.phase("big") is TaskPhase.PENDING
    acts = updated(sim, "big", min_gpus=8)
    assert one(acts, Assign, "big").world_size == 8 and sim.state.tasks["big"].spec.min_gpus == 8
    acts = sim.feed(TaskUpdated(ts=sim.ts(), spec=spec("ghost")))
    assert "not in the task set" in one(acts, Alert).message and "ghost" not in sim.state.tasks


def test_a_rank_of_a_launch_not_yet_confirmed_that_dies_is_restarted_at_once() -> None:
    """Merged as a consequence of the reconfiguration, it waited out the Assign's 300 s deadline with the
    rank dead. A report from an older generation is still a leftover of the replaced configuration."""
    sim = Sim()
    sim.join("n1")
    sim.submit("a", min_gpus=8)
    assert sim.phase("a") is TaskPhase.RECONFIGURING
    gen = sim.state.tasks["a"].generation
    assert sim.incident("n1", SEV2_KIND, task="a", rank=3, generation=gen - 1) == []
    assert sim.phase("a") is TaskPhase.RECONFIGURING
    restart = one(sim.incident("n1", SEV2_KIND, task="a", rank=3, generation=gen), RestartRanks, "a")
    assert (restart.generation, restart.ranks, sim.phase("a")) == (gen, (3,), TaskPhase.RESTARTING)
    sim.progress("a", 1)
    assert sim.phase("a") is TaskPhase.RUNNING and sim.state.tasks["a"].confirmed


def test_submit_above_free_stays_pending_then_runs_after_join() -> None:
    sim = running_cluster({"n1": 8}, {"small": {"weight": 2.0}})
    acts = sim.submit("big", min_gpus=8)
    assert sim.phase("big") is TaskPhase.PENDING and not only(acts, Assign)
    assert "at least 8" in sim.state.tasks["big"].reason
    acts = sim.join("n2")
    big = one(acts, Assign, "big")
    assert big.world_size >= 8
    sim.ok(big)
    assert sim.phase("big") is TaskPhase.RUNNING
    assert sum(sim.gpus("small").values()) + big.world_size == 16


def test_restart_loop_without_progress_marks_task_failed_with_reason() -> None:
    sim = running_cluster({"n1": 8}, {"job": {}})
    sim.progress("job", 40)
    restarts = 0
    for _ in range(10):
        acts = sim.incident("n1", SEV2_KIND, task="job", rank=0)
        if sim.phase("job") is TaskPhase.FAILED:
            break
        sim.ok(one(acts, RestartRanks))
        sim.progress("job", 35)  # resumed from a checkpoint, crashes again before step 40
        restarts += 1
    assert restarts == DecisionSettings().max_restarts_without_progress
    failed = one(acts, MarkTaskFailed, "job")
    assert failed.reason.startswith("no progress across 3 restarts since step 40")
    assert one(acts, StopTask, "job")
    assert sim.state.tasks["job"].placement == {}


def test_progress_past_the_fault_resets_the_restart_budget() -> None:
    sim = running_cluster({"n1": 8}, {"job": {}})
    for step in range(1, 8):  # 7 restarts, but the task moves on between them
        sim.ts(DecisionSettings().flap_window_s / 2)  # hours apart: no flapping node (test_decision_flapping)
        sim.progress("job", step * 100)
        sim.ok(one(sim.incident("n1", SEV2_KIND, task="job"), RestartRanks))
        sim.progress("job", step * 100 + 1)
        assert sim.phase("job") is TaskPhase.RUNNING


def test_progress_of_an_older_generation_changes_nothing() -> None:
    """A step reported by the replaced generation (ahead of the new one, which resumed from a
    checkpoint) set ``last_step`` and reset the restart budget; now the core ignores it, as
    ``causes.progress`` already does."""
    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {}})
    sim.incident("n1", SEV2_KIND, task="job")
    sim.feed(Tick(ts=sim.ts(500)))  # the restart missed its deadline: n1 isolated, a new generation
    before = sim.state.tasks["job"]
    assert before.restarts > 0
    generation = before.generation
    sim.feed(ProgressMade(ts=sim.ts(), task="job", step=100, generation=generation - 1))
    assert sim.state.tasks["job"] == before


def test_unconfirmed_action_expires_on_tick() -> None:
    settings = DecisionSettings(reattempt_deadline_s=30.0)
    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {}}, Sim(settings))
    one(sim.incident("n1", SEV3_KIND, task="job"), Reattempt)
    assert sim.feed(Tick(ts=sim.ts(10))) == []
    acts = sim.feed(Tick(ts=sim.ts(30)))
    assert one(acts, RestartRanks).node == "n1"  # the missed deadline counted as a failed reattempt
    restart = one(acts, RestartRanks)
    acts = sim.feed(Tick(ts=sim.ts(settings.restart_deadline_s)))
    assert one(acts, IsolateNode).node == "n1"
    assert one(acts, ResizeInPlace).placement.keys() == {"n2"}
    assert sim.ok(restart) == []  # a late confirmation of a superseded action changes nothing
    assert sim.phase("job") is TaskPhase.RECONFIGURING


def test_an_expiry_acts_on_an_action_the_same_tick_superseded() -> None:
    """``a`` (n0) has a restart out, ``b`` (n0 + n1) a reattempt on n1; one Tick passes both deadlines.
    a's failed restart isolates n0, whose sev1 re-plans b and supersedes its reattempt. The expiry loop
    read b's entry from before that and failed the reattempt again (``reassign`` in reconfiguring:
    n1 isolated, b's budget charged); now it reads each entry afresh, as ticks at each deadline do."""
    def run(ticks: list[float]) -> Sim:
        sim = Sim()
        sim.join("n0")
        sim.join("n1")
        sim.submit("a", min_gpus=4, max_gpus=4)
        sim.submit("b", min_gpus=12, max_gpus=12)
        for t in ("a", "b"):
            sim.feed(ActionSucceeded(ts=sim.ts(), action_id=sim.outstanding(t)))
        assert sim.state.tasks["b"].placement.keys() == {"n0", "n1"}
        assert sim.state.tasks["a"].placement.keys() == {"n0"}
        sim.incident("n0", SEV2_KIND, task="a", rank=0, generation=1)  # restart of a on n0
        sim.incident("n1", SEV3_KIND, task="b", rank=5, generation=1)  # reattempt of b, node n1
        for advance in ticks:
            sim.feed(Tick(ts=sim.ts(advance)))
        return sim

    # at each deadline: the reattempt fails into a restart of b on n1; a's restart fails, n0 is
    # isolated and b re-planned, which supersedes b's restart
    stepwise = run([40.0, 90.0])
    assert stepwise.state.nodes["n1"].status is NodeState.UP
    together = run([500.0])
    assert together.state.nodes["n1"].status is NodeState.UP, together.state.nodes["n1"].reason
    assert together.state.tasks["b"].restarts == 0  # a node's loss is not charged


def test_assignment_failing_on_a_node_isolates_it_and_reassigns() -> None:
    sim = Sim()
    sim.join("n1")
    sim.join("n2")
    first = one(sim.submit("job"), Assign)
    acts = sim.fail(first, node="n2")
    assert one(acts, IsolateNode).node == "n2"
    again = one(acts, Assign)
    assert again.placement.keys() == {"n1"} and again.generation == first.generation + 1
    assert sim.state.tasks["job"].restarts == 1  # charged to the task's budget
    # failing again without progress, on n1 (no node named): the first failure was the task's too, so
    # n2, isolated on suspicion, is back and the fresh generation may use it (test_decision_suspicion.py)
    acts = sim.fail(again)
    assert not only(acts, IsolateNode) and sim.state.nodes["n2"].status is NodeState.UP
    assert one(acts, Assign).placement.keys() == {"n1", "n2"}


def test_progress_under_the_new_generation_confirms_an_assignment() -> None:
    sim = Sim()
    sim.join("n1")
    sim.submit("job")
    sim.progress("job", 1)
    assert sim.phase("job") is TaskPhase.RUNNING


# --- merging, staleness, operators ------------------------------------------------------------------


def test_incidents_during_a_recovery_merge_or_escalate() -> None:
    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {}})
    one(sim.incident("n1", SEV2_KIND, task="job"), RestartRanks)
    assert sim.incident("n1", SEV3_KIND, task="job") == []  # a consequence of the restart
    assert sim.incident("n2", SEV2_KIND, task="job") == []  # merged into the restart under way
    assert sim.phase("job") is TaskPhase.RESTARTING
    acts = sim.incident("n2", SEV1_KIND)  # more severe: escalates
    assert one(acts, IsolateNode).node == "n2"
    assert one(acts, Assign).placement.keys() == {"n1"}
    assert sim.incident("n1", SEV3_KIND, task="job") == []  # during a reconfigure: ignored
    assert sim.phase("job") is TaskPhase.RECONFIGURING


def test_stale_incident_from_an_old_generation_is_ignored() -> None:
    sim = running_cluster({"n1": 8}, {"job": {}})
    old = sim.state.tasks["job"].generation
    sim.ok(one(sim.join("n2"), Assign, "job"))
    assert sim.state.tasks["job"].generation == old + 1
    assert sim.incident("n1", SEV2_KIND, task="job", generation=old) == []
    assert sim.phase("job") is TaskPhase.RUNNING
    assert only(sim.incident("n1", SEV2_KIND, task="job", generation=old + 1), RestartRanks)


def test_degradation_is_recorded_only() -> None:
    sim = running_cluster({"n1": 8}, {"job": {}})
    assert sim.incident("n1", (M.STATISTICAL_MONITORING, K.DEGRADATION), task="job") == []
    assert sim.phase("job") is TaskPhase.RUNNING


def test_sev1_on_an_idle_node_isolates_it_until_undrained() -> None:
    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {"min_gpus": 8}})
    acts = sim.incident("n2", (M.EXCEPTION_PROPAGATION, K.NVLINK_ERROR))
    assert one(acts, IsolateNode).node == "n2"
    sim.confirm_all(acts)
    assert sim.gpus("job") == {"n1": 8}
    assert sim.join("n2") and sim.state.nodes["n2"].status is NodeState.UP  # repaired node re-joins
    acts = sim.incident("n2", SEV1_KIND)
    sim.confirm_all(acts)
    assert sim.feed(NodeUndrained(ts=sim.ts(), node="n2"))
    assert sum(sim.gpus("job").values()) == 16


@pytest.mark.parametrize("order", ["isolated, then lost", "lost, then a late sev1"])
def test_an_isolation_outlives_the_node_being_lost_and_registering_again(order: str) -> None:
    """A node isolated for a sev1 whose agent's lease then expired became LOST, so its agent's next
    registration (``causes.rejoin``) put it back in service and tasks were placed on the faulty GPUs;
    a sev1 reported after the loss was dropped the same way. Now it stays isolated either way until an
    operator undrains it."""
    from coordinator import causes

    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {"min_gpus": 8}})
    faulty = "n2"
    lost = NodeLost(ts=sim.ts(), node=faulty, reason="agent lease expired")
    if order == "isolated, then lost":
        sim.confirm_all(sim.incident(faulty, SEV1_KIND))
        sim.feed(lost)
    else:
        sim.feed(lost)
        sim.confirm_all(sim.incident(faulty, SEV1_KIND))
    assert sim.state.nodes[faulty].status is NodeState.ISOLATED
    assert causes.rejoin(faulty, 8, sim.state, sim.ts()) is None  # its agent registers again: not back
    sim.feed(NodeUndrained(ts=sim.ts(), node=faulty))
    assert sim.state.nodes[faulty].status is not NodeState.ISOLATED
    joined = causes.rejoin(faulty, 8, sim.state, sim.ts())
    assert joined is not None
    sim.feed(joined)
    assert sim.state.nodes[faulty].status is NodeState.UP


def test_drained_node_moves_tasks_without_a_fault_and_survives_agent_restarts() -> None:
    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {}})
    gen = sim.state.tasks["job"].generation
    acts = sim.feed(NodeDrained(ts=sim.ts(), node="n1"))  # the store's node: the store moves, in place
    shrink = one(acts, ResizeInPlace)
    assert shrink.placement.keys() == {"n2"} and shrink.store_node == "n2" and shrink.leaving == tuple(range(8))
    assert not only(acts, IsolateNode) and not only(acts, Assign)
    sim.progress("job", 50)
    assert sim.state.tasks["job"].restarts == 0 and sim.phase("job") is TaskPhase.RUNNING
    assert sim.join("n1") == []  # still drained
    acts = sim.feed(NodeUndrained(ts=sim.ts(), node="n1"))
    grow = one(acts, ResizeInPlace)
    assert grow.generation == gen and len(grow.members) == 16 and grow.joiners == tuple(range(8))


def test_an_operators_drain_survives_the_node_being_lost_and_coming_back() -> None:
    """Drained nodes come back only by NodeUndrained. A drained node that was lost (its lease expired)
    was LOST, and its NodeJoined put it back in service with tasks placed on it; now the drain (and
    its reason) comes back with it, through a JSON round trip of the state, and also for a drain of a
    node already lost."""
    sim = Sim()
    sim.join("n0")
    sim.join("n1")
    sim.feed(NodeDrained(ts=sim.ts(), node="n0", reason="bad fan"))
    sim.feed(NodeLost(ts=sim.ts(), node="n0", reason="agent lease expired"))
    assert sim.state.nodes["n0"].status is NodeState.LOST
    sim.state = CoreState.from_dict(json.loads(json.dumps(sim.state.to_dict())))
    sim.join("n0")
    sim.submit("a", min_gpus=8, max_gpus=16)
    assert (sim.state.nodes["n0"].status, sim.state.nodes["n0"].reason) == (NodeState.DRAINED, "bad fan")
    assert "n0" not in sim.state.tasks["a"].placement
    sim.feed(NodeLost(ts=sim.ts(), node="n1", reason="agent lease expired"))
    sim.feed(NodeDrained(ts=sim.ts(), node="n1"))  # drained while lost
    sim.join("n1")
    assert sim.state.nodes["n1"].status is NodeState.DRAINED and not sim.state.tasks["a"].placement
    sim.feed(NodeUndrained(ts=sim.ts(), node="n0"))
    assert sim.state.nodes["n0"].status is NodeState.UP and sim.gpus("a") == {"n0": 8}


def test_cancel_stops_the_task_and_frees_its_gpus() -> None:
    sim = running_cluster({"n1": 8}, {"a": {"min_gpus": 4}, "b": {"min_gpus": 4}})
    acts = sim.feed(TaskCancelled(ts=sim.ts(), task="a"))
    stop = one(acts, StopTask, "a")
    assign = one(acts, Assign, "b")
    assert acts.index(stop) < acts.index(assign)
    assert assign.world_size == 8


def test_higher_weight_task_preempts_and_stop_precedes_assign() -> None:
    sim = running_cluster({"n1": 8}, {"low": {"min_gpus": 8, "weight": 0.5}})
    acts = sim.submit("high", min_gpus=8, weight=2.0)
    stop, assign = one(acts, StopTask, "low"), one(acts, Assign, "high")
    assert acts.index(stop) < acts.index(assign)
    assert sim.phase("low") is TaskPhase.PENDING
    sim.feed(TaskFinished(ts=sim.ts(), task="high"))
    assert sim.phase("low") is TaskPhase.RECONFIGURING


def test_resubmitting_an_active_task_is_refused() -> None:
    sim = running_cluster({"n1": 8}, {"job": {}})
    acts = sim.submit("job")
    assert "already" in one(acts, Alert).message


def test_tensor_parallel_groups_stay_inside_nodes() -> None:
    sim = running_cluster({"n1": 8, "n2": 8, "n3": 8}, {"tp": {"tp_size": 4, "min_gpus": 8}, "dp": {}})
    for node, ranks in sim.state.tasks["tp"].placement.items():
        assert len(ranks) % 4 == 0 and ranks == list(range(ranks[0], ranks[0] + len(ranks))), node
        assert ranks[0] % 4 == 0
    acts = sim.feed(NodeLost(ts=sim.ts(), node="n1", reason="power"))
    for a in only(acts, Assign):
        if a.task == "tp":
            assert all(len(r) % 4 == 0 and r[0] % 4 == 0 for r in a.placement.values())


def test_a_task_whose_tp_fits_no_usable_node_does_not_starve_the_others() -> None:
    """One 8-GPU node and three 4-GPU nodes; a TP=8 task on the 8-GPU node, an elastic TP=1 task on the
    rest. Once the 8-GPU node was lost the TP=8 task's 8 GPUs could not be placed, and the core lowered
    the budget of every task until they could: the other task got 7 of 12 usable GPUs. Now a task is
    offered only what whole TP groups of it fit the usable nodes: the other gets all 12, it waits."""
    sim = Sim()
    sim.join("n0", gpus=8)
    for n in ("n1", "n2", "n3"):
        sim.join(n, gpus=4)
    sim.submit("big", tp_size=8, min_gpus=8, max_gpus=8)
    sim.submit("small")
    assert sum(len(r) for r in sim.state.tasks["big"].placement.values()) == 8
    assert sum(len(r) for r in sim.state.tasks["small"].placement.values()) == 12
    actions = sim.feed(NodeLost(ts=sim.ts(), node="n0", reason="lease expired"))
    assert not [a for a in only(actions, Alert) if "left idle" in a.message]
    assert sum(len(r) for r in sim.state.tasks["small"].placement.values()) == 12
    big = sim.state.tasks["big"]
    assert not big.placement and "TP groups of 8 inside one node; the usable nodes hold 0" in big.reason, big.reason


SMALL_MODEL = {"num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 2048,
               "vocab_size": 50000, "global_batch_size": 1024}


def test_waf_plan_on_a_mixed_node_cluster_does_not_leave_most_gpus_idle() -> None:
    """The same with the WAF planner, on one 8-GPU and twenty 4-GPU nodes: it planned more TP=8 groups
    than the one 8-GPU node holds, and the budget loop gave the elastic task 8 GPUs of 88 (72 idle).
    Now the TP=8 task is offered at most the 8 that fit, and the other task the rest it can run on."""
    from coordinator.allocation import WafAllocator

    sim = Sim(core=DecisionCore(allocator=WafAllocator()))
    sim.join("n0", gpus=8)
    for i in range(20):
        sim.join(f"m{i:02d}", gpus=4)
    sim.submit("big", tp_size=8, min_gpus=8, weight=2.0, model=SMALL_MODEL)
    actions = sim.submit("small", model=SMALL_MODEL)
    assert not [a for a in only(actions, Alert) if "left idle" in a.message]
    big = sum(len(r) for r in sim.state.tasks["big"].placement.values())
    small = sum(len(r) for r in sim.state.tasks["small"].placement.values())
    # big can only ever hold n0's 8 GPUs; small (DP a divisor of 1024) fits 64 of the other 80
    assert (big, small) == (8, 64)


def test_gpus_no_tp_group_can_use_cost_no_planner_runs() -> None:
    """TP=8 tasks on 8-GPU nodes, a few of which registered 7 GPUs (one fell off the bus): the core
    offered the planner the total, then one GPU less at a time until placement succeeded, a planner
    run per GPU (~430 runs, 28 s a decision at 512 nodes). The GPUs no whole TP group can use are now
    left out of the budget at once: one run, the same plan."""
    from coordinator.allocation import WafAllocator

    runs = 0

    class Counting(WafAllocator):
        def allocate(self, *args: Any, **kwargs: Any) -> dict[str, int]:
            nonlocal runs
            runs += 1
            return super().allocate(*args, **kwargs)

    model = {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "seq_length": 2048,
             "vocab_size": 51200, "global_batch_size": 5040, "micro_batch_size": 1}
    sim = Sim(core=DecisionCore(allocator=Counting()))
    for i in range(64):
        sim.join(f"n{i:02d}", gpus=7 if i < 8 else 8)
    sim.submit("a", tp_size=8, min_gpus=8, model=model)
    runs = 0
    sim.submit("b", tp_size=8, min_gpus=8, model=model)
    assert runs == 1
    assert {t: sum(len(r) for r in e.placement.values()) for t, e in sim.state.tasks.items()} == {"a": 224, "b": 224}
    # the 7th GPU of a short node is no plan's to use: nothing was cut, nothing to alert (it alerted on
    # every re-plan once the budget started below the total)
    assert not [a for a in only(sim.join("n99", gpus=8), Alert) if "left idle" in a.message]


# --- persistence and determinism ---------------------------------------------------------------------


def _busy_history(seed: int) -> Sim:
    """A random but reproducible mix of events touching most of the machine."""
    rng = random.Random(seed)
    sim = running_cluster(
        {"n1": 8, "n2": 8, "n3": 8, "n4": 4},
        {"a": {"min_gpus": 4}, "b": {"tp_size": 2, "min_gpus": 4, "weight": 1.5}},
    )
    for step in range(60):
        active = [t for t, e in sorted(sim.state.tasks.items()) if e.placement]
        roll = rng.random()
        if roll < 0.3 and active:
            task = rng.choice(active)
            node = rng.choice(sorted(sim.state.tasks[task].placement))
            kind = rng.choice([SEV3_KIND, SEV2_KIND, SEV2_KIND, SEV1_KIND])
            sim.incident(node, kind, task=task)
        elif roll < 0.6:
            outstanding = [e.outstanding for e in sim.state.tasks.values() if e.outstanding]
            if outstanding:
                o = rng.choice(outstanding)
                if rng.random() < 0.8:
                    sim.feed(ActionSucceeded(ts=sim.ts(), action_id=o.action_id))
                else:
                    sim.feed(ActionFailed(ts=sim.ts(), action_id=o.action_id, reason="x"))
        elif roll < 0.7:
            down = [n for n, e in sorted(sim.state.nodes.items()) if e.status is not NodeState.UP]
            if down:
                sim.join(rng.choice(down))
        elif roll < 0.8 and active:
            sim.progress(rng.choice(active), step * 10)
        elif roll < 0.85:
            sim.submit(f"t{step}", min_gpus=rng.choice([1, 2, 8]))
        elif roll < 0.9 and active:
            sim.feed(TaskFinished(ts=sim.ts(), task=rng.choice(active)))
        else:
            sim.feed(Tick(ts=sim.ts(rng.choice([5.0, 60.0, 400.0]))))
    return sim


def test_state_round_trips_through_json_and_resumes_identically() -> None:
    sim = _busy_history(1)
    text = json.dumps(sim.state.to_dict())
    restored = CoreState.from_dict(json.loads(text))
    assert restored == sim.state
    # a coordinator restarted from the persisted state decides exactly as the old one would have
    follow: list[Event] = [NodeJoined(ts=sim.t + 1, node="n9", gpus=8), Tick(ts=sim.t + 1000)]
    a = Sim(core=sim.core)
    a.state = sim.state
    b = Sim(core=sim.core)
    b.state = restored
    for ev in follow:
        assert a.feed(ev) == b.feed(ev)


def test_same_events_give_same_actions() -> None:
    history = _busy_history(7)
    one_run, other_run = Sim(), Sim()
    for ev in history.events:
        assert one_run.feed(ev) == other_run.feed(ev)
    assert one_run.state == other_run.state == history.state


def test_handle_does_not_modify_its_input_state() -> None:
    sim = running_cluster({"n1": 8}, {"job": {}})
    before = json.dumps(sim.state.to_dict(), sort_keys=True)
    sim.core.handle(sim.state, NodeLost(ts=100.0, node="n1", reason="gone"))
    assert json.dumps(sim.state.to_dict(), sort_keys=True) == before


def test_events_and_actions_round_trip_through_json() -> None:
    sim = _busy_history(3)
    assert sim.events
    for ev in sim.events:
        assert from_dict(json.loads(json.dumps(to_dict(ev)))) == ev
    replay = Sim()
    for ev in sim.events:
        for action in replay.feed(ev):
            assert from_dict(json.loads(json.dumps(to_dict(action)))) == action


def test_malformed_records_raise_invalid_record() -> None:
    with pytest.raises(InvalidRecord, match="unknown type"):
        from_dict({"type": "Explode"})
    with pytest.raises(InvalidRecord):
        from_dict({"type": "Tick", "ts": 1.0, "bogus": 2})
    with pytest.raises(InvalidRecord, match="decision state"):
        CoreState.from_dict({"now": 0})


def test_an_event_or_action_field_of_the_wrong_type_is_refused() -> None:
    """``{"type": "Tick", "ts": "x"}`` decoded and raised a TypeError in the core's handle; now every
    field of a record is checked against its type, in one line."""
    for bad, field in (({"type": "Tick", "ts": "x"}, "ts"),
                       ({"type": "NodeJoined", "ts": 1.0, "node": "n0", "gpus": "8"}, "gpus"),
                       ({"type": "ProgressMade", "ts": 1.0, "task": "t", "step": 1, "joined": ["a"]}, "joined"),
                       ({"type": "Assign", "action_id": "a1", "task": "t", "generation": 1,
                         "placement": {"n0": [0, "1"]}, "world_size": 2}, "placement")):
        with pytest.raises(InvalidRecord, match=f"^decision record {bad['type']}: {field}: bad value [^\n]*$"):
            from_dict(bad)


def test_a_damaged_node_gpu_count_in_the_state_is_refused() -> None:
    """A negative or huge ``nodes.*.gpus`` loaded and misled the leader later; now it is refused like
    any malformed state, in one line, with the bound NodeInfo keeps to."""
    for gpus in (-3, 10**9):
        data = CoreState(nodes={"n0": NodeEntry(8)}).to_dict()
        data["nodes"]["n0"]["gpus"] = gpus  # type: ignore[index]
        with pytest.raises(InvalidRecord, match=r"nodes\.n0\.gpus: .* is not a GPU count in \[0, 1024\]") as err:
            CoreState.from_dict(data)
        assert "\n" not in str(err.value)


def test_a_state_entry_whose_key_is_not_its_specs_name_is_refused_on_load() -> None:
    """A task entry stored under one name whose spec names another (a damaged or hand-edited
    state/tasks/<name>) loaded, and every re-plan then raised KeyError in the core (it finds entries by
    spec name): the leader dropped every later input. Now it is refused like any malformed state."""
    sim = running_cluster({"n0": 8}, {"a": {}})
    data = json.loads(json.dumps(sim.state.to_dict()))
    data["tasks"]["b"] = data["tasks"].pop("a")  # the entry of task "a" under the key "b"
    with pytest.raises(InvalidRecord, match=r"^decision state: tasks\.b\.spec\.name: 'a' is not the entry's name; "
                                            r"[^\n]*$"):
        CoreState.from_dict(data)


def test_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="max_reattempts"):
        DecisionSettings(max_reattempts=-1)
    with pytest.raises(ConfigError, match="restart_deadline_s"):
        DecisionSettings(restart_deadline_s=0)


class _BrokenAllocator:
    def allocate(
        self, tasks: Any, healthy_gpus: int, gpus_per_node: int, current: Any, faulted: Any
    ) -> dict[str, int]:
        return {t.name: healthy_gpus + 1 for t in tasks}


def test_an_allocator_breaking_its_contract_is_refused() -> None:
    sim = Sim(core=DecisionCore(allocator=_BrokenAllocator()))
    sim.join("n1")
    with pytest.raises(PermanentError, match="allocator"):
        sim.submit("job")


def test_a_pending_reason_never_contradicts_itself() -> None:
    """Issue 19 item 16: "needs at least 6, 6 usable" after an undrain; the reason must say who holds the GPUs."""
    sim = running_cluster({"n1": 8}, {"big": {"min_gpus": 8, "weight": 2.0}})
    sim.submit("small", min_gpus=8)
    reason = sim.state.tasks["small"].reason
    assert "the plan gives the 8 usable to big 8" in reason, reason
    sim = running_cluster({"n1": 4}, {})
    sim.submit("wide", min_gpus=8)
    assert "only 4 usable" in sim.state.tasks["wide"].reason


def test_a_peer_dying_during_a_restart_widens_it_and_the_restarted_rank_dying_again_does_not() -> None:
    """Issue #19 item 1: during a restart of rank 1 on n2, rank 0's process on n1 died too. The old
    table merged that sev2 into the restart, so rank 0 was never relaunched; the task sat in
    `restarting` until the deadline isolated a healthy node. A dead process is now relaunched by
    widening the restart; the rank the restart already relaunches is still merged (its own restart
    failing is the deadline's and the progress rule's business)."""
    sim = Sim(DecisionSettings(max_restarts_without_progress=3))
    sim.join("n1", gpus=1)
    sim.join("n2", gpus=1)
    sim.submit("job", min_gpus=2)
    sim.feed(ActionSucceeded(ts=sim.ts(), action_id=sim.outstanding("job")))
    sim.progress("job", 5)
    r0, r1 = sim.state.tasks["job"].ranks_on("n1")[0], sim.state.tasks["job"].ranks_on("n2")[0]
    first = sim.incident("n2", SEV2_KIND, task="job", rank=r1)
    assert [(type(a), a.node, a.ranks) for a in first if isinstance(a, RestartRanks)] == [(RestartRanks, "n2", (r1,))]
    widened = sim.incident("n1", SEV2_KIND, task="job", rank=r0)
    restarts = [a for a in widened if isinstance(a, RestartRanks)]
    assert [(a.node, a.ranks) for a in restarts] == [("n1", (r0,))]
    assert restarts[0].restart_epoch > first[0].restart_epoch  # type: ignore[union-attr]
    assert sim.phase("job") is TaskPhase.RESTARTING
    assert sim.state.tasks["job"].relaunching == {"n1": [r0], "n2": [r1]}
    assert sim.state.tasks["job"].restarts == 1  # one burst of deaths spends one restart of the budget
    assert [a for a in sim.incident("n2", SEV2_KIND, task="job", rank=r1) if isinstance(a, RestartRanks)] == []
    sim.progress("job", 9)
    assert sim.phase("job") is TaskPhase.RUNNING and sim.state.tasks["job"].relaunching == {}


def test_the_first_relaunch_of_a_widened_restart_dying_fails_the_restart_on_its_node() -> None:
    """Rank 0 (n1) is restarted at epoch 1, then rank 2 (n2) dies and widens the restart to epoch 2;
    the executor rewrites only n2's record, so rank 0's new process runs at epoch 1. When it died at its
    start, it was neither the widened epoch's nor a peer's: merged, nothing relaunched it, and at the
    deadline the restart isolated n2, whose relaunch was fine."""
    sim = running_cluster({"n1": 2, "n2": 2}, {"job": {"min_gpus": 2}}, Sim())
    sim.progress("job", 5)
    gen = sim.state.tasks["job"].generation
    one(sim.incident("n1", SEV2_KIND, task="job", rank=0, generation=gen, step=5), RestartRanks, "job")
    one(sim.incident("n2", SEV2_KIND, task="job", rank=2, generation=gen, step=5), RestartRanks, "job")
    assert sim.state.tasks["job"].restart_epoch == 2
    acts = sim.incident("n1", SEV2_KIND, task="job", rank=0, generation=gen, step=5, restart_epoch=1)
    assert one(acts, IsolateNode).node == "n1"
    assert sim.transitions[0].trigger is Trigger.RESTART_DIED


def test_a_resumed_state_gives_every_outstanding_action_until_the_earliest_deadline_and_copies() -> None:
    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {"min_gpus": 16}})
    sim.progress("job", 10)
    restart = one(sim.incident("n1", SEV2_KIND, task="job", rank=sim.state.tasks["job"].ranks_on("n1")[0]),
                  RestartRanks)
    before = sim.state.tasks["job"].outstanding
    assert before is not None and before.action_id == restart.action_id
    later = sim.state.resumed(before.deadline + 60)
    moved = later.tasks["job"].outstanding
    assert moved is not None and moved.deadline == before.deadline + 60 and moved.action_id == before.action_id
    assert sim.state.tasks["job"].outstanding is before and before.deadline < moved.deadline  # a copy
    assert sim.state.resumed(0.0).tasks["job"].outstanding == before  # never brought forward
    core = DecisionCore(DecisionSettings())
    assert only(core.handle(sim.state, Tick(ts=before.deadline + 1))[1], IsolateNode)  # expired: escalated
    assert not only(core.handle(later, Tick(ts=before.deadline + 1))[1], IsolateNode)


def test_gpus_left_idle_are_alerted_once_per_situation() -> None:
    """A 2-GPU and a 6-GPU node, a TP=4 and a TP=3 task: no plan cuts the 8 GPUs into whole groups of
    both, 2 stay idle. Every decision that re-planned that same situation (here: weight updates) posted
    the alert again; now it is posted once per (task set, idle count), again when that changes, and a
    new leader (the state through its codec) does not repeat it."""
    def idle(actions: Sequence[Action]) -> list[str]:
        return [a.message for a in only(actions, Alert) if "left idle" in a.message]

    sim = Sim()
    sim.join("n0", gpus=2)
    sim.join("n1", gpus=6)
    sim.confirm_all(sim.submit("t0", tp_size=4, min_gpus=4, max_gpus=8))
    assert idle(sim.submit("t1", tp_size=3, min_gpus=3, max_gpus=6)) == [
        "2 GPUs left idle: the plan could not be cut into whole TP groups"]
    for weight in (1.5, 1.2):
        acts = sim.feed(TaskUpdated(ts=sim.ts(), spec=spec("t0", tp_size=4, min_gpus=4, max_gpus=8, weight=weight)))
        assert not idle(acts), "the same situation re-planned"
    assert idle(sim.join("n2", gpus=1)) == ["3 GPUs left idle: the plan could not be cut into whole TP groups"]
    sim.state = CoreState.from_dict(json.loads(json.dumps(sim.state.to_dict())))
    acts = sim.feed(TaskUpdated(ts=sim.ts(), spec=spec("t0", tp_size=4, min_gpus=4, max_gpus=8, weight=1.0)))
    assert not idle(acts)
    assert idle(sim.submit("t2", tp_size=8, min_gpus=8)), "another task set: alerted again"
