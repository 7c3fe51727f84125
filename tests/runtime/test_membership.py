"""Epoch agreement through the real task store: the sidecar, failure marks, heartbeats, and a regroup
of ranks (threads here, each with its own store connection and gloo groups) after one is marked dead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.runtime.threads import run_ranks
from unicron.cluster.launch import base_env
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.net import free_port
from unicron.runtime import heartbeat
from unicron.runtime import store as keys
from unicron.runtime.comm import PrefixStore
from unicron.runtime.epoch import EpochRecord
from unicron.runtime.heartbeat import STOP_KEY, Heartbeat, StalenessJudge
from unicron.runtime.membership import (
    BASE_KEY,
    CommSettings,
    Groups,
    Membership,
    RegroupFailed,
    asking_to_join,
    await_seeded,
    failed_key,
    mark_failed,
    mark_request,
    raise_counter,
    reseed,
)
from unicron.runtime.plan import Topology


@pytest.fixture(scope="module")
def sidecar() -> Iterator[tuple[str, int]]:
    """``python -m unicron.runtime.store`` as the agent runs it (one per module: tests use disjoint keys)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "unicron.runtime.store", "--host", "127.0.0.1", "--port", str(port)],
        env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        assert proc.stdout is not None
        assert b"listening" in proc.stdout.readline()
        yield "127.0.0.1", port
    finally:
        proc.terminate()
        proc.wait(10)


def used(groups: Groups) -> Groups:
    """``groups`` after one allreduce over all members, as training does before anything else.

    A rank that dropped groups it had just built, while a slower peer was still connecting, closed that
    peer's half-made gloo mesh ("Connection closed by peer"): under load the peer then moved on to an
    epoch the others, already returned, never entered. A collective completes only once every member
    has connected."""
    ones = torch.ones(1)
    groups.world.allreduce([ones]).wait()
    assert ones.item() == len(groups.record.members)
    return groups


def test_sidecar_serves_clients_and_mark_failed_counts(sidecar: tuple[str, int]) -> None:
    host, port = sidecar
    client = keys.connect(host, port)
    assert keys.counter(client, failed_key(3)) == 0
    assert mark_failed(host, port, 3) == 0  # no process of rank 3 counted itself in: none died
    client.add(keys.started_key(3), 1)
    assert mark_failed(host, port, 3) == 1
    assert mark_failed(host, port, 3, store=client) == 1  # the same process, marked twice
    client.add(keys.started_key(3), 1)
    assert mark_failed(host, port, 3, store=client) == 2
    assert keys.counter(client, failed_key(3)) == 2


class _PauseAfterFailedRead:
    """A store client that, right after its first read of ``failed/<rank>`` (``add(key, 0)``), waits
    until the other marker read it too: two markers of one death at once (the rank's own agent and an
    in-place shrink's marker of a lost node's ranks)."""

    def __init__(self, store: PrefixStore, both_read: threading.Barrier) -> None:
        self._store = store
        self._both_read: threading.Barrier | None = both_read

    def add(self, key: str, value: int) -> int:
        out = int(self._store.add(key, value))
        if key.startswith("failed/") and value == 0 and self._both_read is not None:
            self._both_read.wait(5)
            self._both_read = None
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_two_marks_of_one_death_at_once_count_it_once(sidecar: tuple[str, int]) -> None:
    """Both markers read failed=0 < started=1 and both added 1: failed=2, and the rank's next process
    (incarnation 2) was dead on arrival for every survivor. ``failed`` is raised to ``started`` now."""
    host, port = sidecar
    ns = "mark-race/"
    client = PrefixStore(ns, keys.connect(host, port))
    client.add(keys.started_key(1), 1)  # incarnation 1 of rank 1 counted itself in, then died
    both_read = threading.Barrier(2)

    def marker(_: int) -> int:
        s = _PauseAfterFailedRead(PrefixStore(ns, keys.connect(host, port)), both_read)
        return mark_failed(host, port, 1, store=s)  # type: ignore[arg-type]

    assert run_ranks(2, marker, timeout_s=20) == [1, 1]
    assert keys.counter(client, failed_key(1)) == 1


