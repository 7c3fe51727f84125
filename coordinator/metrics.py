"""The coordinator's Prometheus metrics (served with ``--metrics-port``; names in docs/operations.md).

Recorded by the daemon around its decisions (``coordinator/daemon.py``), never by the decision core,
which stays pure (an import-linter contract forbids it I/O). One :class:`CoordinatorMetrics` per
daemon, on its own registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator import decision as d
from unicron.kernel.metrics import HEARTBEAT_BUCKETS, EtcdMetrics
from unicron.kernel.types import Incident

#: seconds; detection is milliseconds to a few seconds (Table 2), recoveries seconds to minutes
DETECTION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
NODE_STATES = tuple(s.value for s in d.NodeState)


class _HeartbeatAges(Collector):
    """``unicron_heartbeat_age_seconds{node}``, read from the link at scrape time."""

    def __init__(self, ages: Callable[[], Mapping[str, float]]) -> None:
        self.ages = ages

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily("unicron_heartbeat_age_seconds",
                                   "seconds since each connected agent's last heartbeat", labels=["node"])
        for node, age in sorted(self.ages().items()):
            family.add_metric([node], age)
        yield family


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.etcd = EtcdMetrics(r)
        self.incidents = Counter("unicron_incidents", "incidents recorded, by severity (info: recorded only) and kind",
                                 ["severity", "kind", "method", "handled"], registry=r)
        self.detection = Histogram("unicron_detection_seconds", "incident detection latency: detected - source time",
                                   ["method", "action"], buckets=DETECTION_BUCKETS, registry=r)
        self.transition = Histogram("unicron_transition_seconds",
                                    "recovery transition: action issued -> recovery confirmed",
                                    ["action"], buckets=RECOVERY_BUCKETS, registry=r)
        self.sub_healthy = Histogram("unicron_sub_healthy_seconds",
                                     "recovery confirmed -> the tasks back at their GPUs before the incident",
                                     ["action"], buckets=RECOVERY_BUCKETS, registry=r)
        self.task_recovery = Counter("unicron_task_recovery_seconds",
                                     "paper Eq. 1 time per task: detection + transition + sub-healthy seconds",
                                     ["task"], registry=r)
        self.task_gpus = Gauge("unicron_task_gpus", "GPUs each active task holds", ["task"], registry=r)
        self.task_planned_flops = Gauge("unicron_task_planned_flops",
                                        "the planner's modelled FLOP/s of each task at its GPUs (not measured)",
                                        ["task"], registry=r)
        self.task_planned_waf = Gauge("unicron_task_planned_waf",
                                      "the planner's weighted achieved FLOP/s (Eq. 2) of each task (modelled)",
                                      ["task"], registry=r)
        self.nodes = Gauge("unicron_nodes", "nodes by state as the decision core sees them", ["state"], registry=r)
        self.leader = Gauge("unicron_leader", "1 while this coordinator leads", registry=r)
        self.heartbeat_gap = Histogram("unicron_heartbeat_gap_seconds", "time between two heartbeats of an agent",
                                       buckets=HEARTBEAT_BUCKETS, registry=r)
        self.node_losses = Counter("unicron_node_losses", "nodes lost, by how (connection closed, heartbeat "
                                   "timeout, lease expiry)", ["reason"], registry=r)
        self.alerts = Counter("unicron_alerts", "Alert actions of the decision core", registry=r)
        self.webhook_failures = Counter("unicron_alert_webhook_failures",
                                        "alerts the webhook did not accept after every retry", registry=r)
        self._tasks: set[str] = set()
        self._planned: set[str] = set()
        self._recovering: set[str] = set()  #: tasks with a task_recovery series

    def watch_heartbeats(self, ages: Callable[[], Mapping[str, float]]) -> None:
        self.registry.register(_HeartbeatAges(ages))

    def incident(self, inc: Incident) -> None:
        """A new incident (with the action it led to, see :mod:`coordinator.costs`)."""
        severity = str(inc.severity) if inc.severity is not None else "info"
        self.incidents.labels(severity, inc.kind.value, inc.method.value, str(inc.handled).lower()).inc()
        if inc.detection_s is not None:
            self.detection.labels(inc.method.value, inc.action or "none").observe(max(0.0, inc.detection_s))
            self._recovery(inc.tasks, inc.detection_s)

    def cost_changed(self, old: Incident | None, new: Incident) -> None:
        """An incident's transition or sub-healthy time became known."""
        action = new.action or "none"
        if new.transition_s is not None and (old is None or old.transition_s is None):
            self.transition.labels(action).observe(new.transition_s)
            self._recovery(new.tasks, new.transition_s)
        if new.sub_healthy_s is not None and (old is None or old.sub_healthy_s is None):
            self.sub_healthy.labels(action).observe(new.sub_healthy_s)
            self._recovery(new.tasks, new.sub_healthy_s)

    def _recovery(self, tasks: Iterable[str], seconds: float) -> None:
        for task in tasks:
            self.task_recovery.labels(task).inc(max(0.0, seconds))
            self._recovering.add(task)

    def state(self, state: d.CoreState) -> None:
        """Gauges from the adopted decision state."""
        counts = dict.fromkeys(NODE_STATES, 0)
        for entry in state.nodes.values():
            counts[entry.status.value] += 1
        for name, n in counts.items():
            self.nodes.labels(name).set(n)
        active = {t: len(e.all_ranks()) for t, e in state.tasks.items() if e.phase in d.ACTIVE_PHASES}
        for task in self._tasks - set(active):
            self.task_gpus.remove(task)
        # a task's recovery series ends with it (a leader that ran through thousands of uniquely
        # named jobs exported one series per name it ever saw); a cost that comes in later (a
        # sub-healthy time) brings it back until the next adopted state
        for task in self._recovering - set(active):
            self.task_recovery.remove(task)
        self._recovering &= set(active)
        for task, gpus in active.items():
            self.task_gpus.labels(task).set(gpus)
        self._tasks = set(active)
        # likewise a task's planned figures: a plan is not re-made for a cancel that leaves no task (or
        # only unmodelled ones), and a cancelled task's modelled FLOP/s stayed on the dashboard
        for task in self._planned - set(active):
            self.task_planned_flops.remove(task)
            self.task_planned_waf.remove(task)
        self._planned &= set(active)

    def planned(self, flops: Mapping[str, float], waf: Mapping[str, float]) -> None:
        """The planner's last plan: modelled throughput and WAF per task."""
        for task in self._planned - set(flops):
            self.task_planned_flops.remove(task)
            self.task_planned_waf.remove(task)
        for task, value in flops.items():
            self.task_planned_flops.labels(task).set(value)
            self.task_planned_waf.labels(task).set(waf.get(task, 0.0))
        self._planned = set(flops)
