"""A failed recovery isolates its node on suspicion only (Figure 7's escalation to sev1): a task that
then fails again elsewhere before any progress was the fault (a job crashing on every launch), so the
node returns to service and nothing more is isolated. Before, a crash loop isolated a healthy node
with every escalation until the restart budget ran out (the escalation test's three nodes all ended
isolated), each out of service until an operator undrained it."""

from __future__ import annotations

import pytest

from coordinator import decision as d
from tests.coordinator.test_decision import SEV1_KIND, SEV2_KIND, K, M, Sim, one, only, running_cluster

JOB = "job"
LOST_LINK = (M.NODE_HEALTH, K.LOST_CONNECTION)


def _escalate(sim: Sim) -> list[d.Action]:
    """A rank of ``job`` dies, and the process its restart relaunches dies too: the restart failed."""
    e = sim.state.tasks[JOB]
    node = min(e.placement)
    rank = e.ranks_on(node)[0]
    restart = one(sim.incident(node, SEV2_KIND, task=JOB, rank=rank, generation=e.generation), d.RestartRanks)
    return sim.incident(node, SEV2_KIND, task=JOB, rank=rank, generation=e.generation,
                        restart_epoch=restart.restart_epoch)


def _statuses(sim: Sim) -> dict[str, tuple[str, str]]:
    return {n: (e.status.value, e.suspected_by) for n, e in sim.state.nodes.items()}


def crash_loop(restarts: int = 9) -> Sim:
    sim = running_cluster({"n1": 8, "n2": 8, "n3": 8}, {JOB: {"min_gpus": 8, "max_gpus": 8}},
                          Sim(d.DecisionSettings(max_restarts_without_progress=restarts)))
    sim.progress(JOB, 3)
    return sim


def test_a_failed_restart_isolates_its_node_on_suspicion() -> None:
    sim = crash_loop()
    first = min(sim.state.tasks[JOB].placement)
    acts = _escalate(sim)
    assert one(acts, d.IsolateNode).node == first
    assert _statuses(sim)[first] == ("isolated", JOB)


def test_failing_again_elsewhere_brings_the_node_back_and_isolates_nothing() -> None:
    sim = crash_loop()
    first = min(sim.state.tasks[JOB].placement)
    sim.confirm_all(_escalate(sim))
    second = min(sim.state.tasks[JOB].placement)
    assert second != first
    acts = _escalate(sim)
    assert only(acts, d.IsolateNode) == []
    assert all(status == "up" for status, _ in _statuses(sim).values()), _statuses(sim)
    assert any(f"node {first} back in service" in a.message for a in only(acts, d.Alert))


def test_a_crash_loop_that_spends_its_budget_leaves_no_node_isolated() -> None:
    """With the default budget the crash loop ends in a failed task; the node its first failed restart
    isolated is back once the task failed elsewhere."""
    sim = crash_loop(restarts=d.DecisionSettings().max_restarts_without_progress)
    for _ in range(6):
        if sim.phase(JOB) is d.TaskPhase.FAILED:
            break
        e = sim.state.tasks[JOB]
        if e.phase is d.TaskPhase.RECONFIGURING:  # the new generation crashes at its launch
            node = min(e.placement)
            acts = sim.incident(node, SEV2_KIND, task=JOB, rank=e.ranks_on(node)[0], generation=e.generation)
            restart = one(acts, d.RestartRanks)
            sim.incident(node, SEV2_KIND, task=JOB, rank=restart.ranks[0], generation=e.generation,
                         restart_epoch=restart.restart_epoch)
        else:
            sim.confirm_all(_escalate(sim))
    assert sim.phase(JOB) is d.TaskPhase.FAILED
    assert all(status == "up" for status, _ in _statuses(sim).values()), _statuses(sim)


def test_progress_elsewhere_makes_the_isolation_stand() -> None:
    sim = crash_loop()
    first = min(sim.state.tasks[JOB].placement)
    sim.confirm_all(_escalate(sim))
    sim.progress(JOB, 10)  # the task runs well without the node: the node was at fault
    assert _statuses(sim)[first] == ("isolated", "")
    _escalate(sim)  # a later, unrelated failure of the task leaves it isolated
    assert sim.state.nodes[first].status is d.NodeState.ISOLATED


