"""The agent's Prometheus metrics (served with ``--metrics-port``; names in docs/operations.md).

One :class:`AgentMetrics` per agent, on its own registry. Gauges that are a view of the agent's
state (report queue depth, unhealthy GPUs) are read at scrape time, not pushed on every change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from unicron.kernel.metrics import HEARTBEAT_BUCKETS, EtcdMetrics


class _Sampled(Collector):
    """One unlabelled gauge whose value is read when scraped."""

    def __init__(self, name: str, doc: str, read: Callable[[], float]) -> None:
        self.name, self.doc, self.read = name, doc, read

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(self.name, self.doc, value=self.read())


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.etcd = EtcdMetrics(r)
        self.rank_restarts = Counter("unicron_agent_rank_restarts",
                                     "ranks relaunched for a sev2 restart (same configuration)", ["task"], registry=r)
        self.rank_launches = Counter("unicron_agent_rank_launches", "rank processes launched (any reason)",
                                     ["task"], registry=r)
        self.reports = Counter("unicron_agent_reports", "reports published by this agent, by detection method and kind",
                               ["method", "kind"], registry=r)
        self.heartbeat_interval = Histogram("unicron_agent_heartbeat_interval_seconds",
                                            "time between two heartbeats this agent sent to the coordinator",
                                            buckets=HEARTBEAT_BUCKETS, registry=r)
        self.gpu_events = Counter("unicron_agent_gpu_events", "GPU health events (XID, ECC, NVLink) by kind",
                                  ["kind"], registry=r)
        self.fences = Counter("unicron_agent_fences", "times this agent killed its ranks, cut off from etcd and "
                              "the coordinator (agent/fence.py)", registry=r)

    def task_left(self, task: str) -> None:
        """Drop ``task``'s series once it left this node: an agent that ran for weeks through
        thousands of uniquely named jobs exported one series per name it ever saw."""
        self.rank_launches.remove(task)
        self.rank_restarts.remove(task)

    def sample(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """Register a gauge read at scrape time."""
        self.registry.register(_Sampled(name, doc, read))
