"""The decision core's state: per task and per node, JSON-serialisable (the daemon persists it so that
a new leader resumes where the old one stopped)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

from coordinator.decision.actions import ActionKind
from coordinator.tasks import TaskSpec, parse_task_spec
from unicron.kernel.errors import InvalidRecord


class TaskPhase(enum.StrEnum):
    PENDING = "pending"  # in the task set, no GPUs (its minimum does not fit)
    RECONFIGURING = "reconfiguring"  # an Assign is out, not yet confirmed
    RUNNING = "running"
    REATTEMPTING = "reattempting"  # a Reattempt is out
    RESTARTING = "restarting"  # a RestartRanks is out
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE_PHASES = frozenset(
    {
        TaskPhase.PENDING,
        TaskPhase.RECONFIGURING,
        TaskPhase.RUNNING,
        TaskPhase.REATTEMPTING,
        TaskPhase.RESTARTING,
    }
)



class NodeState(enum.StrEnum):
    UP = "up"
    DRAINED = "drained"  # by an operator; back only by NodeUndrained
    ISOLATED = "isolated"  # sev1; back by NodeUndrained or NodeJoined
    LOST = "lost"  # agent gone; back by NodeJoined


@dataclass
class NodeEntry:
    gpus: int
    status: NodeState = NodeState.UP
    reason: str = ""


@dataclass
class Outstanding:
    """The one tracked action a task waits for."""

    action_id: str
    kind: ActionKind
    deadline: float
    node: str | None = None
    """The node a restart or reattempt is for (the one to isolate if it fails)."""
    waiting: list[str] = field(default_factory=list)
    """Nodes whose ``assign/<node>`` record carries the action and that have not confirmed it yet."""


@dataclass
class TaskEntry:
    spec: TaskSpec
    phase: TaskPhase = TaskPhase.PENDING
    generation: int = 0
    restart_epoch: int = 0
    regroup_epoch: int = 0
    placement: dict[str, list[int]] = field(default_factory=dict)  # node -> global ranks
    last_step: int | None = None
    outstanding: Outstanding | None = None
    reattempts: int = 0  # for the incident being handled
    fault_node: str | None = None
    failed_ranks: list[int] = field(default_factory=list)
    relaunching: dict[str, list[int]] = field(default_factory=dict)
    """node -> ranks the restart under way relaunches (a restart widened by a dead peer has several)."""
    recovery_step: int | None = None  # last step known when the current recovery began
    restarts: int = 0  # restarts without progress
    no_progress_since: int | None = None  # last step known at the first of those restarts
    reason: str = ""  # why pending / failed / what the last recovery was for

    def ranks_on(self, node: str) -> list[int]:
        return self.placement.get(node, [])

    def all_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for ranks in self.placement.values() for r in ranks))


@dataclass
class CoreState:
    now: float = 0.0
    counter: int = 0  # source of action ids
    nodes: dict[str, NodeEntry] = field(default_factory=dict)
    tasks: dict[str, TaskEntry] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {
            "now": self.now,
            "counter": self.counter,
            "nodes": {
                n: {"gpus": e.gpus, "status": e.status.value, "reason": e.reason}
                for n, e in self.nodes.items()
            },
            "tasks": {t: _task_to_dict(e) for t, e in self.tasks.items()},
        }

    @classmethod
    def from_dict(cls, data: object) -> CoreState:
        """Inverse of :meth:`to_dict`; raises InvalidRecord on anything malformed."""
        if not isinstance(data, dict):
            raise InvalidRecord("decision state: expected an object; delete the state key to start afresh")
        try:
            state = cls(now=float(data["now"]), counter=int(data["counter"]))
            for n, e in data["nodes"].items():
                state.nodes[n] = NodeEntry(int(e["gpus"]), NodeState(e["status"]), str(e["reason"]))
            for t, e in data["tasks"].items():
                state.tasks[t] = _task_from_dict(e)
        except InvalidRecord:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidRecord(
                f"decision state: malformed ({exc!r}); delete the state key to start afresh"
            ) from exc
        return state


def _task_to_dict(e: TaskEntry) -> dict[str, object]:
    out = {f.name: getattr(e, f.name) for f in fields(e)}
    out["spec"] = e.spec.to_dict()
    out["phase"] = e.phase.value
    out["placement"] = {n: list(r) for n, r in e.placement.items()}
    out["failed_ranks"] = list(e.failed_ranks)
    o = e.outstanding
    out["outstanding"] = (
        None
        if o is None
        else {
            "action_id": o.action_id,
            "kind": o.kind.value,
            "deadline": o.deadline,
            "node": o.node,
            "waiting": list(o.waiting),
        }
    )
    return out


def _task_from_dict(d: dict[str, Any]) -> TaskEntry:
    raw = dict(d)
    raw["spec"] = parse_task_spec(raw["spec"], None)
    raw["phase"] = TaskPhase(raw["phase"])
    raw["placement"] = {str(n): [int(r) for r in ranks] for n, ranks in raw["placement"].items()}
    # absent in states written before it existed
    raw["relaunching"] = {str(n): [int(r) for r in ranks] for n, ranks in raw.get("relaunching", {}).items()}
    o = raw["outstanding"]
    raw["outstanding"] = (
        None
        if o is None
        else Outstanding(
            str(o["action_id"]),
            ActionKind(o["kind"]),
            float(o["deadline"]),
            o["node"],
            [str(n) for n in o.get("waiting", [])],  # absent in states written before it existed
        )
    )
    return TaskEntry(**raw)

