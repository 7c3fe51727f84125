"""The baselines of paper §7.5 on the same trace and workload: Megatron, Oobleck, Varuna, Bamboo.

All four start from Unicron's initial plan (paper §7.5: "we assign the same initial configuration plan
designated for Unicron to these baselines"). On a failure only the task directly hit is handled; a task
that lost a node shrinks to the largest count it can run on with what it still holds plus idle GPUs;
a repaired node goes to the task first affected that is still short (paper §7.5). What differs between
them is a :class:`Profile`: throughput relative to Megatron, detection, and the cost of a transition.
docs/simulator.md cites where each number comes from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coordinator.placement import place
from sim.costs import CostSettings
from sim.engine import DETECT, IDLE, RUN, Simulation
from sim.trace import Failure, Trace
from sim.workload import Workload
from unicron.kernel.errors import PermanentError
from unicron.kernel.types import ErrorKind


@dataclass(frozen=True)
class Profile:
    """How one baseline behaves, in terms of :class:`CostSettings`."""

    name: str
    throughput: Callable[[CostSettings], float]
    """F relative to Megatron's at the same allocation."""
    failure_s: Callable[[CostSettings], float]
    """Transition after a failure: restart (and recompute) or in-job reconfiguration."""
    grow_s: Callable[[CostSettings], float]
    """Transition to take a repaired node back (planned: nothing to recompute)."""


def _detect(c: CostSettings, f: Failure) -> float:
    # Without in-band detection (paper Table 2, "w/o Unicron"): a lost node is seen by the scheduler in
    # 5.7 s, everything else only when the collective times out (D_timeout).
    return c.megatron_detect_node_s if f.kind == ErrorKind.LOST_CONNECTION.value else c.megatron_timeout_s


PROFILES: dict[str, Profile] = {
    "megatron": Profile("megatron", lambda c: 1.0, lambda c: c.megatron_restart_s + c.megatron_recompute_s,
                        lambda c: c.megatron_restart_s),
    "oobleck": Profile("oobleck", lambda c: c.oobleck_throughput, lambda c: c.oobleck_transition_s,
                       lambda c: c.oobleck_transition_s),
    "varuna": Profile("varuna", lambda c: c.varuna_throughput, lambda c: c.varuna_restart_s + c.megatron_recompute_s,
                      lambda c: c.varuna_restart_s),
    "bamboo": Profile("bamboo", lambda c: c.bamboo_throughput, lambda c: c.bamboo_transition_s,
                      lambda c: c.bamboo_transition_s),
}


class BaselineSim(Simulation):
    def __init__(
        self,
        profile: Profile,
        initial: dict[str, dict[str, int]],
        workload: Workload,
        trace: Trace,
        costs: CostSettings,
        seed: int = 0,
        progress: bool = False,
    ) -> None:
        self.system = profile.name
        super().__init__(workload, trace, costs, seed, progress)
        self.profile = profile
        self.throughput_factor = profile.throughput(self.costs)
        self.initial = {t: dict(nodes) for t, nodes in initial.items()}
        self.target = {t: sum(nodes.values()) for t, nodes in initial.items()}
        self.placed: dict[str, dict[str, int]] = {}
        self.waiting: list[str] = []  # tasks short of their initial size, first affected first

    def setup(self) -> None:
        self.placed = {t: dict(n) for t, n in self.initial.items() if sum(n.values()) > 0}
        for name, nodes in self.placed.items():
            run = self.tasks[name]
            run.gpus, run.status = sum(nodes.values()), RUN

    def on_failure(self, f: Failure) -> None:
        if f.severity == 1:
            hit = sorted(t for t, nodes in self.placed.items() if nodes.get(f.node))
        else:
            task = self.task_at(self.placed, f.node, f.gpu)
            hit = [task] if task is not None and self.tasks[task].status == RUN else []
        if not hit:
            self.count("failures_on_idle_gpus")
            return
        for name in hit:
            run = self.tasks[name]
            run.status = DETECT
            run.token += 1
        self.at(self.now + _detect(self.costs, f), lambda: self._detected(f, hit))

    def _detected(self, f: Failure, hit: list[str]) -> None:
        for name in hit:
            if self.tasks[name].status != DETECT:
                continue  # a later event already restarted it
            if f.severity == 1:
                self._resize(name, grow=False)
                if name not in self.waiting and self.tasks[name].gpus < self.target[name]:
                    self.waiting.append(name)
            else:
                self.count("restart")
                self.start_transition(name, self.profile.failure_s(self.costs))

    def on_repair(self, f: Failure) -> None:
        for name in list(self.waiting):
            before = self.tasks[name].gpus
            self._resize(name, grow=True)
            if self.tasks[name].gpus >= self.target[name]:
                self.waiting.remove(name)
            if self.tasks[name].gpus > before:
                return  # the node went to the first affected task that could use it

    def _resize(self, name: str, grow: bool) -> None:
        """The largest runnable count <= the task's initial size on what it holds plus idle GPUs; only
        this task moves (the others keep their placement)."""
        usable = self.usable()
        holdings = {t: {n: g for n, g in nodes.items() if n in usable} for t, nodes in self.placed.items()}
        others = sum(sum(h.values()) for t, h in holdings.items() if t != name)
        spec = self.workload.spec(name)
        run = self.tasks[name]
        limit = min(self.target[name], sum(usable.values()) - others)
        for count in range(limit, -1, -1):
            if not spec.valid_count(count) or count % spec.tp_size:
                continue
            counts = {t: sum(h.values()) for t, h in holdings.items()} | {name: count}
            tp = {t: self.workload.spec(t).tp_size for t in counts}
            try:
                placement = place(counts, usable, holdings, tp)
            except PermanentError:
                continue
            if grow and count <= run.gpus:
                return
            self.placed = {t: nodes for t, nodes in placement.items() if nodes}
            run.gpus = count
            if count == 0:
                run.status = IDLE
                run.token += 1
                self.count("stopped")
                return
            self.count("grow" if grow else "shrink")
            self.start_transition(name, (self.profile.grow_s if grow else self.profile.failure_s)(self.costs))
            return
