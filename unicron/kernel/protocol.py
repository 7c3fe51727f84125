"""Messages between a training rank and its node's agent (local Unix socket, one JSON line each).

Rank -> agent: ``Hello`` first, then progress (``IterStart``, ``IterEnd``, ``MicrobatchDone``,
``Phase``), failures (``ExceptionReport``), acknowledgements (``RegroupDone``) and, last, ``Stopped``
when it ends before its last iteration.
Agent -> rank: instructions (``Regroup``, ``Leave``, ``Stop``, ``StoreMoved``), the answer to ``Stopped``
(``StopNoted``) and fault injection (``InjectRaise``, ``InjectSlow``, used by ``unicron inject``).

Every message has a ``type`` tag; :func:`parse` turns a decoded JSON object back into its class and
raises :class:`~unicron.kernel.errors.InvalidRecord` for an unknown type or bad fields.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from unicron.kernel.errors import InvalidRecord
from unicron.kernel.types import Record

ENV_SOCKET = "UNICRON_AGENT_SOCKET"
"""Environment variable the agent sets for each rank: path of its Unix socket."""
ENV_STORE_EPOCH = "UNICRON_STORE_EPOCH"
"""The store's epoch (``StoreAddress.store_epoch``): > 0 once it moved off a lost node; a rank launched
then waits for the survivors to re-seed it before it counts itself in (its incarnation)."""

PHASE_TRAIN = "train"
PHASE_CHECKPOINT = "checkpoint"
PHASE_EVAL = "eval"
PHASE_REGROUP = "regroup"
"""An agreed regroup or rejoin: the members pause on purpose while a peer is replaced or admitted."""
PHASE_DATA = "data"
"""Waiting for the next micro-batch from the data loader: the wait is not iteration time, and it has its
own bound (``IterationSettings.data_wait_factor``) so a loader stuck for good is still a hang."""
PHASE_GC = "gc"
"""A full (generation 2) garbage collection inside a training iteration, reported from ``gc.callbacks``:
like a data wait, not iteration time, with its own bound (``IterationSettings.gc_wait_factor``)."""
PHASE_COLLECTIVE = "collective"
"""Inside the iteration's collective with the rank's peers (the gradient reduction and the commit check):
iteration time like ``train``, but it says the rank waits for whoever has not joined. When every agent
finds its ranks hung, the rank not in it is the one they wait for (``coordinator.causes.hang_culprit``)."""
PHASES = (PHASE_TRAIN, PHASE_CHECKPOINT, PHASE_EVAL, PHASE_REGROUP, PHASE_DATA, PHASE_GC, PHASE_COLLECTIVE)


class Message(Record):
    TYPE: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, **self.to_dict()}


# --- rank -> agent -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello(Message):
    TYPE: ClassVar[str] = "hello"
    rank: int
    local_rank: int
    pid: int
    task: str = ""
    generation: int = 0


@dataclass(frozen=True)
class IterStart(Message):
    TYPE: ClassVar[str] = "iter_start"
    step: int
    ts: float = field(default_factory=time.time)
    mono: float = field(default_factory=time.monotonic)
    """The rank's ``time.monotonic()``, one clock with its agent's on the same host: the hang clock
    runs on it, so a wall-clock step (NTP, an operator) is never taken for a hang. ``ts`` is for reports."""


@dataclass(frozen=True)
class IterEnd(Message):
    TYPE: ClassVar[str] = "iter_end"
    step: int
    duration_s: float
    ts: float = field(default_factory=time.time)
    mono: float = field(default_factory=time.monotonic)
    """As :attr:`IterStart.mono`."""


@dataclass(frozen=True)
class MicrobatchDone(Message):
    TYPE: ClassVar[str] = "microbatch_done"
    step: int
    index: int  # global micro-batch index within the iteration's global batch
    ts: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Phase(Message):
    """The rank entered a phase; statistical monitoring only judges iterations in the train phase."""

    TYPE: ClassVar[str] = "phase"
    name: str
    ts: float = field(default_factory=time.time)
    mono: float = field(default_factory=time.monotonic)
    """As :attr:`IterStart.mono`."""

    def __post_init__(self) -> None:
        if self.name not in PHASES:
            raise InvalidRecord(f"phase: name must be one of {PHASES}, got {self.name!r}")


@dataclass(frozen=True)
class ExceptionReport(Message):
    """An exception inside the rank. ``kind`` is an ErrorKind value when the rank knows it, else ""
    and the agent classifies ``message``/``traceback`` with :mod:`unicron.kernel.patterns`."""

    TYPE: ClassVar[str] = "exception"
    message: str
    kind: str = ""
    traceback: str = ""
    step: int | None = None
    fatal: bool = True  # False: the rank handled it (e.g. regrouped) and keeps running
    ts: float = field(default_factory=time.time)


@dataclass(frozen=True)
class RegroupDone(Message):
    TYPE: ClassVar[str] = "regroup_done"
    epoch: int  # the rank's regroup epoch (not the node's or task's generation)
    ok: bool
    detail: str = ""
    ts: float = field(default_factory=time.time)
    dp: int = 0
    """The data-parallel size the rank regrouped to (0: not said): each rank's share of an iteration's
    micro-batches, so its pace, changes with it; the agent keeps what it learned of the pace otherwise."""


@dataclass(frozen=True)
class Stopped(Message):
    """The rank's last message: it stopped at iteration ``step`` on a SIGTERM (its own or a peer's,
    agreed at one boundary) before its configured end, so its exit 0 is not the job's end.
    ``snapshot``: the iteration of the on-demand snapshot it saved, None without one. The rank waits
    for ``StopNoted`` before it exits, so the agent never reports the exit without this."""

    TYPE: ClassVar[str] = "stopped"
    step: int
    snapshot: int | None = None
    ts: float = field(default_factory=time.time)


# --- agent -> rank -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Regroup(Message):
    """Re-form the task's process group in place at regroup ``epoch`` with ``members`` (global ranks)
    after ``failed`` ranks were lost (sev3 reattempt, or redistribution after a rank died)."""

    TYPE: ClassVar[str] = "regroup"
    epoch: int
    members: list[int]
    failed: list[int]
    master_addr: str = ""
    master_port: int = 0


@dataclass(frozen=True)
class Leave(Message):
    """Leave the task at the next iteration boundary: an in-place shrink gave this rank's GPU away
    (drained node, a higher-weight task). The others go on at the smaller data-parallel size; the
    rank exits 0 once they agreed an epoch without it."""

    TYPE: ClassVar[str] = "leave"
    membership_epoch: int
    reason: str = ""


@dataclass(frozen=True)
class StoreMoved(Message):
    """The task's store moved: its node was lost and an in-place resize named another node, whose
    agent started a fresh sidecar at ``host``:``port`` (``store_epoch``: the assignment's). The rank
    reconnects there, re-seeds what it holds (its incarnation, its epoch; ``lost``: ranks that went
    with the lost node, dead from now on) and goes on (:mod:`unicron.runtime.membership`)."""

    TYPE: ClassVar[str] = "store_moved"
    store_epoch: int
    host: str
    port: int
    lost: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PeersLost(Message):
    """An in-place resize at ``membership_epoch`` gave up ``lost`` ranks, whose nodes left service (lost,
    partitioned, isolated). A survivor cuts its connections to their hosts: a host cut off the network
    answers nothing, and a collective with its ranks would wait out its timeout
    (:mod:`unicron.runtime.hostloss`)."""

    TYPE: ClassVar[str] = "peers_lost"
    membership_epoch: int
    lost: list[int]


@dataclass(frozen=True)
class Stop(Message):
    TYPE: ClassVar[str] = "stop"
    reason: str = ""


@dataclass(frozen=True)
class StopNoted(Message):
    """The agent recorded the rank's ``Stopped``: the rank may exit."""

    TYPE: ClassVar[str] = "stop_noted"
    step: int


@dataclass(frozen=True)
class InjectRaise(Message):
    """Fault injection: raise an exception of ``kind`` (an ErrorKind value) at the next iteration boundary."""

    TYPE: ClassVar[str] = "inject_raise"
    kind: str
    message: str = ""


#: the longest delay one 'slow' injection adds to an iteration (an hour); a rank clamps a longer one
#: (time.sleep(1e300) is an OverflowError that ended the rank)
MAX_SLOW_DELAY_S = 3600.0


@dataclass(frozen=True)
class InjectSlow(Message):
    """Fault injection: delay the next ``iterations`` iterations by ``delay_s`` each (at most
    :data:`MAX_SLOW_DELAY_S`)."""

    TYPE: ClassVar[str] = "inject_slow"
    delay_s: float
    iterations: int = 1


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello, IterStart, IterEnd, MicrobatchDone, Phase, ExceptionReport, RegroupDone, Stopped,
        Regroup, Leave, StoreMoved, PeersLost, Stop, StopNoted, InjectRaise, InjectSlow,
    )
}


def parse(obj: dict[str, Any]) -> Message:
    body = dict(obj)
    tag = body.pop("type", None)
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise InvalidRecord(f"unknown message type {tag!r}; expected one of {sorted(MESSAGE_TYPES)}")
    return cls.from_dict(body)
