"""The planner's measured inputs (coordinator.grounding): pure functions over incidents and progress."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from coordinator import decision as d
from coordinator.allocation import WafAllocator, model_spec
from coordinator.costs import CostTracker
from coordinator.decision.throughput import Measured, StepRate, achieved_flops
from coordinator.grounding import (
    Exposure,
    Grounding,
    reliability,
    transition_times,
)
from coordinator.statestore import steps_only
from coordinator.tasks import TaskSpec
from plans.api import ReliabilityModel
from sim.workload import gpt3_task
from tests.coordinator.test_decision import SEV1_KIND, SEV2_KIND, SEV3_KIND, Sim, one, running_cluster
from unicron.kernel.types import DetectionMethod, ErrorKind, Incident, Severity


class Grounded(Sim):
    """A Sim that feeds a CostTracker and a Grounding as coordinator/daemon.py does."""

    def __init__(self) -> None:
        super().__init__()
        self.tracker = CostTracker()
        self.grounding = Grounding(ReliabilityModel())
        self.records: dict[str, Incident] = {}  # what the daemon writes back to etcd, by id

    def feed(self, event: d.Event) -> list[d.Action]:
        before = self.state
        actions = super().feed(event)
        raised = event.incident if isinstance(event, d.IncidentRaised) else None
        self.tracker, costed = self.tracker.step(before, self.state, event.ts, raised)
        self.records.update((i.incident_id, i) for i in costed)
        self.grounding.decided(self.state, event, costed)
        return actions


def _incident(i: int, action: str | None, transition: float | None, tasks: list[str],
              severity: Severity | None = Severity.SEV1) -> Incident:
    return Incident(incident_id=f"i{i}", severity=severity, method=DetectionMethod.NODE_HEALTH,
                    kind=ErrorKind.LOST_CONNECTION, node="n1", message="", task=None, gpu=None, rank=None,
                    step=None, source_ts=float(i), detected_ts=float(i), report_id=f"r{i}", action=action,
                    action_ts=float(i), tasks=tasks, transition_s=transition)


def test_transition_is_the_median_of_the_tasks_last_reconfigurations() -> None:
    incs = [_incident(i, "reconfigure", float(10 * i), ["a"]) for i in range(1, 8)]  # 10..70 s
    incs += [_incident(20, "restart", 999.0, ["a"]),  # not a reconfiguration
             _incident(21, "reconfigure", None, ["a"]),  # not confirmed yet
             _incident(22, "reconfigure", 5.0, ["b", "c"])]
    got = transition_times(incs, window=5)
    assert got == {"a": 50.0, "b": 5.0, "c": 5.0}  # a: median of its last five, 30..70


def test_failure_rate_follows_the_failures_over_the_exposure() -> None:
    exposure = Exposure().advance(0.0, 128).advance(3600.0, 64).advance(7200.0, 64)
    assert exposure.gpu_hours == pytest.approx(128 + 64)
    prior = ReliabilityModel()
    calm, rough = reliability(prior, 0, exposure), reliability(prior, 50, exposure)
    assert calm.gpu_failure_rate_per_hour < prior.gpu_failure_rate_per_hour < rough.gpu_failure_rate_per_hour
    assert rough == prior.observe(50, 192.0)


def test_one_fault_and_the_incidents_it_sets_off_are_one_failure() -> None:
    """Docs review: a killed rank's peers crash and hang after it; each of their incidents, merged into
    the recovery under way, was counted as a failure (one kill of a 4-rank task read as 12), which
    inflated the planner's failure rate. A degradation, a node already out of service, are none either."""
    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {"recovery": "restart"}})
    gen = sim.state.tasks["job"].generation
    assert any(isinstance(a, d.RestartTask) for a in sim.incident("n1", SEV2_KIND, task="job", rank=0, generation=gen))
    for rank in range(1, 16):  # every peer's crash that follows: merged
        assert sim.incident("n1" if rank < 8 else "n2", SEV2_KIND, task="job", rank=rank, generation=gen) == []
    sim.incident("n2", (DetectionMethod.STATISTICAL_MONITORING, ErrorKind.DEGRADATION), task="job", rank=9)
    assert sim.state.failures == 1
    sim.incident("n2", SEV1_KIND)  # a node taken out of service: a failure
    sim.incident("n2", SEV1_KIND)  # its second report: the node is out already
    sim.feed(d.NodeLost(ts=sim.ts(), node="n2", reason="lease expired"))
    assert sim.state.failures == 2
    sim.feed(d.NodeLost(ts=sim.ts(), node="n1", reason="lease expired"))
    assert sim.state.failures == 3 and sim.state.failure_gpu_hours == sim.state.gpu_hours


