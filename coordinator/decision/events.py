"""The decision core's inputs: one frozen dataclass per event, and the :data:`Event` union."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from coordinator.tasks import TaskSpec
from unicron.kernel.types import Incident


@dataclass(frozen=True, kw_only=True)
class IncidentRaised:
    """A classified incident (``coordinator.causes``)."""

    ts: float
    incident: Incident
    generation: int | None = None
    """The task generation the reporting process ran under (``Report.generation``); an incident from an
    older generation than the task's current one is a leftover of a replaced configuration and ignored."""
    restart_epoch: int | None = None
    """The restart epoch the reporting process was launched under (``Report.restart_epoch``): a process
    of the pending restart's epoch that dies shows the restart failed."""


@dataclass(frozen=True, kw_only=True)
class NodeJoined:
    """An agent registered (new node, or a lost/isolated node back): reconfigure ④."""

    ts: float
    node: str
    gpus: int


@dataclass(frozen=True, kw_only=True)
class NodeLost:
    """The node's agent is gone (lease expired / link dropped): a sev1 on that node."""

    ts: float
    node: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class NodeDrained:
    """An operator takes the node out of service, or its agent stops on purpose (said goodbye on the
    link); its tasks move without counting as a fault."""

    ts: float
    node: str
    reason: str = "drained by an operator"


@dataclass(frozen=True, kw_only=True)
class NodeUndrained:
    """An operator returns a drained or isolated node to service."""

    ts: float
    node: str


@dataclass(frozen=True, kw_only=True)
class NodeForgotten:
    """An operator removes a node for good (``unicron forget``: its hardware was swapped, it was
    renamed): its entry goes. Refused (:class:`~unicron.kernel.errors.PermanentError`) while the node
    is up or a task still refers to it; the daemon also refuses it while the node is registered. A
    node of that name that registers later is a new node."""

    ts: float
    node: str


@dataclass(frozen=True, kw_only=True)
class TaskSubmitted:
    """A task joins the task set: reconfigure ⑥ (it stays pending if its minimum does not fit)."""

    ts: float
    spec: TaskSpec


@dataclass(frozen=True, kw_only=True)
class TaskUpdated:
    """A user replaced the spec of an active task (``unicron update``). A change of how its ranks are
    launched (:meth:`TaskSpec.launch_changes`) relaunches them as a new generation from their on-demand
    snapshot; any other change (weight, GPU bounds) re-plans."""

    ts: float
    spec: TaskSpec


@dataclass(frozen=True, kw_only=True)
class TaskFinished:
    """The task's training completed: its GPUs go to the others (reconfigure ⑤)."""

    ts: float
    task: str


@dataclass(frozen=True, kw_only=True)
class TaskStopped:
    """Every rank exited 0 on its own, but before the task's end: a SIGTERM Unicron did not send (an
    operator, another scheduler) stopped them work-conservingly at iteration ``step``. The task is
    relaunched as a new generation, which resumes from their on-demand snapshot."""

    ts: float
    task: str
    step: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class TaskCancelled:
    """A user withdrew the task: stop it and give its GPUs to the others."""

    ts: float
    task: str


@dataclass(frozen=True, kw_only=True)
class ActionSucceeded:
    """A tracked action (Reattempt, RestartRanks, Assign) was carried out and the ranks run.

    ``node``: the node that reports it. An action written to several nodes (an Assign over two nodes,
    a Reattempt) is confirmed once every one of them has reported; ``None`` confirms it outright.
    """

    ts: float
    action_id: str
    node: str | None = None


class FailureCause(enum.StrEnum):
    """Whose fault a failed action is: it decides whether a node is taken out of service."""

    NODE = "node"
    """The node may be at fault (or nobody knows): escalate (restart -> isolate the node)."""
    TASK = "task"
    """The task's own command cannot run there (e.g. it cannot start): the task fails, no node is blamed."""


@dataclass(frozen=True, kw_only=True)
class ActionFailed:
    """A tracked action could not be carried out; ``node``: where it failed, if known."""

    ts: float
    action_id: str
    reason: str
    node: str | None = None
    cause: FailureCause = FailureCause.NODE


@dataclass(frozen=True, kw_only=True)
class ProgressMade:
    """A task reported a completed step. With the current ``generation`` it also confirms a recovery."""

    ts: float
    task: str
    step: int
    generation: int | None = None
    #: set when the step comes from a process launched at this restart epoch that has completed an
    #: iteration: proof that restart worked even at a step the task had passed before it (a job that
    #: resumed from an older checkpoint redoes steps)
    restart_epoch: int | None = None
    #: the pending joiners of an in-place grow (``TaskEntry.joiners``) whose process, launched by it, has
    #: completed an iteration: only they prove the grow, since the survivors step on without joiners
    #: until they are admitted
    joined: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Tick:
    """Nothing happened but time passed: lets action deadlines expire."""

    ts: float


Event = (
    IncidentRaised
    | NodeJoined
    | NodeLost
    | NodeDrained
    | NodeUndrained
    | NodeForgotten
    | TaskSubmitted
    | TaskUpdated
    | TaskFinished
    | TaskStopped
    | TaskCancelled
    | ActionSucceeded
    | ActionFailed
    | ProgressMade
    | Tick
)
