"""The contract events the daemon wires (issue 12 item 3, core side): TaskFinished, NodeLost,
ActionSucceeded / ActionFailed, and the helpers that map an agent's result to action ids."""

from __future__ import annotations

import json

from coordinator.decision import (
    ActionFailed,
    ActionSucceeded,
    Alert,
    Assign,
    CoreState,
    FailureCause,
    IsolateNode,
    MarkTaskFailed,
    NodeJoined,
    NodeLost,
    NodeState,
    Reattempt,
    ResizeInPlace,
    RestartRanks,
    StopTask,
    TaskFinished,
    TaskPhase,
    Tick,
    from_dict,
    to_dict,
)
from tests.coordinator.test_decision import SEV2_KIND, SEV3_KIND, Sim, one, only, running_cluster
from tests.coordinator.test_executor import Driven
from unicron.kernel.types import AssignmentResult, TaskResult

P = TaskPhase


def _result(
    node: str, tasks: dict[str, tuple[int, int, int]], ok: bool = True, detail: str = "applied"
) -> AssignmentResult:
    """An agent's result: task -> (generation, restart_epoch, regroup_epoch)."""
    return AssignmentResult(
        node=node,
        revision=7,
        ok=ok,
        detail=detail,
        tasks={t: TaskResult(generation=g, restart_epoch=r, regroup_epoch=e, ranks={}) for t, (g, r, e) in tasks.items()},
    )


def _counters(sim: Sim, task: str) -> tuple[int, int, int]:
    e = sim.state.tasks[task]
    return e.generation, e.restart_epoch, e.regroup_epoch


# --- TaskFinished ------------------------------------------------------------------------------------


def test_finished_task_releases_its_gpus_to_a_pending_task_in_the_same_decision() -> None:
    sim = running_cluster({"n1": 8}, {"first": {"min_gpus": 8}})
    sim.submit("second", min_gpus=8)
    assert sim.phase("second") is P.PENDING  # no room while "first" runs
    acts = sim.feed(TaskFinished(ts=sim.ts(), task="first"))
    assert sim.phase("first") is P.FINISHED
    assert sim.state.tasks["first"].placement == {} and sim.state.tasks["first"].outstanding is None
    assign = one(acts, Assign, "second")
    assert assign.placement == {"n1": tuple(range(8))}
    assert sim.phase("second") is P.RECONFIGURING
    assert not only(acts, StopTask)  # a finished task's ranks have exited: nothing to stop


def test_finished_during_a_recovery_still_releases_and_later_results_are_ignored() -> None:
    sim = running_cluster({"n1": 8}, {"first": {"min_gpus": 8}})
    restart = one(sim.incident("n1", SEV2_KIND, task="first", rank=1), RestartRanks)
    sim.submit("second", min_gpus=8)
    acts = sim.feed(TaskFinished(ts=sim.ts(), task="first"))
    assert one(acts, Assign, "second")
    assert sim.fail(restart) == []  # the restart's late failure must not isolate the node
    assert sim.state.nodes["n1"].status is NodeState.UP


# --- NodeLost ----------------------------------------------------------------------------------------


def test_node_lost_is_a_sev1_every_task_on_it_moves_and_the_node_stays_out_until_it_rejoins() -> None:
    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {"min_gpus": 8}})
    assert sim.gpus("job") == {"n1": 8, "n2": 8}
    restart = one(sim.incident("n1", SEV2_KIND, task="job"), RestartRanks)  # a recovery under way
    acts = sim.feed(NodeLost(ts=sim.ts(), node="n1", reason="lease expired"))
    assert sim.state.nodes["n1"].status is NodeState.LOST
    assert one(acts, Alert).node == "n1"
    assert not only(acts, IsolateNode)  # nothing to tell a node that is gone; its status keeps it out
    # in place: the restart under way was on the node now gone
    assert one(acts, ResizeInPlace, "job").placement.keys() == {"n2"}
    assert any(t.task == "job" and t.trigger.value == "sev1" for t in sim.transitions)
    assert sim.ok(restart) == []  # superseded by the reconfiguration
    sim.ok(one(acts, ResizeInPlace, "job"))
    assert sim.join("n3") and sim.state.nodes["n1"].status is NodeState.LOST  # not back by itself
    sim.join("n1")
    assert sim.state.nodes["n1"].status.value == "up"