def test_marker_process_marks_failed_and_survives_bad_requests(sidecar: tuple[str, int]) -> None:
    """``python -m unicron.runtime.membership --marker`` as the agent runs it: JSON lines in, answers out."""
    host, port = sidecar
    proc = subprocess.Popen(
        [sys.executable, "-m", "unicron.runtime.membership", "--marker"], env=base_env(), text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert json.loads(proc.stdout.readline()) == {"ready": True}

        def ask(line: str) -> dict[str, Any]:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            answer: dict[str, Any] = json.loads(proc.stdout.readline())
            return answer

        assert ask("not json")["ok"] is False
        assert ask(json.dumps({"host": host, "port": port}))["ok"] is False  # no rank
        client = keys.connect(host, port)
        for incarnation in (1, 2):
            client.add(keys.started_key(11), 1)
            assert ask(json.dumps({"host": host, "port": port, "rank": 11})) == {
                "ok": True, "rank": 11, "failures": incarnation}
        assert keys.counter(client, failed_key(11)) == 2
    finally:
        proc.stdin.close()
        assert proc.wait(30) == 0


def test_the_failure_marker_answers_a_request_with_a_non_finite_number() -> None:
    """JSON's ``Infinity`` in ``port`` or ``rank`` raised OverflowError out of ``int()`` and ended the
    agent's marker process (every later mark was lost); it is answered as a bad request now."""
    for line in ('{"host": "127.0.0.1", "port": 1, "rank": Infinity}',
                 '{"host": "127.0.0.1", "port": 1e999, "rank": 1}'):
        answer = mark_request(line, {})
        assert answer["ok"] is False and "bad request" in answer["error"]


def test_sidecar_rejects_a_bad_port_with_a_message() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "unicron.runtime.store", "--port", "70000"], env=base_env(),
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2 and "out of range" in out.stderr


def test_epoch_record_round_trip_and_garbage() -> None:
    rec = EpochRecord(3, (0, 1), {0: 1, 1: 2}, "failure")
    assert EpochRecord.decode(rec.encode()) == rec
    with pytest.raises(InvalidRecord):
        EpochRecord.decode(b'{"epoch": "x"}')


def test_heartbeat_process_beats_watches_and_goes_stale_when_stopped(sidecar: tuple[str, int]) -> None:
    host, port = sidecar
    client = keys.connect(host, port)
    beat = Heartbeat(host, port, rank=5, interval_s=0.02, world=8).start()
    try:
        judge = StalenessJudge(client, window_s=0.3)
        time.sleep(0.3)
        assert keys.counter(client, keys.hb_key(5)) > 0
        assert not judge.stale([5]) and not judge.stale([5])
        beat.outside = (6,)
        client.set(keys.join_key(6), "1")
        client.set(STOP_KEY, "1")
        deadline = time.monotonic() + 5
        while not (beat.join_seen and beat.stop_seen) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert beat.join_seen and beat.stop_seen
        beat.paused = True
        time.sleep(0.1)
        judge.stale([5])
        time.sleep(0.5)
        assert judge.stale([5]) == {5}
    finally:
        beat.stop()
    assert judge.stale([7]) == set()  # never beat: not judged (only marks cover it)


def test_survivors_agree_on_one_membership_after_a_marked_failure(sidecar: tuple[str, int]) -> None:
    host, port = sidecar
    topo = Topology(world_size=3, tp=1)
    settings = CommSettings(collective_timeout_s=20, regroup_timeout_s=30, heartbeat_window_s=5)
    results: dict[tuple[int, str], Any] = {}
    started = threading.Barrier(3)

    def rank(r: int) -> None:
        m = Membership(keys.connect(host, port), r, topo, incarnation=1, settings=settings)
        groups = m.start()
        results[(r, "start")] = list(groups.record.members)
        started.wait()
        if r == 2:
            client = keys.connect(host, port)
            client.add(keys.started_key(2), 1)  # what api.build does: incarnation 1 counted itself in
            mark_failed(host, port, 2, store=client)  # what the agent does when the process exits
            return
        groups.release()
        after = used(m.regroup(groups.record, "failure"))
        results[(r, "after")] = (after.record.epoch, list(after.record.members), after.dp.size())

    run_ranks(3, rank)
    assert all(results[(r, "start")] == [0, 1, 2] for r in range(3))
    assert results[(0, "after")] == results[(1, "after")] == (1, [0, 1], 2)


