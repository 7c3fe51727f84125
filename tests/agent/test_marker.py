"""The agent's failure marker (agent.marker) against a real task store sidecar started the agent's way."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import marker, sidecar
from agent.marker import FailureMarker
from agent.prefork import Prefork, PreforkedProcess
from agent.sidecar import StoreSidecar
from unicron.kernel import parentdeath
from unicron.runtime import store as keys
from unicron.runtime.comm import RendezvousStore
from unicron.runtime.membership import failed_key


def wait_counter(client: RendezvousStore, rank: int, least: int) -> int:
    deadline = time.monotonic() + 60.0  # the helper imports torch before it answers
    while keys.counter(client, failed_key(rank)) < least and time.monotonic() < deadline:
        time.sleep(0.05)
    return keys.counter(client, failed_key(rank))


def test_a_mark_counts_each_process_of_the_rank_that_started_and_died() -> None:
    sidecar = StoreSidecar.start("127.0.0.1", "t")
    marker = FailureMarker().start()
    try:
        client = keys.connect(sidecar.host, sidecar.port)
        for incarnation in (1, 2):
            client.add(keys.started_key(2), 1)  # what the rank's process does once it runs
            marker.mark(sidecar.host, sidecar.port, 2)
            assert wait_counter(client, 2, incarnation) == incarnation
        assert keys.counter(client, failed_key(1)) == 0
    finally:
        marker.stop()
        sidecar.stop()


def test_a_mark_raises_failed_to_started_and_never_beyond() -> None:
    """A rank marked twice (an in-place shrink marks a lost node's ranks, whose own agent may have
    marked them first) is one death, and a process that died before it counted itself in (a crash at
    start) is none: either way the rank's next incarnation must not look dead at its start."""
    sidecar = StoreSidecar.start("127.0.0.1", "t")
    marker = FailureMarker().start()
    try:
        client = keys.connect(sidecar.host, sidecar.port)
        client.add(keys.started_key(3), 2)  # incarnation 2 runs
        client.add(failed_key(3), 1)  # incarnation 1 was marked dead long ago
        marker.mark(sidecar.host, sidecar.port, 3)
        marker.mark(sidecar.host, sidecar.port, 3)
        marker.mark(sidecar.host, sidecar.port, 4)  # never started: nothing to mark
        client.add(keys.started_key(5), 1)
        marker.mark(sidecar.host, sidecar.port, 5)  # answered in order: once it is, all are
        assert wait_counter(client, 5, 1) == 1
        assert keys.counter(client, failed_key(3)) == 2
        assert keys.counter(client, failed_key(4)) == 0
    finally:
        marker.stop()
        sidecar.stop()


def test_a_mark_that_waits_returns_once_the_death_is_written() -> None:
    """A rank the agent kills to restart it (a hang) is marked before its successor starts: the mark
    must be in the store when ``mark`` returns, not some time later."""
    sidecar = StoreSidecar.start("127.0.0.1", "t")
    marker = FailureMarker().start()
    try:
        client = keys.connect(sidecar.host, sidecar.port)
        client.add(keys.started_key(1), 1)
        assert marker.mark(sidecar.host, sidecar.port, 1, wait_s=60.0)  # the helper imports torch first
        assert keys.counter(client, failed_key(1)) == 1
    finally:
        marker.stop()
        sidecar.stop()


_FAKE_HELPER = r"""
import json, sys
mode, log = sys.argv[1], sys.argv[2]
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    if mode == "crash":
        sys.exit(1)  # dies (OOM killer, a crash) with the request read and never answered
    with open(log, "a") as f:
        f.write(line)
    print(json.dumps({"ok": True, "rank": json.loads(line)["rank"], "failures": 1}), flush=True)
"""


