"""Ranks' logs bounded on disk.

A rank writes its stdout straight into ``logs/<task>/rank<R>.log`` (the agent opened it with O_APPEND
and handed the descriptor over, or appends what it parsed from a pipe; its stderr goes, through the
agent, into ``rank<R>.err``), for weeks; in the systemd
layout that directory is memory (``/run``), so an unbounded log ends as the node's OOM. Past the cap
a log's content is copied to ``<log>.1`` (replacing the one before) and the log is truncated in
place, as logrotate's ``copytruncate`` does: the rank keeps its descriptor, and with O_APPEND its next
write lands at the new end. Lines written between the copy and the truncation are lost (logrotate's
caveat too); a rename would keep the rank writing into the renamed file, which nobody bounds.
"""

from __future__ import annotations

import os
import shutil

from unicron.kernel import log as ulog

log = ulog.get(__name__)

ROTATED_SUFFIX = ".1"
LOG_SUFFIXES = (".log", ".err")  # a rank's stdout and stderr (agent/supervisor.py)


def cap(path: str, max_bytes: int) -> bool:
    """Rotate ``path`` when it holds more than ``max_bytes``; whether it did. Never raises: a log that
    cannot be rotated (gone, a full disk) is logged and left as it is."""
    try:
        if os.path.getsize(path) <= max_bytes:
            return False
        shutil.copyfile(path, path + ROTATED_SUFFIX)
        os.truncate(path, 0)
    except OSError as exc:
        log.warning("rank log not rotated", path=path, error=str(exc))
        return False
    log.info("rank log rotated", path=path, kept=path + ROTATED_SUFFIX, max_bytes=max_bytes)
    return True


def cap_all(logs_dir: str, max_bytes: int) -> int:
    """Cap every task's rank logs under ``logs_dir`` (``<task>/rank<R>.log`` and ``.err``); how many
    were rotated."""
    rotated = 0
    try:
        tasks = [e.path for e in os.scandir(logs_dir) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return 0  # no logs yet
    for task_dir in tasks:
        try:
            logs = [e.path for e in os.scandir(task_dir) if e.name.endswith(LOG_SUFFIXES)
                    and e.is_file(follow_symlinks=False)]
        except OSError:
            continue  # a task's directory removed meanwhile
        rotated += sum(cap(p, max_bytes) for p in logs)
    return rotated
