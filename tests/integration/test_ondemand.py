"""Work-conserving stops end to end (issue 13 item 4): real etcd, a coordinator, three agents and a
2-rank ``unicron.runtime.train`` task with ``--ckpt memory`` and no periodic checkpoint at all
(``--ckpt-every 0``). Whatever stops it — a cancel, a move the control plane makes by relaunching
it (its node drained, no replica left to keep), or a SIGTERM from somebody else — its ranks stop at one
iteration boundary with an on-demand snapshot and exit 0; the relaunched ranks restore that snapshot:
0 iterations computed again. Without the snapshot there would be nothing to restore (a fresh start)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster

TASK = "od"
STOPPED = re.compile(r"^rank (\d+): stopped at iteration (\d+) .*on-demand snapshot of iteration (\d+) saved")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    env = {"UNICRON_STATUS_INTERVAL": "0.2"}
    with LocalCluster(agents=3, gpus_per_agent=2, extra_env=env) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        try:
            yield c
        finally:
            os.environ.pop("UNICRON_ETCD", None)


def train_argv(tmp: Path) -> list[str]:
    return [sys.executable, "-m", "unicron.runtime.train", "--iterations", "0", "--iter-sleep", "0.05",
            "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "64",
            "--global-batch-size", "8", "--micro-batch-size", "2", "--tp", "1",
            "--ckpt", "memory", "--ckpt-dir", str(tmp / "ck"), "--ckpt-every", "0", "--resume"]


def submit(c: LocalCluster, tmp: Path, name: str, command: list[str] | None = None) -> None:
    command = command or train_argv(tmp)
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps({"name": name, "command": command, "min_gpus": 2, "max_gpus": 2,
                                }))
    assert cli(["submit", str(spec)]) == 0


def log_lines(c: LocalCluster, name: str, rank: int) -> list[str]:
    path = Path(c.run_dir, "logs", name, f"rank{rank}.log")
    return path.read_text(errors="replace").splitlines() if path.exists() else []


def stops(c: LocalCluster, name: str) -> dict[int, list[int]]:
    """Per rank, the iterations at which it stopped with an on-demand snapshot (its exit line)."""
    out: dict[int, list[int]] = {}
    for r in (0, 1):
        out[r] = [int(m[3]) for line in log_lines(c, name, r) if (m := STOPPED.match(line))]
    return out


RESTORED = re.compile(r"^rank (\d+): restored iteration (\d+) from (\w+)")


def restores(c: LocalCluster, name: str) -> list[tuple[int, int, str]]:
    """(rank, iteration, source) of every restore the ranks printed, rank by rank in log order."""
    return [(r, int(m[2]), m[3]) for r in (0, 1) for line in log_lines(c, name, r) if (m := RESTORED.match(line))]


def stepping(c: LocalCluster, name: str, least: int) -> bool:
    ranks = c.running_ranks(name)
    return len(ranks) == 2 and all(isinstance(r.get("step"), int) and r["step"] >= least for r in ranks.values())


def wait_relaunched(c: LocalCluster, name: str, gen: int) -> None:
    """Until both ranks run at a generation after ``gen``."""
    def relaunched() -> bool:
        now = c.running_ranks(name)
        return len(now) == 2 and all(int(r.get("generation") or 0) > gen for r in now.values())

    c.wait_for(relaunched, 60.0, "the task to be relaunched", poll_s=0.1)


def assert_restored_at(c: LocalCluster, name: str, n: int, at: dict[int, list[int]]) -> None:
    """Both ranks restored iteration ``n``, the stop's snapshot: 0 iterations redone."""
    c.wait_for(lambda: len(restores(c, name)) == 2, 30.0, "both ranks to restore", poll_s=0.1)
    got = restores(c, name)
    assert [it for _, it, _ in got] == [n, n], (got, at)


