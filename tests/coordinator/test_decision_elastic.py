"""Elastic world size for ``recovery: "restart"`` tasks (issue 14 item 2): a stock job runs at exactly
``min_gpus`` unless it declares ``max_gpus``; an elastic one lost a node is relaunched at a smaller world
size within [min_gpus, max_gpus], grows back when the node returns, and each relaunch is the next
attempt (``TORCHELASTIC_RESTART_COUNT``)."""

from __future__ import annotations

import pytest

from coordinator import decision as d
from coordinator.allocation import EvenAllocator, WafAllocator
from coordinator.executor import Executor
from coordinator.tasks import parse_task_spec
from tests.coordinator.test_decision import SEV1_KIND, Sim
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.types import NodeAssignment

JOB = "job"


def spec(**fields: object) -> dict[str, object]:
    return {"name": JOB, "command": ["python", "train.py"], "recovery": "restart", **fields}


def elastic(min_gpus: int = 4, max_gpus: int = 16) -> Sim:
    """``job`` (restart, 4..16 GPUs) running on two 8-GPU nodes at its full 16."""
    sim = Sim()
    sim.join("n1")
    sim.join("n2")
    (assign,) = [a for a in sim.submit(JOB, min_gpus=min_gpus, max_gpus=max_gpus, recovery="restart")
                 if isinstance(a, d.Assign)]
    assert assign.world_size == 16 and assign.restart_epoch == 0  # a first launch is attempt 0
    sim.ok(assign)
    sim.progress(JOB, 5)
    return sim


def assign_of(actions: list[d.Action]) -> d.Assign:
    (a,) = [x for x in actions if isinstance(x, d.Assign) and x.task == JOB]
    return a


def test_a_restart_task_is_fixed_size_unless_it_declares_max_gpus() -> None:
    fixed = parse_task_spec(spec(min_gpus=2), None)
    assert fixed.max_gpus == 2 and [g for g in range(9) if fixed.valid_count(g)] == [0, 2]
    grown = parse_task_spec(spec(min_gpus=2, max_gpus=6, tp_size=2), None)
    assert [g for g in range(9) if grown.valid_count(g)] == [0, 2, 4, 6]
    inprocess = parse_task_spec(spec(min_gpus=2, recovery="inprocess"), None)
    assert inprocess.max_gpus is None and inprocess.valid_count(64)  # Unicron's runtime resizes in place
    assert parse_task_spec(grown.to_dict(), None) == grown


@pytest.mark.parametrize(("fields", "message"), [
    ({"min_gpus": 4, "max_gpus": 2}, "task.max_gpus: 2 is less than min_gpus 4"),
    ({"tp_size": 2, "min_gpus": 2, "max_gpus": 5}, "task.max_gpus: 5 is not a multiple of tp_size*pp_size=2; use 4"),
    ({"max_gpus": "8"}, "task.max_gpus: expected a positive integer"),
    ({"max_gpus": 0}, "task.max_gpus: must be at least 1"),
])
def test_a_bad_max_gpus_is_named(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRecord, match=message.replace("*", r"\*")) as exc:
        parse_task_spec(spec(**fields), None)
    assert "\n" not in str(exc.value)


def test_allocators_keep_a_task_within_max_gpus() -> None:
    fixed = parse_task_spec(spec(min_gpus=2), None)
    capped = parse_task_spec({**spec(min_gpus=2, max_gpus=6), "name": "capped"}, None)
    assert EvenAllocator().allocate([fixed, capped], 16, 8, {}, set()) == {JOB: 2, "capped": 6}
    model = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 128, "vocab_size": 1000,
             "global_batch_size": 16}
    waf = parse_task_spec(spec(min_gpus=2, max_gpus=6, model=model), None)
    counts = WafAllocator().allocate([waf], 16, 8, {}, set())
    assert counts == {JOB: 4}  # the planner's 16 capped to the largest valid count <= 6 (DP must divide 16)


def test_a_lost_node_relaunches_an_elastic_job_smaller_then_it_grows_back() -> None:
    sim = elastic()
    shrink = assign_of(sim.incident("n2", SEV1_KIND))
    assert set(shrink.placement) == {"n1"} and shrink.world_size == 8  # within [4, 16], what fits
    assert shrink.restart_epoch == 1  # the next attempt: TORCHELASTIC_RESTART_COUNT goes on
    sim.ok(shrink)
    sim.progress(JOB, 9)
    grow = assign_of(sim.feed(d.NodeUndrained(ts=sim.ts(), node="n2")))  # the operator returns the repaired node
    assert grow.world_size == 16 and set(grow.placement) == {"n1", "n2"} and grow.restart_epoch == 2


def test_a_fixed_size_job_waits_rather_than_shrink() -> None:
    sim = Sim()
    sim.join("n1")
    sim.join("n2")
    sim.ok(assign_of(sim.submit(JOB, min_gpus=16, recovery="restart")))
    sim.progress(JOB, 5)
    acts = sim.incident("n2", SEV1_KIND)
    assert not [a for a in acts if isinstance(a, d.Assign) and a.placement]
    assert sim.phase(JOB) is d.TaskPhase.PENDING


def test_the_executor_carries_the_restart_count_into_the_new_generation() -> None:
    specs = {JOB: parse_task_spec(spec(min_gpus=4, max_gpus=16), None)}
    ex = Executor(Keyspace("/u"), specs.get, lambda n: 8)
    ex.apply(d.Assign(action_id="a1", task=JOB, generation=3, placement={"n1": tuple(range(8))}, world_size=8,
                      reason="sev1", restart_epoch=2))
    (ta,) = NodeAssignment.from_json(ex.record("n1")[1]).task_assignments()
    assert (ta.generation, ta.world_size, ta.restart_epoch, ta.recovery) == (3, 8, 2, "restart")