def test_a_mark_the_dead_helper_never_answered_is_neither_reported_written_nor_lost(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "helper.py"
    script.write_text(_FAKE_HELPER)
    log = tmp_path / "written.log"
    modes = iter(["crash", "serve", "serve"])
    real_popen = subprocess.Popen

    def popen(args, **kw):  # type: ignore[no-untyped-def]
        return real_popen([sys.executable, str(script), next(modes), str(log)], **kw)

    monkeypatch.setattr(subprocess, "Popen", popen)  # the module the marker calls it through
    marker = FailureMarker().start()
    try:
        first = marker._proc
        result: list[bool] = []
        waiter = threading.Thread(target=lambda: result.append(marker.mark("h", 1, 7, wait_s=5.0)))
        waiter.start()
        assert first is not None
        first.wait(5.0)  # the helper died holding rank 7's request
        assert marker.mark("h", 1, 8, wait_s=5.0)  # the next mark starts a new helper
        waiter.join(6.0)
        written = log.read_text() if log.exists() else ""
        assert result == [False] or '"rank": 7' in written, \
            f"mark(rank 7) returned {result} ('answered'), though no helper ever wrote it"
        assert '"rank": 7' in written, f"rank 7's mark was dropped; the new helper got only {written!r}"
    finally:
        marker.stop()


def test_a_helper_restarted_by_a_mark_on_a_short_lived_thread_outlives_that_thread() -> None:
    """The helper died, and the next mark comes from a rank's waiter thread (its exit), which ends
    right after. Before, the mark started the new helper on that thread, and its PDEATHSIG (as the
    agent sets it) killed the helper with the thread: the mark was never written, nor any later one.
    Now every helper is started on the marker's own thread."""
    store = StoreSidecar.start("127.0.0.1", "t")
    failure_marker = FailureMarker(preexec=parentdeath.preexec(signal.SIGKILL)).start()
    try:
        client = keys.connect(store.host, store.port)
        client.add(keys.started_key(2), 1)
        first = failure_marker._proc
        assert first is not None
        first.kill()  # the helper died (OOM, a crash)
        first.wait()
        waiter = threading.Thread(target=lambda: failure_marker.mark(store.host, store.port, 2))
        waiter.start()
        waiter.join()
        assert wait_counter(client, 2, 1) == 1
        second = failure_marker._proc
        assert second is not None and second is not first and second.poll() is None
    finally:
        failure_marker.stop()
        store.stop()


@pytest.fixture
def spawner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Prefork]:
    """A warm spawner preloading the agent's helper modules, as the agent starts it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    p = Prefork([sidecar.MODULE, marker.MODULE], str(tmp_path / "pf")).start().wait_ready(120.0)
    try:
        yield p
    finally:
        p.close()


def test_with_a_warm_spawner_the_store_and_the_marker_are_forked_and_the_marker_before_any_death(
        spawner: Prefork) -> None:
    """Both helpers import torch: started as new processes they cost seconds of CPU each (a store on
    every task start, a marker with every agent). Forked from the spawner they listen and answer at
    once; the marker is forked as soon as the spawner serves, so that no mark waits for its start."""
    store = StoreSidecar.start("127.0.0.1", "t", prefork=spawner)
    failure_marker = FailureMarker(prefork=spawner).start()
    try:
        assert isinstance(store.proc, PreforkedProcess)
        deadline = time.monotonic() + 30.0
        while failure_marker._proc is None and time.monotonic() < deadline:
            time.sleep(0.01)
        forked = failure_marker._proc
        assert isinstance(forked, PreforkedProcess), "no marker forked before the first death"
        client = keys.connect(store.host, store.port)
        client.add(keys.started_key(1), 1)
        assert failure_marker.mark(store.host, store.port, 1, wait_s=30.0)
        assert failure_marker._proc is forked  # the mark used it
        assert keys.counter(client, failed_key(1)) == 1
    finally:
        failure_marker.stop()
        store.stop()
    assert store.proc.poll() is not None


def test_a_marker_started_before_its_spawner_serves_is_forked_once_it_does(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent starts its marker before its spawner (whose imports take seconds)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    late = Prefork([sidecar.MODULE, marker.MODULE], str(tmp_path / "pf"))
    failure_marker = FailureMarker(prefork=late).start()
    try:
        time.sleep(0.3)
        assert failure_marker._proc is None
        late.start().wait_ready(120.0)
        deadline = time.monotonic() + 30.0
        while failure_marker._proc is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(failure_marker._proc, PreforkedProcess)
    finally:
        failure_marker.stop()
        late.close()


def test_a_stopped_marker_forks_nothing_when_its_spawner_comes_up(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    late = Prefork([sidecar.MODULE, marker.MODULE], str(tmp_path / "pf"))
    failure_marker = FailureMarker(prefork=late).start()
    failure_marker.stop()
    try:
        late.start().wait_ready(120.0)
        time.sleep(0.5)  # several of the waiting thread's polls
        assert failure_marker._proc is None
    finally:
        late.close()


def test_a_forked_marker_that_died_with_its_spawner_is_replaced_by_a_new_process(spawner: Prefork) -> None:
    store = StoreSidecar.start("127.0.0.1", "t")  # a new process: it outlives the spawner
    failure_marker = FailureMarker(prefork=spawner).start()
    try:
        client = keys.connect(store.host, store.port)
        client.add(keys.started_key(2), 1)
        assert failure_marker.mark(store.host, store.port, 2, wait_s=30.0)
        forked = failure_marker._proc
        assert isinstance(forked, PreforkedProcess)
        spawner.close()  # its children die with it (PDEATHSIG)
        assert forked.wait(10.0) < 0
        client.add(keys.started_key(2), 1)
        assert failure_marker.mark(store.host, store.port, 2, wait_s=60.0)  # a new process imports torch
        assert isinstance(failure_marker._proc, subprocess.Popen)
        assert keys.counter(client, failed_key(2)) == 2
    finally:
        failure_marker.stop()
        store.stop()
