"""Recovery cost per incident (paper Eq. 1), driven through the real decision core."""

from __future__ import annotations

from coordinator.costs import CostTracker
from coordinator.decision import (
    Action,
    ActionFailed,
    Event,
    IncidentRaised,
    NodeJoined,
    Reattempt,
    ResizeInPlace,
    RestartRanks,
    TaskCancelled,
    TaskPhase,
)
from tests.coordinator.test_decision import SEV1_KIND, SEV2_KIND, SEV3_KIND, Sim, one, running_cluster
from unicron.kernel.types import Incident


class Costed(Sim):
    """A Sim that hands every decision to a CostTracker, as the daemon does."""

    def __init__(self) -> None:
        super().__init__()
        self.tracker = CostTracker()
        self.costed: dict[str, Incident] = {}

    def feed(self, event: Event) -> list[Action]:
        before = self.state
        actions = super().feed(event)
        raised = event.incident if isinstance(event, IncidentRaised) else None
        self.tracker, changed = self.tracker.step(before, self.state, event.ts, raised)
        self.costed.update((i.incident_id, i) for i in changed)
        return actions

    def last(self) -> Incident:
        return self.costed[f"i{self.incidents}"]


def cluster(nodes: dict[str, int], tasks: dict[str, dict[str, object]]) -> Costed:
    sim = Costed()
    running_cluster(nodes, tasks, sim)
    return sim


def test_sev2_restart_costs_detection_and_transition_no_sub_healthy_time() -> None:
    sim = cluster({"n1": 8, "n2": 8}, {"job": {}})
    restart = one(sim.incident("n1", SEV2_KIND, task="job", rank=2), RestartRanks)
    issued = sim.t
    inc = sim.last()
    assert (inc.action, inc.action_ts, inc.tasks) == ("restart", issued, ["job"])
    assert inc.detection_s == 0.0 and inc.transition_s is None  # Sim detects at the source time
    sim.t += 2.5
    sim.progress("job", 5, current_generation=False)  # a step of an older process: not a confirmation
    assert sim.phase("job") is TaskPhase.RESTARTING and sim.last().transition_s is None
    sim.ok(restart)  # the relaunched rank runs (or, in the daemon, a new process's step): confirmed
    inc = sim.last()
    assert sim.phase("job") is TaskPhase.RUNNING
    assert inc.transition_s == sim.t - issued == 4.5
    assert inc.recovered_ts == sim.t
    assert inc.sub_healthy_s == 0.0  # the same GPUs as before
    assert inc.recovery_s == 4.5
    assert sim.tracker.open_incidents() == []


def test_sev1_counts_sub_healthy_time_until_the_task_has_its_gpus_back() -> None:
    sim = cluster({"n1": 8, "n2": 8}, {"job": {}})
    assert sum(sim.gpus("job").values()) == 16
    assign = one(sim.incident("n2", SEV1_KIND, task="job"), ResizeInPlace, "job")  # n1 goes on in place
    issued = sim.t
    assert sim.last().action == "reconfigure"
    sim.ok(assign)  # running on n1 alone: recovered, at half capacity
    inc = sim.last()
    assert inc.transition_s == sim.t - issued and inc.sub_healthy_s is None
    recovered = sim.t
    sim.t += 30.0
    grow = one(sim.feed(NodeJoined(ts=sim.ts(), node="n2", gpus=8)), ResizeInPlace, "job")  # n2 back: grow
    assert sim.last().sub_healthy_s is None  # not until the bigger configuration runs
    sim.ok(grow)
    assert sum(sim.gpus("job").values()) == 16
    assert sim.last().sub_healthy_s == sim.t - recovered
    assert sim.tracker.open_incidents() == []


def test_an_escalated_restart_keeps_the_clock_and_names_the_last_action() -> None:
    sim = cluster({"n1": 8, "n2": 8}, {"job": {}})
    restart = one(sim.incident("n1", SEV2_KIND, task="job", rank=2), RestartRanks)
    issued = sim.t
    shrink = one(sim.fail(restart), ResizeInPlace, "job")  # sev1: isolate n1, reconfigure (in place)
    assert sim.last().action == "reconfigure" and sim.last().action_ts == issued
    sim.ok(shrink)
    assert sim.last().transition_s == sim.t - issued


def test_an_incident_merged_into_a_running_recovery_has_no_action_of_its_own() -> None:
    sim = cluster({"n1": 8}, {"job": {}})
    r = one(sim.incident("n1", SEV3_KIND, task="job", rank=1), Reattempt)
    first = sim.last()
    sim.incident("n1", SEV3_KIND, task="job", rank=2)  # while the reattempt is out
    second = sim.last()
    assert second.action is None and second.tasks == [] and second.action_ts is None
    sim.ok(r)
    assert sim.costed[first.incident_id].transition_s == 2.0
    assert sim.costed[second.incident_id].transition_s is None


def test_a_task_cancelled_while_recovering_closes_the_incident_without_a_transition() -> None:
    sim = cluster({"n1": 8}, {"job": {}})
    one(sim.incident("n1", SEV2_KIND, task="job", rank=0), RestartRanks)
    sim.feed(TaskCancelled(ts=sim.ts(), task="job"))
    assert sim.last().transition_s is None
    assert sim.tracker.open_incidents() == []


def test_step_does_not_change_the_tracker_it_is_called_on() -> None:
    """A decision whose write failed is not adopted: the tracker it came from must be unchanged."""
    sim = cluster({"n1": 8}, {"job": {}})
    restart = one(sim.incident("n1", SEV2_KIND, task="job", rank=0), RestartRanks)
    kept = sim.tracker
    before = sim.state
    sim.ok(restart)
    sim.progress("job", 9)
    assert sim.tracker.open_incidents() == [] and kept.open_incidents() == ["i1"]
    # the kept tracker still closes it on the same decision
    _, changed = kept.step(before, sim.state, sim.t)
    assert [i.transition_s for i in changed] == [2.0]


def test_a_failed_action_for_the_task_error_closes_without_transition() -> None:
    sim = cluster({"n1": 8}, {"job": {}})
    restart = one(sim.incident("n1", SEV2_KIND, task="job", rank=0), RestartRanks)
    from coordinator.decision import FailureCause

    sim.feed(ActionFailed(ts=sim.ts(), action_id=restart.action_id, reason="cannot start", node="n1",
                          cause=FailureCause.TASK))
    assert sim.phase("job") is TaskPhase.FAILED
    assert sim.last().transition_s is None and sim.tracker.open_incidents() == []


def test_old_incident_records_parse_without_the_cost_fields() -> None:
    old = {"incident_id": "r-1", "severity": 2, "method": "process_supervision", "kind": "exited_abnormally",
           "node": "n1", "message": "", "task": "t", "gpu": None, "rank": 0, "step": 3, "source_ts": 1.0,
           "detected_ts": 1.5, "report_id": "1", "handled": False}
    inc = Incident.from_dict(old)
    assert inc.detection_s is None and inc.tasks == [] and inc.recovery_s == 0.0
    again = Incident.from_json(inc.to_json())
    assert again == inc
