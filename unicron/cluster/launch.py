"""A local stand-in for the agent: store sidecar + rank processes + failure marking + restarts.

Tests and benchmarks use :class:`LocalJob` where the real system uses the Unicron agent. It does
the three things the runtime needs from an agent: run the store sidecar, set the torchrun-style
environment of each rank, and call :func:`unicron.runtime.membership.mark_failed` the moment a rank exits
abnormally (optionally restarting it, as the agent does for a sev2 failure).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.prefork import Prefork, PreforkedProcess, stop_process
from unicron.kernel.errors import TemporaryError
from unicron.kernel.net import free_port
from unicron.runtime import store as keys
from unicron.runtime.epoch import EpochRecord
from unicron.runtime.membership import mark_failed

PYTHON = sys.executable
RUN_SCRIPT = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
"""``python -c`` code that runs a script file as ``python SCRIPT ARGS`` would (forkable from a spawner)."""


def base_env() -> dict[str, str]:
    """This environment, with the repository importable and one intra-op thread by default."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("UNICRON_AGENT_SOCKET", None)
    return env


def warm_spawner(modules: Sequence[str] = ("unicron.runtime.train",)) -> Prefork:
    """A started spawner (the agent's, :mod:`agent.prefork`) that pre-imported ``modules``: a rank
    forked from it starts in milliseconds, not the seconds of importing torch and Megatron-core."""
    sock = os.path.join(tempfile.gettempdir(), f"unicron-spawner-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock")
    return Prefork(modules, sock, python=PYTHON, env=base_env()).start().wait_ready()


@dataclass
class RankProc:
    rank: int
    proc: subprocess.Popen[bytes] | PreforkedProcess
    incarnation: int
    log_path: str


