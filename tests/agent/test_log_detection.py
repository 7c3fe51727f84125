"""Detection without instrumentation, with real etcd, a real agent and real rank processes: progress
lines in a rank's output feed the hang detector; an NCCL watchdog timeout line is sev3."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.daemon import Agent
from agent.reconciler import RankState, TaskReconciler
from agent.settings import AgentSettings
from tests.agent.test_agent import KEYS, assign, settings, status, task, wait_for
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel import protocol
from unicron.kernel.etcd import Store
from unicron.kernel.severity import severity_of
from unicron.kernel.types import DetectionMethod, ErrorKind, NodeStatus, Report, Severity

ROOT = Path(__file__).resolve().parents[2]
MEGATRON_LOG = [sys.executable, str(ROOT / "examples" / "megatron_log.py")]


@pytest.fixture
def agent(etcd_server: EtcdServer, tmp_path: Path) -> Iterator[Agent]:
    # Warm-up of one line, then the monitor's 5 samples: hangs are judged from the 7th line on.
    a = Agent(dataclasses.replace(settings(etcd_server, "a0", tmp_path), warmup_iterations=1))
    th = threading.Thread(target=a.run, daemon=True)
    th.start()
    try:
        assert a.ready.wait(30)
        yield a
    finally:
        a.stop()
        th.join(30)


def reports(store: Store) -> list[Report]:
    kvs, _ = store.get_prefix(KEYS.reports())
    return [Report.from_json(kv.value) for kv in kvs]


def test_a_megatron_job_that_stops_printing_is_a_task_hang(agent: Agent, store: Store, tmp_path: Path) -> None:
    # 12 lines, one per 10 iterations of 20 ms (an interval of 0.2 s), then silence: the hang
    # threshold is 3 x 0.2 s after the line of iteration 120.
    argv = [*MEGATRON_LOG, "--lines", "30", "--log-interval", "10", "--iter-ms", "20", "--hang-after", "12"]
    assign(store, "a0", task("mega", argv, [0], 1, store_node="a0"))

    def hang() -> Report | None:
        return next((r for r in reports(store) if r.kind is ErrorKind.TASK_HANG and r.step == 120), None)

    found = wait_for(hang, 30, "a task_hang report for the iteration after the last line")
    assert (found.task, found.rank, found.method) == ("mega", 0, DetectionMethod.STATISTICAL_MONITORING)
    assert severity_of(found.method, found.kind) is Severity.SEV2
    assert "3.0 x mean iteration time 0.200 s" in found.message  # Megatron's own time per iteration x 10
    # progress, as instrumented ranks report it: in the next status record, which under load can come
    # later than the hang report (a fresh clone's run read one written 0.8 s before it, at step 100)
    def at_last_line() -> NodeStatus | None:
        st = status(store, "a0")
        return st if st is not None and [r.step for r in st.ranks] == [120] else None

    st = wait_for(at_last_line, 10, "the node status at the last line's iteration")
    assert [r.advanced for r in st.ranks] == [True]  # a progress line follows the iterations it counts
    # stdout went through the parser and still reached the rank's log file.
    lines = (tmp_path / "logs" / "mega" / "rank0.log").read_text().splitlines()
    assert len(lines) == 12 and "iteration      120/     300" in lines[-1]


def test_a_megatron_evaluation_is_no_hang_and_a_hang_after_it_still_is(agent: Agent, store: Store) -> None:
    """Megatron-LM evaluates after the line of every --eval-interval-th iteration and prints nothing
    until it is done: with a line per iteration, each evaluation (8 intervals here) was reported as a
    hang, a restart per evaluation (review reproduction). The job's flags say when it evaluates; the
    silence until its validation line is the eval phase. A hang later is still found."""
    argv = [*MEGATRON_LOG, "--lines", "40", "--log-interval", "1", "--iter-ms", "50", "--eval-interval", "10",
            "--eval-ms", "400", "--hang-after", "35"]
    assign(store, "a0", task("mega", argv, [0], 1, store_node="a0"))

    def hang() -> Report | None:
        return next((r for r in reports(store) if r.kind is ErrorKind.TASK_HANG), None)

    found = wait_for(hang, 30, "the hang after the evaluations")
    assert found.step == 35, f"a hang reported at step {found.step}: {found.message}"


def megatron_line(iteration: int) -> str:
    return (f" [2025-08-01 07:19:37] iteration {iteration:8d}/{100000:8d} | consumed samples: {iteration * 64:12d} |"
            " elapsed time per iteration (ms): 1000.0 | learning rate: 1.5E-04 |")


def test_a_megatron_evaluation_between_its_progress_lines_is_no_hang(tmp_path: Path) -> None:
    """Megatron-LM evaluates after every --eval-interval-th iteration whether or not it printed that
    iteration's line (one every --log-interval): with lines every 10 and evaluations every 25, those
    after 25, 75, 125 ... fell between lines, and their silence was judged a hang (a restart each).
    A hang after them is still found. (No etcd: the reconciler's line handling and the rank's monitor.)"""
    argv = ["python", "pretrain_gpt.py", "--log-interval", "10", "--eval-interval", "25", "--eval-iters", "100"]
    agent = Agent(AgentSettings(node="a0", etcd="127.0.0.1:1", gpu_backend="simulated", gpus=1,
                                run_dir=str(tmp_path), replica_budget_mb=0, prefork="", advertise_host="127.0.0.1"))
    rec = TaskReconciler(task("mega", argv, [0], 1, store_node="elsewhere"), agent, None)
    with agent._tasks_lock:
        agent._tasks["mega"] = rec
    with rec._lock:  # rank 0 runs as pid 4242 (as _launch leaves it)
        rec._ranks[0], rec.launched_pid[0] = RankState.HEALTHY, 4242
    try:
        hangs: list[int] = []
        t = 1000.0
        for it in range(1, 201):
            t += 1.0  # a 1 s training iteration
            if it % 10 == 0:
                rec._on_line(0, 4242, megatron_line(it), t)
            if it % 25 == 0:  # Megatron: `if args.eval_interval and iteration % args.eval_interval == 0`
                mon = rec.monitors[0]
                hangs += [it for dt in range(1, 36) if mon.check(t + dt)]  # the watcher's view of a 35 s evaluation
                t += 35.0
                rec._on_line(0, 4242, f" validation loss at iteration {it} | lm loss value: 1.0E+01 |", t)
        assert hangs == []
        found = rec.monitors[0].check(t + 60.0)  # silence after the line of 200 and its evaluation
        assert [f.kind for f in found] == [ErrorKind.TASK_HANG]
    finally:
        rec.stop("test over").wait(10)


def test_a_hang_while_an_async_save_finalizes_is_found(agent: Agent, store: Store) -> None:
    """With Megatron's --async-save the save's lines bracket many iterations of training (the success
    line comes when a later iteration finalizes it): taking them as a checkpoint phase left a hang in
    between unjudged, found only by NCCL's timeout. Training resumes at the 'scheduled' line."""
    argv = [*MEGATRON_LOG, "--lines", "40", "--log-interval", "1", "--iter-ms", "50", "--save-interval", "10",
            "--async-save", "--async-lines", "100", "--hang-after", "20"]
    assign(store, "a0", task("async", argv, [0], 1, store_node="a0"))

    def hang() -> Report | None:
        return next((r for r in reports(store) if r.kind is ErrorKind.TASK_HANG), None)

    found = wait_for(hang, 30, "the hang while the save finalizes")
    assert found.step == 20, f"a hang reported at step {found.step}: {found.message}"


