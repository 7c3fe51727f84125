"""Checkpoint hooks of the training runtime, through the ckpt subsystem's ``Checkpointer`` interface.

* ``memory``: :class:`ckpt.manager.CheckpointManager`, the hierarchical in-memory checkpoint (its own
  issue); used by :class:`unicron.runtime.state.CheckpointSource` when no replica holds the state.
* ``torch-save``: :class:`TorchSaveCheckpointer`, snapshots persisted with ``torch.save``, one
  directory per model-parallel shard written by one data-parallel replica (the conventional
  restart-from-checkpoint path; the benchmark's baseline).
"""

from __future__ import annotations

import contextlib
import enum
import glob
import json
import os
import re
import socket
import time
import zlib
from typing import Any, Protocol, runtime_checkable

import torch

from ckpt.api import (
    Checkpointer,
    NoValidCheckpoint,
    Restored,
    SaveOutcome,
    StorageUnavailable,
    Tier,
    TierAttempt,
)
from ckpt.storage import fsync_dir
from unicron.kernel.config import from_args
from unicron.kernel.errors import ConfigError, InvalidRecord

KINDS = ("none", "torch-save", "memory")
ENV_CKPT_PEERS = "UNICRON_CKPT_PEERS"
"""Comma-separated host:port of the replica servers that hold this rank's in-memory snapshots."""
ENV_CKPT_RESTORE_PEERS = "UNICRON_CKPT_RESTORE_PEERS"
"""Comma-separated host:port of every replica server a restore asks (a relaunched rank's replica is on
the successor of the node it ran on before)."""


@runtime_checkable
class SaveTicketLike(Protocol):
    """What a tiered checkpointer's ``save()`` returns (``ckpt.manager.SaveTicket``): its background outcome."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> SaveOutcome: ...


class PersistWatch:
    """The saves whose outcome the runtime has not looked at yet. A failed persist was only a warning in
    the rank's log: nothing else read the outcomes, and a stop said "saved" with nothing in storage."""

    def __init__(self) -> None:
        self._pending: list[SaveTicketLike] = []
        #: the newest iteration this process persisted (None: none yet)
        self.newest_persisted: int | None = None

    def track(self, ticket: object) -> None:
        """Watch what ``save()`` returned (nothing to watch for a checkpointer that saves synchronously)."""
        if isinstance(ticket, SaveTicketLike):
            self._pending.append(ticket)

    def not_persisted(self) -> list[SaveOutcome]:
        """Of the watched saves finished since the last call, those whose persist failed, oldest first."""
        failed: list[SaveOutcome] = []
        pending: list[SaveTicketLike] = []
        for ticket in self._pending:
            if not ticket.done():
                pending.append(ticket)
                continue
            outcome = ticket.result(0)
            if outcome.persisted:
                self.newest_persisted = max(outcome.iteration, self.newest_persisted or 0)
            elif outcome.persisted is False:
                failed.append(outcome)
        self._pending = pending
        return failed


def _host_tag() -> str:
    """This host's name as it goes into a temp file's name (no separators a glob or a parse trips on)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "localhost"


def _process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this host (another user's process counts as running)."""
    if pid <= 0:  # os.kill(0, ...) would mean this process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


#: a checkpoint file's checksum sidecar: ``it<N>.pt`` + this, ``{"size": bytes, "crc32": crc}``
SUM_SUFFIX = ".sum"
_READ_CHUNK = 8 << 20


def _file_sum(path: str) -> tuple[int, int]:
    """Size and CRC-32 of the file at ``path`` (read in chunks: a checkpoint may be larger than memory
    can hold twice)."""
    size, value = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            size += len(chunk)
            value = zlib.crc32(chunk, value)
    return size, value & 0xFFFFFFFF


