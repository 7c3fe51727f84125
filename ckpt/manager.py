"""Training side: :class:`CheckpointManager`, one per rank.

``save(state, iteration)`` blocks only while the state's tensors are copied into a free shared-memory
slot (CPU: a plain copy; GPU: asynchronous copies into the pinned slot, see :meth:`fence`). Three
background stages then take each snapshot in turn: *publish* (checksum the slot off the training
thread, then flip the local pointer), *replicate* (send it to the peers' replica servers) and *persist*
(every ``persist_every`` snapshots, to remote storage). A slot is reused only once every stage is done
with it (a save() that needs the slot the replicate stage holds abandons its pushes still in flight: a
missed replica, never a stall on a frozen peer; a persist that moved no bytes to the storage for
``persist_stall_s`` is abandoned the same way, never a stall on a hung mount), and the newest published slot is never
overwritten, so a valid local snapshot always exists once the first one is published.

``restore()`` follows the nearest principle: local memory, then each peer (the push peers, then the
restore peers: a relaunched rank's replica is on the successor of the node it ran on before), then remote storage; every
copy is verified against the checksums computed at the source, and a missing, partial, stale or
corrupt copy is skipped with its reason logged, and so is one a newer task generation superseded (it
holds a copy at that iteration or an older one: it restored that and trained on). The timeline is linear: restoring iteration k discards
whatever any tier holds that is newer than k; a first save at k withdraws newer local snapshots, and a
peer or the storage drops a rank's newer snapshots when an older one of that rank reaches it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from ckpt import codec, persist
from ckpt.api import (
    CheckpointCorrupt,
    Checkpointer,
    CheckpointError,
    NoValidCheckpoint,
    ReplicaStore,
    ReplicaUnavailable,
    Restored,
    SaveOutcome,
    Snapshot,
    SnapshotInfo,
    Storage,
    TierAttempt,
    UnsafeSnapshot,
    check_name,
)
from ckpt.local import IDLE_DIR_S, LocalStore
from ckpt.tiers import LocalSource, PeerSource, RemoteSource, Source
from unicron.kernel import log
from unicron.kernel.config import setting
from unicron.kernel.errors import ConfigError, InvalidRecord, TemporaryError, UnicronError

DEFAULT_SHM = "/dev/shm/unicron-ckpt"


@dataclass
class CheckpointConfig:
    """Settings of one rank's checkpoint manager (tunables read UNICRON_CKPT_* variables via
    ``unicron.kernel.config.from_args``)."""

    #: the training task's id: names the shared-memory directory, replica keys and remote prefix
    job: str
    #: this process's global rank
    rank: int
    #: directory of this rank's shared-memory slots ("" = /dev/shm/unicron-ckpt/<job>/rank-<rank>)
    local_dir: str = setting(
        "",
        "UNICRON_CKPT_LOCAL_DIR",
        "directory of the shared-memory snapshot slots ('' = /dev/shm/unicron-ckpt/JOB/rank-R)",
    )
    #: shared-memory slots (2 = double buffering; 3 lets a slow persistence overlap two snapshots)
    slots: int = setting(2, "UNICRON_CKPT_SLOTS", "shared-memory snapshot slots per rank (at least 2)")
    #: checksum granularity, and the size of a remote shard file
    chunk_bytes: int = setting(
        64 << 20, "UNICRON_CKPT_CHUNK_BYTES", "bytes per checksummed chunk / remote shard"
    )
    #: persist every Nth snapshot to remote storage (0 = never)
    persist_every: int = setting(
        0, "UNICRON_CKPT_PERSIST_EVERY", "persist every Nth snapshot remotely (0: never)"
    )
    #: persisted snapshots kept per rank
    keep_remote: int = setting(
        2, "UNICRON_CKPT_KEEP_REMOTE", "persisted snapshots kept per rank (more while another rank lags)"
    )
    #: the job's number of ranks (0: unknown); retention keeps what another rank may still need to
    #: restore with, and with this it knows which ranks there are before each has persisted once
    world_size: int = setting(
        0, "UNICRON_CKPT_WORLD_SIZE", "ranks of the job, for remote retention (0: those found in storage)"
    )
    #: threads copying CPU tensors into the slot (capped at the number of CPUs)
    copy_threads: int = setting(
        4, "UNICRON_CKPT_COPY_THREADS", "threads copying a snapshot into shared memory"
    )
    #: threads checksumming chunks in parallel (they compete with training for CPU)
    checksum_threads: int = setting(
        1, "UNICRON_CKPT_CHECKSUM_THREADS", "threads computing/verifying checksums"
    )
    #: also reject, at restore, a copy whose floating tensors hold NaN/Inf
    verify_finite: bool = setting(
        False, "UNICRON_CKPT_VERIFY_FINITE", "reject restored states holding NaN/Inf"
    )
    #: CPU: copy the tensors in the background, overlapping the next forward/backward; the runtime
    #: must then call fence() before the optimizer step (GPU copies are always asynchronous)
    overlap: bool = setting(
        False, "UNICRON_CKPT_OVERLAP", "CPU: copy in the background; fence() before stepping"
    )
    #: how long a new writer waits for the previous holder of this rank's slots to exit: a relaunch
    #: (a new generation, maybe on other nodes) can start while the previous generation's rank still
    #: saves its on-demand snapshot within its agent's stop grace (10 s by default)
    lock_wait_s: float = setting(
        30.0, "UNICRON_CKPT_LOCK_WAIT_S", "seconds to wait for the previous writer of this rank's slots to exit"
    )
    #: the task generation this process runs in (the agent's ``UNICRON_GENERATION``), recorded in
    #: every snapshot: peers and storage refuse one of an older generation than they hold for the rank
    generation: int = setting(
        0, "UNICRON_GENERATION", "the task generation snapshots are written under (set by the agent)"
    )
    #: with the default ``local_dir``, a writer that finds /dev/shm full takes the space of other ranks'
    #: directories that no process holds and nobody wrote for this long (jobs that ended or moved)
    local_idle_s: float = setting(
        IDLE_DIR_S, "UNICRON_CKPT_LOCAL_IDLE_S",
        "seconds unwritten before an unheld rank directory in /dev/shm may give up its space to a full writer",
    )
    #: a peer whose push failed (unreachable, frozen, or too slow to finish before a newer save needed its
    #: slot) gets no push for this long, doubled per further failure up to 8x: a dead peer costs nothing
    peer_backoff_s: float = setting(
        10.0, "UNICRON_CKPT_PEER_BACKOFF_S", "seconds a replica peer whose push failed is skipped (doubling, up to 8x)"
    )
    #: a persist that moved no bytes to the storage for this long (synced every 8 MiB: a slow storage
    #: moves some) is taken for hung (a frozen or dead mount) once a save() needs its slot, or a wait()
    #: (close, restore, a stop) waits for it: it is abandoned, not persisted, and training goes on;
    #: keep it under the agent's stop grace (10 s)
    persist_stall_s: float = setting(
        5.0, "UNICRON_CKPT_PERSIST_STALL_S",
        "seconds without bytes reaching the storage before a persist that a save or wait waits for is abandoned",
    )
    #: extra "module:Name" globals the state may hold, comma-separated (metadata unpickling is allow-listed)
    safe_globals: str = setting(
        "", "UNICRON_CKPT_SAFE_GLOBALS", "extra module:Name globals allowed in a state"
    )

    def validate(self) -> None:
        check_name(self.job, "CheckpointConfig.job")
        checks = [
            ("rank", self.rank >= 0, "must be >= 0"),
            ("slots", self.slots >= 2, "must be >= 2 (double buffering)"),
            ("lock_wait_s", self.lock_wait_s >= 0, "must be >= 0"),
            ("chunk_bytes", self.chunk_bytes >= 4096, "must be >= 4096"),
            ("persist_every", self.persist_every >= 0, "must be >= 0"),
            ("keep_remote", self.keep_remote >= 1, "must be >= 1"),
            ("world_size", self.world_size >= 0 and (self.world_size == 0 or self.rank < self.world_size),
             "must be >= 0 and above the rank"),
            ("checksum_threads", self.checksum_threads >= 1, "must be >= 1"),
            ("copy_threads", self.copy_threads >= 1, "must be >= 1"),
            ("local_idle_s", self.local_idle_s >= 0, "must be >= 0"),
            ("peer_backoff_s", self.peer_backoff_s >= 0, "must be >= 0"),
            ("persist_stall_s", self.persist_stall_s > 0, "must be > 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ConfigError(f"CheckpointConfig.{name}={getattr(self, name)!r}: {why}")

    def local_root(self) -> Path:
        if self.local_dir:
            return Path(self.local_dir)
        return Path(DEFAULT_SHM) / self.job / f"rank-{self.rank:05d}"


class SaveTicket:
    """Returned by :meth:`CheckpointManager.save`: the stall it caused, and the background outcome."""

    def __init__(
        self, iteration: int, nbytes: int, blocking_s: float, encode_s: float, wait_s: float, copy_s: float
    ) -> None:
        self.iteration = iteration
        #: bytes of the snapshot (metadata + tensor data)
        self.nbytes = nbytes
        #: seconds save() held the training thread, all included
        self.blocking_s = blocking_s
        #: of which pickling the state's structure and laying out its tensors
        self.encode_s = encode_s
        #: of which waiting for a free slot (background work of earlier snapshots still running)
        self.wait_s = wait_s
        #: of which copying the tensor bytes into the slot (GPU: queueing the copies)
        self.copy_s = copy_s
        self._done = threading.Event()
        self._outcome: SaveOutcome | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> SaveOutcome:
        if not self._done.wait(timeout):
            raise TimeoutError(f"snapshot of iteration {self.iteration} still in progress after {timeout}s")
        assert self._outcome is not None
        return self._outcome

    def _finish(self, outcome: SaveOutcome) -> None:
        self._outcome = outcome
        self._done.set()


@dataclass
class _Job:
    slot: int
    iteration: int
    meta: bytes
    data_len: int
    ticket: SaveTicket
    event: Any
    persist_due: bool
    info: SnapshotInfo | None = None
    #: the local tier holds it (its slot is in the pointer)
    published: bool = False
    replicas: list[str] = field(default_factory=list)
    persisted: bool | None = None
    errors: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    #: overlap mode on CPU: the tensors still to copy (the publish stage copies them), else None
    enc: codec.Encoded | None = None
    #: the tensors' version counters at save(): a change before the copy finished means a torn copy
    versions: list[int] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    #: set once the tensor bytes are in the slot (CPU overlap) -- what fence() waits for
    copied: threading.Event = field(default_factory=threading.Event)
    #: GPU: fence() ran before any modification, so later ones are ordered after the copies
    fenced_clean: bool = False
    #: a save() needs this job's slot: its pushes still in flight are abandoned
    abandon: bool = False
    #: set when a push ends or the job is abandoned (the replicate stage waits on it)
    wake: threading.Event = field(default_factory=threading.Event)
    #: time.monotonic() of the persist's last bytes that reached the storage (its start, before the first)
    persist_progress: float = 0.0
    #: its manifest and marker are written: persisted; only retention is left, never abandoned
    persist_committed: bool = False
    #: its persist made no progress for persist_stall_s while its slot or its outcome was waited for
    persist_abandoned: bool = False


class PersistAbandoned(CheckpointError):
    """A persist's writer resumed after the persist was abandoned: its snapshot's memory is no longer its own."""


def _changed(job: _Job) -> list[int]:
    """Indices of tensors modified in place since save() (their version counter moved)."""
    return [i for i, (t, v) in enumerate(zip(job.tensors, job.versions, strict=True)) if t._version != v]


def _superseded(claims: Sequence[Mapping[int, int | None]], iteration: int, generation: int | None) -> str | None:
    """Why the copy of ``iteration`` written by ``generation`` is of an abandoned timeline: ``claims``
    (iteration -> generation, per tier) hold a copy of a newer generation at that iteration or an
    older one, so that generation restored an older state and trained on. None when it is not."""
    if generation is None:
        return None
    newer = [(g, it) for c in claims for it, g in c.items() if g is not None and g > generation and it <= iteration]
    if not newer:
        return None
    g, it = max(newer)
    return f"stale: generation {generation}'s copy; generation {g} holds iteration {it} (an abandoned timeline)"


_Item = TypeVar("_Item")
_Answer = TypeVar("_Answer")


def _ask_each(items: Sequence[_Item], ask: Callable[[_Item], _Answer]) -> list[_Answer]:
    """``ask(item)`` per item, in order; up to 16 at once, so asking every node's replica server waits
    for the slowest one (a frozen node: a connect timeout), not for their sum."""
    if len(items) <= 2:
        return [ask(i) for i in items]
    with ThreadPoolExecutor(min(16, len(items)), thread_name_prefix="ckpt-ask") as pool:
        return list(pool.map(ask, items))


def _list_all(sources: Sequence[Source]) -> list[dict[int, int | None] | Exception]:
    """Each source's ``held()``, or the error that kept it from answering; asked in parallel."""

    def held(s: Source) -> dict[int, int | None] | Exception:
        try:
            return s.held()
        except (UnicronError, OSError) as exc:
            return exc

    return _ask_each(sources, held)


