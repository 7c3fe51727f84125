"""In-place resizes: the pure membership arithmetic and the decisions that use it."""

from __future__ import annotations

from coordinator import causes
from coordinator.decision import (
    Action,
    ActionSucceeded,
    Assign,
    DecisionSettings,
    IsolateNode,
    NodeDrained,
    NodeJoined,
    NodeLost,
    NodeUndrained,
    ProgressMade,
    Reattempt,
    ResizeInPlace,
    RestartRanks,
    RestartTask,
    TaskPhase,
    Tick,
)
from coordinator.decision.resize import plan_in_place, store_move, successor_store_node
from coordinator.decision.table import Trigger
from tests.coordinator.test_causes import status
from tests.coordinator.test_decision import (
    SEV1_KIND,
    SEV2_KIND,
    SEV3_KIND,
    STORE_LOST_KIND,
    Sim,
    one,
    only,
    running_cluster,
)
from tests.coordinator.test_executor import Driven
from unicron.kernel.types import DetectionMethod, ErrorKind, RankStatus

JOB = "job"
DIED = (DetectionMethod.PROCESS_SUPERVISION, ErrorKind.EXITED_ABNORMALLY)


def test_shrink_keeps_survivors_and_names_the_lost_ranks() -> None:
    old = {"a": [0, 1], "b": [2, 3], "c": [4, 5]}
    got = plan_in_place(old, {"a": 2, "b": 2}, world_size=6, unit=1, tp=1, gone={"c"})
    assert got is not None
    assert got.placement == {"a": [0, 1], "b": [2, 3]}
    assert (got.joiners, got.leaving, got.lost) == ((), (), (4, 5))


def test_drained_node_ranks_leave_rather_than_get_lost() -> None:
    old = {"a": [0, 1], "b": [2, 3]}
    got = plan_in_place(old, {"a": 2}, world_size=4, unit=1, tp=1, gone=set())
    assert got is not None and got.leaving == (2, 3) and got.lost == ()


def test_grow_rehosts_the_missing_rank_ids_as_joiners() -> None:
    old = {"a": [0, 1], "b": [2, 3]}
    got = plan_in_place(old, {"a": 2, "b": 2, "c": 2}, world_size=6, unit=1, tp=1, gone=set())
    assert got is not None
    assert got.placement == {"a": [0, 1], "b": [2, 3], "c": [4, 5]}
    assert got.joiners == (4, 5) and got.leaving == () and got.members == tuple(range(6))


def test_tensor_parallel_replicas_stay_whole() -> None:
    old = {"a": [0, 1], "b": [2, 3], "c": [4, 5]}  # tp=2: replicas {0,1} {2,3} {4,5}
    got = plan_in_place(old, {"a": 2, "c": 2}, world_size=6, unit=2, tp=2, gone={"b"})
    assert got is not None and got.placement == {"a": [0, 1], "c": [4, 5]} and got.lost == (2, 3)
    back = plan_in_place(got.placement, {"a": 2, "b": 2, "c": 2}, world_size=6, unit=2, tp=2, gone=set())
    assert back is not None and back.placement["b"] == [2, 3] and back.joiners == (2, 3)


def test_a_partial_replica_leaves_and_is_rehosted_whole() -> None:
    # pp=2, tp=1: replica {2,3} spans b and c; c is lost, so rank 2 on b leaves and the replica rejoins
    old = {"a": [0, 1], "b": [2], "c": [3]}
    got = plan_in_place(old, {"a": 2, "b": 2}, world_size=4, unit=2, tp=1, gone={"c"})
    assert got is not None
    assert got.placement == {"a": [0, 1], "b": [2, 3]}
    assert got.joiners == (2, 3) and got.leaving == (2,) and got.lost == (3,)


def test_what_cannot_be_done_in_place() -> None:
    old = {"a": [0, 1], "b": [2, 3]}
    # beyond the launch size; no change at all; a count off the unit
    assert plan_in_place(old, {"a": 2, "b": 2, "c": 2}, world_size=4, unit=1, tp=1, gone=set()) is None
    assert plan_in_place(old, {"a": 2, "b": 2}, world_size=4, unit=1, tp=1, gone=set()) is None
    assert plan_in_place(old, {"a": 2, "b": 1}, world_size=4, unit=2, tp=2, gone=set()) is None
    # no complete replica survives (unit 4 = one replica over both nodes)
    assert plan_in_place(old, {"a": 2, "c": 2}, world_size=4, unit=4, tp=2, gone={"b"}) is None


