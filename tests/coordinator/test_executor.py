"""The executor is pure: its assignments name no host and no port, and take each node's GPUs from
its registration (issue #12 item 4)."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from coordinator import decision as d
from coordinator.daemon import execute
from coordinator.decision.resize import plan_in_place
from coordinator.executor import Executor
from coordinator.tasks import Recovery, TaskSpec
from tests.coordinator.test_decision import SEV1_KIND, Sim, spec
from unicron.kernel.errors import PermanentError
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.types import NodeAssignment

SPEC = TaskSpec(name="t", command=(sys.executable, "-m", "unicron.runtime.workload"))


def executor(gpus: dict[str, int]) -> Executor:
    return Executor(Keyspace("/x"), lambda task: SPEC if task == SPEC.name else None, lambda node: gpus[node])


def assign(task: str, placement: dict[str, tuple[int, ...]], generation: int = 1) -> d.Assign:
    world = sum(len(r) for r in placement.values())
    return d.Assign(action_id="a", task=task, generation=generation, placement=placement, world_size=world,
                    reason="test")


def test_assignment_names_the_store_node_and_no_host_or_port() -> None:
    ex = executor({"n0": 2, "n1": 2})
    assert ex.apply(assign("t", {"n1": (0, 1), "n0": (2, 3)})) == {"n0", "n1"}
    for node in ("n0", "n1"):
        _, value = ex.record(node)
        raw = json.loads(value)
        (task,) = raw["tasks"]
        # The node hosting rank 0 hosts the store; which port, and at what address, its agent decides.
        assert task["store_node"] == "n1"
        assert not {"master_addr", "master_port", "host_store"} & set(task)
        assert "127.0.0.1" not in value and "localhost" not in value
        NodeAssignment.from_dict(raw)


def test_gpus_come_from_the_node_registration() -> None:
    ex = executor({"n0": 4})
    ex.apply(assign("t", {"n0": (0, 1)}))
    spec2 = TaskSpec(name="u", command=("true",))
    ex.specs = lambda task: {"t": SPEC, "u": spec2}.get(task)
    ex.apply(assign("u", {"n0": (0, 1)}))
    gpus = {t.task: [r.gpu for r in t.ranks] for t in ex.desired["n0"].values()}
    assert gpus == {"t": [0, 1], "u": [2, 3]}


def test_a_node_without_free_gpus_is_a_planner_error_and_changes_nothing() -> None:
    ex = executor({"n0": 2, "n1": 1})
    ex.apply(assign("t", {"n0": (0, 1)}))
    before = {n: dict(t) for n, t in ex.desired.items()}
    with pytest.raises(PermanentError, match="node n1, which has 1 free GPU"):
        ex.apply(assign("t", {"n0": (0, 1), "n1": (2, 3)}, generation=2))
    assert ex.desired == before


def test_an_unregistered_node_has_no_gpus() -> None:
    ex = Executor(Keyspace("/x"), lambda task: SPEC, lambda node: 0)
    with pytest.raises(PermanentError, match="0 free GPU"):
        ex.apply(assign("t", {"ghost": (0,)}))


def test_group_rank_numbers_nodes_by_their_lowest_rank_as_torchrun_does() -> None:
    ex = Executor(Keyspace("/x"), lambda task: SPEC, lambda node: 2, max_restarts=4)
    ex.apply(assign("t", {"a": (4, 5), "b": (0, 1), "c": (2, 3)}))
    got = {n: (t["t"].group_rank, t["t"].group_world_size, t["t"].max_restarts) for n, t in ex.desired.items()}
    assert got == {"b": (0, 3, 4), "c": (1, 3, 4), "a": (2, 3, 4)}


def resize(placement: dict[str, tuple[int, ...]], epoch: int, joiners: tuple[int, ...] = (),
           leaving: tuple[int, ...] = (), lost: tuple[int, ...] = ()) -> d.ResizeInPlace:
    members = tuple(sorted(r for ranks in placement.values() for r in ranks))
    return d.ResizeInPlace(action_id="r", task="t", generation=1, membership_epoch=epoch, placement=placement,
                           members=members, joiners=joiners, leaving=leaving, lost=lost, world_size=6,
                           reason="test")


def test_resize_in_place_keeps_the_generation_and_the_survivors_rank_specs() -> None:
    ex = executor({"n0": 2, "n1": 2, "n2": 2})
    ex.apply(assign("t", {"n0": (0, 1), "n1": (2, 3), "n2": (4, 5)}))
    before = {n: ex.desired[n]["t"] for n in ("n0", "n1")}
    # n2 lost: its record drops the task; the others name the new membership, same generation
    assert ex.apply(resize({"n0": (0, 1), "n1": (2, 3)}, 1, lost=(4, 5))) == {"n0", "n1", "n2"}
    assert "t" not in ex.desired["n2"]
    for node, old in before.items():
        now = ex.desired[node]["t"]
        assert (now.generation, now.world_size, now.ranks, now.store_node) == (1, 6, old.ranks, "n0")
        assert (now.membership_epoch, list(now.members), now.joiners, now.lost) == (1, [0, 1, 2, 3], [], [4, 5])
        assert now.members.ranges == [[0, 4]]  # as ranges in the record, not one id each
    # n2 back: its ranks are joiners there, on its GPUs
    ex.apply(resize({"n0": (0, 1), "n1": (2, 3), "n2": (4, 5)}, 2, joiners=(4, 5)))
    back = ex.desired["n2"]["t"]
    assert [(s.rank, s.gpu) for s in back.ranks] == [(4, 0), (5, 1)]
    assert (back.generation, back.membership_epoch, back.joiners, back.world_size) == (1, 2, [4, 5], 6)
    NodeAssignment.from_json(ex.record("n2")[1])


def test_a_node_whose_ranks_leave_keeps_the_task_with_no_ranks() -> None:
    ex = executor({"n0": 2, "n1": 2})
    ex.apply(assign("t", {"n0": (0, 1), "n1": (2, 3)}))
    ex.apply(resize({"n0": (0, 1)}, 1, leaving=(2, 3)))
    drained = ex.desired["n1"]["t"]
    assert drained.ranks == [] and drained.membership_epoch == 1 and list(drained.members) == [0, 1]


def test_a_resize_naming_a_new_store_node_moves_the_store_at_its_membership_epoch() -> None:
    ex = executor({"n0": 2, "n1": 2, "n2": 2})
    ex.apply(assign("t", {"n0": (0, 1), "n1": (2, 3), "n2": (4, 5)}))
    moved = dataclasses.replace(resize({"n1": (2, 3), "n2": (4, 5)}, 1, lost=(0, 1)), store_node="n1")
    assert ex.apply(moved) == {"n0", "n1", "n2"}
    assert "t" not in ex.desired["n0"]
    assert {(t["t"].store_node, t["t"].store_epoch) for n, t in ex.desired.items() if t} == {("n1", 1)}
    # a later resize that keeps the store leaves its epoch alone
    ex.apply(dataclasses.replace(resize({"n1": (2, 3)}, 2, lost=(4, 5)), store_node="n1"))
    assert (ex.desired["n1"]["t"].store_node, ex.desired["n1"]["t"].store_epoch) == ("n1", 1)


def test_an_isolated_nodes_record_says_so_until_it_is_placed_on_again() -> None:
    """Its agent kills (not stops) what the record no longer lists; a draft's isolation is the draft's."""
    ex = executor({"n0": 1, "n1": 1})
    ex.apply(assign("t", {"n0": (0,), "n1": (1,)}))
    draft = ex.draft()
    assert draft.apply(d.IsolateNode(action_id="i", node="n1", reason="xid 79")) == {"n1"}
    isolated = NodeAssignment.from_json(draft.record("n1")[1])
    assert isolated.isolated and isolated.tasks == []
    assert not NodeAssignment.from_json(draft.record("n0")[1]).isolated
    assert "n1" not in ex.isolated and ex.desired["n1"], "the draft changed the executor it was drawn from"

    successor = executor({"n0": 1, "n1": 1})  # a new leader reads the records back
    successor.load({"n0": draft.record("n0")[1].encode(), "n1": draft.record("n1")[1].encode()})
    assert successor.isolated == {"n1"}
    successor.apply(assign("t", {"n0": (0,), "n1": (1,)}, generation=2))  # returned to service
    assert not NodeAssignment.from_json(successor.record("n1")[1]).isolated
    # a leader re-elected after another led meanwhile and returned n1 to service reads the records anew
    records = {"n0": successor.record("n0")[1].encode(), "n1": successor.record("n1")[1].encode()}
    successor.isolated.add("n1")  # what it believed when it lost the lead
    successor.load(records)
    assert successor.isolated == set(), "a reload kept an isolation the records no longer say"


def spare_store_nodes(ex: Executor) -> set[str]:
    return {t["t"].spare_store_node for t in ex.desired.values() if "t" in t}


def test_an_in_place_task_names_the_node_its_store_would_move_to_and_follows_the_move() -> None:
    ex = Executor(Keyspace("/x"), lambda task: SPEC, lambda node: 2, spare_stores=True)
    ex.apply(assign("t", {"n0": (4, 5), "n1": (0, 1), "n2": (2, 3)}))
    # the store on rank 0's node (n1); if n1 alone is lost, the resize puts it on the lowest survivor's
    assert {t["t"].store_node for t in ex.desired.values()} == {"n1"}
    assert spare_store_nodes(ex) == {"n2"}
    plan = plan_in_place({"n0": [4, 5], "n1": [0, 1], "n2": [2, 3]}, {"n0": 2, "n2": 2}, world_size=6, unit=2,
                           tp=1, gone={"n1"}, store_node="n1")
    assert plan is not None and plan.store_node == "n2"  # what the executor named, the planner picks
    ex.apply(dataclasses.replace(resize({"n0": (4, 5), "n2": (2, 3)}, 1, lost=(0, 1)), store_node="n2"))
    assert {t["t"].store_node for t in ex.desired.values() if "t" in t} == {"n2"}
    assert spare_store_nodes(ex) == {"n0"}  # the next one
    ex.apply(resize({"n2": (2, 3)}, 2, leaving=(4, 5)))
    assert spare_store_nodes(ex) == {""}  # no other node holds ranks


def test_a_restart_task_or_spares_off_names_no_spare_store_node() -> None:
    restart = dataclasses.replace(SPEC, recovery=Recovery.RESTART)
    ex = Executor(Keyspace("/x"), lambda task: restart, lambda node: 2, spare_stores=True)
    ex.apply(assign("t", {"n0": (0, 1), "n1": (2, 3)}))
    assert spare_store_nodes(ex) == {""}  # its spare stays with its store (a restart replaces it there)
    off = Executor(Keyspace("/x"), lambda task: SPEC, lambda node: 2)
    off.apply(assign("t", {"n0": (0, 1), "n1": (2, 3)}))
    assert spare_store_nodes(off) == {""}


class Driven(Sim):
    """A Sim whose every decision is also applied to an Executor, as the daemon applies it (a refused
    action raises here; the daemon drops the whole decision and its input)."""

    def __init__(self, settings: d.DecisionSettings | None = None) -> None:
        super().__init__(settings)
        self.executor = Executor(Keyspace("/x"), lambda task: None, lambda node: 0)

    def feed(self, event: d.Event) -> list[d.Action]:
        actions = super().feed(event)
        self.executor, _ = execute(self.executor, self.state, actions)
        return actions

    def confirm_outstanding(self) -> None:
        """Confirm every task's outstanding action (an in-place resize by a step past it)."""
        for name, entry in sorted(self.state.tasks.items()):
            o = entry.outstanding
            if o is None:
                continue
            if o.kind is d.ActionKind.RESIZE:
                self.feed(d.ProgressMade(ts=self.ts(), task=name, step=(entry.last_step or 0) + 1,
                                         generation=entry.generation))
            else:
                self.feed(d.ActionSucceeded(ts=self.ts(), action_id=o.action_id))

    def gpus_on(self, node: str) -> dict[str, list[int]]:
        """The GPUs each task's record on ``node`` names."""
        return {t: sorted(r.gpu for r in ta.ranks) for t, ta in self.executor.desired.get(node, {}).items()}


