"""A full shared-memory root gives up idle, unheld rank directories (jobs that ended or moved away)."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt.api import CheckpointError
from ckpt.local import LocalStore, evict_idle
from ckpt.manager import CheckpointConfig
from tests.conftest import mounted_tmpfs
from unicron.kernel.errors import ConfigError

MiB = 1 << 20


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs: a real ENOSPC from posix_fallocate, as a full /dev/shm gives."""
    with mounted_tmpfs(tmp_path / "shm", "8m") as root:
        yield root


def _leave_snapshot(root: Path, job: str, rank: int, nbytes: int, age_s: float) -> Path:
    """A rank directory as a writer that exited ``age_s`` ago leaves it: a slot written, no lock held."""
    d = root / job / f"rank-{rank:05d}"
    store = LocalStore(d)
    store.lock()
    store.prepare(0, nbytes)[:] = 7
    store.close()
    then = time.time() - age_s
    for f in [*d.iterdir(), d]:
        os.utime(f, (then, then))
    return d


def _writer(root: Path, job: str) -> LocalStore:
    store = LocalStore(root / job / "rank-00000", shared_root=root, idle_s=3600)
    store.lock()
    return store


def test_a_full_root_takes_the_space_of_an_idle_unheld_rank(small_tmpfs: Path) -> None:
    old = _leave_snapshot(small_tmpfs, "finished", 0, 5 * MiB, age_s=7200)
    store = _writer(small_tmpfs, "running")
    store.prepare(0, 5 * MiB)[:] = 1  # 10 MiB asked of 8: fits only once the finished job's went
    assert not old.exists()
    store.close()


def test_the_least_recently_written_goes_first_and_no_more_than_needed(small_tmpfs: Path) -> None:
    older = _leave_snapshot(small_tmpfs, "a", 0, 3 * MiB, age_s=9000)
    newer = _leave_snapshot(small_tmpfs, "b", 0, 3 * MiB, age_s=7200)
    store = _writer(small_tmpfs, "running")
    store.prepare(0, 3 * MiB)
    assert not older.exists() and newer.exists()
    store.close()


@pytest.mark.parametrize("why", ["held", "recent"])
def test_a_held_or_recent_rank_keeps_its_snapshot_and_the_writer_is_told(small_tmpfs: Path, why: str) -> None:
    kept = _leave_snapshot(small_tmpfs, "other", 0, 5 * MiB, age_s=7200 if why == "held" else 60)
    holder = LocalStore(kept)
    if why == "held":
        holder.lock()  # a live process (a restarted rank of that job) holds it
    store = _writer(small_tmpfs, "running")
    with pytest.raises(CheckpointError, match=r"no room for a .*enlarge /dev/shm"):
        store.prepare(0, 5 * MiB)
    assert (kept / "slot-0.data").stat().st_size == 5 * MiB
    holder.close()
    store.close()


def test_without_a_shared_root_nothing_else_is_touched(small_tmpfs: Path) -> None:
    kept = _leave_snapshot(small_tmpfs, "other", 0, 5 * MiB, age_s=7200)
    store = LocalStore(small_tmpfs / "mine" / "rank-00000")  # a directory the user chose
    store.lock()
    with pytest.raises(CheckpointError, match="no room"):
        store.prepare(0, 5 * MiB)
    assert kept.exists()
    store.close()


def test_a_writer_waiting_on_a_directory_being_evicted_starts_a_new_one(tmp_path: Path) -> None:
    d = tmp_path / "job" / "rank-00000"
    d.mkdir(parents=True)
    evictor = os.open(d / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(evictor, fcntl.LOCK_EX)  # what evict_idle holds while it removes the directory
    store = LocalStore(d)
    waiter = threading.Thread(target=store.lock, kwargs={"wait_s": 10.0})
    waiter.start()
    time.sleep(0.2)
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    os.close(evictor)
    waiter.join(10)
    assert not waiter.is_alive()
    # it holds the lock of the directory that exists now, so a second writer is refused there
    assert (d / "LOCK").exists()
    with pytest.raises(CheckpointError, match="in use by another process"):
        LocalStore(d).lock(wait_s=0.1)
    store.prepare(0, 1024)
    store.close()


def test_a_directory_written_after_it_was_listed_is_not_evicted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Idleness was judged when listing only: a rank whose process came back, wrote a snapshot and
    exited (a crash; its restart is about to restore it) before the eviction took its lock lost it."""
    other = _leave_snapshot(tmp_path, "other", 0, MiB, age_s=7200)
    real = fcntl.flock

    def comes_back_first(fd: int, op: int) -> None:
        if not (other / "slot-fresh").exists():
            (other / "slot-fresh").write_bytes(b"new")  # written now, its writer gone again
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", comes_back_first)
    assert evict_idle(tmp_path, tmp_path / "running" / "rank-00000", MiB, idle_s=3600) == 0
    assert (other / "slot-fresh").exists()


def test_a_negative_idle_time_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="local_idle_s"):
        CheckpointConfig(job="j", rank=0, local_idle_s=-1.0).validate()