_STOP = object()


class CheckpointManager(Checkpointer):
    """One rank's hierarchical in-memory checkpointing (see the module docstring).

    ``peers``: the replica servers this rank pushes its replicas to (``placement.replica_targets`` of
    the node it runs on); ``storage``: remote persistence, or None; ``restore_peers``: further replica
    servers that restore and ``available()`` also ask, after ``peers`` (a rank relaunched on another
    node finds its replica on the successor of the node it ran on before, not of this one).
    """

    def __init__(
        self, config: CheckpointConfig, peers: Sequence[ReplicaStore] = (), storage: Storage | None = None,
        restore_peers: Sequence[ReplicaStore] = (),
    ) -> None:
        config.validate()
        self.config = config
        self.peers = list(peers)
        known = {p.describe() for p in self.peers}
        #: asked on restore only, each server once (``peers`` first: the nearest order is kept)
        self.restore_peers: list[ReplicaStore] = []
        for p in restore_peers:
            if p.describe() not in known:
                known.add(p.describe())
                self.restore_peers.append(p)
        self.storage = storage
        if config.persist_every and storage is None:
            raise ConfigError("CheckpointConfig.persist_every is set but no storage was given")
        self._safe = codec.parse_safe_globals(
            [s.strip() for s in config.safe_globals.split(",") if s.strip()]
        )
        self._log = log.get("ckpt", job=config.job, rank=config.rank)
        # other jobs' directories share the default root; a directory of the user's is theirs alone
        shared = None if config.local_dir else Path(DEFAULT_SHM)
        self._store = LocalStore(config.local_root(), config.slots, shared_root=shared, idle_s=config.local_idle_s)
        self._store.lock(wait_s=config.lock_wait_s)
        threads = config.checksum_threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ckpt-crc") if threads > 1 else None
        self._copy_workers = min(config.copy_threads, os.cpu_count() or 1)
        self._copy_pool = ThreadPoolExecutor(self._copy_workers, thread_name_prefix="ckpt-copy")
        self._cv = threading.Condition()
        self._busy = [False] * config.slots
        self._gpu_stage = codec.Stage()  # one GPU staging buffer: every slot's copies run on one stream
        self._stage_refusal_logged = False
        self._dests = [codec.Destinations(self._gpu_stage) for _ in range(config.slots)]  # each slot's GPU copies
        self._inflight: list[SaveTicket] = []
        self._last: int | None = None
        #: what the last restore found (sources out of reach; what each restore peer listed), valid until
        #: the next save: a resume_from after it does not wait for those peers again (see _not_to_ask)
        self._restore_view: tuple[set[str], dict[str, set[int]]] | None = None
        self._count = 0
        #: storage may still hold snapshots newer than this timeline: every save is persisted until one
        #: persist succeeds (it drops them), else a node lost meanwhile restored the abandoned future
        self._persist_pending = False
        self._stream: Any = None
        self._fence_job: _Job | None = None
        # one pusher per peer, so a peer still busy with an abandoned push delays no other
        self._pushers = [ThreadPoolExecutor(1, thread_name_prefix="ckpt-push") for _ in self.peers]
        self._pushing: list[Future[None] | None] = [None] * len(self.peers)
        #: per peer: (no push before this time.monotonic(), consecutive failures)
        self._down: list[tuple[float, int]] = [(0.0, 0)] * len(self.peers)
        #: the job in the replicate stage (under _cv): what _acquire_slot abandons when it needs its slot
        self._replicating: _Job | None = None
        #: the job in the persist stage (under _cv), and the thread writing it: a write blocked in a hung
        #: mount never returns, so it runs apart and is abandoned (see _stalled_persist)
        self._persisting: _Job | None = None
        self._writer: threading.Thread | None = None
        self._closed = False
        self._queues: list[queue.Queue[Any]] = [queue.Queue() for _ in range(3)]
        stages = (self._publish, self._replicate, self._persist)
        self._threads = [
            threading.Thread(
                target=self._stage, args=(i, fn), name=f"ckpt-{fn.__name__.strip('_')}", daemon=True
            )
            for i, fn in enumerate(stages)
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------------------------------- save

    def save(self, state: Any, iteration: int, persist: bool = False) -> SaveTicket:
        """Snapshot ``state`` after ``iteration`` (strictly increasing); see :class:`SaveTicket`.
        ``persist``: also write this one to storage (when there is one) whatever ``persist_every``
        says, e.g. the on-demand snapshot a stopping task takes before its processes exit."""
        t0 = time.perf_counter()
        if self._closed:
            raise CheckpointError("save() on a closed CheckpointManager")
        if not isinstance(iteration, int) or iteration < 0:
            raise InvalidRecord(f"save: iteration must be a non-negative integer, got {iteration!r}")
        if self._last is not None and iteration <= self._last:
            raise CheckpointError(
                f"save: iteration {iteration} is not after the last saved or restored iteration {self._last}"
            )
        # A first save starts a new timeline. Peers and storage enforce it themselves when the snapshot
        # reaches them (a push/persist of a rank replaces whatever newer one they had), so saves are
        # persisted whatever persist_every says until one persist succeeds (see _persist_pending).
        first = self._last is None
        if first:
            self._persist_pending = True
            if gone := self._store.withdraw_newer(iteration - 1):
                self._log.warning("discarded local snapshots newer than the first save", discarded=gone)
        t_start = time.perf_counter()
        enc = codec.encode(state)
        t_enc = time.perf_counter()
        slot = self._acquire_slot()
        t1 = time.perf_counter()
        background = self.config.overlap and not enc.on_cuda
        try:
            data = self._store.prepare(slot, enc.data_len, pin=enc.on_cuda)
            t2 = time.perf_counter()
            event = None
            if not background:
                stream = self._copy_stream() if enc.on_cuda else None
                event = codec.copy_into(
                    enc, data, stream, self._copy_pool, self._copy_workers, self._dests[slot]
                )
                if self._gpu_stage.refused and not self._stage_refusal_logged:
                    self._stage_refusal_logged = True
                    self._log.warning(
                        "no GPU memory for the snapshot staging buffer: GPU tensors are copied one by one "
                        "(more host time in save())",
                        stage_bytes=self._gpu_stage.nbytes,
                    )
        except BaseException:
            self._release(slot)
            raise
        t3 = time.perf_counter()
        # blocking_s is set at the return: what save() cost its caller, bookkeeping included
        ticket = SaveTicket(iteration, enc.data_len + len(enc.meta), 0.0, t_enc - t_start, t1 - t_enc, t3 - t2)
        self._last = iteration
        self._restore_view = None
        self._count += 1
        due = self.storage is not None and (
            persist
            or self._persist_pending
            or (self.config.persist_every > 0 and self._count % self.config.persist_every == 0)
        )
        job = _Job(
            slot, iteration, enc.meta, enc.data_len, ticket, event, due, enc=enc if background else None
        )
        if background or event is not None:  # copies still to run: watch for modifications meanwhile
            job.tensors = enc.tensors
            job.versions = [t._version for t in enc.tensors]
        else:
            job.copied.set()
        self._fence_job = job
        with self._cv:
            self._inflight.append(ticket)
        self._queues[0].put(job)
        ticket.blocking_s = time.perf_counter() - t0
        return ticket

    def fence(self) -> None:
        """Call after save() and before the state is next modified (the optimizer step).

        GPU: makes the current CUDA stream wait for the snapshot's copies (no host stall). CPU with
        ``overlap``: waits for the background copy. CPU without: nothing to do. Without it, a snapshot
        whose tensors were modified before its copy completed is discarded as torn, as far as their
        version counters show: an in-place CPU operation still running when the copy ends has not
        counted yet (PyTorch counts it on return), so only this call makes an overlap snapshot safe.
        """
        job, self._fence_job = self._fence_job, None
        if job is None:
            return
        if job.event is not None:
            torch.cuda.current_stream().wait_event(job.event)
            with self._cv:
                job.fenced_clean = not _changed(job)
        else:
            job.copied.wait()

    def wait(self, timeout: float | None = None) -> list[SaveOutcome]:
        """Wait for the background work of every snapshot still in flight; returns their outcomes,
        oldest first (a finished one's is its ticket's ``result()``)."""
        with self._cv:
            tickets = list(self._inflight)
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for t in tickets:
            # a persist blocked in a hung mount is abandoned once stalled: a stop (close) waited here until
            # the agent's SIGKILL, and said nothing of the snapshot it had not persisted
            while not t.done() and (deadline is None or time.monotonic() < deadline):
                with self._cv:
                    self._abandon_if_stalled(self._persisting)
                left = 0.25 if deadline is None else min(0.25, max(0.0, deadline - time.monotonic()))
                t._done.wait(left)
            out.append(t.result(0))
        return out

    def _copy_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        return self._stream

    def _acquire_slot(self) -> int:
        """A slot that no stage is using and that is not the newest published one (waits if none)."""
        with self._cv:
            while True:
                try:
                    pub = self._store.published()
                except CheckpointCorrupt:
                    pub = {}
                newest = max(pub, key=lambda s: pub[s].iteration) if pub else None
                free = [s for s in range(self.config.slots) if not self._busy[s] and s != newest]
                if free:
                    slot = min(free, key=lambda s: pub[s].iteration if s in pub else -1)
                    self._busy[slot] = True
                    return slot
                rep = self._replicating
                if rep is not None and rep.slot != newest and not rep.abandon:
                    # replication never holds a slot save() needs: a frozen peer stalled every save for
                    # the client's whole timeout (60 s). Its pushes still in flight are abandoned.
                    rep.abandon = True
                    rep.wake.set()
                pending = self._persisting
                if pending is not None and pending.slot != newest and not self._abandon_if_stalled(pending):
                    # a persist that makes progress is waited for (storage slower than the snapshot rate
                    # throttles training, as before); one stalled in a hung mount held every save
                    # until the mount came back
                    stalled = time.monotonic() - pending.persist_progress
                    self._cv.wait(self.config.persist_stall_s if pending.persist_committed
                                  else max(0.01, self.config.persist_stall_s - stalled))
                    continue
                self._cv.wait()

    def _abandon_if_stalled(self, job: _Job | None) -> bool:
        """Abandon ``job``'s persist if it moved no bytes for ``persist_stall_s`` and is not yet committed (under _cv); whether
        it is abandoned."""
        if job is None or job.persist_abandoned:
            return job is not None
        if job.persist_committed or time.monotonic() - job.persist_progress < self.config.persist_stall_s:
            return False
        job.persist_abandoned = True
        job.wake.set()
        return True

    def _release(self, slot: int) -> None:
        with self._cv:
            self._busy[slot] = False
            self._cv.notify_all()

    # ------------------------------------------------------------------------------------------- stages

    def _stage(self, index: int, fn: Any) -> None:
        q = self._queues[index]
        while True:
            job = q.get()
            if job is _STOP:
                if index + 1 < len(self._queues):
                    self._queues[index + 1].put(_STOP)
                return
            t0 = time.perf_counter()
            try:
                forward = fn(job)
            except Exception as exc:  # a stage must never die: the slot would stay busy forever
                job.errors.append(f"{fn.__name__.strip('_')}: {type(exc).__name__}: {exc}")
                forward = False
            job.seconds[fn.__name__.strip("_")] = time.perf_counter() - t0
            if forward and index + 1 < len(self._queues):
                self._queues[index + 1].put(job)
            else:
                self._finish(job)

    def _snapshot(self, job: _Job) -> Snapshot:
        assert job.info is not None
        data = self._store.data_view(job.slot, job.data_len)
        return Snapshot(job.info, job.meta, codec.byte_view(data))

    def _publish(self, job: _Job) -> bool:
        if job.enc is not None:  # CPU overlap: the copy happens here, off the training thread
            try:
                slot_data = self._store.data_view(job.slot, job.data_len)
                codec.copy_into(
                    job.enc, slot_data, None, self._copy_pool, self._copy_workers, self._dests[job.slot]
                )
                torn = _changed(job)
            finally:
                job.enc = None
                job.copied.set()
        elif job.event is not None:
            job.event.synchronize()
            with self._cv:
                torn = [] if job.fenced_clean else _changed(job)
        else:
            torn = []  # copied synchronously inside save(): nothing could interleave
        with self._cv:  # a fence() still to come finds nothing to check (the copy is over, judged here)
            job.tensors, job.versions = [], []
        if torn:
            raise CheckpointError(
                f"torn snapshot discarded: {len(torn)} tensor(s) were modified before their copy completed "
                "(call fence() after save() and before the optimizer step)"
            )
        data = codec.byte_view(self._store.data_view(job.slot, job.data_len))
        crcs = codec.chunk_crcs(data, self.config.chunk_bytes, self._pool)
        # the checksummed snapshot, also what peers and storage get when the local publish fails
        job.info = SnapshotInfo(
            job=self.config.job,
            rank=self.config.rank,
            iteration=job.iteration,
            meta_len=len(job.meta),
            meta_crc=codec.crc(job.meta),
            data_len=job.data_len,
            chunk_bytes=self.config.chunk_bytes,
            chunk_crcs=crcs,
            created=time.time(),
            generation=self.config.generation,
        )
        try:
            self._store.publish(job.slot, job.info, job.meta)
            job.published = True
        except OSError as exc:  # a full or failing local disk: the bytes are good, so the other tiers still get them
            job.errors.append(f"publish: {type(exc).__name__}: {exc}")
            self._log.warning("local publish failed; peers and storage still get the snapshot",
                              iteration=job.iteration, error=str(exc))
        with self._cv:
            self._cv.notify_all()  # the newest published slot changed: another slot may be free now
        return bool(self.peers) or job.persist_due

    def _replicate(self, job: _Job) -> bool:
        snap = self._snapshot(job)
        with self._cv:
            self._replicating = job
            self._cv.notify_all()  # a save() waiting for a slot may need this job's
        try:
            started = self._start_pushes(job, snap)
            while True:  # until every push ended, or a save() needs the slot
                job.wake.clear()
                with self._cv:
                    abandon = job.abandon
                if abandon or all(f.done() for f in started.values()):
                    break
                job.wake.wait()
        finally:
            with self._cv:
                self._replicating = None
        for i, fut in started.items():
            peer = self.peers[i]
            # a store that cannot cut its push short (an in-process one, quick) is waited for
            if not fut.done() and peer.abort() and not fut.done():
                self._push_failed(i, job, "abandoned: a newer save needed its slot before the push ended")
                continue
            try:
                fut.result()
            except UnicronError as exc:
                self._push_failed(i, job, str(exc), down=isinstance(exc, ReplicaUnavailable))
            except Exception as exc:  # a bug in one peer's client must not cost the others or persistence
                job.errors.append(f"replicate to {peer.describe()}: {type(exc).__name__}: {exc}")
                self._log.exception("replication failed", iteration=job.iteration, peer=peer.describe())
            else:
                job.replicas.append(peer.describe())
                if self._down[i][1]:
                    self._log.info("replica peer back", peer=peer.describe())
                self._down[i] = (0.0, 0)
        return job.persist_due

    def _start_pushes(self, job: _Job, snap: Snapshot) -> dict[int, Future[None]]:
        """Start the push to each peer that is neither backing off after a failure nor still busy with
        an abandoned push (each such one is a missed replica); returns the pushes started, by peer."""
        started: dict[int, Future[None]] = {}
        now = time.monotonic()
        for i, peer in enumerate(self.peers):
            until, _ = self._down[i]
            prev = self._pushing[i]
            if now < until:
                job.errors.append(f"replicate to {peer.describe()}: skipped: down after a failed push, "
                                  f"tried again in {until - now:.1f}s")
                continue
            if prev is not None and not prev.done():
                self._push_failed(i, job, "skipped: still busy with an abandoned push")
                continue
            fut = self._pushers[i].submit(peer.put, snap)
            fut.add_done_callback(lambda _: job.wake.set())
            self._pushing[i] = started[i] = fut
        return started

    def _push_failed(self, i: int, job: _Job, why: str, down: bool = True) -> None:
        """Record a missed replica; ``down``: the peer gets no push for its backoff (a refusal, e.g. a
        full budget, is the peer's answer, and the next snapshot may fit)."""
        peer = self.peers[i].describe()
        job.errors.append(f"replicate to {peer}: {why}")
        if not down:
            self._log.warning("replication failed", iteration=job.iteration, peer=peer, error=why)
            return
        failures = self._down[i][1] + 1
        backoff = self.config.peer_backoff_s * 2 ** min(failures - 1, 3)
        self._down[i] = (time.monotonic() + backoff, failures)
        self._log.warning("replication failed; no push to this peer for a while", iteration=job.iteration,
                          peer=peer, error=why, backoff_s=backoff)

    def _persist(self, job: _Job) -> bool:
        if not job.persist_due:
            return False
        storage = self.storage
        assert storage is not None
        where = f"persist to {storage.describe()}"
        if self._writer is not None and self._writer.is_alive():
            # an abandoned write is still blocked in the storage: no second one queues behind it
            job.persisted = False
            job.errors.append(f"{where}: skipped: an abandoned persist is still blocked in the storage")
            self._log.warning("persistence skipped: an abandoned persist is still blocked in the storage",
                              iteration=job.iteration)
            return False
        snap = self._snapshot(job)
        ended: list[BaseException | None] = []

        def step() -> None:
            with self._cv:
                if job.persist_abandoned:
                    raise PersistAbandoned(f"iteration {job.iteration}: abandoned, its memory was taken back")
                job.persist_progress = time.monotonic()

        def moved() -> None:  # bytes reached the storage: slow, not hung
            with self._cv:
                job.persist_progress = time.monotonic()

        def committed() -> None:
            with self._cv:
                job.persist_committed = True

        def write() -> None:
            try:
                persist.persist(storage, snap, self.config.keep_remote, self.config.world_size, step=step,
                                progress=moved, committed=committed)
                ended.append(None)
            except BaseException as exc:
                ended.append(exc)
            finally:
                job.wake.set()

        # a daemon thread: one blocked in a hung mount must hold neither the stages nor the process's exit
        writer = threading.Thread(target=write, name="ckpt-persist-write", daemon=True)
        with self._cv:
            job.persist_progress = time.monotonic()
            self._persisting, self._writer = job, writer
            self._cv.notify_all()  # a save() waiting for a slot may need this job's
        writer.start()
        try:
            while True:
                job.wake.clear()
                with self._cv:
                    if ended or job.persist_abandoned:
                        break
                job.wake.wait()
        finally:
            with self._cv:
                self._persisting = None
        if not ended:  # still blocked: the slot goes back, the writer finds its job abandoned if it resumes
            job.persisted = False
            job.errors.append(f"{where}: abandoned: no bytes reached the storage for {self.config.persist_stall_s:g}s "
                              "(a hung mount?) while its slot or its outcome was waited for")
            self._log.warning("persistence abandoned: the storage made no progress", iteration=job.iteration,
                              storage=storage.describe(), stall_s=self.config.persist_stall_s)
            return False
        exc = ended[0]
        if exc is None:
            job.persisted = True
            self._persist_pending = False
        elif isinstance(exc, UnicronError):
            job.persisted = False
            job.errors.append(f"{where}: {exc}")
            self._log.warning("persistence failed", iteration=job.iteration, error=str(exc))
        else:
            raise exc
        return False

    def _finish(self, job: _Job) -> None:
        if job.persist_due and job.persisted is None:
            job.persisted = False
        self._release(job.slot)
        with self._cv:  # a finished ticket is the caller's alone (periodic saves never call wait())
            if job.ticket in self._inflight:
                self._inflight.remove(job.ticket)
        job.ticket._finish(
            SaveOutcome(
                iteration=job.iteration,
                published=job.published,
                replicas=tuple(job.replicas),
                persisted=job.persisted if job.persist_due else None,
                errors=tuple(job.errors),
                stage_s=tuple(job.seconds.items()),
            )
        )

    # ------------------------------------------------------------------------------------------- restore

    def _sources(self) -> list[Source]:
        job, rank = self.config.job, self.config.rank
        out: list[Source] = [LocalSource(self._store, job, rank)]
        out += [PeerSource(p, job, rank) for p in (*self.peers, *self.restore_peers)]
        if self.storage is not None:
            out.append(RemoteSource(self.storage, job, rank))
        return out

    def available(self) -> list[tuple[str, str, list[int] | None]]:
        """(tier, source, iterations claimed) per source, nearest first; None where unreachable. Lets
        the runtime agree with the other ranks on an iteration every rank can restore."""
        sources = self._sources()
        held = [h if isinstance(h, dict) else None for h in _list_all(sources)]
        claims = [h for h in held if h is not None]
        return [
            (s.tier.value, s.describe(),
             None if h is None else sorted(it for it, g in h.items() if _superseded(claims, it, g) is None))
            for s, h in zip(sources, held, strict=True)
        ]

    def restore(self, iteration: int | None = None, into: Any = None) -> Restored:
        """The state of ``iteration`` (default: the newest any tier holds, falling back to older ones
        when no tier has a valid copy of it) from the nearest tier with a valid copy.

        ``into``: a state of the same structure (e.g. ``{"model": model.state_dict(), ...}``) whose
        tensors receive the values in place, any device; after a NoValidCheckpoint their content is
        undefined. Raises :class:`NoValidCheckpoint` listing every tier and why it was rejected.
        """
        self.wait()
        t0 = time.perf_counter()
        self._restore_view = None  # a failed restore leaves no earlier one's view behind
        sources = self._sources()
        attempts: list[TierAttempt] = []
        claims: dict[int, dict[int, int | None]] = {}
        # sources that could not be listed or read for now: what they hold may be valid, so a fallback to
        # an older iteration discards nothing there (an I/O hiccup deleted the newest durable snapshot)
        out_of_reach: set[str] = set()
        for i, (s, listed) in enumerate(zip(sources, _list_all(sources), strict=True)):
            if isinstance(listed, dict):
                claims[i] = listed
            else:
                claims[i] = {}
                out_of_reach.add(s.describe())
                attempts.append(TierAttempt(s.tier, s.describe(), None, f"unreachable: {listed}"))
        # a copy a newer generation superseded (it restored an older state and trained on) is of an
        # abandoned timeline, whatever tier is nearest: e.g. a node's memory out of reach meanwhile
        everything = list(claims.values())
        stale = {i: {it: why for it, g in c.items() if (why := _superseded(everything, it, g)) is not None}
                 for i, c in claims.items()}
        held = {i: sorted(set(c) - set(stale[i])) for i, c in claims.items()}
        targets = (
            [iteration]
            if iteration is not None
            else sorted({x for v in held.values() for x in v}, reverse=True)
        )
        if not targets:  # say so for every source that answered
            unreachable = {a.source for a in attempts}
            attempts += [
                TierAttempt(s.tier, s.describe(), None, "holds nothing")
                for s in sources
                if s.describe() not in unreachable
            ]
        for it in targets:
            for i, s in enumerate(sources):
                if it in stale[i]:
                    attempts.append(TierAttempt(s.tier, s.describe(), it, stale[i][it]))
                    continue
                if it not in held[i]:
                    newest = max(held[i], default=None)
                    why = (
                        "holds nothing"
                        if newest is None
                        else (
                            f"stale: its newest is iteration {newest}"
                            if newest < it
                            else f"missing: holds {held[i]}"
                        )
                    )
                    attempts.append(TierAttempt(s.tier, s.describe(), it, why))
                    continue
                try:
                    state = self._load(s, it, into, everything)
                except UnsafeSnapshot as exc:
                    # every copy names the same class: nothing older is restored, nothing newer discarded
                    raise UnsafeSnapshot(f"iteration {it} from {s.describe()}: {exc}; nothing was restored "
                                         "or deleted") from exc
                except (CheckpointCorrupt, UnicronError, OSError) as exc:
                    if isinstance(exc, TemporaryError | OSError):
                        out_of_reach.add(s.describe())
                    attempts.append(TierAttempt(s.tier, s.describe(), it, str(exc)))
                    self._log.warning(
                        "checkpoint tier skipped",
                        tier=s.tier.value,
                        source=s.describe(),
                        iteration=it,
                        reason=str(exc),
                    )
                    continue
                only = {p.describe() for p in self.restore_peers}
                self._restore_view = (out_of_reach, {src.describe(): set(claims[j])
                                                     for j, src in enumerate(sources) if src.describe() in only})
                self._discard_newer(it, skip=self._not_to_ask(it))
                self._last = it
                restored = Restored(
                    state, it, s.tier, s.describe(), tuple(attempts), time.perf_counter() - t0
                )
                self._log.info(
                    "restored",
                    tier=s.tier.value,
                    source=s.describe(),
                    iteration=it,
                    seconds=round(restored.seconds, 3),
                    skipped=len(attempts),
                )
                return restored
        raise NoValidCheckpoint(self.config.job, self.config.rank, iteration, attempts)

    def resume_from(self, iteration: int) -> None:
        """The state is that of ``iteration`` without a restore of it here (a reshard put it together
        from every rank's snapshots): saves go on after it, and whatever the tiers hold newer than it is
        discarded, as a restore of it does (a newer snapshot restored for the reshard and not used set
        the count ahead, and the save of the next iteration was refused: the rank died)."""
        self.wait()
        self._discard_newer(iteration, skip=self._not_to_ask(iteration))
        self._last = iteration

    def _not_to_ask(self, iteration: int) -> set[str]:
        """Sources the discard of what is newer than ``iteration`` leaves alone: those the last restore
        found out of reach (see ``_discard_newer``), and restore peers that listed nothing newer (every
        node's server is one; no save pushes to them, so their listing stays true)."""
        if self._restore_view is None:
            return set()
        out_of_reach, listed = self._restore_view
        return out_of_reach | {peer for peer, held in listed.items() if not any(x > iteration for x in held)}

    def _load(self, source: Source, iteration: int, into: Any, claims: Sequence[Mapping[int, int | None]]) -> Any:
        # training is stopped during a restore: verify with every core, not the background budget
        workers = max(self.config.checksum_threads, min(8, os.cpu_count() or 1))
        with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-verify") as pool:
            snap, private = source.load(iteration, pool)
        if (why := _superseded(claims, iteration, snap.info.generation)) is not None:
            raise CheckpointCorrupt(why)  # its generation was not known from the listing
        data = (
            torch.frombuffer(snap.data, dtype=torch.uint8)
            if len(snap.data)
            else torch.empty(0, dtype=torch.uint8)
        )
        state = codec.decode(snap.meta, data, private=private, into=into, safe_globals=self._safe)
        if self.config.verify_finite:
            bad = list(codec.nonfinite_tensors(state))
            if bad:
                raise CheckpointCorrupt(f"non-finite values in {len(bad)} tensor(s), e.g. {bad[:3]}")
        return state

    def _discard_newer(self, iteration: int, skip: set[str]) -> None:
        """Linear timeline after a restore: nothing newer than ``iteration`` may be restored later.
        Best effort per tier; ``skip``: sources out of reach a moment ago. A peer drops the newer ones
        at the next save's push; storage where they may remain gets every save persisted until one is."""
        job, rank = self.config.job, self.config.rank
        gone: dict[str, list[int]] = {}
        if local := self._store.withdraw_newer(iteration):
            gone["local"] = local

        def drop_newer(peer: ReplicaStore) -> list[int] | UnicronError:
            try:
                newer = [i.iteration for i in peer.list(job) if i.rank == rank and i.iteration > iteration]
                for it in newer:
                    peer.drop(job, rank, it)
                return newer
            except UnicronError as exc:
                return exc

        # wherever a copy of the abandoned future may be; in parallel: a frozen peer costs a connect timeout
        asked = [p for p in (*self.peers, *self.restore_peers) if p.describe() not in skip]
        for peer, dropped in zip(asked, _ask_each(asked, drop_newer), strict=True):
            if isinstance(dropped, UnicronError):
                self._log.warning("could not drop newer replicas", peer=peer.describe(), error=str(dropped))
            elif dropped:
                gone[peer.describe()] = dropped
        if self.storage is not None:
            discarded = False
            if self.storage.describe() not in skip:
                try:
                    if remote := persist.discard_newer(self.storage, job, rank, iteration,
                                                          generation=self.config.generation):
                        gone[self.storage.describe()] = remote
                    discarded = True
                except UnicronError as exc:
                    self._log.warning("could not discard newer persisted snapshots", error=str(exc))
            self._persist_pending = not discarded
        if gone:
            self._log.warning("rolled back: discarded newer snapshots", iteration=iteration, discarded=gone)

    # ------------------------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Finish background work and release the slots. The shared memory stays (a restarted process
        restores from it); ``LocalStore.remove(config.local_root())`` frees it for good."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(TimeoutError):
            self.wait()
        self._queues[0].put(_STOP)
        for t in self._threads:
            t.join()
        if self._pool is not None:
            self._pool.shutdown()
        self._copy_pool.shutdown()
        for pusher in self._pushers:  # an abandoned push still connecting gives up by itself
            pusher.shutdown(wait=False)
        self._store.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def local_root(self) -> Path:
        return self._store.root

    def __repr__(self) -> str:
        return f"CheckpointManager(job={self.config.job!r}, rank={self.config.rank}, pid={os.getpid()})"