def test_the_ranks_of_one_node_dying_together_are_one_failure_of_an_in_place_task() -> None:
    """Diff review: an in-place task's peers' deaths widen the restart under way (peer_died -> restart,
    one burst spending one restart): each was counted as a failure, 8 for one node's processes."""
    sim = running_cluster({"n1": 8, "n2": 8}, {"job": {"command": ["python", "-m", "unicron.runtime.x"]}})
    gen = sim.state.tasks["job"].generation
    for rank in range(8):
        sim.incident("n1", SEV2_KIND, task="job", rank=rank, generation=gen)
    assert any(t.cause is d.Trigger.PEER_DIED for t in sim.transitions)
    assert sim.state.failures == 1


def test_step_rate_restarts_with_a_new_configuration() -> None:
    rate = StepRate(1, 8, (0.0, 10), (0.0, 10)).advance(1, 8, 2.0, 12)
    assert rate.steps_per_s() is None  # fewer than three steps
    rate = rate.advance(1, 8, 4.0, 14)
    assert rate.steps_per_s() == pytest.approx(1.0)
    assert achieved_flops(2e15, rate) == pytest.approx(2e15)
    moved = rate.advance(2, 16, 5.0, 15)  # reconfigured: a new measurement
    assert moved.first == (5.0, 15) and moved.steps_per_s() is None


def test_a_measured_point_moves_only_beyond_the_tolerance() -> None:
    m = Measured().with_point(8, 100.0)
    assert m.with_point(8, 105.0) is m
    assert m.with_point(8, 120.0).flops == {8: 120.0}
    assert m.with_point(16, 150.0).calibration() is not None


def _measured(steps: list[int]) -> tuple[Grounding, TaskSpec, d.CoreState]:
    """Task ``a`` (GPT-3 1.3B) running on 8 GPUs, reporting ``steps`` one every 2 s, each decision fed."""
    spec = gpt3_task("a", "1.3B", 1.0)
    core = d.DecisionCore()
    state = core.initial_state()
    state, _ = core.handle(state, d.NodeJoined(ts=0.0, node="n1", gpus=8))
    state, acts = core.handle(state, d.TaskSubmitted(ts=0.0, spec=spec))
    state, _ = core.handle(state, d.ActionSucceeded(ts=1.0, action_id=acts[0].action_id))
    g = Grounding(ReliabilityModel())
    gen = state.tasks["a"].generation
    for i, step in enumerate(steps):
        event = d.ProgressMade(ts=10.0 + 2 * i, task="a", step=step, generation=gen)
        state, _ = core.handle(state, event)
        g.decided(state, event, [])
        flops = g.achieved_flops("a")
        assert flops is None or math.isfinite(flops)
    return g, spec, state


def test_grounding_feeds_the_allocator_what_adopted_decisions_measured() -> None:
    g, spec, state = _measured(list(range(1, 6)))  # one step every 2 s at 8 GPUs
    expected = model_spec(spec).flops_per_iteration / 2.0
    assert g.achieved_flops("a") == pytest.approx(expected)
    inc = dataclasses.replace(_incident(3, "reconfigure", 42.0, ["a"]), node="n9")  # a node the task is not on
    core = d.DecisionCore()
    state, _ = core.handle(state, d.NodeJoined(ts=29.0, node="n9", gpus=8))
    event = d.IncidentRaised(ts=30.0, incident=inc, generation=None)
    state, _ = core.handle(state, event)
    g.decided(state, event, [inc])
    assert g.transition_s == {"a": 42.0} and g.failed == 1
    alloc = WafAllocator("A800")
    assert g.apply(alloc)
    assert alloc.transition_s == {"a": 42.0}
    assert alloc.calibration["a"].measured == {8: pytest.approx(expected)}
    assert alloc.planner.reliability == g.reliability() == reliability(g.prior, 1, g.exposure)
    assert not g.apply(alloc)  # nothing new


