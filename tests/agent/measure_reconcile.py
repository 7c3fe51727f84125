"""Measures what a task stop and a rank restart cost the agent, and how long a status write is
blocked meanwhile (issue #12 item 6). Not a test: run it by hand, under the heavy-test lock:

    PYTHONPATH=$PWD flock /tmp/unicron-heavy.lock .venv/bin/python tests/agent/measure_reconcile.py

Real etcd, a real in-process Agent, ranks that are real processes (``sleep``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from agent.daemon import Agent
from agent.settings import AgentSettings
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.types import RankSpec, TaskAssignment

SLEEPER = [sys.executable, "-c", "import time; time.sleep(1000)"]


def assignment(ranks: int, generation: int, **extra: object) -> TaskAssignment:
    names = {f.name for f in dataclasses.fields(TaskAssignment)}
    fields: dict[str, object] = dict(task="m", generation=generation, argv=SLEEPER, env={}, world_size=ranks,
                                     ranks=[RankSpec(rank=r, local_rank=r, gpu=r) for r in range(ranks)])
    # Works on both interfaces: before (master_addr/port) and after (store_node) issue #12 item 4.
    optional: dict[str, object] = {"master_addr": "127.0.0.1", "master_port": 1, "store_node": "m0"}
    fields.update({k: v for k, v in optional.items() if k in names})
    fields.update(extra)
    return TaskAssignment(**fields)  # type: ignore[arg-type]


def pids(agent: Agent) -> dict[int, int]:
    """rank -> pid of the task's running processes."""
    if hasattr(agent, "status_ranks"):  # after the restructuring
        return {r.rank: r.pid for r in agent.status_ranks() if r.state == "running"}
    with agent._tasks_lock:  # before it
        rt = agent._tasks.get("m")
        return {} if rt is None else {r: s.pid for r, s in rt.supervisor.status().items() if s.state == "running"}


def gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


def timed(what: Callable[[], object], done_when: Callable[[], bool], agent: Agent) -> tuple[float, float]:
    """(seconds from calling ``what`` until ``done_when``, longest a concurrent status write was
    blocked meanwhile)."""
    worst = [0.0]
    done = threading.Event()

    def writer() -> None:
        while not done.is_set():
            t = time.monotonic()
            agent._write_status()
            worst[0] = max(worst[0], time.monotonic() - t)
            time.sleep(0.01)

    th = threading.Thread(target=writer)
    th.start()
    t0 = time.monotonic()
    what()
    settle(done_when)
    took = time.monotonic() - t0
    done.set()
    th.join()
    return took, worst[0]


def settle(pred: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("ranks did not reach the expected state")
        time.sleep(0.005)


def main() -> None:
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    with EtcdServer() as etcd:
        settings = AgentSettings(node="m0", etcd=etcd.endpoint, prefix="/measure", gpu_backend="simulated",
                                 gpus=ranks, run_dir=tempfile.mkdtemp(), replica_budget_mb=0, prefork="")
        agent = Agent(settings)
        th = threading.Thread(target=agent.run, daemon=True)
        th.start()
        agent.ready.wait(30)
        stops, restarts, blocked_stop, blocked_restart = [], [], [], []
        for g in range(1, rounds + 1):
            a = assignment(ranks, g)
            agent.reconcile([a])
            settle(lambda: len(pids(agent)) == ranks)
            time.sleep(0.3)
            # A restart of one hung (SIGSTOPped) rank: done when rank 0 runs as a new process.
            old = pids(agent)
            os.kill(old[0], signal.SIGSTOP)
            b = dataclasses.replace(a, restart_epoch=1, restart_ranks=[0])
            took, blocked = timed(lambda b=b: agent.reconcile([b]),  # type: ignore[misc]
                                  lambda: gone(old[0]) and pids(agent).get(0, old[0]) != old[0], agent)  # noqa: B023
            restarts.append(took)
            blocked_restart.append(blocked)
            time.sleep(0.3)
            # A stop of the whole task: done when every rank process is gone (reaped).
            old = pids(agent)
            took, blocked = timed(lambda: agent.reconcile([]), lambda: all(gone(p) for p in old.values()), agent)  # noqa: B023
            stops.append(took)
            blocked_stop.append(blocked)
            time.sleep(0.3)
        agent.stop()
        th.join(30)
    print(f"{ranks} ranks, {rounds} rounds (median, max):")
    print(f"  restart of a hung rank: {statistics.median(restarts):.3f} s, {max(restarts):.3f} s;"
          f" status write blocked up to {max(blocked_restart):.3f} s")
    print(f"  task stop:              {statistics.median(stops):.3f} s, {max(stops):.3f} s;"
          f" status write blocked up to {max(blocked_stop):.3f} s")


if __name__ == "__main__":
    main()