IN_PLACE = DecisionSettings(in_place_resize=True)


def _three_nodes(**fields: object) -> Sim:
    sim = running_cluster({"n1": 2, "n2": 2, "n3": 2}, {JOB: {"min_gpus": 2, **fields}}, Sim(IN_PLACE))
    sim.progress(JOB, 5)
    assert sim.phase(JOB) is TaskPhase.RUNNING and sim.gpus(JOB) == {"n1": 2, "n2": 2, "n3": 2}
    return sim


def test_node_lost_shrinks_in_place_then_rejoin_grows_back_in_place() -> None:
    sim = _three_nodes()
    gen = sim.state.tasks[JOB].generation
    actions = sim.feed(NodeLost(ts=sim.ts(), node="n3", reason="link closed"))
    assert not only(actions, Assign)
    shrink = one(actions, ResizeInPlace, JOB)
    assert shrink.generation == gen and shrink.membership_epoch == 1 and shrink.world_size == 6
    assert shrink.members == (0, 1, 2, 3) and shrink.lost == (4, 5) and shrink.joiners == ()
    # a step the survivors had already made says nothing; one past the resize confirms it
    sim.progress(JOB, 5)
    assert sim.phase(JOB) is TaskPhase.RECONFIGURING
    sim.progress(JOB, 6)
    assert sim.phase(JOB) is TaskPhase.RUNNING
    grow = one(sim.feed(NodeJoined(ts=sim.ts(), node="n3", gpus=2)), ResizeInPlace, JOB)
    assert grow.generation == gen and grow.membership_epoch == 2
    assert dict(grow.placement) == {"n1": (0, 1), "n2": (2, 3), "n3": (4, 5)} and grow.joiners == (4, 5)


def test_a_restart_task_losing_a_node_is_a_new_generation() -> None:
    sim = _three_nodes(recovery="restart", max_gpus=6)
    assert one(sim.feed(NodeLost(ts=sim.ts(), node="n3", reason="gone")), Assign, JOB)


def test_no_resize_in_place_before_the_launch_is_confirmed() -> None:
    sim = Sim(IN_PLACE)
    for n in ("n1", "n2", "n3"):
        sim.join(n, 2)
    sim.submit(JOB, min_gpus=2)
    assert one(sim.feed(NodeLost(ts=sim.ts(), node="n3", reason="gone")), Assign, JOB)
    sim.feed(ActionSucceeded(ts=sim.ts(), action_id=sim.outstanding(JOB)))
    assert one(sim.feed(NodeLost(ts=sim.ts(), node="n2", reason="gone")), ResizeInPlace, JOB)


def test_records_and_states_written_before_the_membership_epoch_still_read() -> None:
    from coordinator.decision import CoreState
    from unicron.kernel.types import TaskAssignment, TaskResult

    old = {"task": "t", "generation": 3, "argv": ["x"], "env": {}, "world_size": 2,
           "ranks": [{"rank": 0, "local_rank": 0, "gpu": 0}], "store_node": "n1"}
    a = TaskAssignment.from_dict(old)
    assert (a.membership_epoch, list(a.members), a.joiners, a.lost) == (0, [], [], [])
    assert TaskResult.from_dict({"generation": 3, "restart_epoch": 0, "regroup_epoch": 0, "ranks": {}}
                                ).membership_epoch == 0
    sim = _three_nodes()
    raw = sim.state.to_dict()
    for entry in raw["tasks"].values():  # type: ignore[attr-defined]
        for key in ("membership_epoch", "world_size", "confirmed"):
            del entry[key]
    state = CoreState.from_dict(raw)
    # an old state's task has no launch size on record: it is not resized in place until its next Assign
    assert state.tasks[JOB].world_size == 0 and not state.tasks[JOB].confirmed


def test_resize_in_place_is_on_by_default_and_off_makes_a_new_generation() -> None:
    assert DecisionSettings().in_place_resize
    sim = running_cluster({"n1": 2, "n2": 2, "n3": 2}, {JOB: {"min_gpus": 2}}, Sim(DecisionSettings(in_place_resize=False)))
    sim.progress(JOB, 5)
    acts = sim.feed(NodeLost(ts=sim.ts(), node="n3", reason="gone"))
    assert one(acts, Assign, JOB) and not only(acts, ResizeInPlace)