def test_a_sub_healthy_reconfiguration_counts_once_in_d_transition() -> None:
    """The cost tracker reports an incident again when its sub-healthy time is known: the live leader
    counted its transition twice (median(1, 1, 19) = 1 where a new leader seeding from the records
    got 10). Now each incident counts once, and both agree."""
    sim = Grounded()
    running_cluster({"n1": 8, "n2": 8}, {"job": {}}, sim)
    # 1st reconfiguration: n2 fails, the job shrinks onto n1 (1 s), n2 comes back and it grows again
    shrink = one(sim.incident("n2", SEV1_KIND, task="job"), d.ResizeInPlace, "job")
    sim.ok(shrink)
    sim.t += 30.0
    grow = one(sim.feed(d.NodeJoined(ts=sim.ts(), node="n2", gpus=8)), d.ResizeInPlace, "job")
    sim.ok(grow)  # back to 16 GPUs: the incident's sub-healthy time is set (its record is re-costed)
    # 2nd reconfiguration: the same, but it takes 19 s
    shrink = one(sim.incident("n2", SEV1_KIND, task="job"), d.ResizeInPlace, "job")
    sim.t += 18.0
    sim.ok(shrink)
    seconds = sorted(i.transition_s for i in sim.records.values() if i.transition_s is not None)
    assert seconds == [1.0, 19.0]
    fresh = Grounding(ReliabilityModel())
    fresh.seed(sim.records.values(), sim.state)
    assert fresh.transition_s == {"job": 10.0}
    assert sim.grounding.transition_s == fresh.transition_s


def test_a_resubmitted_task_starts_without_the_old_runs_measurements() -> None:
    """A cancelled task's data was dropped only once it left the state, and a cancelled task stays:
    a different model resubmitted under its name was planned with the old model's FLOP/s. Now an
    accepted submission starts the name afresh."""
    core = d.DecisionCore()
    g = Grounding(ReliabilityModel())
    state = core.initial_state()

    def feed(event: d.Event) -> list[d.Action]:
        nonlocal state
        state, actions = core.handle(state, event)
        g.decided(state, event, [])
        return actions

    feed(d.NodeJoined(ts=0.0, node="n1", gpus=8))
    acts = feed(d.TaskSubmitted(ts=0.0, spec=gpt3_task("a", "1.3B", 1.0)))
    feed(d.ActionSucceeded(ts=1.0, action_id=acts[0].action_id))
    gen = state.tasks["a"].generation
    for i, step in enumerate(range(1, 6)):
        feed(d.ProgressMade(ts=10.0 + 2 * i, task="a", step=step, generation=gen))
    assert g.achieved_flops("a") is not None
    feed(d.TaskSubmitted(ts=20.0, spec=gpt3_task("a", "13B", 1.0)))  # refused: "a" is running
    assert g.achieved_flops("a") is not None
    feed(d.TaskCancelled(ts=30.0, task="a"))
    feed(d.TaskSubmitted(ts=40.0, spec=gpt3_task("a", "13B", 1.0)))
    alloc = WafAllocator("A800")
    g.apply(alloc)
    assert "a" not in alloc.calibration and "a" not in g.measured


def test_a_reattempt_pause_is_not_measured_as_slower_training() -> None:
    """A reattempt keeps the generation and the GPUs, so the step rate kept its first sample across
    the outage and a 100 s pause made T(t, 8) ten times lower. Now a rate spans uninterrupted
    training only (the pause is D_transition's)."""
    sim = Grounded()
    sim.join("n1")
    spec = gpt3_task("job", "1.3B", 1.0)
    sim.confirm_all(sim.feed(d.TaskSubmitted(ts=sim.ts(), spec=spec)))
    per_step = model_spec(spec).flops_per_iteration / 2.0  # one step every 2 s at 8 GPUs
    step = 0
    for _ in range(5):
        step += 1
        sim.progress("job", step)  # the Sim's clock advances 1 s per event
        sim.t += 1.0
    assert sim.grounding.achieved_flops("job") == pytest.approx(per_step, rel=0.01)
    r = one(sim.incident("n1", SEV3_KIND, task="job", rank=3), d.Reattempt)
    sim.t += 100.0  # the in-place reattempt takes 100 s (same generation, same 8 GPUs)
    sim.ok(r)
    for _ in range(5):
        step += 1
        sim.progress("job", step)
        sim.t += 1.0
    assert sim.grounding.achieved_flops("job") == pytest.approx(per_step, rel=0.1)