def test_a_node_that_rejoins_with_fewer_gpus_leaves_no_rank_on_a_gpu_it_no_longer_has() -> None:
    """n0 (8 GPUs) runs ``a`` on GPUs 0-3 and ``b`` on 4-7; its agent re-registers with 4 (one fell off
    the bus). The plan keeps ``b`` there at the same count, so b got no action and its record went on
    naming GPUs 4-7 of a 4-GPU node; now every task on a node that came back smaller is relaunched."""
    sim = Driven()
    sim.join("n0", gpus=8)
    sim.submit("a", min_gpus=4, max_gpus=4)
    sim.confirm_outstanding()
    sim.submit("b", min_gpus=4, max_gpus=4, weight=2.0)
    sim.confirm_outstanding()
    assert sim.gpus_on("n0") == {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}
    generation = sim.state.tasks["b"].generation
    acts = sim.feed(NodeJoined(ts=sim.ts(), node="n0", gpus=4))
    assert sim.state.nodes["n0"].gpus == 4
    assert one(acts, Assign, "b").generation == generation + 1 and one(acts, StopTask).task == "a"
    assert sim.gpus_on("n0") == {"b": [0, 1, 2, 3]}
    assert sim.state.tasks["b"].reason == "node n0 re-registered with 4 GPUs (had 8)"


def test_node_lost_twice_or_unknown_changes_nothing() -> None:
    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {"min_gpus": 8}})
    sim.feed(NodeLost(ts=sim.ts(), node="n2", reason="gone"))
    assert sim.feed(NodeLost(ts=sim.ts(), node="n2", reason="gone")) == []
    assert sim.feed(NodeLost(ts=sim.ts(), node="never-joined", reason="gone")) == []


# --- ActionSucceeded / ActionFailed ------------------------------------------------------------------


def test_failed_reattempt_escalates_at_once_to_a_restart() -> None:
    sim = running_cluster({"n1": 8}, {"job": {}})
    r = one(sim.incident("n1", SEV3_KIND, task="job", rank=2), Reattempt)
    acts = sim.feed(ActionFailed(ts=sim.ts(0.1), action_id=r.action_id, reason="regroup refused", node="n1"))
    restart = one(acts, RestartRanks)  # the node's ranks: a refused regroup may have stuck its peers
    assert restart.node == "n1" and 2 in restart.ranks
    assert sim.phase("job") is P.RESTARTING


def test_failed_restart_isolates_the_node_at_once_and_reconfigures() -> None:
    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {"min_gpus": 8}})
    restart = one(sim.incident("n1", SEV2_KIND, task="job"), RestartRanks)
    acts = sim.feed(ActionFailed(ts=sim.ts(0.1), action_id=restart.action_id, reason="spawn failed"))
    assert one(acts, IsolateNode).node == "n1"
    assert one(acts, ResizeInPlace, "job").placement.keys() == {"n2"}


