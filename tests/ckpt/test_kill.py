"""Real processes killed with SIGKILL mid-snapshot and mid-persistence: the previous state must survive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt.api import Snapshot, Tier
from ckpt.codec import decode
from ckpt.manager import CheckpointConfig, CheckpointManager, SaveTicket
from ckpt.persist import iterations as persisted_iterations
from ckpt.persist import load as load_persisted
from ckpt.replica import ReplicaClient
from ckpt.storage import FilesystemStorage
from tests.ckpt.helpers import assert_same, filled_state

Make = Callable[..., CheckpointConfig]
ROOT = Path(__file__).resolve().parents[2]


#: the start of a child that persists to a slow remote store (each shard takes a while to land)
SLOW_STORAGE_CHILD = """
        import sys, time
        from ckpt.manager import CheckpointConfig, CheckpointManager
        from ckpt.storage import FilesystemStorage
        from tests.ckpt.helpers import filled_state

        class SlowStorage(FilesystemStorage):
            def write(self, key, data, progress=None):
                if "/shard-" in key:
                    time.sleep(0.2)
                super().write(key, data, progress)
"""


def _spawn(code: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def _wait_line(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"child exited ({proc.wait()}) before printing {prefix!r}")


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL


def test_kill_mid_write_leaves_previous_snapshot(make_config: Make) -> None:
    cfg = make_config()
    child = _spawn(
        """
        import sys, time
        from ckpt.local import LocalStore
        from ckpt.manager import CheckpointConfig, CheckpointManager
        from tests.ckpt.helpers import filled_state
        cfg = CheckpointConfig(job="job-1", rank=0, local_dir=sys.argv[1], chunk_bytes=4096)
        with CheckpointManager(cfg) as m:
            m.save(filled_state(1), 1)
        # the second snapshot, as save() writes it: withdraw a free slot, copy into it ... and die there
        store = LocalStore(cfg.local_root()); store.lock()
        slot = next(k for k in range(2) if k not in store.published())
        data = store.prepare(slot, 1 << 16)
        data[: 1 << 15].fill_(0xAB)
        print("mid-write", slot, flush=True)
        time.sleep(60)
        """,
        cfg.local_dir,
    )
    slot = int(_wait_line(child, "mid-write").split()[1])
    _kill(child)
    assert (Path(cfg.local_dir) / f"slot-{slot}.data").read_bytes()[:4] == b"\xab" * 4  # it did die mid-write
    with CheckpointManager(cfg) as m:
        r = m.restore()
    assert (r.tier, r.iteration, r.skipped) == (Tier.LOCAL, 1, ())
    assert_same(filled_state(1), r.state)


def test_kill_at_a_random_point_of_a_save_loop(make_config: Make) -> None:
    cfg = make_config(chunk_bytes=1 << 20)
    child = _spawn(
        """
        import sys
        from ckpt.manager import CheckpointConfig, CheckpointManager
        from tests.ckpt.helpers import filled_state
        cfg = CheckpointConfig(job="job-1", rank=0, local_dir=sys.argv[1], chunk_bytes=1 << 20)
        m = CheckpointManager(cfg)
        it = 0
        while True:
            it += 1
            t = m.save(filled_state(it, 8 << 20), it)
            if it > 1:
                print("published", last.iteration if last.result().published else -1, flush=True)
            last = t
        """,
        cfg.local_dir,
    )
    for _ in range(4):
        published = int(_wait_line(child, "published").split()[1])
    time.sleep(0.05)
    _kill(child)
    with CheckpointManager(cfg) as m:
        r = m.restore()
    assert r.tier == Tier.LOCAL and r.iteration >= published
    assert_same(filled_state(r.iteration, 8 << 20), r.state)


def test_kill_during_persistence_keeps_previous_manifest(make_config: Make, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    cfg = make_config(persist_every=1)
    child = _spawn(
        SLOW_STORAGE_CHILD + """

        cfg = CheckpointConfig(job="job-1", rank=0, local_dir=sys.argv[1], chunk_bytes=4096, persist_every=1)
        m = CheckpointManager(cfg, storage=SlowStorage(sys.argv[2]))
        assert m.save(filled_state(1, 5 * 4096), 1).result().persisted
        m.save(filled_state(2, 5 * 4096), 2)
        print("persisting 2", flush=True)
        time.sleep(60)
        """,
        cfg.local_dir,
        str(remote),
    )
    _wait_line(child, "persisting 2")
    iter2 = remote / "job-1" / "rank-00000" / f"iter-{2:012d}"
    deadline = time.monotonic() + 20
    while not (iter2.exists() and any(iter2.glob("*/shard-*.bin"))):
        assert time.monotonic() < deadline, "the child never started persisting iteration 2"
        time.sleep(0.02)
    _kill(child)
    storage = FilesystemStorage(remote)
    assert persisted_iterations(storage, "job-1", 0) == [1]  # iteration 2 has shards but no manifest
    assert_same(filled_state(1, 5 * 4096), _decode(load_persisted(storage, "job-1", 0, 1)))
    fresh = make_config(node="node-b", persist_every=1)  # restore on another node: remote is all there is
    with CheckpointManager(fresh, storage=storage) as m:
        r = m.restore()
        assert (r.tier, r.iteration) == (Tier.REMOTE, 1)
        assert m.save(filled_state(3, 5 * 4096), 3).result(30).persisted
    assert not iter2.exists()  # the orphaned shards of the killed write were cleaned up
    assert persisted_iterations(storage, "job-1", 0) == [1, 3]


def _decode(snap: Snapshot) -> Any:
    return decode(snap.meta, torch.frombuffer(snap.data, dtype=torch.uint8), private=True)


def test_a_frozen_peer_never_stalls_save_and_gets_pushes_again_once_thawed(make_config: Make) -> None:
    """A frozen ring peer (its process SIGSTOPped; a cut-off host's kernel may still accept connections)
    held each push for the client's whole timeout (60 s), and the push held its slot: the next save but
    one waited for it on the training thread. Now a save() that needs the slot abandons the push (a
    missed replica), the peer is skipped for a backoff, and pushes resume once it answers again."""
    server = subprocess.Popen(
        [sys.executable, "-m", "ckpt.replica", "--listen", "127.0.0.1:0", "--budget-bytes", "64M"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        addr = _wait_line(server, "listening on").split()[-1]
        peer = ReplicaClient(addr)  # as the runtime builds it
        cfg = make_config()
        cfg.peer_backoff_s = 0.5
        with CheckpointManager(cfg, peers=[peer]) as m:
            assert m.save(filled_state(1), 1).result(30).replicas == (addr,)
            server.send_signal(signal.SIGSTOP)
            tickets: list[SaveTicket] = []
            saver = threading.Thread(target=lambda: tickets.extend(m.save(filled_state(i), i) for i in range(2, 8)))
            try:
                saver.start()
                saver.join(10)  # generous under load; a stalled save took 60 s
                assert not saver.is_alive(), f"6 saves with a frozen peer still blocked after 10 s ({len(tickets)} done)"
            finally:
                server.send_signal(signal.SIGCONT)  # on a failure too: the stalled pushes end, the manager closes
                saver.join(120)
            outcomes = [t.result(30) for t in tickets]
            assert all(o.published and o.replicas == () and o.errors for o in outcomes), outcomes
            deadline, it = time.monotonic() + 60, 8
            while (out := m.save(filled_state(it), it).result(30)).replicas != (addr,):
                assert time.monotonic() < deadline, f"no push reached the thawed peer: {out.errors}"
                time.sleep(0.1)  # the peer's backoff runs out
                it += 1
        assert max(i.iteration for i in ReplicaClient(addr).list("job-1")) == it
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.parametrize("relaunch_reaches", [2, 3])
def test_a_write_killed_above_the_newest_manifest_is_swept_by_the_next_generation(
        make_config: Make, tmp_path: Path, relaunch_reaches: int) -> None:
    """Generation 1 persisted 1 and is SIGKILLed while persisting 3. Its relaunch (generation 2)
    restores 1 from storage and persists 2 (the write killed is above its newest manifest), or 2 and 3
    (at it): the sweep took only writes below the newest manifest, so the killed one's shards stayed for
    good beside a job that trained no further. A write of the current generation there stays: it may be
    another live writer's."""
    remote = tmp_path / "remote"
    cfg = make_config(generation=1)
    child = _spawn(
        SLOW_STORAGE_CHILD + """

        cfg = CheckpointConfig(job="job-1", rank=0, local_dir=sys.argv[1], chunk_bytes=4096, generation=1)
        m = CheckpointManager(cfg, storage=SlowStorage(sys.argv[2]))
        assert m.save(filled_state(1, 5 * 4096), 1).result().persisted
        assert m.save(filled_state(2, 5 * 4096), 2).result().persisted is None  # persist_every 0
        m.save(filled_state(3, 5 * 4096), 3, persist=True)
        print("persisting 3", flush=True)
        time.sleep(60)
        """,
        cfg.local_dir,
        str(remote),
    )
    _wait_line(child, "persisting 3")
    rank_dir = remote / "job-1" / "rank-00000"
    deadline = time.monotonic() + 20
    while not any(rank_dir.glob(f"iter-{3:012d}/g{1:012d}-*/shard-*.bin")):
        assert time.monotonic() < deadline, "the child never started persisting iteration 3"
        time.sleep(0.02)
    _kill(child)
    storage = FilesystemStorage(remote)
    assert persisted_iterations(storage, "job-1", 0) == [1]  # the killed write is no checkpoint
    live = rank_dir / f"iter-{9:012d}" / f"g{2:012d}-00000000000a"  # generation 2's, maybe in progress
    live.mkdir(parents=True)
    (live / ".shard-00000.bin.tmp-0badf00d").write_bytes(b"z" * 4096)
    relaunch = make_config(node="node-b", generation=2)  # another node: storage is all there is
    with CheckpointManager(relaunch, storage=storage) as m:
        r = m.restore()
        assert (r.iteration, r.tier) == (1, Tier.REMOTE)
        for it in range(2, relaunch_reaches + 1):
            assert m.save(filled_state(it, 5 * 4096), it, persist=True).result(30).persisted
    assert persisted_iterations(storage, "job-1", 0) == [1, 2, 3][:relaunch_reaches][-2:]  # keep_remote 2
    left = sorted(p.relative_to(rank_dir).as_posix() for p in rank_dir.glob("iter-*/*"))
    assert not [w for w in left if f"/g{1:012d}-" in w and w.startswith(f"iter-{3:012d}")], left
    assert live.exists()
    assert load_persisted(storage, "job-1", 0, relaunch_reaches).info.generation == 2