def test_survivors_sev3_of_the_iteration_in_flight_at_a_shrink_is_merged_not_reattempted() -> None:
    """In bench/transition the survivors' reports of the lost peer's broken connection arrived after the
    shrink was confirmed and raised a reattempt; they belong to the resize. A later sev3 is a new fault."""
    sim = _three_nodes()
    one(sim.feed(NodeLost(ts=sim.ts(), node="n3", reason="link closed")), ResizeInPlace, JOB)
    sim.progress(JOB, 6)
    assert sim.phase(JOB) is TaskPhase.RUNNING
    for step in (5, 6):  # the survivors' view of the iteration in flight (step 6) or the one before
        assert not only(sim.incident("n1", SEV3_KIND, task=JOB, rank=0, step=step), Reattempt)
        assert sim.phase(JOB) is TaskPhase.RUNNING
        assert [t.trigger for t in sim.transitions] == [Trigger.RESIZE_ECHO]
    sim.ts(IN_PLACE.resize_echo_s)  # past the window in which anything is the resize's echo
    assert one(sim.incident("n1", SEV3_KIND, task=JOB, rank=0, step=7), Reattempt, JOB)
    # before it: the same report during the resize is merged as any sev3 during a reconfiguration
    sim = _three_nodes()
    sim.feed(NodeLost(ts=sim.ts(), node="n3", reason="link closed"))
    assert not only(sim.incident("n1", SEV3_KIND, task=JOB, rank=0, step=6), Reattempt)
    assert sim.phase(JOB) is TaskPhase.RECONFIGURING


def test_a_sev3_soon_after_a_resize_is_its_echo_whatever_its_step() -> None:
    """A drained store node's agent stops the old store once it applies the resize; in the resize soak
    (0.1 s iterations) the survivors' broken calls to it came 4 steps later and raised reattempts."""
    sim = _three_nodes()
    one(sim.feed(NodeDrained(ts=sim.ts(), node="n1")), ResizeInPlace, JOB)
    sim.progress(JOB, 12)
    assert not only(sim.incident("n2", SEV3_KIND, task=JOB, rank=2, step=12), Reattempt)
    assert [t.trigger for t in sim.transitions][-1] is Trigger.RESIZE_ECHO


def test_a_gone_store_node_moves_the_store_to_the_lowest_survivors_node() -> None:
    old = {"a": [0, 1], "b": [2, 3], "c": [4, 5]}
    got = plan_in_place(old, {"b": 2, "c": 2}, world_size=6, unit=1, tp=1, gone={"a"})
    assert got is not None and got.placement == {"b": [2, 3], "c": [4, 5]} and got.lost == (0, 1)
    assert got.store_node == "b"
    # after the move the store is b's, not rank 0's node's: losing c keeps it, losing b moves it on
    kept = plan_in_place(got.placement, {"b": 2}, world_size=6, unit=1, tp=1, gone={"c"}, store_node="b")
    assert kept is not None and kept.store_node == "b"
    on = plan_in_place(got.placement, {"c": 2}, world_size=6, unit=1, tp=1, gone={"b"}, store_node="b")
    assert on is not None and on.store_node == "c"
    # a node whose only ranks are joiners never hosts the moved store (its agent holds no survivor)
    grow = plan_in_place(old, {"b": 2, "d": 2}, world_size=6, unit=2, tp=1, gone={"a", "c"})
    assert grow is not None and grow.store_node == "b" and grow.joiners == (0, 1)



def test_a_drained_store_node_hands_the_store_to_the_lowest_survivors_node_and_its_ranks_leave() -> None:
    old = {"a": [0, 1], "b": [2, 3], "c": [4, 5]}
    got = plan_in_place(old, {"b": 2, "c": 2}, world_size=6, unit=1, tp=1, gone=set())
    assert got is not None and got.store_node == "b" and got.leaving == (0, 1) and got.lost == ()
    assert got.store_node == successor_store_node(old, "a")  # where the spare waits
    # draining another node leaves the store where it is
    kept = plan_in_place(old, {"a": 2, "c": 2}, world_size=6, unit=1, tp=1, gone=set())
    assert kept is not None and kept.store_node == "a" and kept.leaving == (2, 3)


def test_draining_the_store_node_shrinks_in_place_and_names_the_new_store_node() -> None:
    sim = _three_nodes()
    gen = sim.state.tasks[JOB].generation
    acts = sim.feed(NodeDrained(ts=sim.ts(), node="n1"))
    assert not only(acts, Assign)
    shrink = one(acts, ResizeInPlace, JOB)
    assert shrink.generation == gen and shrink.leaving == (0, 1) and shrink.lost == () and shrink.store_node == "n2"
    assert sim.state.tasks[JOB].store_node == "n2"


