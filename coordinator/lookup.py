"""The plans lookup table the coordinator keeps for its current state (paper §5.2).

After each plan the allocator asks for a table of every one-step change from the new state
(:meth:`PlanLookup.expect`); a background thread builds it (:class:`plans.lookup.LookupTable`, one solve
per task holding GPUs, one for an idle node, one for a join), so that a node lost or joined later is
answered by a dictionary lookup (:meth:`PlanLookup.answer`); anything else, or a table not built yet,
is a miss and the allocator solves. A table is keyed by the exact problem (cluster, every task's demand,
the planner), so a stale table can only miss, never answer the wrong problem - including a table
asked for by a decision whose fenced write failed (the daemon never adopted that state).

The decision loop never waits: ``answer`` reads whatever table is complete, ``expect`` only records the
request. The simulator runs the same code without the thread (``background=False``): it calls
:meth:`PlanLookup.build_pending` after each decision, and its tables solve an entry when first asked
(``lazy``), which gives the same plan as solving it up front.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from plans.api import ClusterSpec, LookupTable, PlanResult, TaskDemand, WafPlanner
from unicron.kernel import log as ulog

log = ulog.get(__name__)


@dataclass(frozen=True)
class _Request:
    cluster: ClusterSpec
    tasks: tuple[TaskDemand, ...]
    planner: WafPlanner


class PlanLookup:
    """The current table, its pending rebuild, and hit / miss counts."""

    def __init__(self, background: bool = True, lazy: bool = False) -> None:
        self.background = background
        self.lazy = lazy
        self.hits = 0
        self.misses = 0
        self.builds = 0
        self._table: LookupTable | None = None
        self._wanted: _Request | None = None
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def hit_rate(self) -> float | None:
        asked = self.hits + self.misses
        return self.hits / asked if asked else None

    @property
    def solve_s(self) -> float:
        """Solving time inside the current table so far (a lazy table solves on its first answer)."""
        table = self._table
        return table.solve_s if table is not None else 0.0

    def answer(self, cluster: ClusterSpec, tasks: Sequence[TaskDemand], planner: WafPlanner) -> PlanResult | None:
        """The table's plan for this problem, or None (a miss: the caller solves)."""
        table = self._table  # one read: the builder swaps whole tables
        found = table.answer(cluster, tasks) if table is not None and table.planner is planner else None
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def expect(self, cluster: ClusterSpec, tasks: Sequence[TaskDemand], planner: WafPlanner) -> None:
        """Build a table for this state (the latest request wins; an older one not started is dropped)."""
        table = self._table
        if table is not None and table.planner is planner and table.cluster == cluster and table.tasks == list(tasks):
            return  # already the current table
        with self._cond:
            self._wanted = _Request(cluster, tuple(tasks), planner)
            self._cond.notify()

    def build_pending(self) -> None:
        """Build the requested table now, in this thread (the simulator, tests)."""
        with self._cond:
            wanted, self._wanted = self._wanted, None
        if wanted is not None:
            self._build(wanted)

    def _build(self, wanted: _Request) -> None:
        try:
            self._table = LookupTable(wanted.cluster, wanted.tasks, wanted.planner, lazy=self.lazy)
            self.builds += 1
        except Exception as exc:  # a table only saves time: a failed build means misses, not a dead daemon
            log.warning("lookup table build failed; planning by solving", error=repr(exc))

    # -- the background builder ---------------------------------------------------------------------

    def start(self) -> None:
        if not self.background or self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="plan-lookup", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30.0)
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._wanted is None and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                wanted, self._wanted = self._wanted, None
            if wanted is not None:
                self._build(wanted)