def test_a_fault_the_node_reports_itself_makes_the_isolation_stand() -> None:
    sim = crash_loop()
    first = min(sim.state.tasks[JOB].placement)
    sim.confirm_all(_escalate(sim))
    sim.incident(first, SEV1_KIND)  # an ECC error of its own
    assert _statuses(sim)[first] == ("isolated", "")
    _escalate(sim)
    assert sim.state.nodes[first].status is d.NodeState.ISOLATED


def test_a_lost_link_leaves_the_suspicion_open() -> None:
    """The coordinator's own word that it lost the node's link (an agent restart, a network blip) says
    nothing of its hardware, as its lease expiring does not: it confirmed the isolation for good, and
    the task failing again elsewhere no longer brought the node back."""
    sim = crash_loop()
    first = min(sim.state.tasks[JOB].placement)
    sim.confirm_all(_escalate(sim))
    sim.incident(first, LOST_LINK)
    assert _statuses(sim)[first] == ("isolated", JOB)
    _escalate(sim)
    assert sim.state.nodes[first].status is d.NodeState.UP


def test_a_task_that_ends_otherwise_leaves_the_isolation_standing() -> None:
    """Cancelled while a node is isolated on its suspicion: nothing showed the task at fault, and a
    later task of the same name must not bring the node back by failing."""
    sim = crash_loop()
    first = min(sim.state.tasks[JOB].placement)
    sim.confirm_all(_escalate(sim))
    sim.feed(d.TaskCancelled(ts=sim.ts(), task=JOB))
    assert _statuses(sim)[first] == ("isolated", "")


def test_a_suspected_node_that_was_drained_comes_back_drained() -> None:
    sim = crash_loop()
    first = min(sim.state.tasks[JOB].placement)
    sim.confirm_all(_escalate(sim))
    sim.feed(d.NodeDrained(ts=sim.ts(), node=first, reason="maintenance"))
    _escalate(sim)
    assert (sim.state.nodes[first].status, sim.state.nodes[first].reason) == (d.NodeState.DRAINED, "maintenance")


def test_an_undrain_clears_the_suspicion() -> None:
    sim = crash_loop()
    first = min(sim.state.tasks[JOB].placement)
    sim.confirm_all(_escalate(sim))
    sim.feed(d.NodeUndrained(ts=sim.ts(), node=first))
    assert _statuses(sim)[first] == ("up", "")


@pytest.mark.parametrize("drained", [False, True])
def test_a_node_back_by_its_node_joined_carries_no_suspicion(drained: bool) -> None:
    """``NodeJoined`` brings an isolated node back (the simulator's repair) as an undrain does: it left
    the mark on a node in service, and the task's next failure elsewhere would take it for one of its
    suspects."""
    sim = crash_loop()
    first = min(sim.state.tasks[JOB].placement)
    sim.confirm_all(_escalate(sim))
    if drained:
        sim.feed(d.NodeDrained(ts=sim.ts(), node=first, reason="maintenance"))
    sim.join(first, 8)
    assert _statuses(sim)[first] == ("drained" if drained else "up", "")


def test_the_suspicion_survives_the_state_codec_and_older_states_load() -> None:
    sim = crash_loop()
    first = min(sim.state.tasks[JOB].placement)
    _escalate(sim)
    raw = sim.state.to_dict()
    assert d.CoreState.from_dict(raw).nodes[first].suspected_by == JOB
    nodes = raw["nodes"]
    assert isinstance(nodes, dict)
    del nodes[first]["suspected_by"]  # written by a coordinator from before it existed
    assert d.CoreState.from_dict(raw).nodes[first].suspected_by == ""


def test_once_the_fault_followed_the_task_no_failure_isolates_a_node_until_it_progresses() -> None:
    """The second failure released the suspected node and cleared its mark, so the third, still without
    progress, found no suspect and isolated its own node again (review reproduction, budget 9)."""
    sim = crash_loop()
    for _ in range(3):
        sim.confirm_all(_escalate(sim))
    assert all(status == "up" for status, _ in _statuses(sim).values()), _statuses(sim)
    sim.progress(JOB, 50)  # progress ends the streak: a failed restart is a suspicion again
    first = min(sim.state.tasks[JOB].placement)
    _escalate(sim)
    assert _statuses(sim)[first] == ("isolated", JOB)


