"""Types shared by the agent, the coordinator, the CLI and the training-side library.

Everything here is plain data: frozen dataclasses that round-trip through JSON (``to_dict`` /
``from_dict``), so the same record can live in etcd, cross a socket and appear in a JSON log.
``from_dict`` raises :class:`unicron.kernel.errors.InvalidRecord` on anything malformed, never a bare
``KeyError``/``TypeError``, so daemons can log and skip garbage instead of crashing.

A field the reader does not know is skipped, as protobuf readers skip one, in every record daemons
write for each other (``Record.REFUSES_UNKNOWN_FIELDS``): during a rolling upgrade a newer agent's or
coordinator's record must stay readable to the older daemons. A record an operator writes refuses it.
"""

from __future__ import annotations

import copy
import enum
import functools
import json
import math
import threading
import time
import types
import typing
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, Self

from unicron.kernel import address, jsontext
from unicron.kernel import log as ulog
from unicron.kernel.errors import InvalidRecord

log = ulog.get(__name__)


class Severity(enum.IntEnum):
    """Paper Table 1: sev1 is the most severe (node-level), sev3 the least (transient)."""

    SEV1 = 1
    SEV2 = 2
    SEV3 = 3

    def escalate(self) -> Severity:
        """Figure 7: a failed reattempt becomes sev2, a failed restart becomes sev1."""
        return Severity(max(1, self.value - 1))

    def __str__(self) -> str:
        return f"sev{self.value}"


class DetectionMethod(enum.StrEnum):
    """The four detection methods of paper §4.1."""

    NODE_HEALTH = "node_health_monitoring"
    PROCESS_SUPERVISION = "process_supervision"
    EXCEPTION_PROPAGATION = "exception_propagation"
    STATISTICAL_MONITORING = "online_statistical_monitoring"


class ErrorKind(enum.StrEnum):
    """Error statuses of paper Table 1, plus DEGRADATION (a slow but completed iteration: recorded, not
    acted on), FENCED (no fault of the rank: its agent killed it, the node cut off from the control
    plane, ``agent/fence.py``) and STORE_LOST (the task's store sidecar died on a node still in service:
    the store moves, no rank is at fault)."""

    LOST_CONNECTION = "lost_connection"
    EXITED_ABNORMALLY = "exited_abnormally"
    CONNECTION_REFUSED_RESET = "connection_refused_reset"
    ILLEGAL_MEMORY_ACCESS = "illegal_memory_access"
    ECC_ERROR = "ecc_error"
    INVALID_DMA_MAPPING = "invalid_dma_mapping"
    CUDA_ERROR = "cuda_error"
    NVLINK_ERROR = "nvlink_error"
    GPU_DRIVER_ERROR = "gpu_driver_error"
    OTHER_NETWORK_ERROR = "other_network_error"
    OTHER_SOFTWARE_ERROR = "other_software_error"
    NCCL_TIMEOUT = "nccl_timeout"
    LINK_FLAPPING = "link_flapping"
    TASK_HANG = "task_hang"
    DEGRADATION = "degradation"
    FENCED = "fenced"
    STORE_LOST = "store_lost"


#: The kinds a rank, a trace or an operator's injection can raise: Table 1's statuses, not the agent's own.
FAULT_KINDS: tuple[ErrorKind, ...] = tuple(
    k for k in ErrorKind if k not in (ErrorKind.DEGRADATION, ErrorKind.FENCED, ErrorKind.STORE_LOST))


@functools.cache
def _field_names(cls: type[Any]) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


#: the (record type, field) pairs this process warned of: one line each, not one per read (a field a
#: newer agent added comes in every node's status, every second, from a thousand nodes)
_warned_unknown: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()
#: the most pairs remembered and warned of: a writer sending fresh names each time (corruption, a
#: forged record) must not grow the set or the log without bound
MAX_UNKNOWN_WARNINGS = 256