def test_a_task_may_take_gpus_that_a_later_action_of_the_same_decision_frees() -> None:
    """``b`` holds all 8 GPUs of n0 and ``a`` (sorted first) is submitted: the core emits ``Assign a``
    before the action that shrinks ``b`` (a ResizeInPlace, or an Assign with in-place resize off).
    Applied one by one, ``Assign a`` found b still on every GPU and was refused, and the daemon dropped
    the decision (the submission failed); now the decision's leaving ranks go first."""
    for in_place in (True, False):
        sim = Driven(d.DecisionSettings(in_place_resize=in_place))
        sim.join("n0", gpus=8)
        sim.submit("b", min_gpus=4)
        sim.confirm_outstanding()
        sim.submit("a", min_gpus=4)
        gpus = sim.gpus_on("n0")
        assert sorted(gpus["a"] + gpus["b"]) == list(range(8)), (in_place, gpus)


def test_an_in_place_grow_may_take_gpus_that_a_later_shrink_of_the_same_decision_frees() -> None:
    """The same between two in-place resizes: ``b`` (ranks 8-15 of 16, on n1) grows back onto n0
    before ``c`` shrinks there. Its joiners found no free GPU and the decision was refused; now c's
    leaving ranks give theirs up first."""
    sim = Driven()
    sim.join("n0", gpus=8)
    sim.join("n1", gpus=8)
    sim.submit("b", min_gpus=4)  # 16 ranks over n0 and n1
    sim.confirm_outstanding()
    sim.submit("c", min_gpus=4)  # b shrinks in place to n1, c gets n0
    sim.confirm_outstanding()
    assert sim.state.tasks["c"].placement == {"n0": list(range(8))}
    sim.feed(d.TaskUpdated(ts=sim.ts(), spec=spec("c", min_gpus=4, max_gpus=4)))  # c: 4 at most
    gpus = sim.gpus_on("n0")
    assert len(gpus["b"]) == 4 and len(gpus["c"]) == 4 and not set(gpus["b"]) & set(gpus["c"])


