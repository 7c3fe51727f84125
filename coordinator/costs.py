"""Recovery cost per incident (paper Eq. 1): detection + transition + sub-healthy time.

Pure, like the decision core it watches: the daemon hands it each decision (the state before and
after, the incident that caused it if any, the decision's time) and writes back the incidents whose
cost changed, in the same fenced transaction as the decision. :meth:`CostTracker.step` returns a new
tracker instead of changing this one, so a decision whose write failed leaves it as it was.

* detection: ``detected_ts - source_ts``, set when the incident is classified (``causes.incident``);
* transition: from the tracked action the incident led to (a Reattempt, RestartRanks, or the Assigns
  of a reconfiguration) until every task it was for runs again at its recovered configuration (the
  core's RECOVERED edge: the task is RUNNING with no action outstanding). An action that fails and
  escalates keeps the clock running; ``action`` then names the last one;
* sub-healthy: from that confirmation until each task holds at least the GPUs it held before the
  incident (0 when no capacity was lost, as in a restart or reattempt), or leaves the task set. A
  task that fails or is cancelled before it recovered is not waited for.

The tracker lives in the leader's memory: incidents still open when leadership moves keep the cost
terms they had, and the new leader does not finish them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from coordinator import decision as d
from unicron.kernel.types import Incident

#: open incidents kept at most (the oldest is dropped, unfinished, beyond it)
MAX_OPEN = 1000

_ACTION_NAMES = {
    d.ActionKind.REATTEMPT: "reattempt",
    d.ActionKind.RESTART: "restart",
    d.ActionKind.ASSIGN: "reconfigure",
    d.ActionKind.RESIZE: "reconfigure",
}
_PRECEDENCE = ("reconfigure", "restart", "reattempt")  # the widest action names a multi-task incident


@dataclass
class _Open:
    incident: Incident
    #: task -> GPUs it held when the incident's action was issued
    gpus_before: dict[str, int]
    #: tasks whose recovery is not confirmed yet
    recovering: set[str]
    #: tasks confirmed running, but on fewer GPUs than before
    reduced: set[str] = field(default_factory=set)
    #: tasks confirmed running again (a task that failed instead is not among them)
    recovered: set[str] = field(default_factory=set)


def _gpus(state: d.CoreState, task: str) -> int:
    entry = state.tasks.get(task)
    return len(entry.all_ranks()) if entry is not None else 0


def _gone(state: d.CoreState, task: str) -> bool:
    entry = state.tasks.get(task)
    return entry is None or entry.phase not in d.ACTIVE_PHASES


def _running(state: d.CoreState, task: str) -> bool:
    entry = state.tasks.get(task)
    return entry is not None and entry.phase is d.TaskPhase.RUNNING and entry.outstanding is None


def _new_actions(before: d.CoreState, after: d.CoreState) -> dict[str, str]:
    """Tasks that got a new tracked action in this decision -> its name."""
    out: dict[str, str] = {}
    for name, entry in after.tasks.items():
        o = entry.outstanding
        old = before.tasks.get(name)
        if o is not None and (old is None or old.outstanding is None or old.outstanding.action_id != o.action_id):
            out[name] = _ACTION_NAMES[o.kind]
    return out


def _widest(names: set[str]) -> str | None:
    return next((n for n in _PRECEDENCE if n in names), None)


class CostTracker:
    def __init__(self, open_: dict[str, _Open] | None = None) -> None:
        self._open: dict[str, _Open] = open_ or {}

    def open_incidents(self) -> list[str]:
        return list(self._open)

    def step(
        self, before: d.CoreState, after: d.CoreState, ts: float, incident: Incident | None = None
    ) -> tuple[CostTracker, list[Incident]]:
        """One adopted decision. Returns the tracker after it and the incidents whose cost changed
        (``incident`` itself, if given, always among them: it carries the action it led to)."""
        if incident is None and not self._open:
            return self, []  # the common case (ticks, progress): nothing to copy
        open_ = {k: dataclasses.replace(o, gpus_before=dict(o.gpus_before), recovering=set(o.recovering),
                                        reduced=set(o.reduced), recovered=set(o.recovered))
                 for k, o in self._open.items()}
        changed: dict[str, Incident] = {}
        issued = _new_actions(before, after)
        # An escalation (a failed restart turned into a reconfiguration) keeps the incident's clock.
        for o in open_.values():
            names = {issued[t] for t in o.recovering if t in issued}
            action = _widest(names | ({o.incident.action} if o.incident.action else set()))
            if names and action != o.incident.action:
                o.incident = dataclasses.replace(o.incident, action=action)
                changed[o.incident.incident_id] = o.incident
        if incident is not None:
            tasks = sorted(t for t in issued if not any(t in o.recovering for o in open_.values()))
            inc = dataclasses.replace(incident, action=_widest({issued[t] for t in tasks}),
                                      action_ts=ts if tasks else None, tasks=tasks)
            changed[inc.incident_id] = inc
            if tasks:
                open_[inc.incident_id] = _Open(inc, {t: _gpus(before, t) for t in tasks}, set(tasks))
        for key in list(open_):
            o = open_[key]
            if self._advance(o, after, ts):
                changed[o.incident.incident_id] = o.incident
            if not o.recovering and not o.reduced:
                del open_[key]
        while len(open_) > MAX_OPEN:
            del open_[next(iter(open_))]
        return CostTracker(open_), list(changed.values())

    @staticmethod
    def _advance(o: _Open, after: d.CoreState, ts: float) -> bool:
        """Confirmations and returns to full capacity in ``after``; True when ``o.incident`` changed."""
        inc = o.incident
        assert inc.action_ts is not None
        for task in sorted(o.recovering):
            if _running(after, task):
                o.recovering.discard(task)
                o.recovered.add(task)
                if _gpus(after, task) < o.gpus_before[task]:
                    o.reduced.add(task)
            elif _gone(after, task):
                o.recovering.discard(task)  # failed or cancelled before it recovered: not waited for
        for task in sorted(o.reduced):
            if _gone(after, task) or (_running(after, task) and _gpus(after, task) >= o.gpus_before[task]):
                o.reduced.discard(task)
        if o.recovering or inc.transition_s is not None:
            if not o.reduced and inc.sub_healthy_s is None and inc.recovered_ts is not None:
                o.incident = dataclasses.replace(inc, sub_healthy_s=ts - inc.recovered_ts)
                return True
            return False
        if not o.recovered:  # every task it was for left before recovering: no transition to speak of
            return False
        o.incident = dataclasses.replace(
            inc, recovered_ts=ts, transition_s=ts - inc.action_ts, sub_healthy_s=None if o.reduced else 0.0)
        return True