def test_a_member_that_never_arrives_is_named_when_the_epoch_gives_up(sidecar: tuple[str, int]) -> None:
    m = Membership(PrefixStore("absent-test/", keys.connect(*sidecar)), 0, Topology(world_size=2, tp=1),
                   incarnation=1, settings=CommSettings(regroup_timeout_s=1))
    with pytest.raises(RegroupFailed, match=r"rank 0: members \[1\] of epoch 0 did not arrive within 1s"):
        m.start()


def test_latest_finds_the_newest_epoch_in_few_reads(sidecar: tuple[str, int]) -> None:
    """A joiner knows no epoch (``latest(-1)``): after a long run it must not read every epoch from 0."""
    host, port = sidecar
    store = PrefixStore("latest-test/", keys.connect(host, port))
    reads: list[str] = []

    class Counting:
        def check(self, k: list[str]) -> bool:
            reads.extend(k)
            return bool(store.check(k))

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

    m = Membership(Counting(), 0, Topology(world_size=2, tp=1), incarnation=1,  # type: ignore[arg-type]
                   settings=CommSettings())
    assert m.latest(-1) is None
    newest = -1
    for n in (0, 1, 2, 6, 37, 300):
        for e in range(newest + 1, n + 1):
            store.set(f"epoch/{e}", EpochRecord(e, (0, 1), {0: 1, 1: 1}, "test").encode())
        newest = n
        for after in {-1, 0, n // 2, n - 1}:
            if after >= n:
                continue
            reads.clear()
            rec = m.latest(after)
            assert rec is not None and rec.epoch == n, (n, after)
            assert len(reads) <= 2 * (n - after).bit_length() + 2, (n, after, len(reads))
        assert m.latest(n) is None


def test_survivors_reseed_a_moved_store_and_a_later_joiner_counts_itself_past_them(sidecar: tuple[str, int]) -> None:
    """The store's node is lost (rank 2 with it): the survivors re-seed a fresh store, agree the next
    epoch there without rank 2, and rank 2 re-hosted later gets incarnation 2 and is admitted."""
    host, port = sidecar
    port_b = free_port()
    server_b = keys.serve_store("127.0.0.1", port_b)  # the new store node's sidecar: empty
    topo = Topology(world_size=3, tp=1)
    settings = CommSettings(collective_timeout_s=20, regroup_timeout_s=30, heartbeat_window_s=5)
    results: dict[Any, Any] = {}
    started, shrunk = threading.Barrier(3), threading.Event()

    def moved() -> PrefixStore:
        return PrefixStore("moved-test/", keys.connect("127.0.0.1", port_b))

    def survivor(r: int) -> None:
        m = Membership(PrefixStore("moved-test/", keys.connect(host, port)), r, topo, incarnation=1,
                       settings=settings)
        groups = m.start()
        started.wait()
        if r == 2:
            return  # lost with the store's node: only the survivors' re-seed says it is dead
        groups.release()
        new = moved()
        reseed(new, r, 1, [groups.record], lost=[2], leaving=False)
        m.use(new)
        after = used(m.regroup(groups.record, "failure"))
        results[r] = (after.record.epoch, list(after.record.members))
        after.release()
        shrunk.set()
        deadline = time.monotonic() + 30
        while not m.joiners(after.record.members) and time.monotonic() < deadline:
            time.sleep(0.02)
        grown = used(m.regroup(after.record, "admission", assume_same=True, admit=True))
        results[(r, "grown")] = (grown.record.epoch, list(grown.record.members))

    def joiner() -> None:
        assert shrunk.wait(30)
        new = moved()
        assert await_seeded(new, 30)
        incarnation = int(new.add(keys.started_key(2), 1))
        results["incarnation"] = incarnation
        joined = Membership(new, 2, topo, incarnation, settings).join(30)
        assert joined is not None
        groups = used(joined)
        results[(2, "grown")] = (groups.record.epoch, list(groups.record.members))

    try:
        run_ranks(4, lambda i: survivor(i) if i < 3 else joiner())
        assert results[0] == results[1] == (1, [0, 1])
        assert results["incarnation"] == 2  # counted past its first process, which the old store knew
        assert results[(0, "grown")] == results[(1, "grown")] == results[(2, "grown")] == (2, [0, 1, 2])
        assert moved().get(BASE_KEY) == b"0"
    finally:
        del server_b


def test_a_restart_whose_mark_was_lost_with_the_store_is_taken_for_dead(sidecar: tuple[str, int]) -> None:
    """Rank 1's process died (marked ``failed/1`` = 1 on the old store) and was relaunched as
    incarnation 2 just before the store's node was lost. On the moved store the mark is gone and rank 1
    is not in ``lost``: the survivor waited at the barrier for incarnation 1 until RegroupFailed.
    ``started/1`` = 2 past the record's incarnation is a death too now."""
    new = PrefixStore("moved-restart/", keys.connect(*sidecar))
    settings = CommSettings(collective_timeout_s=5, regroup_timeout_s=3, heartbeat_window_s=0.3, poll_s=0.005)
    rec = EpochRecord(3, (0, 1), {0: 1, 1: 1}, "failure")
    reseed(new, 0, 1, [rec], lost=[], leaving=False)  # the survivor, rank 0
    reseed(new, 1, 2, [], lost=[], leaving=False)  # rank 1's relaunched process (it holds no epoch)
    m = Membership(new, 0, Topology(world_size=2, tp=1), incarnation=1, settings=settings)
    t0 = time.monotonic()
    groups = m.regroup(rec, "failure", assume_same=True)  # as after a StoreMoved
    assert list(groups.record.members) == [0], groups.record
    assert time.monotonic() - t0 < 2.0


def test_raise_counter_never_lowers(sidecar: tuple[str, int]) -> None:
    store = PrefixStore("raise-test/", keys.connect(*sidecar))
    raise_counter(store, "c", 3)
    raise_counter(store, "c", 2)
    assert keys.counter(store, "c") == 3
    run_ranks(4, lambda i: raise_counter(store, "c", 5 + i))
    assert keys.counter(store, "c") == 8


def test_heartbeat_beats_on_a_moved_store(sidecar: tuple[str, int]) -> None:
    host, port = sidecar
    port_b = free_port()
    server_b = keys.serve_store("127.0.0.1", port_b)
    beat = Heartbeat(host, port, rank=11, interval_s=0.02, world=16).start()
    try:
        moved = keys.connect("127.0.0.1", port_b)
        beat.move("127.0.0.1", port_b)
        deadline = time.monotonic() + 10
        while keys.counter(moved, keys.hb_key(11)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert keys.counter(moved, keys.hb_key(11)) >= 3
    finally:
        beat.stop()
        del server_b


class _GoneStore:
    """The old store's connection once its node is lost: every call fails at once."""

    def __getattr__(self, name: str) -> Any:
        def fail(*_: Any, **__: Any) -> Any:
            raise RuntimeError("Connection reset by peer")
        return fail


@pytest.fixture()
def gone_store_port(monkeypatch: pytest.MonkeyPatch) -> int:
    """A port whose store is lost (a connection to it fails every call), patched before the beater
    forks; the beater's sleeps are cut to 5 ms, so more than a minute of beats at 0.5 s pass in 0.3 s."""
    real_sleep, real_connect = time.sleep, keys.connect
    port = free_port()
    monkeypatch.setattr(heartbeat, "time", types.SimpleNamespace(
        sleep=lambda s: real_sleep(min(s, 0.005)), monotonic=time.monotonic, time=time.time))

    def connect(host: str, at: int, timeout_s: float = keys.DEFAULT_TIMEOUT_S) -> Any:
        return _GoneStore() if at == port else real_connect(host, at, timeout_s)

    monkeypatch.setattr(keys, "connect", connect)  # the module heartbeat connects through
    return port


def test_the_heartbeat_beats_on_a_moved_store_after_a_long_outage(gone_store_port: int) -> None:
    """A rank waits up to its regroup timeout (90 s) for the agent's StoreMoved. The beater gave up for
    good after 30 s of failed beats and never read the move: the rank had no heartbeat, and nobody saw
    join requests or the stop key for it. It keeps trying until the move now (it dies with its rank)."""
    port_b = free_port()
    server_b = keys.serve_store("127.0.0.1", port_b)
    beat = Heartbeat("127.0.0.1", gone_store_port, rank=3, interval_s=0.5, world=8).start()
    beat.outside = (5,)
    pid = beat._pid

    def exited() -> bool:
        return os.waitpid(pid, os.WNOHANG) != (0, 0)

    try:
        time.sleep(2.0)  # "over 2 minutes" of failed beats
        assert not exited(), "the beater gave up"
        beat.move("127.0.0.1", port_b)
        moved = keys.connect("127.0.0.1", port_b)
        moved.set(keys.join_key(5), "2")  # a joiner asks to be admitted on the moved store
        deadline = time.monotonic() + 10
        while not (keys.counter(moved, keys.hb_key(3)) >= 3 and beat.join_seen) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert keys.counter(moved, keys.hb_key(3)) >= 3 and beat.join_seen
    finally:
        beat.stop()
        del server_b


def test_a_process_waiting_to_join_stops_waiting_once_it_is_asked_to_leave(sidecar: tuple[str, int]) -> None:
    """A drain's leaver whose store moved regrouped on the new store after the others had agreed an
    epoch without it: excluded before it read the agent's Leave, it waited to be admitted (alone, no
    complete replica: never) until the agent's leave timeout killed it 60 s later (a fresh clone's TP=2
    in-place test took 120 s). The Leave read while it waits (the poll) now ends the wait."""
    store = PrefixStore("join-leave-test/", keys.connect(*sidecar))
    store.set("epoch/0", EpochRecord(0, (0,), {0: 1, 1: 1}, "start").encode())
    polls: list[float] = []
    m: Membership

    def poll() -> None:  # the scheduler's: the third poll reads a Leave, which writes leave/<rank>
        polls.append(time.monotonic())
        if len(polls) == 3:
            m.leave()

    m = Membership(store, 1, Topology(world_size=2, tp=1), incarnation=1, settings=CommSettings(), poll=poll)
    t0 = time.monotonic()
    assert m.join(timeout_s=30.0) is None
    assert len(polls) == 3 and time.monotonic() - t0 < 5.0
    # a leave key of an earlier incarnation is not this process's: it waits (here until its timeout)
    again = Membership(store, 1, Topology(world_size=2, tp=1), incarnation=2,
                       settings=CommSettings(poll_s=0.01), poll=lambda: None)
    with pytest.raises(RegroupFailed, match="not admitted"):
        again.join(timeout_s=0.5)


def test_a_joiner_is_admitted_after_a_moved_store_was_seeded_with_epochs_that_have_a_gap() -> None:
    """A survivor remembers the epochs it formed: epoch 4 was abandoned at its barrier (a second death),
    so it holds 3, 5, 6, 7. Seeded with all four, the moved store's gap left the relaunched rank looking
    at epoch 3 for ever (the newest is found over contiguous epochs): it was never admitted, and the
    survivor's admission timed out. Only the run from the last gap is seeded now."""
    port = free_port()
    server = keys.serve_store("127.0.0.1", port)
    topo = Topology(world_size=2, tp=1)
    settings = CommSettings(collective_timeout_s=10, regroup_timeout_s=8, heartbeat_window_s=2)
    both = {0: 1, 1: 1}
    # Rank 0's remembered epochs (Trainer._epochs, the last 4 it was in): epoch 4 was proposed and
    # abandoned at its barrier (a second death), so nobody holds its record.
    held = [EpochRecord(e, (0, 1), both, "failure") for e in (3, 5, 6, 7)]
    results: dict[Any, Any] = {}

    def survivor() -> None:
        new = keys.connect("127.0.0.1", port)
        reseed(new, 0, 1, held, lost=[1], leaving=False)  # rank 1 was lost with the store's node
        m = Membership(new, 0, topo, incarnation=1, settings=settings)
        after = m.regroup(held[-1], "failure")
        results["shrunk"] = list(after.record.members)
        deadline = time.monotonic() + 10
        while not m.joiners(after.record.members) and time.monotonic() < deadline:
            time.sleep(0.02)
        try:
            # used: dropping the groups at once closed the joiner's half-made gloo mesh under load
            grown = used(m.regroup(after.record, "admission", assume_same=True, admit=True))
            results[0] = (grown.record.epoch, list(grown.record.members))
        except Exception as exc:
            results[0] = repr(exc)

    def joiner() -> None:
        new = keys.connect("127.0.0.1", port)
        assert await_seeded(new, 10)
        inc = int(new.add(keys.started_key(1), 1))
        try:
            g = Membership(new, 1, topo, inc, settings).join(10)
            results[1] = (g.record.epoch, list(used(g).record.members)) if g is not None else None
        except Exception as exc:
            results[1] = repr(exc)

    try:
        run_ranks(2, lambda i: survivor() if i == 0 else joiner(), timeout_s=60)
    finally:
        del server
    assert results["shrunk"] == [0]
    assert results[0] == results[1] == (9, [0, 1]), results


def test_an_excluded_rank_that_reseeds_a_moved_store_first_is_admitted_to_the_newest_epoch(
    sidecar: tuple[str, int],
) -> None:
    """Rank 1 was excluded at epoch 4 and waits to join, holding the records of epochs 0-3; rank 0 went
    on alone and holds 8-11. The store's node is lost; rank 1 re-seeds the moved store first (base 0,
    epochs 0-3) and finds epoch 3, where it is a member, and waits at its barrier; then rank 0 re-seeds
    8-11. The first ``epoch/base`` stayed (first writer won), so rank 1 waited at epoch 3's barrier
    and rank 0's admission epoch waited for rank 1: both ended in RegroupFailed. The base is the
    newest of the re-seeders' now, and a joiner at an epoch below it moves on to the newest."""
    host, port = sidecar
    ns = "excluded-reseed/"
    topo = Topology(world_size=2, tp=1)
    settings = CommSettings(collective_timeout_s=5, regroup_timeout_s=3, heartbeat_window_s=0.5)
    old = [EpochRecord(e, (0, 1), {0: 1, 1: 1}, "start" if e == 0 else "failure") for e in range(4)]
    recent = [EpochRecord(e, (0,), {0: 1}, "failure") for e in range(8, 12)]
    results: dict[Any, Any] = {}

    def survivor() -> None:
        new = PrefixStore(ns, keys.connect(host, port))
        deadline = time.monotonic() + 5
        while not new.check(["epoch/3/ready/1"]) and time.monotonic() < deadline:
            time.sleep(0.01)  # until rank 1 waits at epoch 3's barrier
        reseed(new, 0, 1, recent, lost=[], leaving=False)
        m = Membership(new, 0, topo, incarnation=1, settings=settings)
        while not m.joiners(recent[-1].members) and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            g = used(m.regroup(recent[-1], "admission", assume_same=True, admit=True))
            results[0] = (g.record.epoch, list(g.record.members))
        except RegroupFailed as exc:
            results[0] = repr(exc)

    def joiner() -> None:
        new = PrefixStore(ns, keys.connect(host, port))
        reseed(new, 1, 1, old, lost=[], leaving=False)
        try:
            g = Membership(new, 1, topo, incarnation=1, settings=settings).join(timeout_s=5)
            results[1] = (g.record.epoch, list(used(g).record.members)) if g is not None else None
        except RegroupFailed as exc:
            results[1] = repr(exc)

    run_ranks(2, lambda i: survivor() if i == 0 else joiner(), timeout_s=30)
    assert results[0] == results[1] == (12, [0, 1]), results
    assert PrefixStore(ns, keys.connect(host, port)).get(BASE_KEY) == b"8"


def test_a_join_key_a_dead_or_departed_joiner_left_asks_nothing(sidecar: tuple[str, int]) -> None:
    """``join/<rank>`` is never deleted: a rank that joined and later died for good (or left) kept the
    heartbeat's ``join_seen`` set, and every survivor checked the store for joiners at every iteration
    boundary for the rest of the job (~5 round trips per outside rank). The beater now tells such a key
    from a live request, off the iteration path."""
    host, port = sidecar
    client = PrefixStore("asking/", keys.connect(host, port))
    client.add(keys.started_key(2), 2)
    client.set(keys.join_key(2), "2")
    assert asking_to_join(client, 2) == 2  # its newest process asks
    client.add(failed_key(2), 2)
    assert asking_to_join(client, 2) is None  # it died since
    client.add(keys.started_key(2), 1)
    client.set(keys.join_key(2), "3")
    assert asking_to_join(client, 2) == 3  # its restart asks again
    client.set(keys.leave_key(2), "3")
    assert asking_to_join(client, 2) is None  # asked to leave: nobody admits it
    assert asking_to_join(client, 4) is None  # never asked
    beat = Heartbeat(host, port, rank=7, interval_s=0.02, world=8, asking=asking_to_join)
    beat.outside = (2, 4)
    beat._watch(client)
    assert not beat.join_seen
    client.set(keys.join_key(4), "1")
    client.add(keys.started_key(4), 1)
    beat._watch(client)
    assert beat.join_seen
