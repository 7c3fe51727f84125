"""The event loop and the bookkeeping every simulated system shares.

Why a heap and not SimPy: every event here is instantaneous (a failure, a detection, the end of a
transition, a repair) and nothing waits on a shared resource, so SimPy's processes and resources
would add a dependency and generator plumbing without modelling anything more. A ``heapq`` of
``(time, sequence, callback)`` gives the same ordering (time, then insertion), is deterministic, and
keeps the hot loop - thousands of events through the decision core - free of framework overhead.

Between two events every task's WAF is constant, so the integral is exact: each task is in one of
``run`` (delivers F(t, x) = w(t) T(t, x) times the system's throughput factor), ``detect`` (failed, not
yet noticed), ``transition`` (being recovered or reconfigured) or ``idle`` (no GPUs). Lost WAF is
booked as detection or transition (what the task would deliver at its current size), and the rest
of the gap to the failure-free plan is the sub-healthy cost of Eq. 1.
"""

from __future__ import annotations

import abc
import functools
import heapq
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from sim.costs import CostSettings
from sim.trace import Failure, Trace
from sim.workload import Workload

RUN, DETECT, TRANSITION, IDLE = "run", "detect", "transition", "idle"


@dataclass
class TaskRun:
    """The simulator's view of one task."""

    name: str
    gpus: int = 0
    status: str = IDLE
    token: int = 0
    """Bumped on every new transition, so the end of a superseded one changes nothing."""


