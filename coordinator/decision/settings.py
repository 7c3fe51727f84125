"""Budgets and deadlines of the decision core."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from coordinator.decision.actions import ActionKind
from coordinator.decision.state import SEV2_FAULTS_KEPT
from unicron.kernel.errors import ConfigError


@dataclass(frozen=True)
class DecisionSettings:
    """Budgets and deadlines of the decision core."""

    max_reattempts: int = 1
    """Reattempts in place per incident before it is escalated to sev2 (paper: one)."""
    max_restarts_without_progress: int = 3
    """Restarts (and restart-driven reconfigurations) a task may take while its step does not advance;
    the next fault marks it failed instead of restarting it again."""
    restart_backoff_s: float = 1.0
    """A ``recovery: "restart"`` task's whole-task restarts without progress wait before relaunching:
    none for the first, then this, doubling each time (torchrun relaunches at once, every time)."""
    restart_backoff_max_s: float = 30.0
    """The longest such wait."""
    flap_faults: int = 3
    """Sev2 faults of one node within ``flap_window_s`` that make it flapping: the one that reaches this
    count is escalated to sev1 (the node isolated, every task on it re-planned, as Figure 7 escalates a
    failed restart) instead of restarting ranks there once more. Each restart that worked resets the
    task's restart budget, so a GPU throwing a CUDA error every few steps was restarted for ever.
    Counted: a sev2 that starts the restart of a task that had made progress since its last one (not
    one merged into the recovery under way, nor a peer's death that widens it; faults with no progress
    between them are ``max_restarts_without_progress``'s). 0: never; at most ``SEV2_FAULTS_KEPT`` (the
    times each node keeps)."""
    flap_window_s: float = 3600.0
    """The window of ``flap_faults``: faults further apart than this never make a node flapping."""
    reattempt_deadline_s: float = 30.0
    """Seconds for a reattempt to be confirmed before it counts as failed."""
    restart_deadline_s: float = 120.0
    """Seconds for a restart to be confirmed before it counts as failed."""
    reconfigure_deadline_s: float = 300.0
    """Seconds for an assignment (launch or reconfiguration) to be confirmed before it counts as failed."""
    resize_deadline_s: float = 120.0
    """Seconds for an in-place resize to be confirmed (a step completed after it) before it counts as failed."""
    resize_echo_s: float = 5.0
    """A sev3 of a task detected this long after its in-place resize at most is that resize's echo,
    whatever its step: a call to the store that moved breaks only once its old node's agent stops it,
    and fast iterations (0.1 s in the resize soak) run several steps past the resize by then."""
    ended_tasks_kept: int = 1000
    """Finished, failed and cancelled tasks kept in the state (shown by ``unicron tasks``); past this the
    one that ended first is retired. Every decision and a new leader's load walk the whole task set,
    and a cluster run for months would otherwise keep every task it ever ran."""
    in_place_resize: bool = True
    """Reach a new allocation that keeps the layout by an in-place resize (survivors keep running)
    instead of a new generation. Off: every move is a new generation (stop, snapshot, relaunch)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "in_place_resize":
                if not isinstance(value, bool):
                    raise ConfigError(f"decision.{f.name}: expected true or false, got {value!r}")
            elif f.name == "flap_faults":
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SEV2_FAULTS_KEPT:
                    raise ConfigError(f"decision.{f.name}: expected an integer in [0, {SEV2_FAULTS_KEPT}], "
                                      f"got {value!r}")
            elif f.name.startswith("max_") or f.name == "ended_tasks_kept":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ConfigError(f"decision.{f.name}: expected an integer >= 0, got {value!r}")
            elif not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"decision.{f.name}: expected a number of seconds > 0, got {value!r}")

    def backoff_s(self, restarts: int) -> float:
        """The wait before the ``restarts``-th consecutive restart without progress (1 = the first)."""
        if restarts <= 1:
            return 0.0
        return float(min(self.restart_backoff_s * 2 ** (restarts - 2), self.restart_backoff_max_s))

    def deadline_s(self, kind: ActionKind) -> float:
        return {
            ActionKind.REATTEMPT: self.reattempt_deadline_s,
            ActionKind.RESTART: self.restart_deadline_s,
            ActionKind.ASSIGN: self.reconfigure_deadline_s,
            ActionKind.RESIZE: self.resize_deadline_s,
        }[kind]

