"""The local tier: one rank's snapshots in shared memory, double-buffered.

A directory (by default under ``/dev/shm``, so it outlives the training process but not the node)::

    LOCK            flock held by the one process writing this rank's snapshots
    PUBLISHED       JSON {"slots": {"0": <SnapshotInfo>, ...}}: the complete, checksummed slots
    slot-<k>.data   tensor bytes of slot k (mapped shared; pages are allocated once and reused)
    slot-<k>.meta   metadata bytes of slot k

A snapshot is written into a slot that PUBLISHED does not list (the slot is first withdrawn from it),
and becomes visible only when PUBLISHED is atomically replaced by a version listing it. A process killed
mid-write therefore leaves PUBLISHED naming only complete slots: the previous snapshot stays intact.

Nothing removes a rank's directory when its job ends or moves to other nodes (a pending job may come
back and restore from it). On a shared root (``/dev/shm/unicron-ckpt/<job>/rank-<r>``), a writer that
finds the filesystem full makes room from directories no process holds and nobody wrote for an hour
(:func:`evict_idle`), as the peers' replica memory does: a node running jobs for weeks does not fill up.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ckpt.api import CheckpointCorrupt, CheckpointError, NoRoomForSnapshot, Snapshot, SnapshotInfo
from ckpt.codec import byte_view
from unicron.kernel import jsontext
from unicron.kernel import log as ulog
from unicron.kernel.errors import InvalidRecord

log = ulog.get(__name__)

_PUBLISHED = "PUBLISHED"


def clear_cuda_error() -> None:
    """Reset CUDA's last error after a call that failed on purpose-tolerated grounds. A refused
    cudaHostRegister stays the runtime's last error, and torch's next kernel-launch check reads it as
    its own (seen on an H100: the optimizer step after it raised cudaErrorInvalidValue); reading the
    error clears it. torch binds no cudaGetLastError, so it is called in the process's libcudart."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "/libcudart.so" in path:
            ctypes.CDLL(path).cudaGetLastError()  # the loaded library: dlopen returns the same instance
            return
    raise CheckpointError("CUDA refused to page-lock a snapshot slot and its error cannot be cleared (no "
                          "libcudart loaded): put CheckpointConfig.local_dir on tmpfs (e.g. /dev/shm)")


class _Mapping:
    """A shared mapping of one slot file, grown on demand, viewed as a uint8 tensor."""

    def __init__(self, path: Path, make_room: Callable[[int], bool] | None = None) -> None:
        self.path = path
        #: called with the bytes missing when the filesystem is full; True: room was made, try again
        self.make_room = make_room
        self.capacity = 0
        self._mm: mmap.mmap | None = None
        self.tensor: torch.Tensor | None = None
        self.pinned = False
        self.unpinnable = False  # cudaHostRegister refused this file's pages: copy into it unpinned

    def ensure(self, nbytes: int, pin: bool = False) -> torch.Tensor:
        if self.tensor is None or self.capacity < nbytes:
            self._map(nbytes)
        assert self.tensor is not None
        if pin and not self.pinned and not self.unpinnable:
            # page-lock the shared pages so GPU->host copies run asynchronously (DMA) straight into them
            rc = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                self.tensor.data_ptr(), self.capacity, 0
            )
            if int(rc) == 0:
                self.pinned = True
            else:
                clear_cuda_error()
                # CUDA page-locks shared mappings of tmpfs only (seen on an H100: a file on ext4 gives
                # cudaErrorInvalidValue). Unpinned, the copy is still whole, just synchronous.
                self.unpinnable = True
                log.warning("snapshot slot cannot be page-locked: GPU copies into it are synchronous; "
                            "put CheckpointConfig.local_dir on tmpfs (e.g. /dev/shm)",
                            path=str(self.path), cuda_error=int(rc))
        return self.tensor[:nbytes]

    def _map(self, nbytes: int) -> None:
        self.close()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = max(nbytes, os.fstat(fd).st_size, 1)
            self._allocate(fd, size)
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self.capacity = size
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)

    def _allocate(self, fd: int, size: int) -> None:
        """Allocate now: ENOSPC here, not SIGBUS mid-copy. A full filesystem is first given a chance
        to make room (once: what it freed is enough, or nothing more can go)."""
        for attempt in range(2):
            try:
                os.posix_fallocate(fd, 0, size)
                return
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                missing = size - os.fstat(fd).st_blocks * 512
                if attempt == 0 and self.make_room is not None and self.make_room(missing):
                    continue
                raise NoRoomForSnapshot(
                    f"no room for a {size}-byte snapshot slot in {self.path.parent} "
                    "(enlarge /dev/shm, e.g. docker --shm-size, or set CheckpointConfig.local_dir)"
                ) from exc

    def close(self) -> None:
        if self.pinned and self.tensor is not None:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())  # type: ignore[no-untyped-call]
            self.pinned = False
        self.tensor = None  # the tensor exports the mmap's buffer; it must go before the mmap closes
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a caller still holds a view: the GC unmaps later
                self._mm.close()
            self._mm = None
        self.capacity = 0


