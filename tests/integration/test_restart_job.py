"""A stock torchrun script under ``recovery: "restart"`` end to end: real etcd, a coordinator, two agents
(one rank each) and the spec docs/jobs.md documents, ``examples/stock_gloo_ckpt.json`` (only its
checkpoint directory moved into the test's own), running ``examples/stock_gloo_ckpt.py`` (0.5 s steps: a 3 x D_iter hang threshold well above
the time a rank takes to exit after its last step line), which knows nothing of Unicron and checkpoints
every step. One rank is SIGKILLed mid-run: every rank of the task is stopped and relaunched (new pids
on both nodes) with TORCHELASTIC_RESTART_COUNT 0 -> 1, the job resumes from its checkpoint (not step
0) and finishes, and no node is isolated (the peer's crash is the restart's consequence, merged). On the namespace cluster
(each node a host of its own; root only)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from coordinator.statestore import read_state
from tests.integration.hosts import require_netns
from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "stock_gloo_ckpt.json"
START = re.compile(r"^start rank (\d+) pid (\d+) restart_count (\d+) resume_step (\d+)$")


def task(name: str) -> dict[str, Any]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        cli(["tasks", "--json"])
    return next(t for t in json.loads(buf.getvalue()) if t["name"] == name)


def lines(c: LocalCluster, rank: int) -> list[str]:
    path = Path(c.run_dir, "logs", "stock", f"rank{rank}.log")
    return path.read_text(errors="replace").splitlines() if path.exists() else []


def starts(c: LocalCluster, rank: int) -> list[tuple[int, int, int]]:
    """(pid, restart count, resume step) of each start of ``rank``, in order."""
    return [(int(m[2]), int(m[3]), int(m[4])) for line in lines(c, rank) if (m := START.match(line))]


def steps(c: LocalCluster, rank: int) -> list[int]:
    return [int(line.split()[1]) for line in lines(c, rank) if line.startswith("step ")]


def documented_spec(ckpt: Path) -> tuple[dict[str, Any], int]:
    """The example's spec with its checkpoint directory replaced by ``ckpt``; and its step count."""
    spec = json.loads(SPEC.read_text())
    argv: list[str] = spec["command"]
    argv[argv.index("--ckpt-dir") + 1] = str(ckpt)
    return spec, int(argv[argv.index("--steps") + 1])


def submit(spec: dict[str, Any], tmp: Path) -> None:
    spec_file = tmp / "stock.json"
    spec_file.write_text(json.dumps(spec))
    assert cli(["submit", str(spec_file)]) == 0


def both_stepped(c: LocalCluster, n: int) -> None:
    c.wait_for(lambda: min(len(steps(c, 0)), len(steps(c, 1))) >= n, 60.0, f"{n} steps on both ranks", poll_s=0.1)