def test_cancel_saves_and_a_resubmit_resumes_where_it_stopped(cluster: LocalCluster, tmp_path: Path) -> None:
    c, name = cluster, f"{TASK}-cancel"
    submit(c, tmp_path, name)
    c.wait_for(lambda: stepping(c, name, 5), 90.0, "the task to train", poll_s=0.1)
    assert cli(["cancel", name]) == 0
    c.wait_for(lambda: not c.running_ranks(name) and all(stops(c, name).values()), 30.0,
               "both ranks to stop with a snapshot", poll_s=0.1)
    at = stops(c, name)
    assert at[0] == at[1] and len(at[0]) == 1, at  # one boundary for both
    n = at[0][0]
    assert n >= 5 and restores(c, name) == []
    submit(c, tmp_path, name)
    c.wait_for(lambda: stepping(c, name, n + 2), 90.0, "the resubmitted task to train on", poll_s=0.1)
    got = restores(c, name)
    assert [it for _, it, _ in got] == [n, n], got  # resumed where it stopped: 0 iterations redone
    assert cli(["cancel", name]) == 0
    c.wait_for(lambda: not c.running_ranks(name), 30.0, "the task to stop", poll_s=0.1)


def test_a_relaunching_move_restores_from_the_on_demand_snapshot(cluster: LocalCluster, tmp_path: Path) -> None:
    """The task's nodes are drained: no replica of it survives there, so the control plane stops it
    and places it again (a new generation, new processes); it resumes at the stop's iteration."""
    c, name = cluster, f"{TASK}-move"
    submit(c, tmp_path, name)
    c.wait_for(lambda: stepping(c, name, 5), 90.0, "the task to train", poll_s=0.1)
    before = c.running_ranks(name)
    nodes = sorted({str(r["node"]) for r in before.values()})
    gen = max(int(r.get("generation") or 0) for r in before.values())
    for node in nodes:
        assert cli(["drain", node]) == 0
    try:
        def moved() -> bool:
            now = c.running_ranks(name)
            return (len(now) == 2 and not {str(r["node"]) for r in now.values()} & set(nodes)
                    and all(int(r.get("generation") or 0) > gen for r in now.values()))

        c.wait_for(moved, 60.0, "the task to run on the other node", poll_s=0.1)
        at = stops(c, name)
        assert at[0] and at[0] == at[1], at
        n = at[0][-1]
        assert_restored_at(c, name, n, at)
    finally:
        for node in nodes:
            cli(["undrain", node])
        cli(["cancel", name])


def relaunch_with(c: LocalCluster, tmp: Path, name: str, changes: dict[str, object], flags: dict[str, str],
                  capsys: pytest.CaptureFixture[str]) -> None:
    """``unicron update --wait`` of a training task's spec with ``changes`` and its command's ``flags``
    replaced: it returns 0 once the new spec's ranks completed a step; both ranks must restore the stop's
    snapshot (0 iterations redone) and train on."""
    submit(c, tmp, name)
    c.wait_for(lambda: stepping(c, name, 5), 90.0, "the task to train", poll_s=0.1)
    gen = max(int(r.get("generation") or 0) for r in c.running_ranks(name).values())
    spec = tmp / f"{name}.json"
    argv = train_argv(tmp)
    for flag, value in flags.items():
        argv[argv.index(flag) + 1] = value
    spec.write_text(json.dumps({**json.loads(spec.read_text()), **changes, "command": argv}))
    capsys.readouterr()
    assert cli(["update", str(spec), "--wait", "--timeout", "90"]) == 0
    out = capsys.readouterr().out
    assert f"updated task {name}; its ranks completed step" in out and "under the new spec" in out, out
    wait_relaunched(c, name, gen)
    at = stops(c, name)
    assert at[0] and at[0] == at[1], at
    n = at[0][-1]
    assert_restored_at(c, name, n, at)
    c.wait_for(lambda: stepping(c, name, n + 2), 60.0, "the relaunched task to train on", poll_s=0.1)