def test_assign_whose_command_cannot_start_fails_the_task_and_isolates_nothing() -> None:
    sim = Sim()
    sim.join("n1")
    sim.join("n2")
    broken = one(sim.submit("broken", min_gpus=16), Assign)
    sim.submit("waiting", min_gpus=8)
    assert sim.phase("waiting") is P.PENDING
    acts = sim.feed(
        ActionFailed(
            ts=sim.ts(),
            action_id=broken.action_id,
            reason="FileNotFoundError: no such file: 'pretrain_gpt.py'",
            node="n1",
            cause=FailureCause.TASK,
        )
    )
    failed = one(acts, MarkTaskFailed, "broken")
    assert "FileNotFoundError" in failed.reason and failed.reason.startswith(f"assign {broken.action_id}")
    assert one(acts, StopTask, "broken")
    assert not only(acts, IsolateNode)
    assert {n.status for n in sim.state.nodes.values()} == {NodeState.UP}
    assert sim.phase("broken") is P.FAILED
    assert one(acts, Assign, "waiting")  # its GPUs go to the pending task in the same decision
    assert sim.fail(broken) == []  # further results of the failed task change nothing


def test_restart_whose_command_cannot_start_fails_the_task_without_isolating_the_node() -> None:
    sim = running_cluster({"n1": 8}, {"job": {}})
    restart = one(sim.incident("n1", SEV2_KIND, task="job"), RestartRanks)
    acts = sim.feed(
        ActionFailed(ts=sim.ts(), action_id=restart.action_id, reason="exec failed", cause=FailureCause.TASK)
    )
    assert one(acts, MarkTaskFailed, "job")
    assert not only(acts, IsolateNode) and sim.state.nodes["n1"].status is NodeState.UP


def test_an_assignment_that_keeps_failing_ends_in_a_failed_task_not_a_loop() -> None:
    sim = Sim()
    sim.join("n1")
    acts = sim.submit("job")
    for _ in range(20):
        if sim.phase("job") is P.FAILED:
            break
        acts = sim.fail(one(acts, Assign, "job"))  # no node named: nothing isolated, re-planned
    assert sim.phase("job") is P.FAILED
    assert one(acts, MarkTaskFailed, "job").reason.startswith("no progress across 3 restarts")
    assert sim.state.nodes["n1"].status is NodeState.UP


def test_a_multi_node_assignment_is_confirmed_once_every_node_reported() -> None:
    sim = Sim()
    sim.join("n1")
    sim.join("n2")
    assign = one(sim.submit("job", min_gpus=16), Assign)
    assert sim.state.tasks["job"].outstanding is not None
    assert sim.state.tasks["job"].outstanding.waiting == ["n1", "n2"]
    sim.feed(ActionSucceeded(ts=sim.ts(), action_id=assign.action_id, node="n1"))
    assert sim.phase("job") is P.RECONFIGURING
    sim.feed(ActionSucceeded(ts=sim.ts(), action_id=assign.action_id, node="n1"))  # a repeat: still waiting
    assert sim.phase("job") is P.RECONFIGURING
    sim.feed(ActionSucceeded(ts=sim.ts(), action_id=assign.action_id, node="n2"))
    assert sim.phase("job") is P.RUNNING


# --- JSON --------------------------------------------------------------------------------------------


def test_new_fields_round_trip_and_old_states_still_load() -> None:
    failed = ActionFailed(ts=1.0, action_id="a3", reason="x", node="n1", cause=FailureCause.TASK)
    assert to_dict(failed)["cause"] == "task"
    assert from_dict(json.loads(json.dumps(to_dict(failed)))) == failed
    ok = ActionSucceeded(ts=1.0, action_id="a3", node="n2")
    assert from_dict(json.loads(json.dumps(to_dict(ok)))) == ok
    sim = Sim()
    sim.join("n1")
    sim.join("n2")
    sim.submit("job", min_gpus=16)
    data = json.loads(json.dumps(sim.state.to_dict()))
    assert CoreState.from_dict(data) == sim.state
    del data["tasks"]["job"]["outstanding"]["waiting"]  # written before per-node confirmation existed
    old = CoreState.from_dict(data)
    o = old.tasks["job"].outstanding
    assert o is not None and o.waiting == []
    # written before a restart's first epoch was kept: a restart under way is judged by its latest epoch,
    # as then (a default of 0 would take every peer's death for the restart's own)
    data["tasks"]["job"]["restart_epoch"] = 3
    del data["tasks"]["job"]["relaunch_epoch"]
    assert CoreState.from_dict(data).tasks["job"].relaunch_epoch == 3