def test_losing_the_store_node_shrinks_in_place_and_names_the_new_store_node() -> None:
    sim = _three_nodes()
    gen = sim.state.tasks[JOB].generation
    acts = sim.feed(NodeLost(ts=sim.ts(), node="n1", reason="link closed"))
    assert not only(acts, Assign)
    shrink = one(acts, ResizeInPlace, JOB)
    assert shrink.generation == gen and shrink.lost == (0, 1) and shrink.store_node == "n2"
    assert sim.state.tasks[JOB].store_node == "n2"
    sim.progress(JOB, 6)
    # the store is n2's now: losing n2 moves it again (to n3), losing rank 0's old node says nothing
    again = one(sim.feed(NodeLost(ts=sim.ts(), node="n2", reason="link closed")), ResizeInPlace, JOB)
    assert again.store_node == "n3" and again.members == (4, 5)


def _grown_back() -> tuple[Sim, ResizeInPlace]:
    """n3 lost (shrink confirmed), then back: the grow re-hosts ranks 4 and 5 there as joiners."""
    sim = _three_nodes()
    sim.feed(NodeLost(ts=sim.ts(), node="n3", reason="link closed"))
    sim.progress(JOB, 6)
    grow = one(sim.feed(NodeJoined(ts=sim.ts(), node="n3", gpus=2)), ResizeInPlace, JOB)
    assert grow.joiners == (4, 5) and sim.phase(JOB) is TaskPhase.RECONFIGURING
    return sim, grow


def _step(sim: Sim, step: int, joined: tuple[int, ...] = ()) -> list[Action]:
    gen = sim.state.tasks[JOB].generation
    return sim.feed(ProgressMade(ts=sim.ts(), task=JOB, step=step, generation=gen, joined=joined))


def test_a_grow_is_confirmed_by_an_iteration_of_each_joiner_not_by_the_survivors_steps() -> None:
    """The survivors step on without the joiners until they are admitted: before, their steps confirmed
    a grow whose joiner never ran, and the task was RUNNING one replica short with its GPUs held."""
    sim, _ = _grown_back()
    for step in (7, 8, 9):
        _step(sim, step)
    assert sim.phase(JOB) is TaskPhase.RECONFIGURING
    _step(sim, 10, joined=(4,))
    assert sim.phase(JOB) is TaskPhase.RECONFIGURING and sim.state.tasks[JOB].joiners == [5]
    _step(sim, 11, joined=(5,))
    assert sim.phase(JOB) is TaskPhase.RUNNING
    assert "once every joiner completed an iteration" in sim.transitions[-1].reason


def test_a_joiner_that_dies_at_its_start_is_relaunched() -> None:
    """Before, its death was merged into the resize and the survivors' steps confirmed it: rank 4 stayed
    dead for good."""
    sim, grow = _grown_back()
    acts = sim.incident("n3", (DetectionMethod.PROCESS_SUPERVISION, ErrorKind.EXITED_ABNORMALLY), task=JOB,
                        rank=4, generation=grow.generation, step=6)
    restart = one(acts, RestartRanks, JOB)
    assert (restart.node, restart.ranks) == ("n3", (4,)) and sim.phase(JOB) is TaskPhase.RESTARTING
    # a hang report during a resize is still its consequence (peers waiting for removed ranks): merged
    sim, grow = _grown_back()
    assert not sim.incident("n1", (DetectionMethod.STATISTICAL_MONITORING, ErrorKind.TASK_HANG), task=JOB, rank=0,
                            generation=grow.generation, step=6)
    assert sim.phase(JOB) is TaskPhase.RECONFIGURING


def _joiner_restarted() -> Sim:
    """The grow's rank 4 died at its start and is being restarted on n3; rank 5 has not joined yet."""
    sim, grow = _grown_back()
    one(sim.incident("n3", (DetectionMethod.PROCESS_SUPERVISION, ErrorKind.EXITED_ABNORMALLY), task=JOB, rank=4,
                     generation=grow.generation, step=6), RestartRanks, JOB)
    return sim


def _relaunch_step(sim: Sim, step: int, joined: tuple[int, ...]) -> list[Action]:
    entry = sim.state.tasks[JOB]
    return sim.feed(ProgressMade(ts=sim.ts(), task=JOB, step=step, generation=entry.generation,
                                 restart_epoch=entry.restart_epoch, joined=joined))