def _check_fields(cls: type[Record], data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise InvalidRecord(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
    unknown = data.keys() - _field_names(cls)  # type: ignore[arg-type]
    if not unknown:
        return data
    if cls.REFUSES_UNKNOWN_FIELDS:
        raise InvalidRecord(f"{cls.__name__}: unknown field(s) {sorted(unknown)}")
    _warn_unknown(cls.__name__, unknown)
    return {k: v for k, v in data.items() if k not in unknown}


def _warn_unknown(record: str, names: Iterable[object]) -> None:
    for name in names:
        pair = (record, name if isinstance(name, str) and len(name) <= 80 and name.isprintable() else _show(name))
        with _warned_lock:
            if pair in _warned_unknown or len(_warned_unknown) >= MAX_UNKNOWN_WARNINGS:
                continue
            _warned_unknown.add(pair)
            last = len(_warned_unknown) == MAX_UNKNOWN_WARNINGS
        log.warning("ignoring unknown record field (written by a newer version?)", record=record, field=pair[1],
                    **({"further_unknown_fields": "not logged"} if last else {}))


@functools.cache
def _field_types(cls: type[Any]) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _finite(value: int | float) -> bool:
    """A JSON number a float field can hold: Python's parser reads ``NaN``/``Infinity``/``1e999`` and
    4000-digit integers, none of which is a time or a duration (a NaN compares false with everything,
    which would silently disable a hang check)."""
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond a float's range
        return False


def conforms(value: Any, hint: Any) -> bool:
    """JSON-level type check, element by element: a ``list[int]`` holding a string would otherwise be
    accepted here and raise a ``TypeError`` deep inside a daemon."""
    try:
        check = _checker(hint)
    except TypeError:  # an unhashable hint: compiled for this call only
        check = _compile_check(hint)
    return check(value)


def _compile_check(hint: Any) -> Callable[[Any], bool]:
    """The check of :func:`conforms` for ``hint``, worked out once (the typing introspection was most of
    the cost of reading a record: 2 ms per node status, 1,000 of them a second at 1,000 nodes)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return lambda v: True
    if origin in (typing.Union, types.UnionType):
        alts = tuple(_checker(a) for a in args)
        return lambda v: any(c(v) for c in alts)
    if hint is type(None):
        return lambda v: v is None
    if hint is float:
        return lambda v: isinstance(v, int | float) and not isinstance(v, bool) and _finite(v)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        # None only where the hint says "| None" (the Union branch); the value itself is checked
        # when the enum is built (from_dict)
        return lambda v: v is not None and not isinstance(v, bool)
    if isinstance(hint, type) and issubclass(hint, Record):
        record_kinds = dict | hint
        return lambda v: isinstance(v, record_kinds)
    if (origin or hint) in (list, tuple):
        kinds = list | tuple if (origin or hint) is tuple else list
        item = _checker(args[0] if args else Any)  # tuple[X, ...] names X first
        return lambda v: isinstance(v, kinds) and all(item(x) for x in v)
    if (origin or hint) is dict:
        key, val = (_checker(args[0]), _checker(args[1])) if len(args) == 2 else (_checker(Any), _checker(Any))
        return lambda v: isinstance(v, dict) and all(key(k) and val(x) for k, x in v.items())
    if isinstance(hint, type):
        return lambda v: isinstance(v, hint)
    return lambda v: False


_checker = functools.cache(_compile_check)


@functools.cache
def _enum_type(hint: Any) -> type[enum.Enum] | None:
    """The enum a field holds (``Kind`` or ``Kind | None``), if any."""
    for h in (hint, *typing.get_args(hint)):
        if isinstance(h, type) and issubclass(h, enum.Enum):
            return h
    return None


def _show(value: Any) -> str:
    """``repr(value)`` cut short: an error message is one line, not a megabyte of the bad input."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@functools.cache
def _holds_records(hint: Any) -> bool:
    """Whether values of ``hint`` may hold records (or tuples) that :func:`_nested` must build."""
    if isinstance(hint, type) and issubclass(hint, Record):
        return True
    return typing.get_origin(hint) is tuple or any(_holds_records(a) for a in typing.get_args(hint))


def _nested(value: Any, hint: Any) -> Any:
    """Build nested records: a ``Record`` field, or a list/tuple/dict of them, from their JSON form."""
    try:
        if not _holds_records(hint):
            return value
    except TypeError:  # an unhashable hint: the long way
        pass
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return value if value is None or len(inner) != 1 else _nested(value, inner[0])
    if isinstance(hint, type) and issubclass(hint, Record):
        return value if isinstance(value, hint) else hint.from_dict(value)
    if origin in (list, tuple) and args and isinstance(value, list | tuple):
        items = [_nested(v, args[0]) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict and len(args) == 2 and isinstance(value, dict):
        return {k: _nested(v, args[1]) for k, v in value.items()}
    return value


_SCALARS = (str, int, float, bool, type(None), enum.Enum)


@functools.cache
def _field_order(cls: type[Any]) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


@functools.cache
def _omitted_when_empty(cls: type[Any]) -> frozenset[str]:
    return frozenset(getattr(cls, "OMITTED_WHEN_EMPTY", ()))


def _plain(value: Any) -> Any:
    """``dataclasses.asdict``'s conversion: dataclasses to dicts, lists, tuples and dicts rebuilt,
    anything else deep-copied; immutable scalars (the bulk of a record) are kept as they are."""
    if isinstance(value, _SCALARS):
        return value
    if is_dataclass(value) and not isinstance(value, type):
        omit = _omitted_when_empty(type(value))
        return {name: _plain(getattr(value, name)) for name in _field_order(type(value))
                if name not in omit or getattr(value, name)}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*[_plain(v) for v in value])
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return type(value)((_plain(k), _plain(v)) for k, v in value.items())
    return copy.deepcopy(value)


class Record:
    """Mixin: JSON round-trip with validation of field names and shallow types.

    Enum fields are built from their values here; subclasses may check more in ``_coerce``.
    """

    #: whether ``from_dict`` refuses a field it does not know (InvalidRecord naming it) instead of
    #: skipping it with a warning. Off for what daemons write for each other, which an older daemon
    #: must still act on during a rolling upgrade; on for what an operator writes, where an unknown
    #: field is a typo that must not be silently ignored. Known fields are type-checked either way.
    REFUSES_UNKNOWN_FIELDS: ClassVar[bool] = False

    def to_dict(self) -> dict[str, Any]:
        # what dataclasses.asdict gives, without its deepcopy of every scalar (at 1,000 nodes the
        # status records' asdict alone cost ~0.5 ms each, 1,000 a second)
        return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in _plain(self).items()}

    @classmethod
    def from_dict(cls, data: Any) -> Self:
        raw = dict(_check_fields(cls, data))
        hints = _field_types(cls)  # type: ignore[arg-type]
        for name, value in raw.items():
            if not conforms(value, hints[name]):
                raise InvalidRecord(f"{cls.__name__}.{name}: bad value {_show(value)} (expected {hints[name]})")
            try:
                raw[name] = _nested(value, hints[name])
            except InvalidRecord as exc:  # a nested record's message names its field; say whose field it is
                raise InvalidRecord(f"{cls.__name__}.{name}: {exc}") from exc
            kind = _enum_type(hints[name])
            if kind is not None and value is not None and not isinstance(value, kind):
                try:
                    raw[name] = kind(value)
                except ValueError:
                    raise InvalidRecord(
                        f"{cls.__name__}.{name}: {_show(value)} is not one of {[k.value for k in kind]}"
                    ) from None
        try:
            raw = cls._coerce(raw)
            return cls(**raw)
        except InvalidRecord:
            raise
        except (TypeError, ValueError, KeyError) as exc:
            raise InvalidRecord(f"{cls.__name__}: {exc}") from exc

    @classmethod
    def _coerce(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return raw

    @classmethod
    def from_json(cls, raw: str | bytes) -> Self:
        """One JSON-encoded record (an etcd value, a socket line); :class:`InvalidRecord` on anything
        malformed, so a reader logs and skips it with one ``except``."""
        return cls.from_dict(jsontext.parse(raw, f"{cls.__name__}: not a JSON record"))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def new_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class Report(Record):
    """An abnormal status observed by an agent (or by the coordinator itself for node loss)."""

    method: DetectionMethod
    kind: ErrorKind
    node: str
    message: str = ""
    task: str | None = None
    gpu: int | None = None
    rank: int | None = None
    step: int | None = None
    generation: int | None = None
    #: the restart epoch the reporting rank's process was launched under (the agent's launch record):
    #: a process a pending restart launched that fails shows the restart failed, not its consequence
    restart_epoch: int | None = None
    #: the rank already recovered in place (the runtime's own sev3 reattempt): record, do not act
    handled: bool = False
    #: wall-clock time the fault was observed at its source (process exit, exception raised, ...)
    source_ts: float = field(default_factory=time.time)
    #: wall-clock time the agent published the report
    agent_ts: float = field(default_factory=time.time)
    report_id: str = field(default_factory=new_id)


@dataclass(frozen=True)
class Incident(Record):
    """A classified report, as the coordinator records it under ``incidents/``."""

    incident_id: str
    severity: Severity | None  # None: recorded only (degradation), no recovery action
    method: DetectionMethod
    kind: ErrorKind
    node: str
    message: str
    task: str | None
    gpu: int | None
    rank: int | None
    step: int | None
    source_ts: float
    detected_ts: float
    report_id: str
    handled: bool = False
    # Recovery cost (paper Eq. 1), filled in by the coordinator as the recovery goes on. Optional with
    # defaults, so records written before they existed still parse.
    #: detected_ts - source_ts
    detection_s: float | None = None
    #: the tracked action the incident led to: "reattempt", "restart", "reconfigure" (the last one,
    #: when a failed action escalated); None when it led to none (handled in place, merged, recorded only)
    action: str | None = None
    #: when the coordinator issued that action
    action_ts: float | None = None
    #: the tasks the action was for
    tasks: list[str] = field(default_factory=list)
    #: when the last of those tasks was confirmed running again (progress at the recovered configuration)
    recovered_ts: float | None = None
    #: action issued -> recovery confirmed; None until confirmed (or when no task recovered)
    transition_s: float | None = None
    #: recovery confirmed -> the tasks back at the GPUs they had before (0: no capacity lost); None until then
    sub_healthy_s: float | None = None

    @property
    def detection_latency_s(self) -> float:
        return self.detected_ts - self.source_ts

    @property
    def recovery_s(self) -> float:
        """Eq. 1's time terms known so far: detection + transition + sub-healthy seconds."""
        return sum(x for x in (self.detection_s, self.transition_s, self.sub_healthy_s) if x is not None)


#: GPUs one node may register: more is a corrupted record (the largest machines have 16)
MAX_NODE_GPUS = 1024


@dataclass(frozen=True)
class NodeInfo(Record):
    """What an agent registers about its node (under its lease)."""

    node: str
    #: the address other nodes reach this agent (and the store sidecars it hosts) at: --advertise-host
    host: str
    gpus: int
    gpu_backend: str  # "nvml" | "simulated"
    agent_pid: int
    started_ts: float
    #: address of the agent's checkpoint replica server, "" if none
    replica_addr: str = ""
    #: random secret of this agent process; its link hello must carry it (see ``LinkHello.token``)
    link_token: str = ""
    #: the machine's hostname: a restarted agent recognises its dead predecessor's registration by it
    hostname: str = ""

    def __post_init__(self) -> None:
        # the coordinator sums these into the cluster's size: a negative count made every valid submit
        # "more than the cluster's -N GPUs", a huge one a plan over that many GPUs (found by the fuzz)
        if not 0 <= self.gpus <= MAX_NODE_GPUS:
            raise InvalidRecord(f"NodeInfo.gpus: {self.gpus} is not a GPU count in [0, {MAX_NODE_GPUS}]")
        # other nodes' agents hand it to their ranks in UNICRON_CKPT_PEERS: "h:²" crashed every one of
        # them at launch, "h:1,x:2" added a peer nobody placed there
        if self.replica_addr and not address.dialable(self.replica_addr):
            raise InvalidRecord(f"NodeInfo.replica_addr: {self.replica_addr!r} is not host:port "
                                "(an IP address or host name, a port in 1-65535)")


@dataclass(frozen=True)
class StoreAddress(Record):
    """Where a task's rendezvous store sidecar listens (``stores/<task>``).

    The agent of ``store_node`` picks a free port on its own node, starts the sidecar and publishes
    this under its lease; the other nodes' agents launch their ranks once the record for the task's
    current ``generation`` exists.
    """

    task: str
    generation: int
    node: str
    host: str
    port: int
    #: for a ``recovery: "restart"`` task, the restart epoch (attempt) the store serves: each whole-task
    #: restart gets a fresh store, as torchrun's agent makes one per rendezvous round (torch 2.13's
    #: env:// with the agent store adds no per-attempt prefix, so a reused store hands the relaunched
    #: ranks the previous attempt's keys and their process group init hangs). 0 for other tasks.
    restart_epoch: int = 0
    #: the assignment's ``store_epoch`` this store serves (a store moved off a lost node is newer)
    store_epoch: int = 0


@dataclass(frozen=True)
class RankStatus(Record):
    """One rank process of a node, as its agent reports it in ``status/<node>``."""

    task: str
    #: the task generation this process was launched for (a rank's own, not its node's newest)
    generation: int
    rank: int
    pid: int
    state: str  # "running" | "exited" | "stopped"
    returncode: int | None = None
    #: whether the agent asked this process to stop (an exit then is no failure)
    requested: bool = False
    #: the last iteration the rank reported
    step: int | None = None
    #: the task's restart epoch when this process was launched: progress confirms a sev2 restart only
    #: when it comes from a process launched at (or after) the restart's epoch
    restart_epoch: int = 0
    #: the task's membership epoch when this process was launched: a joiner of an in-place grow has the
    #: grow's, and only its completed iteration confirms the grow (the survivors step on without it)
    membership_epoch: int = 0
    #: this process completed an iteration since it was launched (an ``IterEnd``, or a progress line of
    #: its output): its ``step`` is then its own work, not just the checkpoint it resumed from, and it
    #: confirms a restart even below the step the task had reached (a stock job redoes from its checkpoint)
    advanced: bool = False
    #: the iteration at which the rank said it stopped before its end (a work-conserving stop on a
    #: SIGTERM, ``protocol.Stopped``): its exit 0 does not finish the task. None: it said no such thing
    stopped_at: int | None = None
    #: the phase the process last reported (``protocol.PHASES``): ``collective`` while it waits for its
    #: peers inside an iteration, which tells a hung rank from the peers it holds. None: it reports none
    phase: str | None = None
    #: in a checkpoint or evaluation phase, when (wall clock) the rank is hung there by its agent's
    #: ``UNICRON_PHASE_HANG_S``: past it the coordinator no longer takes another rank's hang for a wait
    #: on this save (``causes.held_by_phase``). None: another phase, or none bounded
    phase_deadline: float | None = None

    #: left out of a record while empty: a reader from before unknown fields were skipped refuses them,
    #: and most statuses (no rank saving) must stay readable to it during a rolling upgrade
    OMITTED_WHEN_EMPTY: ClassVar[tuple[str, ...]] = ("phase_deadline",)


@dataclass(frozen=True)
class NodeStatus(Record):
    """An agent's periodic summary of its node, written under its lease."""

    node: str
    ts: float
    generation: int | None
    task: str | None
    ranks: list[RankStatus]
    gpu_health: list[dict[str, Any]]


@dataclass(frozen=True)
class RankSpec(Record):
    """One training process to run on a node."""

    rank: int
    local_rank: int
    gpu: int
    #: the nodes the rank ran on in the task's earlier placements, newest first (the coordinator keeps
    #: a few): it pushed its in-memory replicas from there, so a restore asks their ring successors
    #: (``ckpt.placement.restore_order``), wherever they are on a ring of thousands of nodes
    previous_nodes: list[str] = field(default_factory=list)

    #: left out of a record while empty: a reader from before unknown fields were skipped refuses them,
    #: and a first placement (most records) must stay readable to it during a rolling upgrade
    OMITTED_WHEN_EMPTY: ClassVar[tuple[str, ...]] = ("previous_nodes",)


#: the largest rank id a :class:`RankSet` takes from a record: a forged range must not make a reader
#: iterate for ever
MAX_RANK = 1 << 24


@dataclass(frozen=True)
class RankSet(Record):
    """Rank ids as sorted, disjoint half-open ranges ``[[start, stop], ...]``. Every node's assignment
    names the task's whole membership: as a list of ids that was 8,000 numbers in each of 1,000 node
    records, ~40 MB rewritten per in-place resize, which filled etcd and took the coordinator seconds
    per decision at 1,000 nodes; a membership is a few ranges (a lost node's ranks cut one out)."""

    ranges: list[list[int]] = field(default_factory=list)

    @classmethod
    def of(cls, ranks: Iterable[int]) -> RankSet:
        out: list[list[int]] = []
        for r in sorted(set(ranks)):
            if out and out[-1][1] == r:
                out[-1][1] = r + 1
            else:
                out.append([r, r + 1])
        return cls(out)

    def __iter__(self) -> Iterator[int]:
        for start, stop in self.ranges:
            yield from range(start, stop)

    def __len__(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and any(start <= rank < stop for start, stop in self.ranges)

    @classmethod
    def _coerce(cls, raw: dict[str, Any]) -> dict[str, Any]:
        last = -1
        for pair in raw.get("ranges", []):
            if len(pair) != 2 or not last < pair[0] < pair[1] <= MAX_RANK:
                raise InvalidRecord(f"RankSet.ranges: {_show(pair)} is no [start, stop] range above {last} "
                                    f"(sorted, disjoint, 0 <= start < stop <= {MAX_RANK})")
            last = pair[1]
        return raw


@dataclass(frozen=True)
class TaskAssignment(Record):
    """What one node must run for one task (desired state, written by the coordinator).

    ``generation`` changes on every reconfiguration: the agent then replaces all the task's
    processes. ``restart_epoch`` changes for a sev2 restart: only ``restart_ranks`` are relaunched
    with the same configuration and rejoin the running ones. ``regroup_epoch`` changes for a sev3
    reattempt: running ranks get a Regroup instruction, no process is restarted.
    """

    task: str
    generation: int
    argv: list[str]
    env: dict[str, str]
    world_size: int
    ranks: list[RankSpec]
    #: the node whose agent hosts the task's rendezvous store sidecar and publishes its StoreAddress
    store_node: str
    restart_epoch: int = 0
    restart_ranks: list[int] = field(default_factory=list)
    regroup_epoch: int = 0
    regroup_members: RankSet = field(default_factory=RankSet)
    regroup_failed: list[int] = field(default_factory=list)
    #: this node's index among the task's nodes (ordered by their lowest rank) and their number:
    #: torchrun's GROUP_RANK / GROUP_WORLD_SIZE
    group_rank: int = 0
    group_world_size: int = 1
    #: the restarts the task may take without progress before it is marked failed (the decision
    #: core's budget): torchrun's TORCHELASTIC_MAX_RESTARTS
    max_restarts: int = 0
    #: ``inprocess`` (a restart epoch relaunches ``restart_ranks`` and they rejoin) or ``restart`` (a
    #: restart epoch stops every rank named, gives the task a fresh store, then relaunches them all)
    recovery: str = "inprocess"
    #: a whole-task restart waits this long between stopping the ranks and relaunching them (backoff)
    restart_delay_s: float = 0.0
    #: an in-place resize (same generation, layout kept) bumps this: ranks named in ``ranks`` that do
    #: not run yet are launched (``joiners`` among them join the running ones at an iteration
    #: boundary), running ranks no longer named are asked to leave at an iteration boundary; the
    #: survivors never stop. ``world_size`` stays the launch size: the rank ids are kept.
    membership_epoch: int = 0
    #: every rank of the task in this membership, on all nodes (empty: all ``world_size`` ranks)
    members: RankSet = field(default_factory=RankSet)
    #: ranks of ``members`` (any node) that start now and take their state from a healthy replica
    joiners: list[int] = field(default_factory=list)
    #: ranks removed because their node was lost (their processes are gone with it): the node that
    #: hosts the task's store marks them failed, so survivors need not wait for heartbeats to go stale
    lost: list[int] = field(default_factory=list)
    #: the membership epoch at which ``store_node``'s sidecar started (0: the launch's): an in-place
    #: resize after the store's node was lost names a new ``store_node`` and bumps this; agents then
    #: hand the new address to their running ranks (``StoreMoved``), which re-seed it and go on there
    store_epoch: int = 0
    #: an in-place task's node that would host the store if ``store_node`` alone were lost (the
    #: lowest-ranked other node, as the resize picks it): its agent keeps a spare sidecar listening, so
    #: that move does not wait seconds for one to import torch ("": none kept)
    spare_store_node: str = ""

    def rank_specs(self) -> list[RankSpec]:
        return list(self.ranks)


@dataclass(frozen=True)
class NodeAssignment(Record):
    """Everything a node must run; ``revision`` only grows, so agents can ignore stale writes."""

    node: str
    revision: int
    tasks: list[TaskAssignment]
    #: the node is out of service after a sev1 (``IsolateNode``): its agent SIGKILLs the ranks of every
    #: task the record no longer lists instead of stopping them. A faulty node's rank must go as a lost
    #: node's would: its work-conserving stop (SIGTERM) would ride the gradient all-reduce and stop the
    #: survivors with it, and a task resized in place around it would be taken as finished
    isolated: bool = False

    def task_assignments(self) -> list[TaskAssignment]:
        return list(self.tasks)


@dataclass(frozen=True)
class TaskResult(Record):
    """One task as an agent found it after reconciling: what it runs and each rank's process state."""

    generation: int
    restart_epoch: int
    regroup_epoch: int
    ranks: dict[str, str]  # rank (JSON keys are strings) -> "running" | "exited" | "stopped"
    cannot_start: str = ""
    """Why the task's command could not be executed (no such file, not executable): its own fault."""
    #: the in-place membership the node applied (``TaskAssignment.membership_epoch``)
    membership_epoch: int = 0


@dataclass(frozen=True)
class AssignmentResult(Record):
    """What an agent observed after reconciling (observed state, written by the agent)."""

    node: str
    revision: int
    ok: bool
    detail: str
    tasks: dict[str, TaskResult]
    ts: float = field(default_factory=time.time)
