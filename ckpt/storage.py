"""Implementations of :class:`ckpt.api.Storage`: a filesystem directory, and process memory (for tests
and as the simplest example of a non-filesystem backend)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from ckpt.api import Buffer, ObjectMissing, Storage, StorageFull, StorageUnavailable
from unicron.kernel.errors import InvalidRecord

#: leads the name of a write's temporary (hidden from list())
_TMP_MARK = "."
_KEY_RX = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*$")


def check_key(key: str) -> str:
    """Keys are relative, ``/``-separated, no empty, hidden, ``.`` or ``..`` segments."""
    if not isinstance(key, str) or not _KEY_RX.match(key) or len(key) > 1024:
        raise InvalidRecord(
            f"storage key {key!r}: use '/'-separated [A-Za-z0-9._-] names not starting with '.'"
        )
    return key


def fsync_dir(path: Path | str) -> None:
    """Make a directory's entries (a rename into it, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FilesystemStorage(Storage):
    """Objects are files under ``root``; a write goes to a hidden temporary name, is fsync'd, renamed
    into place and the directory fsync'd, so a crash leaves either the old object or the new one."""

    def __init__(self, root: Path | str, drop_cache: bool = True) -> None:
        #: directory holding the objects (created if missing)
        self.root = Path(root)
        #: evict written files from the page cache: a checkpoint is read back rarely, and keeping
        #: gigabytes of it cached would push the training job's own pages out
        self.drop_cache = drop_cache
        self.root.mkdir(parents=True, exist_ok=True)

    def describe(self) -> str:
        return f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _makedirs(self, d: Path) -> None:
        missing = []
        while not d.exists():
            missing.append(d)
            d = d.parent
        for m in reversed(missing):
            m.mkdir(exist_ok=True)
            fsync_dir(m.parent)  # the new directory entry itself must be durable

    #: bytes written (and synced) between two ``progress`` calls of a write that asks for them
    PROGRESS_BYTES = 8 << 20

    def write(self, key: str, data: Buffer, progress: Callable[[], None] | None = None) -> None:
        path = self._path(key)
        tmp: Path | None = None
        try:
            self._makedirs(path.parent)
            tmp = path.parent / f"{_TMP_MARK}{path.name}.tmp-{uuid.uuid4().hex[:8]}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data).cast("B")
                while view:
                    part, view = view[: self.PROGRESS_BYTES], view[self.PROGRESS_BYTES :]
                    while part:
                        part = part[self._write_part(fd, part) :]
                    if progress is not None:  # synced: bytes in the page cache say nothing of a hung mount
                        os.fdatasync(fd)
                        progress()
                os.fsync(fd)
                if self.drop_cache:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except OSError as exc:
            if tmp is not None:  # its bytes would stay on a full disk: list() and retention skip it
                with contextlib.suppress(OSError):
                    tmp.unlink()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the writer may make room (persist.persist)
                raise StorageFull(f"writing {self.describe()}/{key}: {exc}") from exc
            raise StorageUnavailable(f"writing {self.describe()}/{key}: {exc}") from exc

    def _write_part(self, fd: int, part: memoryview) -> int:
        return os.write(fd, part)

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError as exc:
            raise ObjectMissing(f"{self.describe()}/{key} does not exist") from exc
        except OSError as exc:
            raise StorageUnavailable(f"reading {self.describe()}/{key}: {exc}") from exc

    def read_into(self, key: str, out: memoryview) -> int:
        try:
            with open(self._path(key), "rb", buffering=0) as f:
                total = 0
                view = out.cast("B") if out.format != "B" else out
                while total < len(view):
                    n = f.readinto(view[total:])
                    if not n:
                        break
                    total += n
                if total == len(view) and f.read(1):
                    raise StorageUnavailable(
                        f"{self.describe()}/{key} is larger than the {len(view)}-byte buffer"
                    )
                return total
        except FileNotFoundError as exc:
            raise ObjectMissing(f"{self.describe()}/{key} does not exist") from exc
        except OSError as exc:
            raise StorageUnavailable(f"reading {self.describe()}/{key}: {exc}") from exc

    def list_incomplete(self, prefix: str) -> list[str]:  # before list(): it would shadow the builtin here
        # a write directory holding only a killed writer's temporary was invisible to list(), so the
        # orphan sweep never found it and its bytes (up to a chunk) stayed for good
        return self._walk(prefix, incomplete=True)

    def _walk(self, prefix: str, incomplete: bool) -> list[str]:
        """The keys under ``prefix``: of the objects, or (``incomplete``) of the temporaries' writes."""
        head = prefix.rpartition("/")[0]
        base = self.root / check_key(head) if head else self.root
        # a missing job directory holds nothing; a root gone since __init__ created it (a shared filesystem
        # unmounted under a running job) says nothing of what the storage holds: taken for empty, it was a
        # fresh start (one not mounted at __init__ is created there: docs/ckpt.md, "Known limit")
        if not self.root.is_dir():
            raise StorageUnavailable(f"listing {self.describe()}/{prefix}: the storage root is missing")
        out = []

        def unreadable(exc: OSError) -> None:  # os.walk skipped it: an I/O error listed as "holds nothing"
            if not isinstance(exc, FileNotFoundError):
                raise StorageUnavailable(f"listing {self.describe()}/{prefix}: {exc}") from exc

        for dirpath, dirnames, filenames in os.walk(base, onerror=unreadable):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if name.startswith(_TMP_MARK):  # temporaries of writes in progress (or killed): no objects
                    if not (incomplete and _is_temporary(name)):
                        continue
                    name = name[len(_TMP_MARK) :].rpartition(".tmp-")[0]  # the key being written
                elif incomplete:
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    out.append(key)
        return sorted(set(out))

    def list(self, prefix: str) -> list[str]:
        return self._walk(prefix, incomplete=False)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
            # durable before the caller's next delete: retention deletes a manifest before its shards,
            # and a manifest back after a crash would name shards that are gone
            fsync_dir(path.parent)
            parent = path.parent
            while parent != self.root and _only_abandoned(parent):
                parent.rmdir()  # leave no empty per-iteration directories behind
                fsync_dir(parent.parent)
                parent = parent.parent
        except OSError as exc:
            raise StorageUnavailable(f"deleting {self.describe()}/{key}: {exc}") from exc