def test_a_restart_of_one_joiner_is_confirmed_once_the_other_joiners_joined_too() -> None:
    """Before, the relaunched rank 4's iteration confirmed the restart and forgot the grow's joiners:
    rank 5 was never checked, and a joiner that never joined left the task one replica short."""
    sim = _joiner_restarted()
    _relaunch_step(sim, 8, joined=(4,))
    assert sim.phase(JOB) is TaskPhase.RESTARTING and sim.state.tasks[JOB].joiners == [5]
    _step(sim, 9, joined=(5,))
    assert sim.phase(JOB) is TaskPhase.RUNNING and sim.state.tasks[JOB].joiners == []
    assert "once every joiner completed an iteration" in sim.transitions[-1].reason
    # the other order: rank 5 first, then the restart's own proof
    sim = _joiner_restarted()
    _step(sim, 8, joined=(5,))
    assert sim.phase(JOB) is TaskPhase.RESTARTING
    _relaunch_step(sim, 9, joined=(4,))
    assert sim.phase(JOB) is TaskPhase.RUNNING


def test_a_restart_of_a_joiner_whose_peer_joiner_never_joins_isolates_the_missing_joiners_node() -> None:
    sim = _joiner_restarted()
    _relaunch_step(sim, 8, joined=(4,))
    acts = sim.feed(Tick(ts=sim.ts(IN_PLACE.restart_deadline_s + 1)))
    assert one(acts, IsolateNode).node == "n3"
    assert one(acts, ResizeInPlace, JOB).lost == (4, 5)
    # joiners on two nodes (n2 and n3 came back one after the other): n2's restarted joiner joined with
    # its peer, n3's never did: n3 is isolated, not the restart's node
    sim = _three_nodes()
    for node, step in (("n3", 6), ("n2", 7)):
        sim.feed(NodeLost(ts=sim.ts(), node=node, reason="link closed"))
        sim.progress(JOB, step)
    one(sim.feed(NodeJoined(ts=sim.ts(), node="n2", gpus=2)), ResizeInPlace, JOB)
    one(sim.feed(NodeJoined(ts=sim.ts(), node="n3", gpus=2)), ResizeInPlace, JOB)
    assert sim.state.tasks[JOB].joiners == [2, 3, 4, 5]
    one(sim.incident("n2", (DetectionMethod.PROCESS_SUPERVISION, ErrorKind.EXITED_ABNORMALLY), task=JOB, rank=2,
                     generation=sim.state.tasks[JOB].generation, step=7), RestartRanks, JOB)
    _relaunch_step(sim, 9, joined=(2, 3))
    assert sim.phase(JOB) is TaskPhase.RESTARTING
    acts = sim.feed(Tick(ts=sim.ts(IN_PLACE.restart_deadline_s + 1)))
    assert one(acts, IsolateNode).node == "n3"
    # a survivor restarted during the grow: its node while its relaunch has not completed an
    # iteration, the joiners' once it has
    for proven, blamed in ((False, "n1"), (True, "n3")):
        sim, grow = _grown_back()
        one(sim.incident("n1", (DetectionMethod.PROCESS_SUPERVISION, ErrorKind.EXITED_ABNORMALLY), task=JOB,
                         rank=0, generation=grow.generation, step=6), RestartRanks, JOB)
        if proven:
            _relaunch_step(sim, 8, joined=())
        else:
            _step(sim, 8)
        assert sim.phase(JOB) is TaskPhase.RESTARTING
        acts = sim.feed(Tick(ts=sim.ts(IN_PLACE.restart_deadline_s + 1)))
        assert one(acts, IsolateNode).node == blamed, proven


