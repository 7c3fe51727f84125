"""``recovery: "restart"`` in the decision core, the executor and the task spec (issue 14 item 2): a rank's
failure or hang relaunches every rank of the task on the same nodes as one new attempt; the peers'
crashes that follow are merged; restarts without progress back off and are budgeted; no node is isolated
for a peer's crash."""

from __future__ import annotations

import json
import sys

import pytest

from coordinator import decision as d
from coordinator.executor import Executor
from coordinator.tasks import Recovery, TaskSpec, default_recovery, parse_task_spec
from tests.coordinator.test_decision import SEV1_KIND, SEV2_KIND, SEV3_KIND, Sim
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.types import DetectionMethod, ErrorKind, NodeAssignment

JOB = "job"
HANG = (DetectionMethod.STATISTICAL_MONITORING, ErrorKind.TASK_HANG)


def running(settings: d.DecisionSettings | None = None) -> Sim:
    """``job`` with recovery "restart" on 16 GPUs over two nodes, running at step 5."""
    sim = Sim(settings)
    sim.join("n1")
    sim.join("n2")
    sim.submit(JOB, min_gpus=16, recovery="restart")
    sim.feed(d.ActionSucceeded(ts=sim.ts(), action_id=sim.outstanding(JOB)))
    sim.progress(JOB, 5)
    assert sim.phase(JOB) is d.TaskPhase.RUNNING
    return sim


def only_restart(actions: list[d.Action]) -> d.RestartTask:
    (action,) = actions
    assert isinstance(action, d.RestartTask), actions
    return action


def test_a_dead_rank_relaunches_every_rank_on_every_node_as_one_attempt() -> None:
    sim = running()
    entry = sim.state.tasks[JOB]
    act = only_restart(sim.incident("n2", SEV2_KIND, task=JOB, rank=entry.ranks_on("n2")[0]))
    assert act.placement == {n: tuple(r) for n, r in entry.placement.items()}  # all 16 ranks, where they are
    assert sorted(r for rs in act.placement.values() for r in rs) == list(range(16))
    assert (act.restart_epoch, act.delay_s, act.generation) == (1, 0.0, 1)  # the first: no backoff
    o = sim.state.tasks[JOB].outstanding
    assert o is not None and o.kind is d.ActionKind.RESTART and o.node == "n2" and o.waiting == ["n1", "n2"]
    assert sim.phase(JOB) is d.TaskPhase.RESTARTING


@pytest.mark.parametrize("kind", [SEV3_KIND, HANG], ids=["sev3", "hang"])
def test_a_sev3_or_a_hang_is_no_reattempt_for_a_stock_job(kind: tuple[DetectionMethod, ErrorKind]) -> None:
    sim = running()
    act = only_restart(sim.incident("n1", kind, task=JOB, rank=0))
    assert len(act.placement) == 2


def test_the_peers_crashes_are_merged_and_no_node_is_isolated() -> None:
    sim = running()
    sim.incident("n2", SEV2_KIND, task=JOB, rank=8)
    # every other rank crashes as a consequence (gloo's connection reset), on both nodes
    for node, rank in [("n1", 0), ("n1", 7), ("n2", 9)]:
        assert sim.incident(node, SEV2_KIND, task=JOB, rank=rank) == []
        assert sim.transitions[0].response is d.Response.MERGE
    assert all(n.status is d.NodeState.UP for n in sim.state.nodes.values())
    sim.progress(JOB, 6)  # the new attempt made a step past the fault: recovered
    assert sim.phase(JOB) is d.TaskPhase.RUNNING and sim.state.tasks[JOB].restarts == 0