def test_a_new_micro_batch_size_relaunches_the_task_from_the_on_demand_snapshot(
        cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``unicron update`` with a new micro-batch size (a layout change the running ranks cannot take):
    both ranks stop at one boundary with a snapshot, the new command is launched as a new generation
    and restores it."""
    c, name = cluster, f"{TASK}-mbs"
    try:
        relaunch_with(c, tmp_path, name, {}, {"--micro-batch-size": "1"}, capsys)
        split = [line for r in (0, 1) for line in log_lines(c, name, r) if RESTORED.match(line)]
        assert all(line.endswith("(8 micro-batches of 1)") for line in split), split  # global batch 8 kept
    finally:
        cli(["cancel", name])


def test_a_new_tp_size_relaunches_the_task_and_reshards_the_on_demand_snapshot(
        cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``unicron update`` from TP=1 x DP=2 to TP=2 x DP=1: the ranks stop with their snapshots (each a
    whole TP=1 replica), the task is placed again with TP=2 (both ranks on one node) and each rank
    restores its half of the stop's iteration: 0 iterations redone, the global batch kept."""
    c, name = cluster, f"{TASK}-tp"
    try:
        relaunch_with(c, tmp_path, name, {"tp_size": 2}, {"--tp": "2"}, capsys)
        split = [line for r in (0, 1) for line in log_lines(c, name, r) if RESTORED.match(line)]
        assert all(line.endswith("resharded from TP 1 to 2 (4 micro-batches of 2)") for line in split), split
        assert len({str(r["node"]) for r in c.running_ranks(name).values()}) == 1  # a TP group stays on a node
    finally:
        cli(["cancel", name])


def assert_rolled_back(c: LocalCluster, name: str, since: float, command: list[str], *alert_says: str) -> None:
    """The task went back to ``command`` after a failed update: both ranks stopped at one boundary,
    restored there (0 iterations redone) and train on; an alert saying ``alert_says`` and "rolled back",
    no MarkTaskFailed, and the spec record shows the command that runs."""
    at = stops(c, name)
    assert at[0] and at[0] == at[1], at
    n = at[0][-1]
    assert_restored_at(c, name, n, at)
    c.wait_for(lambda: stepping(c, name, n + 2), 60.0, "the rolled-back task to train on", poll_s=0.1)
    alerts = [str(a.get("message")) for a in c.actions(since) if a.get("action") == "Alert" and a.get("task") == name]
    assert any("rolled back" in a and all(s in a for s in alert_says) for a in alerts), alerts
    assert not [a for a in c.actions(since) if a.get("action") == "MarkTaskFailed" and a.get("task") == name]
    assert c.store is not None
    kv = c.store.get(c.keys.task(name))
    assert kv is not None and json.loads(kv.value)["command"] == command


def test_an_update_whose_command_cannot_start_rolls_back_and_the_job_trains_on(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """``unicron update`` with a typo in the command (an executable that does not exist): the ranks stop
    with their snapshot, the new command cannot be executed, and the task goes back to the command it
    ran with, relaunched from that snapshot (0 iterations redone), with an alert; its spec record shows
    the command that runs. Before, the task was failed: one bad update lost a job that trained fine."""
    c, name = cluster, f"{TASK}-bad-update"
    submit(c, tmp_path, name)
    try:
        c.wait_for(lambda: stepping(c, name, 5), 90.0, "the task to train", poll_s=0.1)
        gen = max(int(r.get("generation") or 0) for r in c.running_ranks(name).values())
        spec = tmp_path / f"{name}.json"
        good = json.loads(spec.read_text())
        spec.write_text(json.dumps({**good, "command": [str(tmp_path / "no-such-python"), *good["command"][1:]]}))
        since = time.time()
        assert cli(["update", str(spec)]) == 0
        wait_relaunched(c, name, gen + 1)  # the update's generation launched nothing: the rollback's runs
        assert_rolled_back(c, name, since, good["command"], "update failed")
    finally:
        cli(["cancel", name])


def test_an_update_whose_command_crashes_before_its_first_step_rolls_back_and_the_job_trains_on(
        cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``unicron update`` with a command that starts but dies before any step (a flag the script does not
    know: argparse exits 2 in both ranks). The task goes back to the command it ran with, relaunched from
    the update's snapshot (0 iterations redone), with an alert naming the crash. Before, the crash was an
    ordinary rank failure: the broken command was restarted until the budget failed the job. ``--wait``
    exits 1 saying so in one line (before, 'update' answered at once: success and rollback looked alike)."""
    c, name = cluster, f"{TASK}-crash-update"
    submit(c, tmp_path, name)
    try:
        c.wait_for(lambda: stepping(c, name, 5), 90.0, "the task to train", poll_s=0.1)
        gen = max(int(r.get("generation") or 0) for r in c.running_ranks(name).values())
        spec = tmp_path / f"{name}.json"
        good = json.loads(spec.read_text())
        spec.write_text(json.dumps({**good, "command": [*good["command"], "--no-such-flag"]}))
        since = time.time()
        capsys.readouterr()
        assert cli(["update", str(spec), "--wait", "--timeout", "90"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"unicron update: update of task {name} rolled back: ") and err.count("\n") == 1, err
        assert "exited abnormally" in err and "Traceback" not in err
        wait_relaunched(c, name, gen + 1)  # the update's generation crashed: the rollback's runs
        assert_rolled_back(c, name, since, good["command"], "update failed", "exited abnormally")
    finally:
        cli(["cancel", name])


def test_a_rank_sigtermed_by_somebody_else_goes_on_from_the_snapshot_and_is_not_finished(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """A SIGTERM its agent did not send (an operator, another scheduler): both ranks stop at one
    boundary and exit 0 unasked, but the task has not reached its end. Rank 1 said so before it exited,
    so the control plane relaunches the task (a new generation) from the snapshot. Before, it took the
    exits 0 for the job's end and marked the task FINISHED within a second: the job was lost."""
    c, name = cluster, f"{TASK}-term"
    submit(c, tmp_path, name)
    c.wait_for(lambda: stepping(c, name, 5), 90.0, "the task to train", poll_s=0.1)
    before = c.running_ranks(name)
    gen = max(int(r.get("generation") or 0) for r in before.values())
    os.kill(int(before[1]["pid"]), signal.SIGTERM)
    try:
        wait_relaunched(c, name, gen)
        at = stops(c, name)
        assert not at[0] and len(at[1]) == 1, at  # the signalled rank prints the stop line
        n = at[1][0]
        assert_restored_at(c, name, n, at)
        c.wait_for(lambda: stepping(c, name, n + 2), 60.0, "the relaunched task to train on", poll_s=0.1)
    finally:
        cli(["cancel", name])


@pytest.mark.parametrize("delay_s", [0, 2])
def test_ranks_that_crash_before_they_count_in_are_restarted_and_all_train_together(
        cluster: LocalCluster, tmp_path: Path, delay_s: int) -> None:
    """Each rank's first process exits 1 at start, before it counted itself in its store (as when a
    relaunch found its checkpoint slots still locked). The agent's failure mark of such a process once
    counted as a death, so each rank's restarted process looked dead at its start: rank 0 trained
    alone and rank 1 waited to be admitted forever (``delay_s`` 2: the failure comes after the launch
    was confirmed). At once (``delay_s`` 0), before the Assign was confirmed, the deaths were merged as
    consequences of the reconfiguration and nothing happened until the Assign's 300 s deadline."""
    c, name = cluster, f"{TASK}-crash{delay_s}"
    once = tmp_path / "crashed"
    once.mkdir()
    script = (f'm={once}/$RANK; if [ ! -e "$m" ]; then sleep {delay_s}; touch "$m"; '
              f'echo "rank $RANK: failing at start" >&2; exit 1; fi; exec "$@"')
    submit(c, tmp_path, name, ["/bin/sh", "-c", script, "sh", *train_argv(tmp_path)])
    try:
        c.wait_for(lambda: sorted(p.name for p in once.iterdir()) == ["0", "1"], 60.0, "both first processes to fail",
                   poll_s=0.1)
        c.wait_for(lambda: stepping(c, name, 5), 90.0, "both restarted ranks to train together", poll_s=0.1)
    finally:
        cli(["cancel", name])