def _sum_mismatch(path: str) -> str | None:
    """Why ``path`` is not the file its sidecar describes; None when it is, or when it has no sidecar
    (written before sidecars existed: loaded unverified, as then)."""
    try:
        with open(path + SUM_SUFFIX, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        want = json.loads(raw)
        size, crc = int(want["size"]), int(want["crc32"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"checksum sidecar unreadable ({type(exc).__name__})"
    if os.path.getsize(path) != size:
        return f"partial: {os.path.getsize(path)} bytes, its sidecar says {size}"
    if _file_sum(path)[1] != crc:
        return "checksum mismatch (bit rot, or a copy damaged in transit)"
    return None


def _why(exc: BaseException) -> str:
    """The OS error behind ``exc`` (torch.save's RuntimeError "unexpected pos" hides the ENOSPC in its
    chain), else its first line."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return f"[Errno {seen.errno}] {seen.strerror or os.strerror(seen.errno)}"
        seen = seen.__cause__ or seen.__context__
    return (str(exc).splitlines() or [type(exc).__name__])[0]


class TorchSaveCheckpointer(Checkpointer):
    """``<directory>/tp<K>/it<N>.pt``: one directory per model-parallel shard, as Megatron lays out
    ``mp_rank_<tp>_<pp>``, written atomically (unique temp file + rename); keeps the last ``keep``.

    With TP=1 every data-parallel replica holds the same parameters and optimizer state, so one
    replica per shard writes (:attr:`shared_by_replicas`; the scheduler picks the lowest-ranked live
    member of the shard's data-parallel group) and every rank of the shard reads the same files. A
    restart with a different data-parallel size, or a rank that rejoined and has not saved since, then
    restores the shard's newest snapshot instead of a stale per-rank one.
    """

    #: one writer per model-parallel shard; every rank of the shard restores the same files
    shared_by_replicas = True

    def __init__(self, directory: str, rank: int, keep: int = 2, shard: int = 0) -> None:
        if keep < 1:
            raise ConfigError(f"TorchSaveCheckpointer keep must be >= 1, got {keep}")
        self.root = directory
        self.rank = rank
        self.keep = keep
        self.use_shard(shard)

    def use_shard(self, shard: int) -> None:
        """Read and write the directory of tensor-parallel rank ``shard``."""
        self.shard = shard
        self.dir = os.path.join(self.root, f"tp{shard}")
        os.makedirs(self.dir, exist_ok=True)
        self.remove_orphans()

    def remove_orphans(self) -> list[str]:
        """Remove this rank's temp files in this shard's directory whose writer died mid-save (nothing
        else ever would: :meth:`held` and pruning see only ``it<N>.pt``); returns their paths.

        The directory may be shared by every rank of the shard, on several hosts: only this rank's files
        written on this host, by a process that no longer runs, are removed (a pid says nothing about
        another host's processes, so their files are left to the rank that runs there)."""
        mine = re.compile(rf"it\d+\.pt(?:{re.escape(SUM_SUFFIX)})?\.{self.rank}\.{re.escape(_host_tag())}\.(\d+)\.tmp$")
        removed = []
        for path in glob.glob(os.path.join(self.dir, f"it*.pt*.{self.rank}.*.tmp")):
            m = mine.match(os.path.basename(path))
            if m and _process_gone(int(m.group(1))):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                    removed.append(path)
        return removed

    def _path(self, iteration: int, directory: str | None = None) -> str:
        return os.path.join(directory or self.dir, f"it{iteration}.pt")

    def held(self, directory: str | None = None) -> list[int]:
        """Iterations of the snapshots on disk (in this shard's directory, or ``directory``), ascending."""
        pattern = os.path.join(directory or self.dir, "it*.pt")
        found = (re.match(r"it(\d+)\.pt$", os.path.basename(p)) for p in glob.glob(pattern))
        return sorted(int(m.group(1)) for m in found if m)

    def read_shard(self, shard: int, limit: int) -> list[Restored]:
        """The newest ``limit`` snapshots of shard ``shard``'s directory that load, newest first (any
        rank may read any shard: the files are shared); this checkpointer keeps its own shard."""
        directory = os.path.join(self.root, f"tp{shard}")
        found: list[Restored] = []
        for it in reversed(self.held(directory)):
            if len(found) == limit:
                break
            with contextlib.suppress(NoValidCheckpoint):  # torn: the older ones may still serve
                found.append(self._load(directory, it))
        return found

    def save(self, state: Any, iteration: int) -> None:
        # Unique per writer: after a regroup the previous writer may still be finishing a save. The
        # rank, host and pid name it so that remove_orphans can tell a dead writer's from a live one's.
        path = self._path(iteration)
        tag = f".{self.rank}.{_host_tag()}.{os.getpid()}.tmp"
        tmp, sum_tmp = path + tag, path + SUM_SUFFIX + tag
        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())  # else a node crash can leave the renamed file torn
            # the checksum of what reached the file: torch.load alone restored a flipped bit silently
            size, crc = _file_sum(tmp)
            with open(sum_tmp, "wb") as f:
                f.write(json.dumps({"size": size, "crc32": crc}).encode())
                f.flush()
                os.fsync(f.fileno())
            # the sidecar first: a crash between the renames leaves it without its file (ignored), never
            # a new file without its sidecar (which would load unverified)
            os.replace(sum_tmp, path + SUM_SUFFIX)
            os.replace(tmp, path)
            fsync_dir(self.dir)  # the renames themselves
        except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as a RuntimeError
            # a full disk: the partial temp file kept it full (remove_orphans spares a live writer's own),
            # and the traceback killed the rank at every relaunch; the previous checkpoint stays
            for t in (tmp, sum_tmp):
                with contextlib.suppress(OSError):
                    os.remove(t)
            raise StorageUnavailable(f"checkpoint of iteration {iteration} not saved in {self.dir}: {_why(exc)}") from exc
        held = self.held()
        for old in held[: -self.keep]:
            with contextlib.suppress(FileNotFoundError):  # pruned by a concurrent writer
                os.remove(self._path(old))
        oldest_kept = held[-self.keep:][0] if held else iteration
        for side in glob.glob(os.path.join(self.dir, f"it*.pt{SUM_SUFFIX}")):
            m = re.match(rf"it(\d+)\.pt{re.escape(SUM_SUFFIX)}$", os.path.basename(side))
            if m and int(m.group(1)) < oldest_kept:  # a pruned file's, or one of a save that crashed
                with contextlib.suppress(FileNotFoundError):
                    os.remove(side)
        self.remove_orphans()  # a dead writer's that was not yet reaped when this checkpointer was built

    def restore(self, iteration: int | None = None, into: Any = None) -> Restored:
        return self._load(self.dir, iteration)

    def _load(self, directory: str, iteration: int | None) -> Restored:
        """``iteration`` of ``directory``, or (None) its newest file that loads; a file that does not
        (torn by a crash, not a snapshot, unlike its checksum sidecar) is passed over with its reason,
        as the memory tiers do."""
        t0 = time.perf_counter()
        held = self.held(directory)
        wanted = [iteration] if iteration is not None else held[::-1]
        attempts: list[TierAttempt] = []
        for it in wanted:
            path = self._path(it, directory)
            if it not in held:
                attempts.append(TierAttempt(Tier.REMOTE, directory, it, "no such checkpoint file"))
                continue
            try:
                damaged = _sum_mismatch(path)
            except OSError as exc:  # gone meanwhile (pruned by a concurrent writer), an I/O error
                damaged = f"unreadable ({exc})"
            if damaged is not None:
                attempts.append(TierAttempt(Tier.REMOTE, path, it, damaged))
                continue
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # torch.load raises whatever its unpickler meets in a torn file
                why = f"unreadable ({type(exc).__name__}: {exc}".splitlines()[0] + ")"
                attempts.append(TierAttempt(Tier.REMOTE, path, it, why))
                continue
            return Restored(state, it, Tier.REMOTE, path, tuple(attempts), time.perf_counter() - t0)
        if not attempts:
            attempts.append(TierAttempt(Tier.REMOTE, directory, None, "no checkpoint file"))
        raise NoValidCheckpoint("torch-save", self.rank, iteration, attempts)


class Presence(enum.IntEnum):
    """What a rank's checkpointer holds, as far as it can tell (cheap: nothing is loaded)."""

    NONE = 0
    FOUND = 1
    #: nothing found, and the durable (remote) tier could not be listed: a first launch cannot be told
    #: from a checkpoint out of reach, and starting afresh would later discard it
    UNKNOWN = 2


def checkpoint_presence(checkpointer: Checkpointer) -> Presence:
    """Whether ``checkpointer`` holds any snapshot this rank can restore. A peer replica out of reach
    does not make it UNKNOWN: its copies are memory, lost with nodes anyway."""
    if isinstance(checkpointer, TorchSaveCheckpointer):
        return Presence.FOUND if checkpointer.held() else Presence.NONE
    available = getattr(checkpointer, "available", None)
    if not callable(available):
        return Presence.FOUND
    entries = available()  # CheckpointManager: (tier, source, iterations or None) per source
    if any(iterations for _, _, iterations in entries):
        return Presence.FOUND
    if any(iterations is None and tier == Tier.REMOTE.value for tier, _, iterations in entries):
        return Presence.UNKNOWN
    return Presence.NONE


def newest_checkpoint(checkpointer: Checkpointer) -> int | None:
    """The newest iteration any of ``checkpointer``'s tiers claims to hold (unverified, nothing loaded)."""
    if isinstance(checkpointer, TorchSaveCheckpointer):
        held = checkpointer.held()
        return held[-1] if held else None
    available = getattr(checkpointer, "available", None)
    if callable(available):
        return max((i for _, _, its in available() for i in (its or [])), default=None)
    return None


def storage_root(storage: str, directory: str) -> str:
    """``--ckpt-storage``: the directory persisted snapshots go to ("" = under ``--ckpt-dir``; none: off)."""
    if storage == "none":
        return ""
    return storage or (os.path.join(directory, "persisted") if directory else "")


def make_checkpointer(kind: str, directory: str, job: str, rank: int, *, storage: str = "",
                      persist_every: int = 1, world_size: int = 0) -> Checkpointer | None:
    """The checkpointer named by ``--ckpt``; None for ``none``. ``storage``/``persist_every``: the
    remote tier of ``memory`` (see :func:`storage_root`); ``world_size``: the job's ranks, which its
    retention keeps a common persisted iteration of (0: unknown)."""
    if kind == "none":
        return None
    if kind == "torch-save":
        if not directory:
            raise ConfigError("--ckpt torch-save needs --ckpt-dir DIR")
        try:
            return TorchSaveCheckpointer(directory, rank)
        except OSError as exc:  # a file in the way, no permission: the flag's value, not a bug
            raise ConfigError(f"--ckpt-dir {directory!r}: {exc}") from exc
    if kind == "memory":
        from ckpt.manager import CheckpointConfig, CheckpointManager
        from ckpt.replica import ReplicaClient
        from ckpt.storage import FilesystemStorage
        from unicron.kernel import tls

        name = re.sub(r"[^A-Za-z0-9._-]", "-", job or "local")[:128] or "local"
        local = os.path.join(directory, f"rank-{rank}") if directory else ""
        tls_config = tls.from_env()  # the node's certificate, when the agent runs with --tls-dir
        def clients(var: str) -> list[ReplicaClient]:
            raw = os.environ.get(var, "")
            out = []
            for addr in (a.strip() for a in raw.split(",")):
                if not addr:
                    continue
                try:
                    out.append(ReplicaClient(addr, tls_config=tls_config))
                except InvalidRecord as exc:  # the variable's value, not a bug: one line, not a traceback
                    raise ConfigError(f"environment variable {var}={raw!r}: {addr!r} is not host:port; "
                                      "expected the peers' replica servers as comma-separated host:port (the "
                                      "agent sets it)") from exc
            return out

        # Peer nodes' replica servers (GEMINI placement), given by the agent that launched us: the ring
        # successors of our node get our pushes; a restore asks every node's (our replica may be on the
        # successor of the node this rank ran on before a relaunch)
        peers = clients(ENV_CKPT_PEERS)
        restore_peers = clients(ENV_CKPT_RESTORE_PEERS)
        root = storage_root(storage, directory)
        try:
            remote = FilesystemStorage(root) if root else None
        except OSError as exc:
            raise ConfigError(f"--ckpt-storage {root!r}: {exc}") from exc
        # the flags' values win; every other tunable comes from its UNICRON_CKPT_* variable (docs/ckpt.md)
        given: dict[str, str | int] = {"local_dir": local} if local else {}
        config = from_args(CheckpointConfig, None, job=name, rank=rank, world_size=world_size,
                           persist_every=persist_every if remote is not None else 0, **given)
        return CheckpointManager(config, peers=peers, storage=remote, restore_peers=restore_peers)
    raise ConfigError(f"--ckpt {kind!r}: choose one of {KINDS}")