def test_a_process_the_restart_launched_that_dies_fails_the_restart_at_once() -> None:
    """Before, its death was merged like a peer's crash, and another relaunched rank's step confirmed
    the restart: the dead rank was never relaunched (seen in bench/fence.py, where ranks step without
    each other)."""
    sim = running()
    act = only_restart(sim.incident("n2", SEV2_KIND, task=JOB, rank=8))
    gen = sim.state.tasks[JOB].generation
    # the old attempt's processes dying is the restart's own doing: still merged
    assert sim.incident("n1", SEV2_KIND, task=JOB, rank=0, generation=gen, restart_epoch=act.restart_epoch - 1) == []
    assert sim.phase(JOB) is d.TaskPhase.RESTARTING
    # a process of the new attempt dies: the restart failed, sev1 on its node, without its deadline
    acts = sim.incident("n1", SEV2_KIND, task=JOB, rank=0, generation=gen, restart_epoch=act.restart_epoch)
    assert escalated(sim)
    assert any(isinstance(a, d.IsolateNode) and a.node == "n1" for a in acts)
    assert sim.state.nodes["n1"].status is d.NodeState.ISOLATED
    # the other new ranks' steps no longer confirm an attempt that lost a rank (8 GPUs left: it waits)
    assert any(isinstance(a, d.StopTask) for a in acts)
    sim.feed(d.ProgressMade(ts=sim.ts(), task=JOB, step=6, generation=gen, restart_epoch=act.restart_epoch))
    assert sim.phase(JOB) is d.TaskPhase.PENDING


def test_a_relaunched_rank_that_dies_fails_a_rank_restart_at_once() -> None:
    sim = Sim()
    sim.join("n1")
    sim.join("n2")
    sim.submit(JOB, min_gpus=16)
    sim.feed(d.ActionSucceeded(ts=sim.ts(), action_id=sim.outstanding(JOB)))
    sim.progress(JOB, 5)
    (act,) = [a for a in sim.incident("n2", SEV2_KIND, task=JOB, rank=8) if isinstance(a, d.RestartRanks)]
    gen = sim.state.tasks[JOB].generation
    acts = sim.incident("n2", SEV2_KIND, task=JOB, rank=8, generation=gen, restart_epoch=act.restart_epoch)
    assert escalated(sim)
    assert any(isinstance(a, d.IsolateNode) and a.node == "n2" for a in acts)


def escalated(sim: Sim) -> bool:
    return any((t.phase, t.trigger, t.response) == (d.TaskPhase.RESTARTING, d.Trigger.RESTART_DIED, d.Response.ESCALATE)
               for t in sim.transitions)


def test_a_restart_that_redoes_steps_from_the_jobs_checkpoint_is_confirmed_by_its_first_iteration() -> None:
    """The job resumes from its own checkpoint, behind the step it had reached. Before, only a step
    past the fault confirmed the restart: a redo longer than the restart deadline (120 s) expired it,
    isolated a healthy node and stopped the task."""
    sim = running()
    sim.progress(JOB, 500)
    act = only_restart(sim.incident("n2", SEV2_KIND, task=JOB, rank=8))
    gen = sim.state.tasks[JOB].generation
    # a redone step not shown to come from the restart's processes, or from an earlier restart's, is no proof
    sim.feed(d.ProgressMade(ts=sim.ts(), task=JOB, step=400, generation=gen))
    sim.feed(d.ProgressMade(ts=sim.ts(), task=JOB, step=401, generation=gen, restart_epoch=act.restart_epoch - 1))
    assert sim.phase(JOB) is d.TaskPhase.RESTARTING
    sim.feed(d.ProgressMade(ts=sim.ts(), task=JOB, step=402, generation=gen, restart_epoch=act.restart_epoch))
    assert sim.phase(JOB) is d.TaskPhase.RUNNING and sim.state.tasks[JOB].outstanding is None
    assert sim.feed(d.Tick(ts=sim.ts(200.0))) == []  # past the restart's deadline: nothing to escalate
    assert all(n.status is d.NodeState.UP for n in sim.state.nodes.values())
    # a redone step is no progress for the budget: a crash before step 500 is another restart without it
    assert sim.state.tasks[JOB].restarts == 1
    assert only_restart(sim.incident("n2", SEV2_KIND, task=JOB, rank=8)).restart_epoch == act.restart_epoch + 1
    assert sim.state.tasks[JOB].restarts == 2


def test_a_hardware_fault_still_moves_the_task() -> None:
    sim = running()
    acts = sim.incident("n1", SEV1_KIND)
    assert any(isinstance(a, d.IsolateNode) and a.node == "n1" for a in acts)
    assert not any(isinstance(a, d.RestartTask) for a in acts)