def _is_temporary(name: str) -> bool:
    return name.startswith(_TMP_MARK) and ".tmp-" in name


def _only_abandoned(directory: Path) -> bool:
    """Whether ``directory`` is empty once the temporaries left in it are removed: a writer killed
    mid-write leaves one, which kept its iteration's directory (and bytes) for ever. Called for a
    directory whose last object was just deleted, or one the caller judged abandoned (it deleted one of
    its :meth:`FilesystemStorage.list_incomplete` keys), so no write into it is in progress."""
    entries = list(directory.iterdir())
    if any(not (_is_temporary(e.name) and e.is_file()) for e in entries):
        return False
    for e in entries:
        e.unlink(missing_ok=True)
    return True


class MemoryStorage(Storage):
    """Objects in a dict: no durability; the reference implementation of the contract's semantics."""

    def __init__(self) -> None:
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"memory://{id(self):x}"

    def write(self, key: str, data: Buffer, progress: Callable[[], None] | None = None) -> None:
        blob = bytes(data)
        with self._lock:
            self._objects[check_key(key)] = blob
        if progress is not None:
            progress()

    def _get(self, key: str) -> bytes:
        with self._lock:
            blob = self._objects.get(check_key(key))
        if blob is None:
            raise ObjectMissing(f"{self.describe()}/{key} does not exist")
        return blob

    def size(self, key: str) -> int:
        return len(self._get(key))

    def read_into(self, key: str, out: memoryview) -> int:
        blob = self._get(key)
        if len(blob) > len(out):
            raise StorageUnavailable(f"{self.describe()}/{key} is larger than the {len(out)}-byte buffer")
        out[: len(blob)] = blob
        return len(blob)

    def list(self, prefix: str) -> list[str]:
        with self._lock:
            return sorted(k for k in self._objects if k.startswith(prefix))

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(check_key(key), None)
