"""The two small interfaces of the checkpoint subsystem, its records and its errors.

* Training side, :class:`Checkpointer`: ``save(state, iteration)`` at an iteration boundary and
  ``restore()`` by the nearest principle (local memory -> peer memory -> remote storage).
* Agent side, :class:`ReplicaStore`: hold, serve and drop other ranks' snapshots in memory.
* Remote side, :class:`Storage`: the few operations persistence needs, implementable by a filesystem
  or an object store (whole-object atomic writes, listing by prefix, ranged reads are not needed).

A snapshot travels as (:class:`SnapshotInfo`, meta bytes, data bytes): ``data`` is every tensor's bytes
back to back, ``meta`` the pickled rest of the state. Checksums are computed once, at the source, over
those exact bytes and travel with them; every tier verifies them and no tier recomputes them from
its own copy (a replica that went bad must not vouch for itself).
"""

from __future__ import annotations

import enum
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from unicron.kernel.errors import InvalidRecord, PermanentError, TemporaryError

#: Anything whose bytes can be written (bytes, bytearray, memoryview over an mmap or an array).
Buffer: TypeAlias = bytes | bytearray | memoryview

FORMAT_VERSION = 1
_NAME_RX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Tier(enum.StrEnum):
    """Where a snapshot was found, nearest first (paper §6.3)."""

    LOCAL = "local"
    PEER = "peer"
    REMOTE = "remote"


# --------------------------------------------------------------------------------------------- errors


class CheckpointError(PermanentError):
    """Base of the checkpoint subsystem's deliberate errors."""


class CheckpointCorrupt(CheckpointError):
    """One copy of a snapshot failed verification (checksum, size, format); another tier may be fine."""


class UnsafeSnapshot(CheckpointError):
    """A snapshot names a class that is not on the unpickling allow-list. Not a damaged copy: every
    tier holds the same, so a restore stops here instead of falling back to an older iteration and
    discarding the newer ones (the operator's remedy, the allow-list, would then find them gone)."""


class StaleGeneration(CheckpointError):
    """A snapshot of an older task generation than one already held for its rank: refused, so that a
    stopping generation's late snapshot cannot replace (or, newer ones being dropped as abandoned,
    delete) what its relaunch saved since."""


class NoRoomForSnapshot(CheckpointError):
    """The node-local snapshot directory (``/dev/shm``, ``local_dir``) has no room for a slot, even
    after idle ranks' directories gave theirs up: this snapshot is not taken, the previous ones stay
    and a later ``save()`` tries again. A condition of the node, not a fault of the caller's, so a
    trainer goes on training (its own class: a programming error stays a :class:`CheckpointError`)."""


class NoValidCheckpoint(CheckpointError):
    """No tier held a valid snapshot; ``attempts`` says what each tier had and why it was rejected."""

    def __init__(self, job: str, rank: int, wanted: int | None, attempts: Sequence[TierAttempt]) -> None:
        self.attempts = tuple(attempts)
        what = "the newest iteration" if wanted is None else f"iteration {wanted}"
        lines = [f"no valid checkpoint of job {job!r} rank {rank} ({what}); tiers tried:"]
        lines += [f"  - {a}" for a in self.attempts] or ["  - (no tier configured)"]
        super().__init__("\n".join(lines))


class ReplicaUnavailable(TemporaryError):
    """A peer's replica server could not be reached or broke the connection."""


class ReplicaRejected(CheckpointError):
    """A peer refused a replica (over its memory budget, or a malformed request)."""


class ObjectMissing(CheckpointError):
    """A :class:`Storage` key does not exist."""


class StorageUnavailable(TemporaryError):
    """Remote storage failed (I/O error, unreachable service)."""


class StorageFull(StorageUnavailable):
    """Remote storage has no room for a write (ENOSPC, a quota): deleting snapshots may make some."""


# --------------------------------------------------------------------------------------------- records


def check_name(value: str, what: str) -> str:
    """Job names become directory names and storage keys: a conservative character set only."""
    if not isinstance(value, str) or not _NAME_RX.match(value):
        raise InvalidRecord(
            f"{what}: {value!r} is not a valid name (letters, digits, '.', '_', '-'; at most 128)"
        )
    return value


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (not a number, NaN, infinite, an integer beyond a float)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        out = float(value)
    except OverflowError:
        return None
    return out if math.isfinite(out) else None