@dataclass
class LocalJob:
    """Run ``python -m unicron.runtime.train ARGS`` on ``world`` local ranks."""

    world: int
    args: Sequence[str]
    out_dir: str
    #: per-rank extra environment (e.g. UNICRON_RUNTIME_FAULTS)
    rank_env: Mapping[int, Mapping[str, str]] = field(default_factory=dict)
    #: ranks to restart after an abnormal exit, with the delay before restarting
    restart: Mapping[int, float] = field(default_factory=dict)
    module: str = "unicron.runtime.train"
    #: run this Python file (``python SCRIPT ARGS``, e.g. a job on ``unicron.runtime.pretrain``) instead of
    #: ``-m module``; forked from the spawner through ``-c`` (which runs it as ``__main__``)
    script: str | None = None
    host: str = "127.0.0.1"
    #: host the store in this process (a thread of TCPStore) instead of a sidecar subprocess
    store_in_process: bool = True
    #: fork ranks from a warm spawner (fast; tests) instead of exec'ing python
    fork: bool = False
    #: a warm spawner (:func:`warm_spawner`) shared between jobs (implies fork; not closed by this job)
    spawner: Prefork | None = None
    #: call mark_failed when a rank exits abnormally (what the agent does); off to emulate a job
    #: whose survivors only learn of a death through their own timeouts
    mark_failures: bool = True

    def __post_init__(self) -> None:
        self.port = free_port()
        self.procs: dict[int, RankProc] = {}
        self.history: list[dict[str, Any]] = []
        self._store_proc: subprocess.Popen[bytes] | None = None
        self._spawner: Prefork | None = None
        self._store: Any = None
        self._server: Any = None
        self._stop = threading.Event()
        self._killed = threading.Event()  # set by ``stop`` once every rank it killed has exited
        self._monitor = threading.Thread(target=self._watch, name="localjob-monitor", daemon=True)
        self._lock = threading.Lock()
        os.makedirs(self.out_dir, exist_ok=True)

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> LocalJob:
        if self.store_in_process:
            self._server = keys.serve_store(self.host, self.port)
            self._store = keys.connect(self.host, self.port)
        else:
            self._start_sidecar()
        if self.spawner is not None:
            self._spawner = self.spawner
        elif self.fork:
            self._spawner = warm_spawner((self.module,))
        for r in range(self.world):
            self._spawn(r)
        self._monitor.start()
        return self

    def _start_sidecar(self) -> None:
        self._store_proc = subprocess.Popen(
            [PYTHON, "-m", "unicron.runtime.store", "--host", self.host, "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self._base_env(),
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                self._store = keys.connect(self.host, self.port, timeout_s=2.0)
                return
            except TemporaryError:
                if time.monotonic() > deadline or self._store_proc.poll() is not None:
                    raise
                time.sleep(0.2)

    def _base_env(self) -> dict[str, str]:
        return base_env()

    def _spawn(self, rank: int) -> None:
        env = self._base_env()
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world),
            "LOCAL_WORLD_SIZE": str(self.world), "MASTER_ADDR": self.host, "MASTER_PORT": str(self.port),
            "UNICRON_TASK": "local", "UNICRON_GENERATION": "0", "UNICRON_NODE": "local",
        })
        env.update(self.rank_env.get(rank, {}))
        prev = self.procs.get(rank)
        inc = prev.incarnation + 1 if prev else 1
        log_path = os.path.join(self.out_dir, f"rank{rank}.{inc}.log")
        argv = [*self.args, "--out-dir", os.path.join(self.out_dir, f"inc{inc}")]
        proc: subprocess.Popen[bytes] | PreforkedProcess
        with open(log_path, "wb") as fh:
            if self._spawner is not None:
                proc = self._spawner.spawn(self._command(argv, fork=True), env, None, fh.fileno(), fh.fileno())
            else:
                proc = subprocess.Popen(self._command(argv, fork=False), stdout=fh, stderr=subprocess.STDOUT, env=env)
        self.procs[rank] = RankProc(rank, proc, inc, log_path)
        self.history.append({"event": "spawn", "rank": rank, "incarnation": inc, "ts": time.time()})

    def _command(self, argv: Sequence[str], fork: bool) -> list[str]:
        if self.script is None:
            return [PYTHON, "-m", self.module, *argv]
        if fork:  # the spawner forks ``-c`` code with sys.argv = ["-c", SCRIPT, *ARGS]
            return [PYTHON, "-c", RUN_SCRIPT, self.script, *argv]
        return [PYTHON, self.script, *argv]

    def _watch(self) -> None:
        handled: set[tuple[int, int]] = set()
        while not self._stop.is_set():
            self._record_exits(handled, react=True)
            self._stop.wait(0.005)
        # ``stop`` kills what is left and joins this thread: record those exits too, or ``wait`` after
        # ``stop`` would wait out its whole timeout for entries that never come.
        self._killed.wait()
        self._record_exits(handled, react=False)

    def _record_exits(self, handled: set[tuple[int, int]], react: bool) -> None:
        with self._lock:
            items = list(self.procs.values())
        for rp in items:
            code = rp.proc.poll()
            if code is None or (rp.rank, rp.incarnation) in handled:
                continue
            handled.add((rp.rank, rp.incarnation))
            self.history.append({"event": "exit", "rank": rp.rank, "incarnation": rp.incarnation,
                                 "code": code, "ts": time.time()})
            if not react:
                continue
            if code != 0 and self.mark_failures:
                mark_failed(self.host, self.port, rp.rank, store=self._store)
            if code != 0 and rp.rank in self.restart:
                threading.Timer(self.restart[rp.rank], self._respawn, args=(rp.rank,)).start()

    def _respawn(self, rank: int) -> None:
        with self._lock:
            if not self._stop.is_set():
                self._spawn(rank)

    def wait(self, timeout_s: float) -> dict[int, int | None]:
        """Wait until every rank process has exited (restarts included); returns final exit codes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                current = list(self.procs.values())
            # An exit counts once the watcher has recorded it: returning between a process's exit and its
            # history entry would hide that exit from the caller (seen under load).
            recorded = {(h["rank"], h["incarnation"]) for h in list(self.history) if h["event"] == "exit"}
            done = all(rp.proc.poll() is not None and (rp.rank, rp.incarnation) in recorded for rp in current)
            # After ``stop`` nothing is respawned, so a killed rank's exit is final.
            pending_restart = not self._stop.is_set() and any(
                h["event"] == "exit" and h["code"] != 0 and h["rank"] in self.restart
                and self.procs[h["rank"]].incarnation == h["incarnation"]
                for h in self.history
            )
            if done and not pending_restart:
                break
            time.sleep(0.05)
        return {r: rp.proc.poll() for r, rp in self.procs.items()}

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for rp in self.procs.values():
                if rp.proc.poll() is None:
                    rp.proc.kill()
                    rp.proc.wait()
        self._killed.set()
        if self._monitor.is_alive():
            self._monitor.join()
        if self._spawner is not None and self._spawner is not self.spawner:
            self._spawner.close()
        if self._store_proc is not None:
            stop_process(self._store_proc)

    def __enter__(self) -> LocalJob:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- results ---------------------------------------------------------------------------------

    def set_key(self, key: str, value: str) -> None:
        """Write a store key (e.g. ``stop``: every rank stops at the next iteration boundary)."""
        self._store.set(key, value)

    def epochs(self) -> list[EpochRecord]:
        """Every agreed epoch record so far."""
        out, e = [], 0
        while (raw := self.store_value(f"epoch/{e}")) is not None:
            out.append(EpochRecord.decode(raw))
            e += 1
        return out

    def store_value(self, key: str) -> str | None:
        if self._store is None or not self._store.check([key]):
            return None
        return bytes(self._store.get(key)).decode()

    def result(self, rank: int, incarnation: int | None = None) -> dict[str, Any]:
        inc = incarnation or self.procs[rank].incarnation
        with open(os.path.join(self.out_dir, f"inc{inc}", f"rank{rank}.json")) as fh:
            out: dict[str, Any] = json.load(fh)
            return out

    def params_path(self, rank: int, incarnation: int | None = None) -> str:
        inc = incarnation or self.procs[rank].incarnation
        return os.path.join(self.out_dir, f"inc{inc}", f"rank{rank}.pt")

    def logs(self) -> str:
        parts = []
        for name in sorted(os.listdir(self.out_dir)):
            if name.endswith(".log"):
                with open(os.path.join(self.out_dir, name), errors="replace") as fh:
                    parts.append(f"== {name}\n{fh.read()[-4000:]}")
        return "\n".join(parts)
