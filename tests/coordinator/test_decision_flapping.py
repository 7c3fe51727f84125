"""A flapping node: sev2 faults that each recover, again and again, on one node (a GPU throwing a CUDA
error every few steps). Each restart that worked reset the task's restart budget, so the node was
restarted for ever, each time a failure of the cluster for the planner; ``flap_faults`` sev2 faults
within ``flap_window_s`` now escalate to sev1: the node is isolated and its tasks re-planned."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from coordinator.daemon import Coordinator
from coordinator.decision import (
    Action,
    ActionSucceeded,
    Alert,
    CoreState,
    DecisionSettings,
    IsolateNode,
    NodeDrained,
    NodeJoined,
    NodeLost,
    NodeState,
    NodeUndrained,
    ProgressMade,
    RestartRanks,
    TaskPhase,
)
from coordinator.settings import CoordinatorSettings
from tests.coordinator.test_decision import K, M, Sim, only, running_cluster
from unicron.kernel.errors import ConfigError

CUDA_ERROR = (M.EXCEPTION_PROPAGATION, K.CUDA_ERROR)
ILLEGAL_MEMORY_ACCESS = (M.EXCEPTION_PROPAGATION, K.ILLEGAL_MEMORY_ACCESS)
JOB = {"job": {"min_gpus": 8}}


class Cycles:
    """A task on n1 and n2 whose rank on n2 fails with a sev2 and recovers (its restart confirmed by
    the relaunched process's iteration, then steps on), as often as asked."""

    def __init__(self, settings: DecisionSettings | None = None) -> None:
        self.sim = running_cluster({"n1": 8, "n2": 8}, JOB, Sim(settings))
        self.step = 10
        self.actions: list[Action] = []

    def fault(self, node: str = "n2", kind: tuple[M, K] = CUDA_ERROR, gap_s: float = 1.0) -> list[Action]:
        sim = self.sim
        sim.ts(gap_s - 1.0)  # the incident's own second is added by Sim.incident
        rank = sim.state.tasks["job"].placement.get(node, [None])[0]
        acts = sim.incident(node, kind, task="job", rank=rank, generation=sim.state.tasks["job"].generation)
        self.actions += acts
        return acts

    def recover(self) -> None:
        sim, entry = self.sim, self.sim.state.tasks["job"]
        restarts = only(self.actions, RestartRanks)  # the latest: its relaunched process's iteration
        self.step += 1
        sim.feed(ProgressMade(ts=sim.ts(), task="job", step=self.step, generation=entry.generation,
                              restart_epoch=restarts[-1].restart_epoch if restarts else None))
        settle(sim)
        self.step += 2
        sim.progress("job", self.step)

    def cycle(self, gap_s: float = 1.0) -> list[Action]:
        acts = self.fault(gap_s=gap_s)
        self.recover()
        return acts


def test_a_node_failing_again_and_again_is_isolated_at_the_third_sev2_within_the_window() -> None:
    run = Cycles()
    isolated_at = []
    for cycle in range(50):
        acts = run.cycle(gap_s=5.0)
        if only(acts, IsolateNode):
            isolated_at.append(cycle)
    assert isolated_at == [2]  # the third fault, once; later ones find no task on the node
    isolation = only(run.actions, IsolateNode)[0]
    assert isolation.node == "n2" and "flapping: 3 sev2 faults in " in isolation.reason
    assert "within 3600 s" in isolation.reason and "cuda_error on n2" in isolation.reason
    assert any(a.node == "n2" and "flapping" in a.message for a in only(run.actions, Alert))
    assert len(only(run.actions, RestartRanks)) == 2  # the first two faults restarted the rank
    assert run.sim.state.nodes["n2"].status is NodeState.ISOLATED
    assert run.sim.state.failures == 3  # two restarts and the isolation: not one failure per cycle
    assert set(run.sim.state.tasks["job"].placement) == {"n1"}  # re-planned off the node


def test_merged_sev2s_of_one_burst_count_once() -> None:
    """The reports that follow one fault (merged into its restart) are not faults of their own."""
    run = Cycles()
    for _ in range(2):
        run.fault()
        run.fault(kind=ILLEGAL_MEMORY_ACCESS)  # merged into the restart under way
        run.fault()
        run.recover()
    assert not only(run.actions, IsolateNode)
    assert len(run.sim.state.nodes["n2"].sev2_faults) == 2
    assert only(run.cycle(), IsolateNode)


def test_faults_further_apart_than_the_window_never_escalate() -> None:
    run = Cycles()
    for _ in range(20):
        acts = run.cycle(gap_s=1800.0)  # any three span 3600 s and more
        assert len(only(acts, RestartRanks)) == 1 and not only(acts, IsolateNode)
    assert run.sim.state.nodes["n2"].status is NodeState.UP
    assert len(run.sim.state.nodes["n2"].sev2_faults) <= 3  # older ones are forgotten


def test_faults_on_different_nodes_do_not_add_up() -> None:
    run = Cycles()
    for node in ("n1", "n2", "n1", "n2"):
        acts = run.fault(node=node)
        run.recover()
        assert len(only(acts, RestartRanks)) == 1 and not only(acts, IsolateNode)


def test_a_return_to_service_clears_the_history() -> None:
    run = Cycles()
    run.cycle()
    run.cycle()
    sim = run.sim
    # an operator drains and undrains the node (after checking it): its history is gone
    sim.feed(NodeDrained(ts=sim.ts(), node="n2", reason="checking its GPUs"))
    sim.feed(NodeUndrained(ts=sim.ts(), node="n2"))
    assert sim.state.nodes["n2"].sev2_faults == ()
    settle(sim)
    run.step += 5
    sim.progress("job", run.step)
    assert "n2" in sim.state.tasks["job"].placement
    for _ in range(2):
        assert not only(run.cycle(), IsolateNode)  # 2 of 3 again: not flapping
    assert only(run.cycle(), IsolateNode)
    # isolated as flapping, then repaired and back (NodeJoined after isolation): nothing is left of it
    sim.feed(NodeJoined(ts=sim.ts(), node="n2", gpus=8))
    assert sim.state.nodes["n2"].status is NodeState.UP and sim.state.nodes["n2"].sev2_faults == ()


def test_a_lost_node_back_keeps_its_history() -> None:
    """An agent restart (lost, registered again) repairs nothing."""
    run = Cycles()
    run.cycle()
    sim = run.sim
    sim.feed(NodeLost(ts=sim.ts(), node="n2", reason="agent gone"))
    sim.feed(NodeJoined(ts=sim.ts(), node="n2", gpus=8))
    assert len(sim.state.nodes["n2"].sev2_faults) == 1


def test_zero_turns_the_rule_off_and_the_threshold_is_bounded() -> None:
    run = Cycles(DecisionSettings(flap_faults=0))
    for _ in range(10):
        assert not only(run.cycle(), IsolateNode)
    assert run.sim.state.nodes["n2"].sev2_faults == ()
    with pytest.raises(ConfigError, match="flap_faults"):
        DecisionSettings(flap_faults=9)  # more than a node keeps: it could never fire
    with pytest.raises(ConfigError, match="flap_window_s"):
        DecisionSettings(flap_window_s=0)


def test_the_coordinator_flaps_as_configured_and_by_default_as_the_simulator() -> None:
    """``sim.unicron`` decides with ``DecisionSettings()``: the live defaults must be the same, or the
    two would part at the third sev2 of a node (tests/integration/test_sim_equivalence.py)."""
    assert Coordinator(CoordinatorSettings()).core.settings == DecisionSettings()
    tuned = Coordinator(CoordinatorSettings(flap_faults=5, flap_window_s=60.0)).core.settings
    assert (tuned.flap_faults, tuned.flap_window_s) == (5, 60.0)


def test_the_history_is_stored_and_an_old_state_without_it_loads() -> None:
    run = Cycles()
    run.cycle()
    run.cycle()
    raw = json.loads(json.dumps(run.sim.state.to_dict()))
    loaded = CoreState.from_dict(raw)
    assert loaded.nodes["n2"].sev2_faults == run.sim.state.nodes["n2"].sev2_faults
    assert len(loaded.nodes["n2"].sev2_faults) == 2
    assert "sev2_faults" not in raw["nodes"]["n1"]  # none: nothing written
    del raw["nodes"]["n2"]["sev2_faults"]  # written by a coordinator from before it existed
    assert CoreState.from_dict(raw).nodes["n2"].sev2_faults == ()


def settle(sim: Sim) -> None:
    """Confirms the action of every task being reconfigured (a re-plan's Assign or resize)."""
    for name in sim.state.tasks:
        if sim.phase(name) is TaskPhase.RECONFIGURING:
            sim.feed(ActionSucceeded(ts=sim.ts(), action_id=sim.outstanding(name)))


@pytest.mark.parametrize("kind", [(M.PROCESS_SUPERVISION, K.EXITED_ABNORMALLY),
                                  (M.EXCEPTION_PROPAGATION, K.OTHER_SOFTWARE_ERROR)], ids=["exited", "software"])
def test_a_rank_that_keeps_exiting_makes_no_node_flap(kind: tuple[M, K]) -> None:
    """A job's own bug (an exception every few hundred steps) says nothing of the GPU it ran on: only a
    CUDA error or an illegal memory access counts, or every node the job ran on was isolated in turn."""
    run = Cycles()
    for _ in range(10):
        acts = run.fault(kind=kind, gap_s=5.0)
        run.recover()
        assert not only(acts, IsolateNode)
    assert run.sim.state.nodes["n2"].status is NodeState.UP and not run.sim.state.nodes["n2"].sev2_faults


def test_device_faults_that_follow_their_task_to_another_node_isolate_no_second_node() -> None:
    """A kernel of the job's own that faults every few steps looks like a flapping GPU on the first node;
    once the task moved and its faults go on, they are the task's: an Alert, the node kept in service."""
    run = Cycles()
    for _ in range(3):
        run.cycle(gap_s=5.0)
    assert run.sim.state.nodes["n2"].status is NodeState.ISOLATED  # the first node flapped
    assert run.sim.state.tasks["job"].flapped_off == "n2"
    settle(run.sim)
    run.sim.progress("job", run.step + 1)
    run.step += 1
    for _ in range(6):
        acts = run.fault(node="n1", gap_s=5.0)
        run.recover()
        assert not only(acts, IsolateNode) and len(only(acts, RestartRanks)) == 1
    assert run.sim.state.nodes["n1"].status is NodeState.UP
    alerts = [a.message for a in only(run.actions, Alert) if a.node == "n1"]
    assert len(alerts) == 2 and all("made node n2 flap before" in m for m in alerts), alerts


def test_the_flapping_escalation_leaves_the_state_it_was_given_alone() -> None:
    """The leader adopts a decision's state only once its write lands: a failed write left the task
    marked as having made n2 flap (written into the caller's entry), and a real flapping GPU later was
    kept in service as the task's doing."""
    run = Cycles()
    for _ in range(2):
        run.cycle(gap_s=5.0)
    before = run.sim.state
    acts = run.fault(gap_s=5.0)
    assert only(acts, IsolateNode) and run.sim.state.tasks["job"].flapped_off == "n2"
    assert before.tasks["job"].flapped_off == "", "the core changed the state it was given"


def three_nodes_one_flapped(nodes: dict[str, int], job: dict[str, int]) -> Cycles:
    """A task on n1, n2 and n3 (and a spare where ``nodes`` has n4) whose rank 8 made n2 flap: n2 is
    isolated and the task runs on, re-planned without it."""
    run = Cycles()
    run.sim = running_cluster(nodes, {"job": job}, Sim())
    assert run.sim.state.tasks["job"].placement["n2"][0] == 8
    for _ in range(3):
        run.cycle(gap_s=5.0)
    assert run.sim.state.nodes["n2"].status is NodeState.ISOLATED
    settle(run.sim)
    run.step += 1
    run.sim.progress("job", run.step)
    return run


def faults_on(run: Cycles, nodes: list[str]) -> list[Action]:
    acts: list[Action] = []
    for node in nodes:
        acts += run.fault(node=node, gap_s=5.0)
        run.recover()
    return acts


SPARE = {"n1": 8, "n2": 8, "n3": 8, "n4": 8}
FIXED = {"min_gpus": 24, "max_gpus": 24}  # its world stays 24 ranks: rank 8 goes to the spare n4


def test_a_task_that_meets_two_bad_gpus_has_both_nodes_isolated() -> None:
    """n3's GPU fails too, on a rank of its own, while n1 and n4 run the task, in the same world, without
    faults: a second bad node, not faults that follow the task (only n2 was isolated, n3 kept failing
    with an Alert)."""
    run = three_nodes_one_flapped(SPARE, FIXED)
    assert run.sim.state.tasks["job"].placement["n3"][0] == 16
    acts = faults_on(run, ["n3"] * 3)
    isolation = only(acts, IsolateNode)
    assert [i.node for i in isolation] == ["n3"] and "flapping: 3 sev2 faults" in isolation[0].reason
    assert run.sim.state.nodes["n3"].status is NodeState.ISOLATED
    assert not any("follow the task" in a.message for a in only(run.actions, Alert))
    assert run.sim.state.tasks["job"].flapped_ranks == [8, 16]


@pytest.mark.parametrize("faulting", [lambda ranks: ranks[-1], lambda ranks: ranks[37 % len(ranks)]],
                         ids=["last-rank", "poison-sample"])
def test_a_task_bug_whose_rank_depends_on_the_world_size_isolates_one_node_only(
        faulting: Callable[[list[int]], int]) -> None:
    """A bug of the task's last rank (its short last data shard), or a corrupt sample replayed at each
    resume (index mod world size): once the first node flapped the task shrank, and the faults land on
    another rank, on another node, each time. No rank id tells them from a GPU's in a world of another
    size: one node isolated, then Alerts (it isolated n5, n3, n2, n1 in turn)."""
    run = Cycles()
    run.sim = sim = running_cluster({f"n{i}": 8 for i in range(1, 6)}, JOB, Sim())
    for _ in range(40):
        entry = sim.state.tasks["job"]
        rank = faulting(list(entry.all_ranks()))
        node = next(n for n, ranks in entry.placement.items() if rank in ranks)
        sim.ts(4.0)
        run.actions += sim.incident(node, CUDA_ERROR, task="job", rank=rank, generation=entry.generation)
        run.recover()
    assert [n for n, e in sim.state.nodes.items() if e.status is NodeState.ISOLATED] == ["n5"]
    assert len(only(run.actions, IsolateNode)) == 1
    assert any("follow the task" in a.message for a in only(run.actions, Alert))
    assert sim.state.tasks["job"].flapped_world == 40


def test_faults_that_follow_their_rank_to_a_spare_node_isolate_it_not() -> None:
    """A kernel bug of rank 8's own: the rank moved from n2 to the spare n4 and faults there as it did on
    n2, while n1 and n3 run without faults. The rank's, not n4's: an Alert, n4 stays in service."""
    run = three_nodes_one_flapped({"n1": 8, "n2": 8, "n3": 8, "n4": 8}, {"min_gpus": 24, "max_gpus": 24})
    assert run.sim.state.tasks["job"].placement["n4"][0] == 8  # rank 8 went to the spare
    acts = faults_on(run, ["n4"] * 6)
    assert not only(acts, IsolateNode) and run.sim.state.nodes["n4"].status is NodeState.UP
    alerts = [a.message for a in only(acts, Alert) if a.node == "n4"]
    assert len(alerts) == 2 and all("made node n2 flap before" in m for m in alerts), alerts


def test_a_stray_fault_long_ago_keeps_no_second_bad_gpu_in_service() -> None:
    """n2 flapped; one transient CUDA error on n1 (restarted, fine); a week of training; then n3's GPU
    fails every few seconds. The fault on n1 a week ago is no part of n3's: n3 is isolated (it was kept
    in service with an Alert, for good: the task's record of n1's fault never aged)."""
    run = three_nodes_one_flapped(SPARE, FIXED)
    faults_on(run, ["n1"])
    for _ in range(7 * 24):
        run.sim.ts(3600.0)
        run.step += 100
        run.sim.progress("job", run.step)
    acts = faults_on(run, ["n3"] * 3)
    assert [i.node for i in only(acts, IsolateNode)] == ["n3"]
    assert run.sim.state.nodes["n3"].status is NodeState.ISOLATED
    assert not any("follow the task" in a.message for a in only(acts, Alert))


def test_faults_on_every_node_the_task_runs_on_isolate_no_second_node() -> None:
    """A kernel bug that hits whichever rank: once n2 was isolated, faults come from n1 and n3 alike,
    so n3 reaching the limit first is no sign of its GPU (in the same world: a spare took n2's ranks)."""
    run = three_nodes_one_flapped(SPARE, FIXED)
    acts = faults_on(run, ["n3", "n1", "n3", "n3"])
    assert not only(acts, IsolateNode)
    assert {n: e.status for n, e in run.sim.state.nodes.items() if n != "n2"} == {
        "n1": NodeState.UP, "n3": NodeState.UP, "n4": NodeState.UP}
    assert any("made node n2 flap before" in a.message for a in only(acts, Alert) if a.node == "n3")


def test_the_task_s_flapping_evidence_is_stored() -> None:
    run = three_nodes_one_flapped({"n1": 8, "n2": 8, "n3": 8}, {"min_gpus": 8})
    faults_on(run, ["n3"])
    raw = json.loads(json.dumps(run.sim.state.to_dict()))
    entry = CoreState.from_dict(raw).tasks["job"]
    assert (entry.flapped_off, entry.flapped_ranks) == ("n2", [8])
    assert entry.flapped_world == 24  # n1, n2 and n3's ranks when n2 flapped
    assert entry.faulted_since_flap == run.sim.state.tasks["job"].faulted_since_flap
    assert list(entry.faulted_since_flap) == ["n3"] and entry.faulted_since_flap["n3"] > 0
    # written by the coordinator of 8cde6ed: the nodes without times, taken as faults of the state's now
    raw["tasks"]["job"]["faulted_since_flap"] = ["n3"]
    assert CoreState.from_dict(raw).tasks["job"].faulted_since_flap == {"n3": raw["now"]}
    # none: nothing written (a coordinator from before these fields refuses them)
    fresh = json.loads(json.dumps(Cycles().sim.state.to_dict()))["tasks"]["job"]
    assert not {"flapped_ranks", "flapped_world", "faulted_since_flap"} & set(fresh)
