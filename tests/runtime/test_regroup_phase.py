"""#19 item 2: a rejoin pause is not a hang; #16 item 5: neither is a wait for data. Ranks report the ``regroup`` phase for the time of an
agreed regroup or rejoin (real ranks over the agent socket), and the agent's hang detection does not
judge that time (its IterationMonitor and HangWatcher, with a control pause in the train phase)."""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable

from agent.iterations import Finding, HangWatcher, IterationMonitor, IterationSettings
from tests.runtime.conftest import Runner, train_args, wait_for
from tests.runtime.test_agent_contract import FakeAgentSocket, agent_socket  # noqa: F401 (fixture)
from unicron.cluster.launch import LocalJob
from unicron.kernel import protocol
from unicron.kernel.types import ErrorKind


def _phases_and_regroups(sock: FakeAgentSocket, rank: int, waits: bool = False) -> list[tuple[str, str]]:
    """(kind, detail) of the rank's Hello, Phase and RegroupDone messages, in order; the phases inside
    an iteration (a data phase per micro-batch fetched, a gc phase per full collection while training,
    a collective phase per gradient reduction) and their return to train only with ``waits``."""
    out: list[tuple[str, str]] = []
    in_wait = False
    with sock.lock:
        for r, m in sock.messages:
            if r != rank:
                continue
            wait = isinstance(m, protocol.Phase) and m.name in (protocol.PHASE_DATA, protocol.PHASE_GC,
                                                                protocol.PHASE_COLLECTIVE)
            if not waits and isinstance(m, protocol.Phase) and (wait or in_wait):
                in_wait = wait  # a wait and its return to train
                continue
            if isinstance(m, protocol.Hello):
                out.append(("hello", ""))
            elif isinstance(m, protocol.Phase):
                out.append(("phase", m.name))
            elif isinstance(m, protocol.RegroupDone):
                out.append(("done", m.detail.split(":")[0]))
    return out


def test_survivor_and_joiner_report_the_regroup_phase_around_a_rejoin(
    runner: Runner, agent_socket: FakeAgentSocket,  # noqa: F811 (fixture)
) -> None:
    args = train_args(0, "float32", False, "--iter-sleep", "0.02")
    env = {"UNICRON_AGENT_SOCKET": agent_socket.path}

    def drive(job: LocalJob) -> None:
        def rejoined() -> bool:
            return any(e.incarnations.get(1) == 2 for e in job.epochs())

        wait_for(rejoined, 60, "rank 1 to rejoin")
        wait_for(lambda: len(agent_socket.of(1, protocol.IterEnd)) >= 6, 60, "iterations after the rejoin")
        job.set_key("stop", "1")

    done = runner.run(2, args, faults={1: "die@2:mb1"}, restart={1: 0.3}, while_running=drive,
                      env={0: env, 1: env})
    assert done.codes == {0: 0, 1: 0}, done.job.logs()
    survivor = _phases_and_regroups(agent_socket, 0)
    # Every micro-batch's fetch is a data phase, back to train right after (the rank fetched each
    # micro-batch it computed: at least one per MicrobatchDone).
    with_waits = _phases_and_regroups(agent_socket, 0, waits=True)
    fetches = [i for i, p in enumerate(with_waits) if p == ("phase", "data")]
    assert len(fetches) >= len(agent_socket.of(0, protocol.MicrobatchDone)) > 0
    assert all(with_waits[i + 1] == ("phase", "train") for i in fetches), with_waits
    # The full collection after the model is built (the runtime's GC policy) is a gc phase, back to
    # train right after: the rank client reports each one while training.
    collections = [i for i, p in enumerate(with_waits) if p == ("phase", "gc")]
    assert collections and all(with_waits[i + 1] == ("phase", "train") for i in collections), with_waits
    # Every iteration reduces inside the collective phase (the coordinator's hang culprit reads it),
    # back to train before the iteration ends.
    reductions = [i for i, p in enumerate(with_waits) if p == ("phase", "collective")]
    assert len(reductions) >= len(agent_socket.of(0, protocol.IterEnd)) > 0
    assert all(with_waits[i + 1] == ("phase", "train") for i in reductions), with_waits
    # start; the failure regroup; the admission of the restarted rank: each pause inside the phase.
    assert survivor == [
        ("hello", ""), ("done", "start"),
        ("phase", "regroup"), ("phase", "train"), ("done", "failure"),
        ("phase", "regroup"), ("phase", "train"), ("done", "admission"),
    ], survivor
    joiner = _phases_and_regroups(agent_socket, 1)
    second = len(joiner) - 1 - joiner[::-1].index(("hello", ""))
    assert joiner[second:] == [("hello", ""), ("phase", "regroup"), ("phase", "train"), ("done", "join")], joiner


def _steady(mon: IterationMonitor, n: int, dur: float) -> float:
    t = time.monotonic()
    for step in range(n):
        mon.iter_start(step, t)
        t += dur
        mon.iter_end(step, dur, t)
    return t


def _pause(phase: str) -> list[Finding]:
    """Baseline 20 ms; then an iteration that pauses 0.4 s (20x) in ``phase`` and completes."""
    found: list[Finding] = []
    seen = threading.Event()

    def on_finding(key: Hashable, finding: Finding) -> None:
        found.append(finding)
        seen.set()

    mon = IterationMonitor(IterationSettings(warmup_iterations=1, min_samples=3))
    watcher = HangWatcher(on_finding)
    watcher.add(("t", 0), mon)
    watcher.start()
    try:
        _steady(mon, 6, 0.02)
        mon.iter_start(6, time.monotonic())
        mon.phase(phase, time.monotonic())
        seen.wait(0.4)
        mon.phase(protocol.PHASE_TRAIN, time.monotonic())
        time.sleep(0.03)  # training resumed: well within 3x the baseline of the resumed clock
        mon.iter_end(6, 0.45, time.monotonic())
        time.sleep(0.1)
    finally:
        watcher.stop()
    return [f for f in found if f.kind is ErrorKind.TASK_HANG]


def test_hang_watcher_does_not_judge_a_pause_in_the_regroup_phase() -> None:
    assert _pause(protocol.PHASE_REGROUP) == []
    # Control: the same pause while training is a hang (so the first assertion can fail).
    assert len(_pause(protocol.PHASE_TRAIN)) == 1
