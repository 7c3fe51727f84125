"""Helpers for the cluster harness tests: an owner process SIGKILLed with its cluster running, and
waiting for a process to go."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gone(pid: int, within_s: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def etcd_of_a_sigkilled_owner(tmp_path: Path, **cluster: object) -> int:
    """The PID of the etcd a ``LocalCluster(agents=0, **cluster)`` started in a process that was then
    SIGKILLed (its cleanup never ran)."""
    options = ", ".join(f"{k}={v!r}" for k, v in {"agents": 0, "run_dir": str(tmp_path), **cluster}.items())
    code = ("import os; from unicron.cluster.localcluster import LocalCluster;"
            f" c = LocalCluster({options}); c.etcd.start();"
            " print(c.etcd.proc.pid, flush=True); os.kill(os.getpid(), 9)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": ROOT, "TMPDIR": str(tmp_path)})
    return int(out.stdout.split()[0])