def test_a_node_lost_while_a_grows_crashed_joiner_is_relaunched_shrinks_in_place() -> None:
    """Reviewers' run: shrunk off n2, n2 undrained and grown back, its joiner crashed at its start and
    was being restarted when n3 was lost. The restart (on a node still in service) refused the in-place
    shrink: a new generation killed every survivor and restarted the task from its checkpoint."""
    sim = running_cluster({"n1": 1, "n2": 1, "n3": 1}, {JOB: {"min_gpus": 1}}, Sim(IN_PLACE))
    sim.progress(JOB, 5)
    gen = sim.state.tasks[JOB].generation
    assert one(sim.incident("n2", SEV1_KIND), ResizeInPlace, JOB).lost == (1,)
    sim.progress(JOB, 6)
    grow = one(sim.feed(NodeUndrained(ts=sim.ts(), node="n2")), ResizeInPlace, JOB)
    assert grow.joiners == (1,)
    one(sim.incident("n2", DIED, task=JOB, rank=1, generation=gen, step=6), RestartRanks, JOB)
    acts = sim.feed(NodeLost(ts=sim.ts(), node="n3", reason="heartbeat timeout"))
    assert not only(acts, Assign)
    shrink = one(acts, ResizeInPlace, JOB)
    assert shrink.generation == gen and shrink.members == (0, 1) and shrink.lost == (2,)
    entry = sim.state.tasks[JOB]
    assert entry.relaunching == {} and entry.joiners == [1]
    # confirmed once the relaunched joiner completed an iteration, not by rank 0's steps alone
    _step(sim, 8)
    assert sim.phase(JOB) is TaskPhase.RECONFIGURING
    _step(sim, 9, joined=(1,))
    assert sim.phase(JOB) is TaskPhase.RUNNING
    # pending joiners are no surviving replica: with the only rank holding state lost, a new generation
    sim = _joiner_restarted()
    sim.feed(NodeLost(ts=sim.ts(), node="n2", reason="heartbeat timeout"))
    assert one(sim.feed(NodeLost(ts=sim.ts(), node="n1", reason="heartbeat timeout")), Assign, JOB)
    sim, _ = _grown_back()
    sim.feed(NodeLost(ts=sim.ts(), node="n2", reason="heartbeat timeout"))
    assert one(sim.feed(NodeLost(ts=sim.ts(), node="n1", reason="heartbeat timeout")), Assign, JOB)


def test_a_survivor_restarted_during_a_grow_is_not_confirmed_by_the_joiners_alone() -> None:
    """Rank 0 dies during the grow and is restarted on n1. The joiners' processes (launched by the grow,
    restart epoch 0) then complete an iteration. Before, their step confirmed the restart although rank
    0's relaunch had shown nothing: its outstanding action and deadline were gone, the budget reset."""
    sim, grow = _grown_back()
    one(sim.incident("n1", DIED, task=JOB, rank=0, generation=grow.generation, step=6), RestartRanks, JOB)

    def joiner(rank: int) -> RankStatus:
        return RankStatus.from_dict({
            "task": JOB, "generation": grow.generation, "rank": rank, "state": "running", "pid": 1,
            "step": 7, "advanced": True, "membership_epoch": grow.membership_epoch, "restart_epoch": 0})

    for made in causes.progress(status("n3", [joiner(4), joiner(5)]), sim.state, {(JOB, grow.generation): 6},
                                ts=sim.ts()):
        sim.feed(made)
    entry = sim.state.tasks[JOB]
    assert sim.phase(JOB) is TaskPhase.RESTARTING and entry.joiners == [] and entry.relaunching == {"n1": [0]}
    _relaunch_step(sim, 8, joined=())
    assert sim.phase(JOB) is TaskPhase.RUNNING


def test_a_grow_whose_joiners_never_join_isolates_their_node_at_its_deadline() -> None:
    sim, _ = _grown_back()
    _step(sim, 7)
    acts = sim.feed(Tick(ts=sim.ts(IN_PLACE.resize_deadline_s + 1)))
    assert one(acts, IsolateNode).node == "n3"
    shrink = one(acts, ResizeInPlace, JOB)
    assert shrink.lost == (4, 5) and "n3" not in shrink.placement and sim.state.tasks[JOB].joiners == []
    # the survivors made no step either: the task stalled, which is not the joiners' doing
    sim, _ = _grown_back()
    acts = sim.feed(Tick(ts=sim.ts(IN_PLACE.resize_deadline_s + 1)))
    assert not only(acts, IsolateNode) and sim.state.nodes["n3"].status.value == "up"