def test_a_jobs_own_progress_regex_from_its_env(agent: Agent, store: Store) -> None:
    code = "import time\nfor i in range(1, 6):\n    print(f'epoch 0 batch {i*7} done', flush=True); time.sleep(0.05)\n"
    t = dataclasses.replace(task("own", [sys.executable, "-c", code], [0], 1, store_node="a0"),
                            env={"UNICRON_PROGRESS_REGEX": r"^epoch \d+ batch (?P<iteration>\d+) done$"})
    assign(store, "a0", t)

    def step() -> int | None:
        st = status(store, "a0")
        return next((r.step for r in st.ranks if r.task == "own" and r.step == 35), None) if st else None

    assert wait_for(step, 30, "the custom regex's last iteration in the node status") == 35


def test_a_jobs_own_save_lines_pause_the_hang_clock(agent: Agent, store: Store) -> None:
    """A job read through its own progress regex had no save the agent could see: a save of 12
    intervals was reported as a hang (under recovery: restart, a relaunch at every save, for ever).
    Its save lines, named in its env, pause the hang clock; a hang later is still found."""
    code = ("import time\n"
            "for i in range(1, 41):\n"
            "    if i > 25: time.sleep(60)\n"
            "    time.sleep(0.05); print(f'step {i} loss 1.0', flush=True)\n"
            "    if i == 15:\n"
            "        print('saving model at step 15', flush=True); time.sleep(0.6); print('model saved', flush=True)\n")
    env = {"UNICRON_PROGRESS_REGEX": r"^step (?P<iteration>\d+) ",
           "UNICRON_SAVE_START_REGEX": r"^saving model at step (?P<iteration>\d+)", "UNICRON_SAVE_END_REGEX": r"^model saved"}
    assign(store, "a0", dataclasses.replace(task("own", [sys.executable, "-c", code], [0], 1, store_node="a0"), env=env))

    def hang() -> Report | None:
        return next((r for r in reports(store) if r.kind is ErrorKind.TASK_HANG), None)

    found = wait_for(hang, 30, "the hang after the save")
    assert found.step == 25, f"a hang reported at step {found.step}: {found.message}"