def test_a_killed_rank_restarts_the_whole_job_from_its_checkpoint(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    require_netns()  # two hosts: MASTER_ADDR and the ranks' gloo traffic cross the network
    monkeypatch.chdir(ROOT)  # the spec's paths are relative to the agents' directory, the repository
    env = {"UNICRON_STATUS_INTERVAL": "0.2", "UNICRON_RESTART_DEADLINE": "30"}
    with LocalCluster(agents=2, gpus_per_agent=1, extra_env=env, netns=True, prefork=["unicron.runtime.workload"]) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        try:
            spec, steps_total = documented_spec(tmp_path / "ckpt")
            assert spec["name"] == "stock" and spec["recovery"] == "restart" and spec["min_gpus"] == 2
            submit(spec, tmp_path)
            both_stepped(c, 3)
            (victim, _, _), = starts(c, 1)
            (survivor, _, _), = starts(c, 0)
            os.kill(victim, signal.SIGKILL)
            killed_at = max(steps(c, 1))
            t0 = time.monotonic()
            final = c.wait_for(lambda: (t := task("stock"))["phase"] in ("finished", "failed") and t, 60.0,
                               "the job to finish", poll_s=0.2)
            recovered_s = time.monotonic() - t0
            assert final["phase"] == "finished", final
            for rank, old in ((0, survivor), (1, victim)):
                (pid0, count0, resume0), (pid1, count1, resume1) = starts(c, rank)  # exactly two starts
                assert (pid0, count0, resume0) == (old, 0, 0)
                assert pid1 != old and count1 == 1  # relaunched, as the next attempt
                # from its checkpoint, not step 0: at most the step in flight, which rank 0 may have saved
                # before the barrier that the dead rank never reached (its line never printed)
                assert 0 < resume1 <= killed_at + 2, (resume1, killed_at)
                assert steps(c, rank)[-1] == steps_total - 1 and lines(c, rank)[-1] == f"done rank {rank}"
            acts = [str(a["action"]) for a in c.actions()]
            assert acts.count("RestartTask") == 1, acts  # one restart of the whole task, the peer's crash merged
            assert "RestartRanks" not in acts and "IsolateNode" not in acts, acts
            assert acts.count("Assign") == 1, acts  # the same placement: no reconfiguration
            print(f"kill -> finished in {recovered_s:.1f} s")
        finally:
            os.environ.pop("UNICRON_ETCD", None)


def test_a_restart_that_redoes_steps_from_an_older_checkpoint_is_confirmed_by_its_first_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job checkpoints every 35 steps of 0.4 s (after step 34), and a rank is killed at step 60 or
    later: the relaunched job redoes at least 26 steps (10.4 s) from its checkpoint. Its first step
    confirms the restart. Before, only a step past the fault did, so the 9 s restart deadline expired
    during the redo: the restart's node (healthy) was isolated and the task reconfigured."""
    require_netns()
    monkeypatch.chdir(ROOT)
    env = {"UNICRON_STATUS_INTERVAL": "0.2", "UNICRON_RESTART_DEADLINE": "9"}
    with LocalCluster(agents=2, gpus_per_agent=1, extra_env=env, netns=True) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        try:
            spec, _ = documented_spec(tmp_path / "ckpt")
            argv: list[str] = spec["command"]
            argv[argv.index("--steps") + 1] = "1000"
            argv[argv.index("--step-time") + 1] = "0.4"
            argv += ["--ckpt-interval", "35"]
            submit(spec, tmp_path)
            c.wait_for(lambda: max(steps(c, 1) or [0]) >= 60, 120.0,
                       "step 60 on rank 1", poll_s=0.1)
            (victim, _, _), = starts(c, 1)
            t0 = time.time()
            os.kill(victim, signal.SIGKILL)
            killed_at = max(steps(c, 1))
            assert killed_at >= 60

            def confirmed() -> dict[str, Any] | None:
                return next((r for r in c.coordinator_log(t0) if r.get("event") == "transition"
                             and "restarting --progress--> running" in str(r.get("edge"))), None)

            edge = c.wait_for(confirmed, 60.0, "the restart confirmed", poll_s=0.2)
            (_, _, resume), = starts(c, 1)[1:]
            assert resume == 35 and killed_at >= 60, (resume, killed_at)  # redone from its checkpoint
            # confirmed by the relaunched attempt's step, before it got back to the fault
            by = re.search(r"step (\d+) completed by a process of restart epoch 1", str(edge["edge"]))
            assert by is not None, edge
            done = int(by[1])
            assert resume <= done < killed_at, (resume, done, killed_at)
            time.sleep(max(0.0, t0 + 11.0 - time.time()))  # past the restart's deadline
            acts = [str(a["action"]) for a in c.actions(t0)]
            assert acts == ["RestartTask"], acts  # no escalation: no IsolateNode, no re-Assign
            assert task("stock")["phase"] == "running"
            assert all(c.node_state(n) == "up" for n in c.node_names())
        finally:
            os.environ.pop("UNICRON_ETCD", None)


def test_a_relaunched_process_that_dies_fails_the_restart_at_once(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's process of the first restart exits 3 as it starts. Before, its death was merged like a
    peer's crash: the restart waited out its deadline (60 s here) with rank 1 blocked in the rendezvous,
    and a job whose ranks step without each other confirmed the restart with rank 0 dead. Now the
    restart fails at once: rank 0's node is isolated and the task re-planned (it waits: 1 GPU left)."""
    monkeypatch.chdir(ROOT)
    env = {"UNICRON_STATUS_INTERVAL": "0.2", "UNICRON_RESTART_DEADLINE": "60"}
    with LocalCluster(agents=2, gpus_per_agent=1, extra_env=env) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        try:
            spec, _ = documented_spec(tmp_path / "ckpt")
            argv: list[str] = spec["command"]
            argv[argv.index("--steps") + 1] = "1000"
            spec["command"] = ["sh", "-c", 'if [ "$RANK" = 0 ] && [ "$TORCHELASTIC_RESTART_COUNT" = 1 ]; '
                               'then exit 3; fi; exec "$@"', "sh", *argv]
            submit(spec, tmp_path)
            both_stepped(c, 2)
            (victim, _, _), = starts(c, 1)
            assert c.store is not None
            state, _, _ = read_state(c.store, c.keys)
            assert state is not None
            rank0_node = next(n for n, ranks in state.tasks["stock"].placement.items() if 0 in ranks)
            t0 = time.time()
            os.kill(victim, signal.SIGKILL)

            def failed() -> dict[str, Any] | None:
                return next((r for r in c.coordinator_log(t0) if r.get("event") == "transition"
                             and "restarting --restart_died--> reconfiguring" in str(r.get("edge"))), None)

            c.wait_for(failed, 20.0, "the restart failed by rank 0's new process", poll_s=0.2)
            assert time.time() - t0 < 20.0  # far inside the restart's 60 s deadline
            c.wait_for(lambda: c.node_state(rank0_node) == "isolated", 10.0, "rank 0's node isolated")
            acts = [str(a["action"]) for a in c.actions(t0)]
            assert acts[:2] == ["RestartTask", "IsolateNode"], acts
            c.wait_for(lambda: task("stock")["phase"] == "pending", 10.0, "the task waiting for GPUs")
        finally:
            os.environ.pop("UNICRON_ETCD", None)