def test_a_resize_decided_while_a_grows_joiners_join_waits_for_them() -> None:
    sim, _ = _grown_back()
    drain = one(sim.feed(NodeDrained(ts=sim.ts(), node="n2")), ResizeInPlace, JOB)
    assert drain.leaving == (2, 3) and drain.joiners == () and sim.state.tasks[JOB].joiners == [4, 5]
    _step(sim, 8)
    assert sim.phase(JOB) is TaskPhase.RECONFIGURING
    _step(sim, 9, joined=(4, 5))
    assert sim.phase(JOB) is TaskPhase.RUNNING
    # another node lost meanwhile: its sev1 clears the outstanding grow before the re-plan, which used
    # to drop the joiners, and the survivors' steps confirmed a task that ran one replica short
    sim, _ = _grown_back()
    shrink = one(sim.feed(NodeLost(ts=sim.ts(), node="n2", reason="link closed")), ResizeInPlace, JOB)
    assert shrink.lost == (2, 3) and sim.state.tasks[JOB].joiners == [4, 5]
    _step(sim, 8)
    assert sim.phase(JOB) is TaskPhase.RECONFIGURING
    _step(sim, 9, joined=(4, 5))
    assert sim.phase(JOB) is TaskPhase.RUNNING
    # a joiner whose node leaves before it joined is waited for no longer
    sim, _ = _grown_back()
    one(sim.feed(NodeLost(ts=sim.ts(), node="n3", reason="link closed")), ResizeInPlace, JOB)
    assert sim.state.tasks[JOB].joiners == []
    _step(sim, 8)
    assert sim.phase(JOB) is TaskPhase.RUNNING


HANG = (DetectionMethod.STATISTICAL_MONITORING, ErrorKind.TASK_HANG)


def test_a_node_lost_while_its_rank_is_being_restarted_shrinks_in_place() -> None:
    """Resize soak, seed 11: a partitioned node's rank looked hung to its peers (its last status showed
    it computing), so a peer's hang report restarted it half a second before the node's loss was found;
    the loss then relaunched the whole task as a new generation, as for any restart under way."""
    sim = _three_nodes()
    gen = sim.state.tasks[JOB].generation
    one(sim.incident("n3", HANG, task=JOB, rank=4, generation=gen, step=5), RestartRanks, JOB)
    acts = sim.feed(NodeLost(ts=sim.ts(), node="n3", reason="heartbeat timeout"))
    shrink = one(acts, ResizeInPlace, JOB)
    assert not only(acts, Assign) and shrink.lost == (4, 5) and sim.state.tasks[JOB].relaunching == {}
    # a restart on a node that stays is still under way: the loss of another node is a new generation
    sim = _three_nodes()
    one(sim.incident("n2", HANG, task=JOB, rank=2, generation=gen, step=5), RestartRanks, JOB)
    assert one(sim.feed(NodeLost(ts=sim.ts(), node="n3", reason="heartbeat timeout")), Assign, JOB)


def test_a_node_isolated_and_rejoined_in_one_decision_keeps_no_in_place_survivors() -> None:
    """``b`` (n1) and ``a`` (ranks 0-3 on n1, 4-11 on n2) each have a restart out; n1's agent
    re-registers past both deadlines. That NodeJoined's deadline check isolates n2 and n1 (their ranks
    killed), then puts n1 back: the re-plan resized ``a`` in place keeping ranks 0-3 on n1 as survivors,
    which the executor (no record of ``a`` left) dropped, and the core waited out the resize's deadline.
    Now the tasks of a node isolated and back in one decision are relaunched; the executor's records
    match the core's placements."""
    sim = Driven()
    sim.join("n1", gpus=8)
    sim.join("n2", gpus=8)
    sim.submit("b", min_gpus=4, max_gpus=4)
    sim.confirm_outstanding()
    sim.submit("a", min_gpus=4, max_gpus=12)
    sim.confirm_outstanding()
    assert sim.state.tasks["b"].placement == {"n1": [0, 1, 2, 3]}
    assert sim.state.tasks["a"].placement == {"n1": [0, 1, 2, 3], "n2": list(range(4, 12))}
    sim.incident("n2", DIED, task="a", rank=4, generation=1)  # RestartRanks a on n2
    sim.incident("n1", DIED, task="b", rank=0, generation=1)  # RestartRanks b on n1
    acts = sim.feed(NodeJoined(ts=sim.ts(200), node="n1", gpus=8))
    assert {a.node for a in only(acts, IsolateNode)} == {"n1", "n2"} and not only(acts, ResizeInPlace)
    for name, entry in sim.state.tasks.items():
        for node, ranks in entry.placement.items():
            record = sim.executor.desired.get(node, {}).get(name)
            assert record is not None and sorted(r.rank for r in record.ranks) == ranks, (
                f"core places {name} ranks {ranks} on {node}; executor record: {record}")


def test_a_survivors_failed_reconcile_during_a_grow_does_not_isolate_the_joiners_node() -> None:
    """A failed reconcile names no node; the core blamed the node the grow named (its joiners'): n1's
    agent failing isolated n3. Now a failure on a node the action is not for blames none; one on the
    joiners' node still isolates it."""
    from tests.coordinator.test_decision_results import _failed_reconcile

    sim, _ = _grown_back()
    acts = [a for ev in _failed_reconcile(sim, "n1", JOB) for a in sim.feed(ev)]
    assert not only(acts, IsolateNode)
    sim, _ = _grown_back()
    acts = [a for ev in _failed_reconcile(sim, "n3", JOB) for a in sim.feed(ev)]
    assert one(acts, IsolateNode).node == "n3"