def test_a_failure_that_names_no_node_brings_the_suspected_node_back() -> None:
    """A failed multi-node action blames no node; it is the task failing again all the same, elsewhere."""
    sim = running_cluster({f"n{i}": 8 for i in range(1, 5)}, {JOB: {"min_gpus": 16, "max_gpus": 16}},
                          Sim(d.DecisionSettings(max_restarts_without_progress=3)))
    sim.progress(JOB, 3)
    first = min(sim.state.tasks[JOB].placement)
    _escalate(sim)
    assert _statuses(sim)[first] == ("isolated", JOB)
    pending = sim.state.tasks[JOB].outstanding
    assert pending is not None
    sim.feed(d.ActionFailed(ts=sim.ts(), action_id=pending.action_id, reason="assign timed out"))
    sim.feed(d.TaskCancelled(ts=sim.ts(), task=JOB))
    assert all(status == "up" for status, _ in _statuses(sim).values()), _statuses(sim)


def _two_tasks(b_gpus: int = 4) -> Sim:
    """Tasks ``a`` (4 GPUs, on n1) and ``b`` (on n1, and n2 when it has more than 4), both past step 3."""
    sim = running_cluster({"n1": 8, "n2": 8, "n3": 8},
                          {"a": {"min_gpus": 4, "max_gpus": 4}, "b": {"min_gpus": b_gpus, "max_gpus": b_gpus}},
                          Sim(d.DecisionSettings(max_restarts_without_progress=9)))
    assert sim.state.tasks["a"].ranks_on("n1") and sim.state.tasks["b"].ranks_on("n1")
    sim.progress("a", 3)
    sim.progress("b", 3)
    return sim


def _kill(sim: Sim, task: str, node: str, restart_epoch: int | None = None) -> list[d.Action]:
    e = sim.state.tasks[task]
    return sim.incident(node, SEV2_KIND, task=task, rank=e.ranks_on(node)[0], generation=e.generation,
                        restart_epoch=restart_epoch)


def test_a_second_tasks_restart_there_makes_the_isolation_stand() -> None:
    """Two tasks' ranks died on n1; a's relaunch dies too and n1 is isolated, which reconfigures b and
    drops its restart there: b's failure on n1 could never be counted, and a's failing again elsewhere
    brought n1 back. The rule 'a second task's failure there makes the isolation stand' never fired."""
    sim = _two_tasks()
    restart = one(_kill(sim, "a", "n1"), d.RestartRanks)
    one(_kill(sim, "b", "n1"), d.RestartRanks)
    assert one(_kill(sim, "a", "n1", restart.restart_epoch), d.IsolateNode).node == "n1"
    assert _statuses(sim)["n1"] == ("isolated", "")
    pending = sim.state.tasks["a"].outstanding
    assert pending is not None
    sim.feed(d.ActionFailed(ts=sim.ts(), action_id=pending.action_id, reason="assign timed out"))
    assert sim.state.nodes["n1"].status is d.NodeState.ISOLATED


def test_two_restarts_there_that_miss_their_deadline_together_make_the_isolation_stand() -> None:
    sim = _two_tasks()
    _kill(sim, "a", "n1")
    _kill(sim, "b", "n1")
    sim.feed(d.Tick(ts=sim.ts(1000)))
    assert _statuses(sim)["n1"] == ("isolated", "")


def test_a_second_tasks_restart_for_a_fault_elsewhere_leaves_the_suspicion_open() -> None:
    """b's rank died on n2, and its peer on n1 in the collective that broke: n1 is no fault of b's."""
    sim = _two_tasks(b_gpus=12)
    restart = one(_kill(sim, "b", "n2"), d.RestartRanks)
    peer = sim.state.tasks["b"].ranks_on("n1")[0]
    sim.incident("n1", SEV2_KIND, task="b", rank=peer, generation=sim.state.tasks["b"].generation)
    assert sim.state.tasks["b"].relaunching.get("n1"), "the restart widened to the peer on n1"
    assert restart.node == "n2"
    restart = one(_kill(sim, "a", "n1"), d.RestartRanks)
    _kill(sim, "a", "n1", restart.restart_epoch)
    assert _statuses(sim)["n1"] == ("isolated", "a")