def test_an_nccl_watchdog_timeout_in_stderr_is_sev3(agent: Agent, store: Store) -> None:
    line = ("[rank0]:[E801 07:19:37.123 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=1841, OpType=ALLREDUCE, NumelIn=1048576, Timeout(ms)=600000) ran for 600042 "
            "milliseconds before timing out.")
    code = f"import sys, time\nprint({line!r}, file=sys.stderr, flush=True)\ntime.sleep(30)\n"
    assign(store, "a0", task("nccl", [sys.executable, "-c", code], [0], 1, store_node="a0"))
    found = wait_for(lambda: next((r for r in reports(store) if r.task == "nccl"), None), 30, "the stderr report")
    assert (found.kind, found.method) == (ErrorKind.NCCL_TIMEOUT, DetectionMethod.STATISTICAL_MONITORING)
    assert severity_of(found.method, found.kind) is Severity.SEV3  # Table 1; it was sev2 before


def test_a_stderr_report_carries_the_ranks_last_step(agent: Agent, store: Store) -> None:
    """A line says no step, but the coordinator needs one to tell a survivor's broken call to a moved
    store (the echo of an in-place resize) from a new fault: the rank's last reported step goes with it
    (without it a drain of the store's node raised a reattempt in the resize soak)."""
    code = ("import sys, time\nfrom unicron.kernel.client import AgentClient\n"
            "c = AgentClient.from_env().connect()\n"
            "with c.iteration(41): pass\n"
            "time.sleep(0.5)\n"
            "print('[W1127 14:39:08.576720330 TCPStore.cpp:106] [c10d] sendBytes failed on SocketImpl(fd=4): "
            "Broken pipe', file=sys.stderr, flush=True)\n"
            "time.sleep(30)\n")
    assign(store, "a0", task("echo", [sys.executable, "-c", code], [0], 1, store_node="a0"))
    found = wait_for(lambda: next((r for r in reports(store) if r.task == "echo"), None), 30, "the stderr report")
    assert found.kind is ErrorKind.OTHER_NETWORK_ERROR and found.step == 41


# Megatron-LM's output as Megatron prints it: checkpoint lines on rank 0 (print_rank_0), progress lines
# on the last rank (print_rank_last); rank 0 trains on silently. A 0.3 s save at iteration 5.
MEGATRON_SPLIT = [sys.executable, "-c", (
    "import os, time\n"
    "rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])\n"
    "for it in range(1, 41):\n"
    "    time.sleep(0.1)\n"
    "    if rank == world - 1:\n"
    "        print(f' iteration {it:8d}/      40 | consumed samples: {it * 64:12d} |'\n"
    "              ' elapsed time per iteration (ms): 100.0 | lm loss: 1.04E+01 |', flush=True)\n"
    "    if it == 5:\n"
    "        if rank == 0:\n"
    "            print(f'saving checkpoint at iteration {it:7d} to /ckpt in torch_dist format', flush=True)\n"
    "        time.sleep(0.3)\n"
    "        if rank == 0:\n"
    "            print(f'  successfully saved checkpoint from iteration {it:7d} to /ckpt [ t 1/1, p 1/1 ]',"
    " flush=True)\n"
    "time.sleep(1.0)\n"
)]


def test_megatrons_rank_0_is_not_hung_by_the_silence_after_its_checkpoint_lines(
        etcd_server: EtcdServer, store: Store, tmp_path: Path) -> None:
    """A checkpoint line armed the warm-up silence bound (warmup_hang_s, here 1 s for 1800 s) of every
    rank of rank 0's node; rank 0 never prints progress, so it was reported hung that long after every
    save (the reviewer's repro 3)."""
    a = Agent(dataclasses.replace(settings(etcd_server, "a0", tmp_path), warmup_iterations=1, warmup_hang_s=1.0))
    th = threading.Thread(target=a.run, daemon=True)
    th.start()
    try:
        assert a.ready.wait(30)
        assign(store, "a0", task("split", MEGATRON_SPLIT, [0, 1], 2, store_node="a0"))

        def phases() -> dict[int, str | None] | None:
            st = status(store, "a0")
            got = {r.rank: r.phase for r in st.ranks if r.task == "split"} if st else {}
            return got if len(got) == 2 else None

        # None before the first checkpoint line: train only once the save ended
        wait_for(lambda: phases() == {0: protocol.PHASE_TRAIN, 1: protocol.PHASE_TRAIN} or None, 30,
                 "the save's end shown for both ranks")
        time.sleep(2.5)  # > warmup_hang_s after the save; the ranks run 3.5 s more
        hangs = [r for r in reports(store) if r.kind is ErrorKind.TASK_HANG and r.rank == 0]
        assert not hangs, [r.message for r in hangs]
    finally:
        a.stop()
        th.join(30)