@dataclass
class Result:
    """What one system did over one trace."""

    system: str
    trace: str
    seed: int
    duration_s: float
    times: list[float] = field(default_factory=list)
    available_gpus: list[int] = field(default_factory=list)
    waf: list[float] = field(default_factory=list)
    """Cluster WAF, FLOP/s, from ``times[i]`` until ``times[i + 1]``."""
    accumulated: float = 0.0
    """Integral of the cluster WAF over the run, FLOP (weighted)."""
    ideal: float = 0.0
    """The failure-free plan's WAF times the duration, FLOP (weighted)."""
    lost_detection: float = 0.0
    lost_transition: float = 0.0
    incidents: dict[str, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    decide_ms: list[float] = field(default_factory=list)
    """Wall time of each ``DecisionCore.handle`` call (Unicron only)."""
    setup_events: int = 0
    """How many of ``decide_ms`` were the time-0 setup (nodes joining, tasks submitted)."""
    setup_s: float = 0.0
    wall_s: float = 0.0

    @property
    def lost_sub_healthy(self) -> float:
        return max(self.ideal - self.accumulated - self.lost_detection - self.lost_transition, 0.0)

    def summary(self) -> dict[str, object]:
        pf = 1e15
        hours = self.duration_s / 3600
        return {
            "system": self.system, "trace": self.trace, "seed": self.seed,
            "accumulated_waf_pflop_h": round(self.accumulated / pf / 3600, 3),
            "mean_waf_pflops": round(self.accumulated / pf / max(self.duration_s, 1e-9), 4),
            "ideal_waf_pflop_h": round(self.ideal / pf / 3600, 3),
            "efficiency": round(self.accumulated / self.ideal, 4) if self.ideal else 0.0,
            "lost_pflop_h": {
                "detection": round(self.lost_detection / pf / 3600, 3),
                "transition": round(self.lost_transition / pf / 3600, 3),
                "sub_healthy": round(self.lost_sub_healthy / pf / 3600, 3),
            },
            "hours": round(hours, 2), "incidents": dict(self.incidents), "counters": dict(self.counters),
            "wall_s": round(self.wall_s, 3),
        }


class Simulation(abc.ABC):
    """One system on one trace and workload: a heap of timed callbacks and the WAF integral."""

    system = "system"
    throughput_factor = 1.0

    def __init__(
        self, workload: Workload, trace: Trace, costs: CostSettings, seed: int = 0, progress: bool = False
    ) -> None:
        self.workload = workload
        self.trace = trace
        self.costs = costs
        self.progress = progress
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.tasks = {t.name: TaskRun(t.name) for t in workload.tasks}
        self.down: set[str] = set()
        self.result = Result(self.system, trace.name, seed, trace.duration_s)
        self._last = 0.0
        self._shown = -1

    # -- plumbing -------------------------------------------------------------------------------------

    def at(self, t: float, callback: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, callback))

    def count(self, key: str, n: int = 1) -> None:
        self.result.counters[key] = self.result.counters.get(key, 0) + n

    def nodes(self) -> list[str]:
        from sim.trace import node_name

        return [node_name(i) for i in range(self.workload.n_nodes)]

    def usable(self) -> dict[str, int]:
        return {n: self.workload.gpus_per_node for n in self.nodes() if n not in self.down}

    def task_waf(self, run: TaskRun) -> float:
        return self.throughput_factor * self.workload.waf(run.name, run.gpus)

    def cluster_waf(self) -> float:
        return sum(self.task_waf(r) for r in self.tasks.values() if r.status == RUN)

    def start_transition(self, name: str, seconds: float, then: Callable[[], None] | None = None) -> None:
        run = self.tasks[name]
        run.status = TRANSITION
        run.token += 1
        token = run.token

        def end() -> None:
            if run.token == token and run.status == TRANSITION:
                run.status = RUN if run.gpus > 0 else IDLE
                if then is not None:
                    then()

        self.at(self.now + seconds, end)

    def task_at(self, placement: Mapping[str, Mapping[str, int]], node: str, gpu: int) -> str | None:
        """The task whose ranks use GPU ``gpu`` of ``node`` (tasks fill a node in name order)."""
        offset = 0
        for name in sorted(placement):
            held = placement[name].get(node, 0)
            if offset <= gpu < offset + held:
                return name
            offset += held
        return None

    # -- the loop -------------------------------------------------------------------------------------

    def _integrate(self, t: float) -> None:
        dt = t - self._last
        if dt <= 0:
            return
        for run in self.tasks.values():
            potential = self.task_waf(run) * dt
            if run.status == RUN:
                self.result.accumulated += potential
            elif run.status == DETECT:
                self.result.lost_detection += potential
            elif run.status == TRANSITION:
                self.result.lost_transition += potential
        self._last = t

    def _record(self) -> None:
        r = self.result
        avail = (self.workload.n_nodes - len(self.down)) * self.workload.gpus_per_node
        waf = self.cluster_waf()
        if r.times and r.times[-1] == self.now:
            r.available_gpus[-1], r.waf[-1] = avail, waf
        elif not r.waf or r.waf[-1] != waf or r.available_gpus[-1] != avail:
            r.times.append(self.now)
            r.available_gpus.append(avail)
            r.waf.append(waf)

    def _show(self, t: float) -> None:
        """A progress line on stderr: rewritten in place on a terminal, every 25 % otherwise."""
        if not self.progress or self.trace.duration_s <= 0:
            return
        pct = int(100 * t / self.trace.duration_s)
        tty = sys.stderr.isatty()
        step = 5 if tty else 25
        if pct // step != self._shown // step:
            self._shown = pct
            line = f"  {self.system:<9} {self.trace.name}: {pct:3d}% of {self.trace.duration_s / 86400:.1f} days"
            print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)

    def run(self) -> Result:
        started = time.perf_counter()
        self.setup()
        self.result.setup_events = len(self.result.decide_ms)
        self.result.setup_s = time.perf_counter() - started
        self._record()
        self.result.ideal = self.cluster_waf() * self.trace.duration_s
        for f in self.trace.failures:
            if f.time_s < self.trace.duration_s:
                self.at(f.time_s, functools.partial(self._failure, f))
        while self._heap and self._heap[0][0] <= self.trace.duration_s:
            t, _, callback = heapq.heappop(self._heap)
            self._integrate(t)
            self.now = t
            callback()
            self._record()
            self._show(t)
        self._integrate(self.trace.duration_s)
        self.now = self.trace.duration_s
        if self.progress and sys.stderr.isatty():
            print(file=sys.stderr)
        self.result.wall_s = time.perf_counter() - started
        return self.result

    def _failure(self, f: Failure) -> None:
        key = f"sev{f.severity}"
        self.result.incidents[key] = self.result.incidents.get(key, 0) + 1
        if f.node in self.down or f.node not in set(self.nodes()):
            self.count("failures_ignored_node_down")
            return
        if f.severity == 1:
            self.down.add(f.node)
            self.at(f.time_s + f.repair_s, lambda: self._repair(f))
        self.on_failure(f)

    def _repair(self, f: Failure) -> None:
        self.down.discard(f.node)
        self.on_repair(f)

    # -- what a system decides ------------------------------------------------------------------------

    @abc.abstractmethod
    def setup(self) -> None:
        """Start every task on the initial plan at time 0 (no cost)."""

    @abc.abstractmethod
    def on_failure(self, f: Failure) -> None:
        """A failure happened now (a sev1 node is already out of ``usable()``)."""

    @abc.abstractmethod
    def on_repair(self, f: Failure) -> None:
        """A sev1 node is back in service now."""