def test_an_absurd_step_is_not_measured_and_the_next_reports_are() -> None:
    """One status record with a step of ~1e300 made the measured FLOP/s ``inf``, which a later point
    never replaced (``abs(x - inf) <= 0.1 * inf``); the planner's calibration refused it after every
    decision from then on (review reproduction: 17 refused inputs in 3 s, every submit an error)."""
    g, spec, _ = _measured([1, 2, 3, 4, 10**300, 10**300 + 1, 10**300 + 2, 10**300 + 3, 10**300 + 4])
    assert g.achieved_flops("a") == pytest.approx(model_spec(spec).flops_per_iteration / 2.0)
    alloc = WafAllocator("A800")
    g.apply(alloc)  # the calibration takes it (it refused inf with an error)
    assert alloc.calibration["a"].measured == {8: pytest.approx(model_spec(spec).flops_per_iteration / 2.0)}


def test_a_new_leader_plans_with_the_failures_exposure_and_flops_its_predecessor_measured() -> None:
    """Reviewers' failover: the leader counted failures and measured FLOP/s that only it held; a
    standby seeding from the incident records and the state restarted them at zero, so the planner's
    D_running and T(t, x) moved and it reconfigured healthy tasks. Both now come from the state."""
    sim = Grounded()
    for n in ("n1", "n2", "n3", "n4"):
        sim.join(n)
    tasks = [gpt3_task("a", "1.3B", 1.0), gpt3_task("b", "7B", 1.0)]
    for t in tasks:
        sim.confirm_all(sim.feed(d.TaskSubmitted(ts=sim.ts(), spec=t)))
    step = 0
    for i in range(6):  # a few hours of training, a fault now and then: measured and counted
        for _ in range(5):
            step += 1
            for t in tasks:
                sim.progress(t.name, step)
        node = min(sim.state.tasks["a"].placement)
        sim.ok(one(sim.incident(node, SEV3_KIND, task="a", rank=0, step=step), d.Reattempt))
        sim.t += 3000.0 * (i + 1)
    leader = sim.grounding
    assert leader.failed == 6 and leader.measured.keys() == {"a", "b"}
    assert leader.reliability() != leader.prior
    stored = d.CoreState.from_dict(json.loads(json.dumps(sim.state.to_dict())))  # what etcd holds
    standby = Grounding(ReliabilityModel())
    standby.seed(sim.records.values(), stored)
    assert (standby.failed, standby.exposure.gpu_hours) == (leader.failed, leader.exposure.gpu_hours)
    assert standby.reliability() == leader.reliability()
    assert standby.measured == leader.measured and standby.rates == leader.rates
    assert standby.transition_s == leader.transition_s
    for gpus, current, faulted in ((32, {"a": 16, "b": 16}, set()), (24, {"a": 16, "b": 16}, {"b"}),
                                   (40, {"a": 8, "b": 24}, set())):
        plans = []
        for g in (leader, standby):
            alloc = WafAllocator("A800")
            g.apply(alloc)
            plans.append(alloc.allocate(tasks, gpus, 8, current, faulted))
        assert plans[0] == plans[1], (gpus, current, faulted)
    # a step rate that only moves its last report is no reason for a state write (the standby goes on
    # measuring from the same first report); one that starts measuring is
    started = sim.state
    sim.progress("a", step + 1)
    advanced = sim.state
    sim.progress("a", step + 2)
    assert not steps_only(started, advanced) and steps_only(advanced, sim.state)


def test_a_task_on_more_than_one_nodes_worth_of_gpus_survives_a_leader_change() -> None:
    """Its step rate's GPU count was checked as a node's (at most 1024): a task of 2048 GPUs that had
    made one step could not be read back, and the next leader dropped the cluster's largest task."""
    sim = Grounded()
    for n in ("n1", "n2", "n3"):
        sim.join(n, 1024)
    big = gpt3_task("big", "13B", 1.0)
    sim.confirm_all(sim.feed(d.TaskSubmitted(ts=sim.ts(), spec=dataclasses.replace(big, min_gpus=2048))))
    for step in (1, 2):
        sim.progress("big", step)
    assert sim.gpus("big") and sum(sim.gpus("big").values()) >= 2048
    rate = sim.state.tasks["big"].rate
    assert rate is not None and rate.gpus >= 2048
    stored = d.CoreState.from_dict(json.loads(json.dumps(sim.state.to_dict())))
    assert stored.tasks["big"].rate == rate
