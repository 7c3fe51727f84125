"""The three places a snapshot can be restored from, behind one small interface, nearest first."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Executor

from ckpt import persist
from ckpt.api import CheckpointCorrupt, ReplicaStore, Snapshot, Storage, Tier
from ckpt.codec import verify
from ckpt.local import LocalStore


def check_identity(snap: Snapshot, job: str, rank: int, iteration: int) -> None:
    i = snap.info
    if (i.job, i.rank, i.iteration) != (job, rank, iteration):
        raise CheckpointCorrupt(
            f"stale: holds job {i.job!r} rank {i.rank} iteration {i.iteration}, "
            f"wanted {job!r} {rank} {iteration}"
        )


class Source(ABC):
    """One tier's copy of one rank's snapshots."""

    tier: Tier

    def __init__(self, job: str, rank: int) -> None:
        self.job = job
        self.rank = rank

    @abstractmethod
    def describe(self) -> str: ...

    @abstractmethod
    def iterations(self) -> list[int]:
        """Iterations this tier claims to hold (unverified); raises if it cannot be asked."""

    @abstractmethod
    def held(self) -> dict[int, int | None]:
        """Iteration -> the task generation that wrote this tier's copy (None: it cannot tell without
        loading it), unverified; raises if it cannot be asked."""

    @abstractmethod
    def load(self, iteration: int, pool: Executor | None) -> tuple[Snapshot, bool]:
        """The verified snapshot, and whether its data buffer is private to the caller.
        Raises CheckpointCorrupt (with the reason) for a missing, partial, stale or corrupt copy."""


class LocalSource(Source):
    tier = Tier.LOCAL

    def __init__(self, store: LocalStore, job: str, rank: int) -> None:
        super().__init__(job, rank)
        self.store = store

    def describe(self) -> str:
        return str(self.store.root)

    def iterations(self) -> list[int]:
        return sorted(i.iteration for i in self.store.published().values())

    def held(self) -> dict[int, int | None]:
        return {i.iteration: i.generation for i in self.store.published().values()}

    def load(self, iteration: int, pool: Executor | None) -> tuple[Snapshot, bool]:
        for slot, info in self.store.published().items():
            if info.iteration == iteration:
                snap = self.store.read(slot, info)
                check_identity(snap, self.job, self.rank, iteration)
                verify(snap.info, snap.meta, snap.data, pool)
                return snap, False  # shared memory: the next snapshot may overwrite it
        raise CheckpointCorrupt("missing: no longer published")


class PeerSource(Source):
    tier = Tier.PEER

    def __init__(self, peer: ReplicaStore, job: str, rank: int) -> None:
        super().__init__(job, rank)
        self.peer = peer

    def describe(self) -> str:
        return self.peer.describe()

    def iterations(self) -> list[int]:
        return sorted(i.iteration for i in self.peer.list(self.job) if i.rank == self.rank)

    def held(self) -> dict[int, int | None]:
        return {i.iteration: i.generation for i in self.peer.list(self.job) if i.rank == self.rank}

    def load(self, iteration: int, pool: Executor | None) -> tuple[Snapshot, bool]:
        snap = self.peer.get(self.job, self.rank, iteration)
        if snap is None:
            raise CheckpointCorrupt("missing: evicted or dropped since it was listed")
        check_identity(snap, self.job, self.rank, iteration)
        verify(snap.info, snap.meta, snap.data, pool)
        return snap, True


class RemoteSource(Source):
    tier = Tier.REMOTE

    def __init__(self, storage: Storage, job: str, rank: int) -> None:
        super().__init__(job, rank)
        self.storage = storage

    def describe(self) -> str:
        return self.storage.describe()

    def iterations(self) -> list[int]:
        return persist.iterations(self.storage, self.job, self.rank)

    def held(self) -> dict[int, int | None]:
        out: dict[int, int | None] = {}
        for it in self.iterations():
            try:
                out[it] = persist.generation(self.storage, self.job, self.rank, it)
            except CheckpointCorrupt:
                out[it] = None  # a damaged manifest: its load says why
        return out

    def load(self, iteration: int, pool: Executor | None) -> tuple[Snapshot, bool]:
        return persist.load(self.storage, self.job, self.rank, iteration, pool), True