#: a rank directory nobody wrote for this long may give up its space to a writer that finds the
#: filesystem full (a running job snapshots every few minutes; the peers' replica memory waits as long)
IDLE_DIR_S = 3600.0


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _last_write(d: Path) -> float:
    return max((f.stat().st_mtime for f in d.iterdir() if f.is_file()), default=d.stat().st_mtime)


def _allocated(d: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in d.iterdir() if f.is_file())


def evict_idle(shared_root: Path, keep: Path, need: int, idle_s: float) -> int:
    """Remove rank directories ``shared_root/<job>/rank-<r>`` other than ``keep`` that no process holds
    (their LOCK is free) and in which nothing was written for ``idle_s``, least recently written first,
    until ``need`` bytes are freed. Returns the bytes freed.

    What goes is a job's that ended or moved elsewhere an hour ago: a writer holds its directory's
    lock for as long as it runs, and a live job snapshots far more often. Each removal holds the
    directory's lock, and judges its idleness again once it holds it, so a writer arriving meanwhile waits, then finds the directory gone and starts
    a new one (:meth:`LocalStore.lock`)."""
    now = time.time()
    candidates: list[tuple[float, Path]] = []
    mine = keep.resolve()
    for d in shared_root.glob("*/rank-*"):
        try:
            if d.is_dir() and d.resolve() != mine and now - (written := _last_write(d)) >= idle_s:
                candidates.append((written, d))
        except OSError:  # removed meanwhile by another writer's eviction
            continue
    freed = 0
    for _, d in sorted(candidates):
        if freed >= need:
            break
        try:
            fd = os.open(d / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live process writes here
        try:
            # judged idle when listed: its writer may have come back, written and exited since
            if time.time() - _last_write(d) < idle_s:
                continue
            size = _allocated(d)
            shutil.rmtree(d, ignore_errors=True)
        except OSError:  # removed meanwhile by another writer's eviction
            continue
        finally:
            os.close(fd)
        freed += size
        log.warning("evicted an idle rank's snapshots to make room", directory=str(d), bytes=size)
    return freed


class LocalStore:
    """The shared-memory slots of one rank. Only the holder of the lock writes; see the module docstring."""

    def __init__(self, root: Path, slots: int = 2, shared_root: Path | None = None,
                 idle_s: float = IDLE_DIR_S) -> None:
        """``shared_root``: the directory whose ``<job>/rank-<r>`` directories (``root`` among them) may
        give up their space to this rank when the filesystem is full and they are idle for ``idle_s``."""
        if slots < 2:
            raise CheckpointError(f"LocalStore: slots={slots}; at least 2 are needed for double buffering")
        self.root = Path(root)
        self.slots = slots
        self.shared_root = shared_root
        self.idle_s = idle_s
        make_room = self._make_room if shared_root is not None else None
        self._maps = [_Mapping(self.root / f"slot-{k}.data", make_room) for k in range(slots)]
        self._lock_fd: int | None = None
        self._pointer_lock = threading.Lock()  # the writer's threads update PUBLISHED in turn

    # ---- ownership

    def lock(self, wait_s: float = 0.0) -> None:
        """Become this rank's writer, waiting up to ``wait_s`` for another live process that is (its
        flock dies with it: a previous generation's rank still saving its last snapshot)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + wait_s
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _same_file(fd, self.root / "LOCK"):
                    break
                # an eviction removed the directory while we waited for its lock: start over in a new one
                os.close(fd)
                self.root.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
            except BlockingIOError as exc:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise CheckpointError(
                        f"{self.root} is in use by another process (it holds {self.root / 'LOCK'}) "
                        f"after {wait_s:g} s; give each rank its own directory or stop the other process"
                    ) from exc
                if not waited:
                    log.info("waiting for the previous writer of this rank's slots to exit", root=str(self.root))
                    waited = True
                time.sleep(0.05)
        self._lock_fd = fd

    def close(self) -> None:
        for m in self._maps:
            m.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _make_room(self, missing: int) -> bool:
        assert self.shared_root is not None
        freed = evict_idle(self.shared_root, keep=self.root, need=missing, idle_s=self.idle_s)
        return freed > 0

    @staticmethod
    def remove(root: Path) -> None:
        """Free a rank's shared memory for good (the job is over, or the rank moved elsewhere)."""
        shutil.rmtree(root, ignore_errors=True)

    # ---- the published pointer

    def published(self) -> dict[int, SnapshotInfo]:
        """Complete slots and what they hold. An unreadable pointer counts as none (and is reported)."""
        try:
            raw = jsontext.parse((self.root / _PUBLISHED).read_bytes(), str(self.root / _PUBLISHED))
            slots = raw["slots"]
            return {int(k): SnapshotInfo.from_dict(v) for k, v in slots.items() if 0 <= int(k) < self.slots}
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError, AttributeError, InvalidRecord) as exc:
            raise CheckpointCorrupt(f"{self.root / _PUBLISHED} unreadable: {exc}") from exc

    def _write_published(self, slots: dict[int, SnapshotInfo]) -> None:
        body = json.dumps({"slots": {str(k): v.to_dict() for k, v in sorted(slots.items())}}).encode()
        tmp = self.root / f".{_PUBLISHED}.tmp"
        tmp.write_bytes(body)
        os.replace(tmp, self.root / _PUBLISHED)  # atomic: readers see the old or the new pointer

    def _published_or_empty(self) -> dict[int, SnapshotInfo]:
        try:
            return self.published()
        except CheckpointCorrupt:
            return {}

    # ---- writing

    def prepare(self, slot: int, nbytes: int, pin: bool = False) -> torch.Tensor:
        """Withdraw ``slot`` from the pointer and return its first ``nbytes`` to write into
        (``pin``: page-locked for CUDA copies)."""
        with self._pointer_lock:
            pub = self._published_or_empty()
            if slot in pub:
                del pub[slot]
                self._write_published(pub)
        return self._maps[slot].ensure(nbytes, pin)

    def publish(self, slot: int, info: SnapshotInfo, meta: bytes) -> None:
        tmp = self.root / f".slot-{slot}.meta.tmp"
        tmp.write_bytes(meta)
        os.replace(tmp, self.root / f"slot-{slot}.meta")
        with self._pointer_lock:
            pub = self._published_or_empty()
            pub[slot] = info
            self._write_published(pub)

    def withdraw_newer(self, iteration: int) -> list[int]:
        """Unpublish snapshots newer than ``iteration`` (an abandoned timeline after a rollback)."""
        with self._pointer_lock:
            pub = self._published_or_empty()
            gone = [k for k, v in pub.items() if v.iteration > iteration]
            if gone:
                self._write_published({k: v for k, v in pub.items() if k not in gone})
        return sorted(pub[k].iteration for k in gone)

    def data_view(self, slot: int, nbytes: int) -> torch.Tensor:
        return self._maps[slot].ensure(nbytes)

    # ---- reading

    def read(self, slot: int, info: SnapshotInfo) -> Snapshot:
        """The slot's bytes, unverified (a view of shared memory, valid until the slot is rewritten)."""
        try:
            meta = (self.root / f"slot-{slot}.meta").read_bytes()
            size = (self.root / f"slot-{slot}.data").stat().st_size
        except FileNotFoundError as exc:
            raise CheckpointCorrupt(f"partial: {exc.filename} is missing") from exc
        if size < info.data_len:
            raise CheckpointCorrupt(
                f"partial: slot {slot} holds {size} bytes, the snapshot has {info.data_len}"
            )
        data = self._maps[slot].ensure(info.data_len)
        return Snapshot(info=info, meta=meta, data=byte_view(data))