def _failed_reconcile(sim: Sim, node: str, task: str) -> list[ActionFailed]:
    """What ``causes.outcomes`` makes of ``node``'s agent failing to reconcile ``task``'s record."""
    from coordinator import causes

    e = sim.state.tasks[task]
    tr = TaskResult(generation=e.generation, restart_epoch=e.restart_epoch, regroup_epoch=e.regroup_epoch,
                    membership_epoch=e.membership_epoch, ranks={str(r): "exited" for r in e.ranks_on(node)})
    res = AssignmentResult(node=node, revision=9, ok=False, detail="reconcile failed: spawn error", tasks={task: tr})
    out = causes.outcomes(res, {node: res}, sim.state, sim.ts())
    assert out and all(isinstance(o, ActionFailed) for o in out)
    return [o for o in out if isinstance(o, ActionFailed)]


def test_a_whole_task_restart_that_fails_on_another_node_isolates_neither() -> None:
    """A failed reconcile names no node, and the core blamed the node the action named instead: a
    torchrun-style restart (fault seen on n1) whose relaunch failed on n2 isolated n1. Now a failure on
    a node the action is not for blames none (the restart budget ends a task that cannot run); one on
    the node a restart of ranks is for still isolates it."""
    from coordinator.decision import RestartTask

    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {"min_gpus": 16, "recovery": "restart",
                                                        "command": ["torchrun", "x.py"]}})
    one(sim.incident("n1", SEV2_KIND, task="job"), RestartTask)
    acts = [a for ev in _failed_reconcile(sim, "n2", "job") for a in sim.feed(ev)]
    assert not only(acts, IsolateNode)
    assert {n.status for n in sim.state.nodes.values()} == {NodeState.UP}

    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {"min_gpus": 8}})
    one(sim.incident("n1", SEV2_KIND, task="job"), RestartRanks)
    acts = [a for ev in _failed_reconcile(sim, "n1", "job") for a in sim.feed(ev)]
    assert one(acts, IsolateNode).node == "n1"


def test_a_widened_restart_that_misses_its_deadline_isolates_the_first_faults_node() -> None:
    """A rank on n1 dies, then a peer on n2 dies in the collective it broke: the restart is widened to
    n2. The widening took the tracked node with it, so n1's relaunch never coming back isolated n2
    (healthy) and left n1 in service. Now the first fault's node is the one isolated."""
    sim = running_cluster({"n1": 8, "n2": 8, "n3": 8}, {"job": {"min_gpus": 16}})
    sim.progress("job", 100)
    placement, gen = sim.state.tasks["job"].placement, sim.state.tasks["job"].generation
    first, peer = sorted(placement)[:2]
    one(sim.incident(first, SEV2_KIND, task="job", rank=placement[first][0], generation=gen), RestartRanks)
    widened = one(sim.incident(peer, SEV2_KIND, task="job", rank=placement[peer][0], generation=gen), RestartRanks)
    assert widened.node == peer  # the peer's ranks are relaunched too
    acts = sim.feed(Tick(ts=sim.ts(130)))
    assert one(acts, IsolateNode).node == first
    # a failed reconcile on the peer's node names no node: the widened restart is for two
    sim2 = running_cluster({"n1": 8, "n2": 8, "n3": 8}, {"job": {"min_gpus": 16}})
    sim2.progress("job", 100)
    one(sim2.incident(first, SEV2_KIND, task="job", rank=placement[first][0], generation=gen), RestartRanks)
    one(sim2.incident(peer, SEV2_KIND, task="job", rank=placement[peer][0], generation=gen), RestartRanks)
    acts = [a for ev in _failed_reconcile(sim2, peer, "job") for a in sim2.feed(ev)]
    assert not only(acts, IsolateNode)
