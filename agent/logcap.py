"""Ranks' logs bounded on disk.

A rank writes its stdout straight into ``logs/<task>/rank<R>.log`` (the agent opened it with O_APPEND
and handed the descriptor over, or appends what it parsed from a pipe; its stderr goes, through the
agent, into ``rank<R>.err``), for weeks; in the systemd
layout that directory is memory (``/run``), so an unbounded log ends as the node's OOM. Past the cap
a log's content is copied to ``<log>.1`` (replacing the one before) and the log is truncated in
place, as logrotate's ``copytruncate`` does: the rank keeps its descriptor, and with O_APPEND its next
write lands at the new end. Lines written between the copy and the truncation are lost (logrotate's
caveat too); a rename would keep the rank writing into the renamed file, which nobody bounds.

The copy needs as much free space as the log. On a full log disk (the rank's own log filled it) it
cannot be made, and giving up would never free a byte: the log is then truncated anyway and only its
last :data:`FULL_DISK_TAIL` bytes are kept in ``<log>.1``, written after the truncation freed the
space; the rest is dropped, and said so.

A task that left the node keeps its directory for an operator to read, but only the newest few
(:func:`prune_ended`): one directory per job ever run filled the memory in the end too. Agents sharing
a run dir each mark the task directories their ranks write into, and remove only unmarked ones.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Collection, Iterable

from unicron.kernel import log as ulog

log = ulog.get(__name__)

ROTATED_SUFFIX = ".1"
LOG_SUFFIXES = (".log", ".err")  # a rank's stdout and stderr (agent/supervisor.py)
#: what a rotation on a full disk keeps of the log (its end: the newest lines, the ones that say why)
FULL_DISK_TAIL = 1 << 20
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
#: ``<task>/.in-use.<node>``: that node's ranks of the task write there (:func:`mark_in_use`)
IN_USE_PREFIX = ".in-use."


def cap(path: str, max_bytes: int) -> bool:
    """Rotate ``path`` when it holds more than ``max_bytes``; whether it did. Never raises: a log that
    cannot be rotated (gone, a full disk) is logged and left as it is."""
    try:
        if os.path.getsize(path) <= max_bytes:
            return False
        try:
            shutil.copyfile(path, path + ROTATED_SUFFIX)
        except OSError as exc:
            if exc.errno not in _NO_ROOM:
                raise
            _truncate_keeping_tail(path, min(max_bytes, FULL_DISK_TAIL))
            return True
        os.truncate(path, 0)
    except OSError as exc:
        log.warning("rank log not rotated", path=path, error=str(exc))
        return False
    log.info("rank log rotated", path=path, kept=path + ROTATED_SUFFIX, max_bytes=max_bytes)
    return True


def _truncate_keeping_tail(path: str, tail_bytes: int) -> None:
    """The full disk's rotation: the log's last ``tail_bytes`` (from a line's start) go to ``<log>.1``
    once the log is truncated; when even that does not fit (the rank refilled the space at once),
    nothing is kept."""
    rotated = path + ROTATED_SUFFIX
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        fh.seek(max(0, size - tail_bytes))
        tail = fh.read(tail_bytes)
    if size > len(tail) and b"\n" in tail:
        tail = tail[tail.index(b"\n") + 1:]  # no half line at the start
    with contextlib.suppress(FileNotFoundError):
        os.unlink(rotated)  # the partial copy (or an empty file): its blocks are part of what is full
    os.truncate(path, 0)
    kept = 0
    try:
        with open(rotated, "wb") as out:
            out.write(tail)
        kept = len(tail)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(rotated)
        log.warning("rank log's tail not kept either", path=rotated, error=str(exc))
    log.warning("log disk full: rank log truncated without a full copy, its older content dropped",
                path=path, kept=rotated if kept else None, kept_bytes=kept, dropped_bytes=size - kept)


def cap_all(logs_dir: str, tasks: Iterable[str], max_bytes: int) -> int:
    """Cap the rank logs (``<task>/rank<R>.log`` and ``.err``) of ``tasks``, the ones on the node now,
    under ``logs_dir``; how many were rotated. Only those: an ended task's logs are not written any more,
    and scanning every directory ever made cost each status write time linear in the jobs ever run."""
    rotated = 0
    for task in tasks:
        try:
            logs = [e.path for e in os.scandir(os.path.join(logs_dir, task)) if e.name.endswith(LOG_SUFFIXES)
                    and e.is_file(follow_symlinks=False)]
        except OSError:
            continue  # no log yet, or the task's directory removed meanwhile
        rotated += sum(cap(p, max_bytes) for p in logs)
    return rotated


def mark_in_use(task_dir: str, node: str) -> None:
    """Note in ``task_dir`` that ``node``'s ranks write there: agents sharing a run dir (one host's
    local cluster, the default /tmp/unicron) must not take each other's running tasks for ended ones.
    Raises OSError (the node's trouble: its disk), as making the directory does."""
    os.close(os.open(os.path.join(task_dir, IN_USE_PREFIX + node), os.O_WRONLY | os.O_CREAT, 0o644))


def prune_ended(logs_dir: str, node: str, live: Collection[str], kept: int) -> list[str]:
    """Remove the log directories under ``logs_dir`` of ended tasks but the ``kept`` last written; the
    names removed. A task is ended once it is not in ``live`` (``node``'s: its in-use mark is removed
    then) and no other agent's mark is in its directory. Never raises: a directory that cannot be
    removed is logged and tried again at the next call."""
    try:
        dirs = [e for e in os.scandir(logs_dir) if e.name not in live and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []  # no logs yet
    ended = []
    for entry in dirs:
        with contextlib.suppress(OSError):  # absent: it ran elsewhere, or its leaving was noted before
            os.unlink(os.path.join(entry.path, IN_USE_PREFIX + node))
        if not _in_use(entry.path):
            ended.append(entry)
    if len(ended) <= kept:
        return []  # the common case: nothing to stat
    ended.sort(key=_last_written)
    removed = []
    for entry in ended[:len(ended) - kept]:
        try:
            shutil.rmtree(entry.path)
        except OSError as exc:
            log.warning("ended task's logs not removed", path=entry.path, error=str(exc))
            continue
        removed.append(entry.name)
    if removed:
        log.info("ended tasks' logs removed", tasks=removed, kept=kept)
    return removed


def _in_use(task_dir: str) -> bool:
    """Another agent's ranks still write into ``task_dir`` (its in-use mark is there)."""
    try:
        return any(name.startswith(IN_USE_PREFIX) for name in os.listdir(task_dir))
    except OSError:
        return True  # removed meanwhile, or unreadable: not this call's to remove


def _last_written(task_dir: os.DirEntry[str]) -> float:
    """When the task's directory or a file in it (its ranks' logs) last changed: when the task ended,
    as near as the directory tells."""
    try:
        with os.scandir(task_dir.path) as entries:
            return max([task_dir.stat(follow_symlinks=False).st_mtime,
                        *(e.stat(follow_symlinks=False).st_mtime for e in entries)])
    except OSError:
        return 0.0  # removed meanwhile: as good as the oldest