def test_a_resize_of_a_task_the_executor_runs_nowhere_is_refused() -> None:
    """The core and the executor out of step: the resize used to be dropped silently (the core then
    waited out its deadline for ranks nothing ran); now it is refused."""
    with pytest.raises(PermanentError, match="no ranks assigned"):
        executor({"n0": 2}).apply(resize({"n0": (0, 1)}, 1))


def test_a_reassigned_rank_is_told_where_it_ran_before_its_replica_holders_are_found_from_it() -> None:
    """The agent gave a relaunched rank the 1,024 replica servers nearest its new node: on a larger
    cluster the one holding its replica (its previous node's successor) was not among them. Its
    RankSpec now names the nodes it ran on, newest first, even when that node is isolated in the same
    decision and its record cleared."""
    ex = executor({"n0": 2, "n1": 2, "n2": 2, "n3": 2})
    ex.apply(assign("t", {"n0": (0, 1), "n1": (2, 3)}))
    ex.apply_all([d.IsolateNode(action_id="i", node="n1", reason="xid 79"),
                  assign("t", {"n0": (0, 1), "n2": (2, 3)}, generation=2)])
    previous = {s.rank: s.previous_nodes for t in ("n0", "n2") for s in ex.desired[t]["t"].ranks}
    assert previous == {0: ["n0"], 1: ["n0"], 2: ["n1"], 3: ["n1"]}
    # lost again before it saved there: the node before is still named (its replica may be there alone)
    ex.apply(assign("t", {"n0": (0, 1), "n3": (2, 3)}, generation=3))
    previous = {s.rank: s.previous_nodes for t in ("n0", "n3") for s in ex.desired[t]["t"].ranks}
    assert previous == {0: ["n0"], 1: ["n0"], 2: ["n2", "n1"], 3: ["n2", "n1"]}
    ex.apply(assign("t", {"n1": (0, 1), "n2": (2, 3)}, generation=4))  # a few only: the newest two
    assert [s.previous_nodes for s in ex.desired["n2"]["t"].ranks] == [["n3", "n2"], ["n3", "n2"]]
    _, value = ex.record("n2")
    assert NodeAssignment.from_json(value).tasks[0].ranks[0].previous_nodes == ["n3", "n2"]  # round trip