# --- a store sidecar that dies on a node still in service ----------------------------------------


def test_a_store_move_keeps_the_membership_and_names_the_spares_node_or_the_same_one() -> None:
    placement = {"b": [2, 3], "a": [0, 1]}
    moved = store_move(placement, "a")
    assert moved.placement == {"a": [0, 1], "b": [2, 3]} and moved.store_node == "b" and moved.fresh_store
    assert (moved.joiners, moved.leaving, moved.lost) == ((), (), ())
    assert store_move({"a": [0, 1]}, "a").store_node == "a"  # no other node: a fresh sidecar on the same one


def test_a_dead_store_sidecar_moves_the_store_in_place_and_restarts_nothing() -> None:
    """(Taken for a sev2 it restarted ranks onto the dead store, and the failed restart isolated the
    healthy node; reproduced with a SIGKILLed sidecar, tests/integration/test_store_lost.py.)"""
    sim = Driven(IN_PLACE)
    for n in ("n1", "n2", "n3"):
        sim.join(n, 2)
    sim.submit(JOB, min_gpus=2)
    sim.confirm_outstanding()
    sim.progress(JOB, 5)
    gen = sim.state.tasks[JOB].generation
    acts = sim.incident("n1", STORE_LOST_KIND, task=JOB, generation=gen)
    move = one(acts, ResizeInPlace, JOB)
    assert not only(acts, IsolateNode) and not only(acts, RestartRanks) and not only(acts, Assign)
    assert move.generation == gen and move.members == (0, 1, 2, 3, 4, 5)
    assert (move.joiners, move.leaving, move.lost) == ((), (), ())
    assert move.store_node == "n2" and move.fresh_store  # the spare's node
    records = {n: sim.executor.desired[n][JOB] for n in ("n1", "n2", "n3")}
    assert {(r.store_node, r.store_epoch) for r in records.values()} == {("n2", move.membership_epoch)}
    assert [s.rank for s in records["n1"].ranks] == [0, 1]  # every rank stays where it runs
    sim.progress(JOB, 6)
    assert sim.phase(JOB) is TaskPhase.RUNNING
    # the same report again, or one from the old store's node, is of a store that has moved on
    assert sim.incident("n1", STORE_LOST_KIND, task=JOB, generation=gen) == []


def test_a_dead_store_sidecar_of_a_one_node_task_gets_a_fresh_one_there() -> None:
    sim = Driven(IN_PLACE)
    sim.join("n1", 2)
    sim.submit(JOB, min_gpus=2)
    sim.confirm_outstanding()
    sim.progress(JOB, 5)
    move = one(sim.incident("n1", STORE_LOST_KIND, task=JOB), ResizeInPlace, JOB)
    assert move.store_node == "n1" and move.fresh_store
    record = sim.executor.desired["n1"][JOB]
    assert (record.store_node, record.store_epoch) == ("n1", move.membership_epoch) and record.store_epoch > 0


def test_a_dead_store_sidecar_where_no_in_place_change_is_allowed_relaunches_the_task() -> None:
    """A restart task's next attempt brings a fresh store; with in-place resizes off, or a restart under
    way (its relaunched ranks wait on the dead store), a new generation does."""
    restart = _three_nodes(recovery="restart", max_gpus=6)
    assert one(restart.incident("n1", STORE_LOST_KIND, task=JOB), RestartTask, JOB)
    off = running_cluster({"n1": 2, "n2": 2}, {JOB: {"min_gpus": 2}}, Sim(DecisionSettings(in_place_resize=False)))
    off.progress(JOB, 5)
    gen = off.state.tasks[JOB].generation
    relaunch = one(off.incident("n1", STORE_LOST_KIND, task=JOB), Assign, JOB)
    assert relaunch.generation > gen
    restarting = _three_nodes()
    one(restarting.incident("n2", SEV2_KIND, task=JOB, rank=2), RestartRanks, JOB)
    acts = restarting.incident("n1", STORE_LOST_KIND, task=JOB)
    assert one(acts, Assign, JOB) and not only(acts, ResizeInPlace) and not only(acts, IsolateNode)