def test_restarts_without_progress_back_off_then_fail_the_task() -> None:
    settings = d.DecisionSettings(restart_backoff_s=2.0, restart_backoff_max_s=5.0)
    sim = running(settings)
    delays = []
    epochs = []
    for _ in range(3):
        act = only_restart(sim.incident("n1", SEV2_KIND, task=JOB, rank=0))
        delays.append(act.delay_s)
        epochs.append(act.restart_epoch)
        o = sim.state.tasks[JOB].outstanding
        assert o is not None and o.deadline == pytest.approx(sim.state.now + settings.restart_deadline_s + act.delay_s)
        sim.feed(d.ActionSucceeded(ts=sim.ts(), action_id=act.action_id))  # relaunched, but no new step
    assert delays == [0.0, 2.0, 4.0] and epochs == [1, 2, 3]
    assert settings.backoff_s(5) == 5.0  # capped
    acts = sim.incident("n1", SEV2_KIND, task=JOB, rank=0)  # the budget (3) is spent
    assert sim.phase(JOB) is d.TaskPhase.FAILED
    assert {type(a) for a in acts} >= {d.StopTask, d.MarkTaskFailed}
    assert "no progress across 3 restarts since step 5" in sim.state.tasks[JOB].reason


def test_progress_resets_the_backoff() -> None:
    sim = running(d.DecisionSettings(restart_backoff_s=2.0))
    only_restart(sim.incident("n1", SEV2_KIND, task=JOB, rank=0))
    sim.feed(d.ActionSucceeded(ts=sim.ts(), action_id=sim.outstanding(JOB)))
    sim.progress(JOB, 9)
    assert only_restart(sim.incident("n1", SEV2_KIND, task=JOB, rank=0)).delay_s == 0.0


def test_state_and_action_round_trip_through_json() -> None:
    sim = running()
    act = only_restart(sim.incident("n2", SEV2_KIND, task=JOB, rank=8))
    assert d.from_dict(json.loads(json.dumps(d.to_dict(act)))) == act
    back = d.CoreState.from_dict(json.loads(json.dumps(sim.state.to_dict())))
    assert back.tasks[JOB].spec.recovery is Recovery.RESTART and back == sim.state


def test_executor_gives_every_node_the_same_restart_epoch_and_all_its_ranks() -> None:
    spec = parse_task_spec({"name": "s", "command": ["python", "train.py"], "min_gpus": 4}, None)
    ex = Executor(Keyspace("/x"), lambda task: spec, lambda node: 2)
    ex.apply(d.Assign(action_id="a1", task="s", generation=1, placement={"n0": (0, 1), "n1": (2, 3)},
                      world_size=4, reason="test"))
    changed = ex.apply(d.RestartTask(action_id="a2", task="s", generation=1, restart_epoch=4,
                                     placement={"n0": (0, 1), "n1": (2, 3)}, delay_s=1.5, reason="test"))
    assert changed == {"n0", "n1"}
    for node, ranks in (("n0", [0, 1]), ("n1", [2, 3])):
        (a,) = NodeAssignment.from_json(ex.record(node)[1]).task_assignments()
        assert (a.recovery, a.restart_epoch, a.restart_ranks, a.restart_delay_s) == ("restart", 4, ranks, 1.5)


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["python", "train.py"], Recovery.RESTART),
        (["torchrun", "--nproc-per-node", "8", "pretrain_gpt.py"], Recovery.RESTART),
        ([sys.executable, "-m", "unicron.runtime.train", "--iterations", "0"], Recovery.INPROCESS),
        (["/opt/venv/bin/unicron", "train", "--layers", "2"], Recovery.INPROCESS),
    ],
)
def test_default_recovery_follows_the_command(command: list[str], expected: Recovery) -> None:
    assert default_recovery(tuple(command)) is expected
    spec = parse_task_spec({"name": "t", "command": command}, None)
    assert spec.recovery is expected
    assert TaskSpec(name="t", command=tuple(command)).recovery is expected  # built directly, too
    assert TaskSpec.from_dict(spec.to_dict()) == spec


def test_an_explicit_recovery_wins_and_a_wrong_one_is_named() -> None:
    spec = parse_task_spec({"name": "t", "command": "python train.py", "recovery": "inprocess"}, None)
    assert spec.recovery is Recovery.INPROCESS and not spec.restarts_whole
    with pytest.raises(InvalidRecord, match=r"task\.recovery: 'torchrun' is not one of \['inprocess', 'restart'\]"):
        parse_task_spec({"name": "t", "command": "python train.py", "recovery": "torchrun"}, None)
    with pytest.raises(InvalidRecord, match=r"task\.recovery: "):
        parse_task_spec({"name": "t", "command": "python train.py", "recovery": ["restart"]}, None)