@dataclass(frozen=True)
class SnapshotInfo:
    """Describes one snapshot of one rank; the checksums are those of the source bytes."""

    #: job (training task) the snapshot belongs to
    job: str
    #: global rank whose state this is
    rank: int
    #: training iteration the state was captured after
    iteration: int
    #: length of the pickled metadata (everything that is not tensor bytes)
    meta_len: int
    #: CRC-32 of the metadata bytes
    meta_crc: int
    #: length of the tensor bytes
    data_len: int
    #: the tensor bytes are checksummed (and stored remotely) in chunks of this many bytes
    chunk_bytes: int
    #: CRC-32 of each chunk of the tensor bytes, in order
    chunk_crcs: tuple[int, ...]
    #: wall-clock time the snapshot was taken
    created: float
    #: layout version of meta/data
    format: int = FORMAT_VERSION
    #: the writer's task generation (``UNICRON_GENERATION``): a rank's timeline is linear within one,
    #: and a late snapshot of an older one (its stop snapshot, still pushed or persisted while the
    #: relaunch trains on) never displaces a newer generation's
    generation: int = 0

    @property
    def nbytes(self) -> int:
        return self.meta_len + self.data_len

    def chunks(self) -> list[tuple[int, int]]:
        """(offset, length) of every checksummed chunk of the data."""
        return [
            (o, min(self.chunk_bytes, self.data_len - o)) for o in range(0, self.data_len, self.chunk_bytes)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "rank": self.rank,
            "iteration": self.iteration,
            "meta_len": self.meta_len,
            "meta_crc": self.meta_crc,
            "data_len": self.data_len,
            "chunk_bytes": self.chunk_bytes,
            "chunk_crcs": list(self.chunk_crcs),
            "created": self.created,
            "format": self.format,
            "generation": self.generation,
        }

    @classmethod
    def from_dict(cls, data: Any) -> SnapshotInfo:
        """Validates every field; raises InvalidRecord naming the first bad one."""
        if not isinstance(data, dict):
            raise InvalidRecord(f"SnapshotInfo: expected an object, got {type(data).__name__}")
        ints = ("rank", "iteration", "meta_len", "meta_crc", "data_len", "chunk_bytes", "format")
        for name in ("job", "created", "chunk_crcs", *ints):
            if name not in data:
                raise InvalidRecord(f"SnapshotInfo: missing field {name!r}")
        for name in ints:
            v = data[name]
            # below 2**63: what a length or offset can be (a bigger one overflows the buffers it sizes)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**63:
                raise InvalidRecord(
                    f"SnapshotInfo.{name}: expected a non-negative integer below 2**63, got {v!r:.40}"
                )
        if data["format"] != FORMAT_VERSION:
            raise InvalidRecord(f"SnapshotInfo.format: version {data['format']} is not {FORMAT_VERSION}")
        if data["chunk_bytes"] == 0:
            raise InvalidRecord("SnapshotInfo.chunk_bytes: must be positive")
        crcs = data["chunk_crcs"]
        want = -(-data["data_len"] // data["chunk_bytes"])
        if (
            not isinstance(crcs, list)
            or len(crcs) != want
            or not all(isinstance(c, int) and 0 <= c < 2**32 for c in crcs)
        ):
            raise InvalidRecord(f"SnapshotInfo.chunk_crcs: expected {want} CRC-32 values")
        generation = data.get("generation", 0)  # absent in snapshots written before it existed
        if not isinstance(generation, int) or isinstance(generation, bool) or not 0 <= generation < 2**63:
            raise InvalidRecord(f"SnapshotInfo.generation: expected a non-negative integer, got {generation!r:.40}")
        created = _finite(data["created"])
        if created is None:
            raise InvalidRecord(f"SnapshotInfo.created: expected a finite number, got {data['created']!r:.40}")
        return cls(
            job=check_name(data["job"], "SnapshotInfo.job"),
            rank=data["rank"],
            iteration=data["iteration"],
            meta_len=data["meta_len"],
            meta_crc=data["meta_crc"],
            data_len=data["data_len"],
            chunk_bytes=data["chunk_bytes"],
            chunk_crcs=tuple(crcs),
            created=created,
            format=data["format"],
            generation=generation,
        )


@dataclass(frozen=True)
class Snapshot:
    """A snapshot's bytes as held by a tier; ``data`` is a writable 1-D byte buffer."""

    info: SnapshotInfo
    meta: bytes
    data: memoryview


@dataclass(frozen=True)
class TierAttempt:
    """One tier looked at during a restore, and why it was not used (or ``used``)."""

    tier: Tier
    #: which copy: the local directory, the peer's address, the storage location
    source: str
    #: the iteration looked for there (None: the tier was not reachable to say what it holds)
    iteration: int | None
    reason: str

    def __str__(self) -> str:
        at = "" if self.iteration is None else f" iteration {self.iteration}"
        return f"{self.tier.value} ({self.source}){at}: {self.reason}"


@dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore` returns."""

    #: the saved state, tensors on CPU (or copied into the ``into`` template's tensors)
    state: Any
    iteration: int
    tier: Tier
    source: str
    #: tiers looked at before this one and why they were passed over
    skipped: tuple[TierAttempt, ...] = ()
    #: wall-clock seconds the restore took
    seconds: float = 0.0


@dataclass(frozen=True)
class SaveOutcome:
    """What became of one snapshot once its background work finished."""

    iteration: int
    #: the local (shared-memory) copy is complete, checksummed and visible to a restore
    published: bool
    #: peers that accepted a replica
    replicas: tuple[str, ...] = ()
    #: None when persistence was not due for this snapshot
    persisted: bool | None = None
    errors: tuple[str, ...] = field(default=())
    #: seconds each background stage took: ("publish", s), ("replicate", s), ("persist", s)
    stage_s: tuple[tuple[str, float], ...] = ()


# --------------------------------------------------------------------------------------------- interfaces


class Checkpointer(ABC):
    """Training side: what the training runtime calls."""

    @abstractmethod
    def save(self, state: Any, iteration: int) -> Any:
        """Capture ``state`` (nested containers of tensors and picklable objects) after ``iteration``.

        Returns once the state may be modified again (on GPU: once the copies are queued, see the
        implementation's ``fence``); checksumming, publishing, replication and persistence continue
        in the background.
        """

    def fence(self) -> None:
        """Call after ``save()`` and before the saved tensors are next modified in place (the optimizer
        step): an implementation still copying them (on a side stream, in a background thread) orders
        or waits for that copy here. One that copies inside ``save()`` has nothing to do."""
        return None  # deliberately concrete: a checkpointer that copies synchronously needs no override

    @abstractmethod
    def restore(self, iteration: int | None = None, into: Any = None) -> Restored:
        """The state of ``iteration`` (default: the newest valid one) from the nearest valid tier.

        Raises :class:`NoValidCheckpoint` listing every tier tried when none is valid.
        """

    def resume_from(self, iteration: int) -> None:
        """The state is now that of ``iteration``, put together without this checkpointer's
        :meth:`restore` of it (resharded from every rank's snapshots of another tensor-parallel size):
        the next ``save()`` follows it, whatever this checkpointer restored before (a newer snapshot of
        its own that the reshard could not use). One that keeps no count has nothing to do."""
        return None  # deliberately concrete, as fence()


class ReplicaStore(ABC):
    """Agent side: holds other ranks' snapshots in memory, serves them back, drops them."""

    @abstractmethod
    def put(self, snapshot: Snapshot) -> None:
        """Hold ``snapshot`` (replacing the same job/rank/iteration). Raises ReplicaRejected if it cannot."""

    @abstractmethod
    def get(self, job: str, rank: int, iteration: int) -> Snapshot | None:
        """The held snapshot, or None. The bytes are returned unverified: the caller verifies."""

    @abstractmethod
    def list(self, job: str | None = None) -> list[SnapshotInfo]:
        """Infos of every held snapshot (of ``job`` if given)."""

    @abstractmethod
    def drop(self, job: str, rank: int | None = None, iteration: int | None = None) -> int:
        """Forget the matching snapshots; returns how many were dropped."""

    @abstractmethod
    def describe(self) -> str:
        """Where this store is (an address), for logs and error messages."""

    def abort(self) -> bool:
        """Cut short the calls in flight (from another thread), if this store can: True once none of
        them reads its snapshot's bytes any more (they fail); False when it cannot (the caller waits)."""
        return False


class Storage(ABC):
    """Remote persistent storage: a filesystem path, or an object store implementing the same contract.

    Keys are ``/``-separated names of ``[A-Za-z0-9._-]`` segments. ``write`` is durable and atomic: once
    it returns the object survives a crash, and a reader never sees a partial object.
    """

    @abstractmethod
    def write(self, key: str, data: Buffer, progress: Callable[[], None] | None = None) -> None:
        """Store ``data`` under ``key``. ``progress``: called each time a part of the bytes has reached
        the storage (durably), where the store can tell; a caller tells a slow write from a hung one by it
        (a 64 MiB shard takes seconds on a shared filesystem serving thousands of ranks)."""

    @abstractmethod
    def read_into(self, key: str, out: memoryview) -> int:
        """Read the whole object into ``out`` (at least ``size(key)`` bytes); returns the length."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Length of the object; raises ObjectMissing."""

    def list_incomplete(self, prefix: str) -> list[str]:
        """Sorted keys starting with ``prefix`` whose write began and has not completed (in progress, or
        its writer killed) and left something behind (a filesystem's temporaries); once no object is
        left beside them, deleting such a key removes it. None where a failed write leaves nothing
        (defined before list(), whose name would shadow the builtin in its annotation)."""
        return []

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Sorted keys starting with ``prefix``."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing key is not an error."""

    @abstractmethod
    def describe(self) -> str: ...

    def read(self, key: str) -> bytes:
        buf = bytearray(self.size(key))
        n = self.read_into(key, memoryview(buf))
        return bytes(buf[:n])
