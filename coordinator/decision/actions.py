"""The decision core's outputs: one frozen dataclass per action, the :data:`Action` union, and
:class:`ActionKind`, the actions that are tracked (they have a deadline and a result)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Reattempt:
    """sev3 ①: running ranks regroup and retry the failed operation in place; no process restarts."""

    action_id: str
    task: str
    generation: int
    regroup_epoch: int
    node: str
    members: tuple[int, ...]
    """Every rank of the task (they all re-form their communicators)."""
    failed_ranks: tuple[int, ...]
    """The ranks the incident named."""


@dataclass(frozen=True, kw_only=True)
class RestartRanks:
    """sev2 ②: relaunch these ranks on ``node`` with the same configuration; the others rejoin them."""

    action_id: str
    task: str
    generation: int
    restart_epoch: int
    node: str
    ranks: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class RestartTask:
    """sev2 / sev3 on a ``recovery: "restart"`` task: stop every rank of the task (SIGTERM, grace,
    SIGKILL) and relaunch all of them where they are, as ``restart_epoch`` (their
    ``TORCHELASTIC_RESTART_COUNT``, the same on every node), after ``delay_s`` (the backoff)."""

    action_id: str
    task: str
    generation: int
    restart_epoch: int
    placement: Mapping[str, tuple[int, ...]]
    """node -> the ranks there: all of the task's."""
    delay_s: float
    reason: str


@dataclass(frozen=True, kw_only=True)
class IsolateNode:
    """sev1 ③: take the node out of every plan until it is undrained or re-joins."""

    action_id: str
    node: str
    reason: str
    task: None = None


@dataclass(frozen=True, kw_only=True)
class Assign:
    """Run ``task`` as ``generation`` with these global ranks per node (launch or reconfiguration).

    Ranks on a node are consecutive and each node holds whole tensor-parallel groups.
    """

    action_id: str
    task: str
    generation: int
    placement: Mapping[str, tuple[int, ...]]
    world_size: int
    reason: str
    restart_epoch: int = 0
    """A ``restart`` task relaunched at a new placement or size is torchrun's next attempt: its restart
    count goes on (``TORCHELASTIC_RESTART_COUNT``); 0 for a first launch and for ``inprocess`` tasks."""
    previous_placement: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """node -> global ranks of the task's last placement when its ranks left it before this decision
    (stopped to wait for GPUs, ``TaskEntry.last_placement``): the executor names those nodes as where
    the ranks ran (``RankSpec.previous_nodes``), which its records no longer say. Empty otherwise."""


@dataclass(frozen=True, kw_only=True)
class ResizeInPlace:
    """Change ``task``'s data-parallel size without stopping its running ranks (same generation, same
    layout): ``membership_epoch`` is its new membership. Rank ids are those of the launch
    (``world_size`` stays); ``placement`` holds every rank of the new membership. Survivors keep their
    processes; ``joiners`` start on their node and join at an iteration boundary, taking their state
    from a healthy replica; ``leaving`` ranks, on nodes still in service, are asked to leave at an
    iteration boundary; ``lost`` ranks went with their node (the task's store node marks them failed).
    ``store_node`` hosts the task's store in the new membership: a node other than the previous one
    when that one is gone (its agent starts a fresh sidecar, the survivors move to it); with
    ``fresh_store`` (the old store's sidecar died) a new store even on the same node, and nothing else
    changes."""

    action_id: str
    task: str
    generation: int
    membership_epoch: int
    placement: Mapping[str, tuple[int, ...]]
    """node -> the ranks there (survivors and joiners)."""
    members: tuple[int, ...]
    joiners: tuple[int, ...]
    leaving: tuple[int, ...]
    lost: tuple[int, ...]
    world_size: int
    reason: str
    store_node: str = ""
    fresh_store: bool = False


@dataclass(frozen=True, kw_only=True)
class StopTask:
    """Stop every process of the task (preempted, cancelled or failed). Returned before any Assign."""

    action_id: str
    task: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class MarkTaskFailed:
    """Record the task as failed, with the reason, for the user."""

    action_id: str
    task: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class Alert:
    """Something an operator should see (a node isolated or lost, a task failed)."""

    action_id: str
    message: str
    task: str | None = None
    node: str | None = None


Action = (
    Reattempt | RestartRanks | RestartTask | IsolateNode | Assign | ResizeInPlace | StopTask | MarkTaskFailed | Alert
)


class ActionKind(enum.StrEnum):
    """The tracked actions (with a deadline and a result)."""

    REATTEMPT = "reattempt"
    RESTART = "restart"
    ASSIGN = "assign"
    RESIZE = "resize"