def previous_nodes(sim: Driven, task: str) -> dict[int, list[str]]:
    """rank -> the nodes its RankSpec names as where it ran before, over every node's record."""
    return {s.rank: s.previous_nodes for tasks in sim.executor.desired.values() if task in tasks
            for s in tasks[task].ranks}


def new_leader(sim: Driven) -> None:
    """What a coordinator taking the lead holds: the state as persisted (JSON), the executor loaded
    from the node records the old leader wrote."""
    sim.state = d.CoreState.from_dict(json.loads(json.dumps(sim.state.to_dict())))
    records = dict(sim.executor.record(node) for node in sorted(sim.executor.desired))
    sim.executor = Executor(Keyspace("/x"), lambda task: None, lambda node: 0)
    sim.executor.load({key: value.encode() for key, value in records.items()})


@pytest.mark.parametrize("failover", [False, True])
def test_a_task_stopped_to_wait_for_a_node_is_placed_again_naming_where_its_ranks_ran(failover: bool) -> None:
    """A full cluster loses a node: the task stops and waits pending, its records go. Its next Assign,
    decisions later, named no previous node (read from those records) and its restore could not find
    the peers holding its in-memory replicas; the core now keeps the last placement until then, with
    the state (a new leader in between names them too)."""
    sim = Driven()
    sim.join("n0", gpus=8)
    sim.join("n1", gpus=8)
    sim.submit("job", min_gpus=16, max_gpus=16)
    sim.confirm_outstanding()
    assert previous_nodes(sim, "job") == {r: [] for r in range(16)}  # a first placement names none
    sim.feed(d.NodeLost(ts=sim.ts(), node="n1", reason="lease expired"))
    assert sim.phase("job") is d.TaskPhase.PENDING and previous_nodes(sim, "job") == {}
    if failover:
        new_leader(sim)
    sim.join("n1", gpus=8)  # back: placed again in a later decision
    assert sim.phase("job") is d.TaskPhase.RECONFIGURING
    assert sim.state.tasks["job"].placement == {"n0": list(range(8)), "n1": list(range(8, 16))}
    assert previous_nodes(sim, "job") == {r: ["n0" if r < 8 else "n1"] for r in range(16)}
    assert sim.state.tasks["job"].last_placement == {}  # named once: the records say it now


