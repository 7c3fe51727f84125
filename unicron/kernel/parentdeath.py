"""Processes that die with their parent: Linux ``PR_SET_PDEATHSIG``.

Used wherever a helper must not outlive the process that started it: the agent's ranks, store sidecar,
failure marker and warm spawner; the spawner's ranks; a rank's heartbeat beater. The kernel sends the
signal when the *thread* that forked the child exits, so long-lived parents fork from one long-lived
thread (:func:`popen` does, for any caller). After ``prctl`` the child checks that its parent is still the one it expects: a parent that
died between ``fork`` and ``prctl`` would never signal it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _prctl() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl: Callable[..., int] = libc.prctl
    except (OSError, AttributeError):
        return None  # not Linux: callers' own parent checks remain
    return prctl


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """In a forked child: receive ``sig`` when the parent dies; exit now if ``parent`` is gone already."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(126)


def preexec(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``Popen(preexec_fn=...)`` doing :func:`die_with_parent` for the calling process. Everything is
    resolved before the fork: the child only makes two system calls (no imports, no allocation that
    could hit a lock held by another thread of the parent)."""
    prctl = _prctl()
    parent = os.getpid()

    def run() -> None:
        if prctl is not None and prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent:
            os._exit(126)

    return run


#: the thread :func:`popen` forks on, with the PID it belongs to (a forked child has no such thread)
_starter: tuple[int, ThreadPoolExecutor] | None = None
_starter_lock = threading.Lock()


def popen(argv: Sequence[str], sig: int = signal.SIGKILL, **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **kwargs)`` of a child that gets ``sig`` when this process dies. The fork
    runs on one thread kept for the life of the process: a caller on a short-lived thread (a cluster
    started in the background, say) would otherwise have its child killed when that thread ends."""
    global _starter
    with _starter_lock:
        if _starter is None or _starter[0] != os.getpid():
            _starter = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="parentdeath-starter"))
        starter = _starter[1]
    def fork() -> subprocess.Popen[bytes]:
        return subprocess.Popen(list(argv), preexec_fn=preexec(sig), **kwargs)

    return starter.submit(fork).result()