def test_a_rank_whose_node_was_isolated_before_its_reassignment_is_told_that_node() -> None:
    """The node is isolated (its record cleared) in the decision that stops the task (the rest does
    not fit its minimum); a node joins later and the task is placed there: the ranks that ran on the
    isolated node are told it, as those that ran on the healthy one are."""
    sim = Driven()
    sim.join("n0", gpus=8)
    sim.join("n1", gpus=8)
    sim.submit("job", min_gpus=16, max_gpus=16)
    sim.confirm_outstanding()
    acts = sim.incident("n1", SEV1_KIND)
    assert any(isinstance(a, d.IsolateNode) and a.node == "n1" for a in acts)
    assert sim.phase("job") is d.TaskPhase.PENDING and previous_nodes(sim, "job") == {}
    acts = sim.join("n2", gpus=8)
    (launch,) = [a for a in acts if isinstance(a, d.Assign)]
    assert launch.placement == {"n0": tuple(range(8)), "n2": tuple(range(8, 16))}
    assert previous_nodes(sim, "job") == {r: ["n0" if r < 8 else "n1"] for r in range(16)}
    # stopped so again: the newest placement is the one named
    sim.confirm_outstanding()
    sim.incident("n2", SEV1_KIND)
    sim.join("n3", gpus=8)
    assert {r: nodes[0] for r, nodes in previous_nodes(sim, "job").items()} == {
        r: "n0" if r < 8 else "n2" for r in range(16)}


def test_the_last_placement_goes_with_the_state_and_is_left_out_while_empty() -> None:
    """Persisted so that a new leader names it; absent while empty (an older leader reading the state
    refuses unknown fields), and dropped when the task ends (no Assign will name it)."""
    sim = Driven()
    sim.join("n0", gpus=8)
    sim.submit("job", min_gpus=8)
    sim.confirm_outstanding()
    assert "last_placement" not in sim.state.to_dict()["tasks"]["job"]  # type: ignore[index]
    sim.feed(d.NodeLost(ts=sim.ts(), node="n0", reason="lease expired"))
    data = json.loads(json.dumps(sim.state.to_dict()))
    assert data["tasks"]["job"]["last_placement"] == {"n0": list(range(8))}
    assert d.CoreState.from_dict(data) == sim.state
    sim.feed(d.TaskCancelled(ts=sim.ts(), task="job"))
    assert sim.state.tasks["job"].last_placement == {}
    assert "last_placement" not in sim.state.to_dict()["tasks"]["job"]  # type: ignore[index]


def test_an_assigns_previous_placement_round_trips_and_is_left_out_while_empty() -> None:
    named = dataclasses.replace(assign("t", {"n0": (0, 1)}), previous_placement={"n1": (0, 1)})
    assert d.from_dict(json.loads(json.dumps(d.to_dict(named)))) == named
    plain = assign("t", {"n0": (0, 1)})
    assert "previous_placement" not in d.to_dict(plain)
    assert d.from_dict(json.loads(json.dumps(d.to_dict(plain)))) == plain
