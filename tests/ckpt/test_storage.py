"""Storage backends against the contract, and the persisted layout (manifests, shards, retention)."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt.api import (
    Buffer,
    CheckpointCorrupt,
    Snapshot,
    SnapshotInfo,
    StaleGeneration,
    Storage,
    StorageFull,
    StorageUnavailable,
)
from ckpt.codec import byte_view, chunk_crcs, crc
from ckpt.persist import LAG_WINDOW, apply_retention, iterations, load, manifest_key, persist
from ckpt.storage import FilesystemStorage, MemoryStorage
from tests.ckpt.storage_contract import StorageContract


class TestFilesystemStorage(StorageContract):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path / "store"

    def make_storage(self) -> Storage:
        return FilesystemStorage(self.root)

    def test_no_temporaries_left_and_none_listed(self, storage: Storage) -> None:
        storage.write("a/b", b"x")
        (self.root / "a" / ".b.tmp-deadbeef").write_bytes(b"half")  # what a killed write leaves
        (self.root / "a" / "c").mkdir()
        (self.root / "a" / "c" / ".d.tmp-0badf00d").write_bytes(b"half")  # killed in its directory's first
        assert storage.list("") == ["a/b"]
        assert storage.list_incomplete("") == ["a/b", "a/c/d"] and storage.list_incomplete("a/c") == ["a/c/d"]
        storage.delete("a/c/d")  # nothing beside it: its temporary goes, and its directory
        assert not (self.root / "a" / "c").exists()


class TestMemoryStorage(StorageContract):
    def make_storage(self) -> Storage:
        return MemoryStorage()


def _snap(iteration: int, data_len: int = 10_000, chunk: int = 4096) -> Snapshot:
    data = byte_view(torch.arange(data_len, dtype=torch.int64).to(torch.uint8) + iteration)
    meta = b"meta-%d" % iteration
    info = SnapshotInfo(
        job="job-1",
        rank=2,
        iteration=iteration,
        meta_len=len(meta),
        meta_crc=crc(meta),
        data_len=data_len,
        chunk_bytes=chunk,
        chunk_crcs=chunk_crcs(data, chunk),
        created=time.time(),
    )
    return Snapshot(info, meta, data)


@pytest.fixture(params=["fs", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    return FilesystemStorage(tmp_path / "s") if request.param == "fs" else MemoryStorage()


def test_persist_and_load_roundtrip(storage: Storage) -> None:
    s = _snap(5)
    persist(storage, s, keep=2)
    assert iterations(storage, "job-1", 2) == [5]
    got = load(storage, "job-1", 2, 5)
    assert got.info == s.info and got.meta == s.meta and bytes(got.data) == bytes(s.data)
    assert len(storage.list("job-1/rank-00002/iter-")) == 3 + 1  # 3 shards + metadata


def test_retention_keeps_last_r(storage: Storage) -> None:
    for it in range(1, 6):
        persist(storage, _snap(it), keep=2)
    assert iterations(storage, "job-1", 2) == [4, 5]
    assert {k.split("/")[2] for k in storage.list("job-1/rank-00002/iter-")} == {
        f"iter-{4:012d}",
        f"iter-{5:012d}",
    }
    assert apply_retention(storage, "job-1", 2, keep=1) == [4]


def _of_rank(snap: Snapshot, rank: int) -> Snapshot:
    return Snapshot(dataclasses.replace(snap.info, rank=rank), snap.meta, snap.data)


def test_retention_keeps_the_iteration_every_rank_persisted(storage: Storage) -> None:
    """Rank 3's persists fail from iteration 3 on (its node's path to storage), rank 2's succeed: rank 2
    still keeps 2, the newest both hold (per-rank retention deleted it: storage could restore nothing)."""
    for it in (1, 2):
        persist(storage, _of_rank(_snap(it), 3), keep=2)
    for it in range(1, 6):
        persist(storage, _snap(it), keep=2)
    assert iterations(storage, "job-1", 3) == [1, 2]
    assert iterations(storage, "job-1", 2) == [2, 3, 4, 5]  # from rank 3's newest on: it may persist them
    persist(storage, _of_rank(_snap(4), 3), keep=2)  # back: 4 is common, 2 and 3 go at the next persist
    persist(storage, _snap(6), keep=2)
    assert iterations(storage, "job-1", 2) == [4, 5, 6]
    assert iterations(storage, "job-1", 3) == [2, 4]


def test_retention_waits_for_every_rank_of_the_world(storage: Storage) -> None:
    """With the world size known, a rank whose first persist has not landed yet (a slower rank) keeps the
    others from trimming: its first may be any of their iterations."""
    for it in range(1, 5):
        persist(storage, _snap(it), keep=2, world_size=4)
    assert iterations(storage, "job-1", 2) == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("flip_shard", "checksum mismatch in shard 1"),
        ("truncate_shard", "partial: shard"),
        ("drop_shard", "partial: shard"),
        ("flip_meta", "checksum mismatch in metadata"),
        ("edit_manifest", "checksum mismatch in job-1/rank-00002/manifest"),
        ("garble_manifest", "unreadable"),
        ("nest_manifest", "unreadable"),  # deep enough to exhaust the parser's recursion: no RecursionError
    ],
)
def test_every_damage_is_detected(storage: Storage, damage: str, reason: str) -> None:
    persist(storage, _snap(3), keep=2)
    mkey = manifest_key("job-1", 2, 3)
    body = json.loads(storage.read(mkey))["body"]
    shard, meta = body["shards"][1]["key"], body["meta"]["key"]
    if damage == "flip_shard":
        b = bytearray(storage.read(shard))
        b[100] ^= 1
        storage.write(shard, b)
    elif damage == "truncate_shard":
        storage.write(shard, storage.read(shard)[:-1])
    elif damage == "drop_shard":
        storage.delete(shard)
    elif damage == "flip_meta":
        storage.write(meta, b"meta-4")
    elif damage == "edit_manifest":
        m = json.loads(storage.read(mkey))
        m["body"]["info"]["iteration"] = 4  # a consistent-looking edit still breaks the manifest's CRC
        storage.write(mkey, json.dumps(m).encode())
    elif damage == "nest_manifest":
        storage.write(mkey, b"[" * 100_000)
    else:
        storage.write(mkey, b"{not json")
    with pytest.raises(CheckpointCorrupt, match=reason):
        load(storage, "job-1", 2, 3)


def test_persisting_an_older_iteration_discards_newer_ones(storage: Storage) -> None:
    for it in (5, 6):
        persist(storage, _snap(it), keep=3)
    persist(storage, _snap(3), keep=3)  # the rank rolled back: 5 and 6 must never be restored
    assert iterations(storage, "job-1", 2) == [3]


def _fail_scandir_under(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    real = os.scandir

    def scandir(p: object = ".") -> object:
        if str(p).startswith(str(path)):
            raise OSError(errno.EIO, "Input/output error", str(p))
        return real(p)  # type: ignore[call-overload]

    monkeypatch.setattr(os, "scandir", scandir)


def test_list_reports_an_unreadable_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """os.walk swallows the I/O error: a failing storage lists as empty instead of raising."""
    storage = FilesystemStorage(tmp_path / "s")
    persist(storage, _snap(5), keep=2)
    assert iterations(storage, "job-1", 2) == [5]
    _fail_scandir_under(monkeypatch, tmp_path / "s" / "job-1")
    with pytest.raises(StorageUnavailable):
        storage.list("job-1/rank-00002/manifest-")


def test_a_missing_root_is_unreachable_not_empty(tmp_path: Path) -> None:
    """The root gone (a shared filesystem not mounted, its mount point removed) listed as "holds nothing",
    and the job started afresh; a missing job directory under a present root is still empty."""
    storage = FilesystemStorage(tmp_path / "s")
    assert storage.list("other-job/rank-00000/manifest-") == []
    (tmp_path / "s").rmdir()
    with pytest.raises(StorageUnavailable, match="root is missing"):
        storage.list("job-1/rank-00002/manifest-")


def test_a_failed_write_leaves_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """write() creates .name.tmp-XXXX and never removes it when a write or fsync fails (ENOSPC): list()
    and retention ignore hidden files, so the partial bytes stay on the (full) disk for good."""
    root = tmp_path / "s"
    storage = FilesystemStorage(root)
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.path.isfile(f"/proc/self/fd/{fd}") and ".tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StorageFull):  # a full disk is told apart: the writer may make room
        storage.write("job-1/rank-00000/iter-000000000002/shard-00000.bin", b"x" * 100_000)
    monkeypatch.undo()
    left = [p for p in root.rglob("*") if p.is_file()]
    assert left == [], f"a failed write left {left}"


def test_a_delete_is_durable_before_the_next_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention deletes an iteration's manifest, then its shards. Before, no delete was fsync'd: after
    a crash the manifest could be back while its shards were gone. Each delete now syncs its directory
    (and each emptied directory's parent) before it returns."""
    storage = FilesystemStorage(tmp_path / "s")
    key = "job-1/rank-00000/iter-000000000002/shard-00000.bin"
    storage.write(key, b"x")
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    storage.delete(key)
    monkeypatch.undo()
    iteration = tmp_path / "s" / "job-1" / "rank-00000" / "iter-000000000002"
    assert synced[:2] == [str(iteration), str(iteration.parent)], synced


def test_retention_removes_what_a_killed_write_left(tmp_path: Path) -> None:
    """A writer killed mid-shard leaves iter-N/.shard-K.bin.tmp-XXXX: retention deletes the orphaned
    iteration through list(), which hides temporaries, so that directory and its bytes are never freed."""
    root = tmp_path / "s"
    storage = FilesystemStorage(root)
    persist(storage, _snap(1), keep=2)
    iter2 = root / "job-1" / "rank-00002" / f"iter-{2:012d}"
    storage.write(f"job-1/rank-00002/iter-{2:012d}/shard-00000.bin", b"y" * 4096)
    (iter2 / ".shard-00001.bin.tmp-0badf00d").write_bytes(b"z" * 2000)  # killed mid-write (SIGKILL)
    for it in (3, 4, 5):
        persist(storage, _snap(it), keep=2)
    assert iterations(storage, "job-1", 2) == [4, 5]
    assert not iter2.exists(), f"orphan of a killed write never collected: {sorted(os.listdir(iter2))}"


class _Gated(FilesystemStorage):
    """A storage whose writes of one key pause until released (a slow shard upload)."""

    def __init__(self, root: Path, gate: str) -> None:
        super().__init__(root)
        self.gate = gate
        self.reached = threading.Event()
        self.go = threading.Event()

    def write(self, key: str, data: object, progress: Callable[[], None] | None = None) -> None:
        if key.startswith(self.gate) and key.endswith("/shard-00001.bin"):
            self.reached.set()
            assert self.go.wait(10)
        super().write(key, data, progress)  # type: ignore[arg-type]


def test_two_writers_of_one_iteration_never_leave_a_torn_snapshot(tmp_path: Path) -> None:
    """An old incarnation still persisting its on-demand snapshot of iteration N and the relaunched one
    persisting its own N write the same shard keys: both persist() calls succeed, and the manifest left
    names shards the other writer overwrote."""
    root = tmp_path / "s"
    base = FilesystemStorage(root)
    persist(base, _snap(1), keep=2)
    old_n = _snap(2)  # the old incarnation's iteration 2
    data = byte_view(torch.full((10_000,), 7, dtype=torch.uint8))  # the relaunched one's, other bytes
    new_n = Snapshot(dataclasses.replace(old_n.info, chunk_crcs=chunk_crcs(data, 4096)), old_n.meta, data)

    old_storage = _Gated(root, f"job-1/rank-00002/iter-{2:012d}/")
    errors: list[BaseException] = []

    def old_writer() -> None:
        try:
            persist(old_storage, old_n, keep=2)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=old_writer)
    t.start()
    assert old_storage.reached.wait(10)  # the old writer has written shard 0 and is slow on shard 1
    persist(base, new_n, keep=2)  # the new incarnation persists its iteration 2 completely
    old_storage.go.set()
    t.join(10)
    assert not errors
    # both writers were told their snapshot is persisted; whichever manifest is left must load
    load(base, "job-1", 2, 2)


def _of_generation(snap: Snapshot, generation: int, iteration: int | None = None) -> Snapshot:
    info = dataclasses.replace(snap.info, generation=generation, iteration=iteration or snap.info.iteration)
    return Snapshot(info, snap.meta, snap.data)


class _Hooked(FilesystemStorage):
    """Runs ``hook`` once, just before the first write whose key holds ``at``."""

    def __init__(self, root: Path, at: str, hook: Callable[[], None]) -> None:
        super().__init__(root)
        self.at = at
        self.hook: Callable[[], None] | None = hook

    def write(self, key: str, data: Buffer, progress: Callable[[], None] | None = None) -> None:
        if self.at in key and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        super().write(key, data, progress)


@pytest.mark.parametrize("during", ["upload", "manifest"])
def test_a_newer_generation_persisting_during_an_older_ones_write_is_kept(tmp_path: Path, during: str) -> None:
    """Generation 1's stop snapshot of 50 uploads slowly; generation 2 (restored 49) persists its own 50
    meanwhile. The check ran before the upload only, and generation 1's manifest landed over generation
    2's: storage served the abandoned 50. Now the older writer checks again before and after its manifest
    (whose name holds its generation: it never replaces another's) and withdraws."""
    root = tmp_path / "s"
    fast = FilesystemStorage(root)
    persist(fast, _of_generation(_snap(49), 1), keep=2)
    newer = _of_generation(_snap(50), 2)

    def newer_persists() -> None:
        persist(fast, newer, keep=2)

    # "upload": between two shards; "manifest": after the older writer's last check, before its manifest
    slow = _Hooked(root, "/shard-00001" if during == "upload" else "/manifest-", newer_persists)
    with pytest.raises(StaleGeneration):
        persist(slow, _of_generation(_snap(51), 1, iteration=50), keep=2)
    got = load(fast, "job-1", 2, 50)
    assert got.info.generation == 2 and bytes(got.data) == bytes(newer.data)
    assert fast.list("job-1/rank-00002/manifest-") == [manifest_key("job-1", 2, 49, 1), manifest_key("job-1", 2, 50, 2)]
    assert all("/g000000000002-" in k or "iter-000000000049" in k for k in fast.list("job-1/rank-00002/iter-"))


def test_an_older_generations_retention_leaves_a_newer_ones_writes_alone(tmp_path: Path) -> None:
    """Generation 2 restored 40 and is uploading 45 when generation 1's late persist of 50 ends: its
    retention took generation 2's shards of 45 for an orphan (older than its newest manifest)."""
    storage = FilesystemStorage(tmp_path / "s")
    for it in (40, 49):
        persist(storage, _of_generation(_snap(it), 1), keep=2)
    newer = _of_generation(_snap(45), 2)
    storage.write(f"job-1/rank-00002/iter-{45:012d}/g{2:012d}-0123456789ab/shard-00000.bin", b"x")  # in progress
    persist(storage, _of_generation(_snap(50), 1), keep=2)
    assert storage.list(f"job-1/rank-00002/iter-{45:012d}/")
    persist(storage, newer, keep=5)  # its manifest lands: generation 1 may delete nothing of the rank now
    with pytest.raises(StaleGeneration):
        persist(storage, _of_generation(_snap(51), 1), keep=1)
    assert load(storage, "job-1", 2, 45).info.generation == 2


def test_a_manifest_named_without_its_generation_is_still_read(storage: Storage) -> None:
    """Storage written before the generation was in the manifest's name keeps being restorable."""
    persist(storage, _of_generation(_snap(7), 3), keep=2)
    key = manifest_key("job-1", 2, 7, 3)
    storage.write(f"job-1/rank-00002/manifest-{7:012d}.json", storage.read(key))
    storage.delete(key)
    assert iterations(storage, "job-1", 2) == [7] and load(storage, "job-1", 2, 7).info.generation == 3
    with pytest.raises(StaleGeneration):  # its body names its generation
        persist(storage, _of_generation(_snap(8), 2), keep=2)
    persist(storage, _of_generation(_snap(8), 3), keep=1)
    assert iterations(storage, "job-1", 2) == [8]


@pytest.mark.parametrize("rank1_persisted", [(1, 2), ()])
def test_a_rank_that_stopped_persisting_for_good_leaves_retention_bounded(
        tmp_path: Path, rank1_persisted: tuple[int, ...]) -> None:
    """Rank 1 left (an in-place shrink) after persisting 1 and 2, or was excluded before its first
    persist: its markers held the retention line down, and rank 0 kept every snapshot it persisted (40
    of 40 here; review of this session's diff). What a lagging rank may still need is kept only among
    the newest keep x LAG_WINDOW, and the newest common iteration stays."""
    st = FilesystemStorage(tmp_path / "s")

    def of_rank(it: int, rank: int) -> Snapshot:
        s = _snap(it)
        return Snapshot(dataclasses.replace(s.info, rank=rank), s.meta, s.data)

    for it in rank1_persisted:
        persist(st, of_rank(it, 0), keep=2, world_size=2)
        persist(st, of_rank(it, 1), keep=2, world_size=2)
    for it in range(len(rank1_persisted) + 1, 41):
        persist(st, of_rank(it, 0), keep=2, world_size=2)
    held = iterations(st, "job-1", 0)
    common = [2] if rank1_persisted else []
    assert held == [*common, *range(41 - 2 * LAG_WINDOW, 41)], held


class _Capacity(FilesystemStorage):
    """A filesystem of ``capacity`` bytes shared with another tenant (``other`` bytes): a write that
    does not fit fails as a full disk does (OSError ENOSPC, its temporary removed)."""

    def __init__(self, root: Path, capacity: int) -> None:
        super().__init__(root)
        self.capacity = capacity
        self.other = 0

    def used(self) -> int:
        return self.other + sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def write(self, key: str, data: Buffer, progress: Callable[[], None] | None = None) -> None:
        if self.used() + memoryview(data).nbytes > self.capacity:
            err = OSError(errno.ENOSPC, "No space left on device")
            raise StorageFull(f"writing {self.describe()}/{key}: {err}") from err
        super().write(key, data, progress)


def test_a_persist_that_failed_on_a_full_disk_leaves_nothing_and_the_next_ones_succeed(tmp_path: Path) -> None:
    """Another tenant's transient file filled the disk during the persist of 4: its shards stayed, only
    a successful persist's retention would have removed them, and they kept the disk full, so every
    later persist failed although the tenant freed its space (reviewer's repro_enospc_orphans.py)."""
    st = _Capacity(tmp_path / "s", capacity=1 << 30)
    for it in (1, 2, 3):
        persist(st, _snap(it), keep=2)
    st.capacity = st.used() + 10_000 + 4_000  # room for one more snapshot (10,000 bytes) beside the two kept
    held = st.list("")
    st.other = 8_000
    with pytest.raises(StorageUnavailable, match="No space left"):
        persist(st, _snap(4), keep=2)
    assert st.list("") == held, "the failed write left objects behind"
    st.other = 0
    for it in (5, 6, 7):
        persist(st, _snap(it), keep=2)
    assert iterations(st, "job-1", 2) == [6, 7]


def test_a_storage_filled_by_the_snapshots_kept_for_a_lagging_rank_makes_room(tmp_path: Path) -> None:
    """Rank 1's persists failed for a while (EIO on its node's mount); rank 0 kept what rank 1 might still
    need (LAG_WINDOW), and the shared filesystem filled with the job's own snapshots. Retention ran only
    after a successful persist, so no rank ever persisted again (reviewer's e7_retention_deadlock.py). A
    write that finds the storage full now deletes what only the lag window kept (never the newest
    iteration every rank holds) and is tried once more."""
    st = _Capacity(tmp_path / "s", capacity=1 << 30)

    def of_rank(it: int, rank: int) -> Snapshot:
        s = _snap(it)
        return Snapshot(dataclasses.replace(s.info, rank=rank), s.meta, s.data)

    for it in (1, 2):
        for rank in (0, 1):
            persist(st, of_rank(it, rank), keep=2, world_size=2)
    for it in range(3, 9):  # rank 1 lags
        persist(st, of_rank(it, 0), keep=2, world_size=2)
    assert iterations(st, "job-1", 0) == [2, 3, 4, 5, 6, 7, 8]
    st.capacity = st.used() + 5_000  # no room for another snapshot (10,000 bytes)
    persist(st, of_rank(9, 0), keep=2, world_size=2)
    assert iterations(st, "job-1", 0) == [2, 7, 8, 9]  # 2: the last checkpoint every rank holds
    persist(st, of_rank(9, 1), keep=2, world_size=2)  # the lagging rank catches up: there is room again
    persist(st, of_rank(10, 0), keep=2, world_size=2)
    assert iterations(st, "job-1", 0) == [9, 10]
    assert iterations(st, "job-1", 1) == [2, 9]
    assert load(st, "job-1", 0, 9).info.iteration == 9


def test_a_full_storage_never_loses_the_last_checkpoint_every_rank_holds(tmp_path: Path) -> None:
    """Making room deletes only what the rank's newest ``keep`` and the newest common iteration leave:
    with nothing else to delete the write fails as before, and the common checkpoint stays."""
    st = _Capacity(tmp_path / "s", capacity=1 << 30)

    def of_rank(it: int, rank: int) -> Snapshot:
        s = _snap(it)
        return Snapshot(dataclasses.replace(s.info, rank=rank), s.meta, s.data)

    persist(st, of_rank(1, 0), keep=1, world_size=2)
    persist(st, of_rank(1, 1), keep=1, world_size=2)
    persist(st, of_rank(2, 0), keep=1, world_size=2)
    st.capacity = st.used() + 5_000
    with pytest.raises(StorageFull):
        persist(st, of_rank(3, 0), keep=1, world_size=2)
    assert iterations(st, "job-1", 0) == [1, 2]
    assert load(st, "job-1", 0, 1).info.iteration == 1


def test_a_failed_persist_sweeps_a_dead_writers_orphans(tmp_path: Path) -> None:
    """A writer that died mid-upload of 2 after 3 was persisted left shards that fill the disk: only a
    successful persist's retention swept them, and none could succeed any more. A failed persist sweeps
    them too (by the same rules), so the next one fits."""
    st = _Capacity(tmp_path / "s", capacity=1 << 30)
    for it in (1, 3):
        persist(st, _snap(it), keep=2)
    dead = f"job-1/rank-00002/iter-{2:012d}/g{0:012d}-0123456789ab/"
    for i in range(2):
        st.write(f"{dead}shard-{i:05d}.bin", b"x" * 4096)
    st.capacity = st.used() + 6_000
    with pytest.raises(StorageUnavailable, match="No space left"):
        persist(st, _snap(4), keep=2)
    assert not st.list(dead)
    persist(st, _snap(5), keep=2)
    assert iterations(st, "job-1", 2) == [3, 5]


def test_a_failed_manifest_write_leaves_another_writers_manifest_of_the_key(tmp_path: Path) -> None:
    """Two writers of one iteration and generation name the same manifest key: the one whose manifest
    write fails withdraws its shards, never the other's manifest (which then named nothing, or nothing
    at all was left of the iteration)."""
    st = FilesystemStorage(tmp_path / "s")
    persist(st, _snap(2), keep=2)

    def full() -> None:
        raise StorageUnavailable("writing the manifest: [Errno 28] No space left on device")

    with pytest.raises(StorageUnavailable):
        persist(_Hooked(tmp_path / "s", "/manifest-", full), _snap(2), keep=2)
    assert load(st, "job-1", 2, 2).info.iteration == 2
    assert len({k.split("/")[3] for k in st.list("job-1/rank-00002/iter-")}) == 1  # one write's shards


def test_a_write_killed_in_its_first_shard_is_collected(tmp_path: Path) -> None:
    """A writer killed while writing the first shard of its write left a directory holding only a hidden
    temporary: list() never showed it, so the orphan sweep never found it, and retention of its iteration
    stopped at that directory; the bytes (up to a chunk) stayed for good (reviewer's
    repro_kill_first_shard_leak.py). The same rules as for a write with shards say it is abandoned: a
    newer generation's, or one of an iteration not older than the newest manifest, stays."""
    root = tmp_path / "s"
    st = FilesystemStorage(root)
    rank = root / "job-1" / "rank-00002"
    persist(st, _snap(1), keep=2)

    def killed(iteration: int, generation: int) -> Path:
        write = rank / f"iter-{iteration:012d}" / f"g{generation:012d}-{iteration:012x}"
        write.mkdir(parents=True)
        (write / ".shard-00000.bin.tmp-0badf00d").write_bytes(b"z" * 4096)
        return write

    dead, newer, in_progress = killed(2, 0), killed(3, 1), killed(9, 0)
    for it in range(2, 7):  # the relaunch restored 1 and trains on: retention passes 2 and 3
        persist(st, _snap(it), keep=2)
    assert iterations(st, "job-1", 2) == [5, 6]
    assert not dead.parent.exists(), f"left: {sorted(p.name for p in dead.parent.rglob('*'))}"
    assert newer.exists() and in_progress.exists()


def test_an_older_generations_retention_never_tears_a_newer_ones_write_of_the_iteration(tmp_path: Path) -> None:
    """Generation 2 restored 39 and is writing 40 again when generation 1's late persist of 50 lands:
    its retention deleted iteration 40 whole, generation 2's shards written so far with it, and
    generation 2's manifest then named shards that were gone (it was told "persisted"). Deletion takes
    only what the deleting generation or an older one wrote."""
    root = tmp_path / "s"
    fast = FilesystemStorage(root)
    for it in (40, 49):
        persist(fast, _of_generation(_snap(it), 1), keep=2)

    def older_persists() -> None:  # in the middle of generation 2's upload
        persist(fast, _of_generation(_snap(50), 1), keep=1)
        assert not fast.list(manifest_key("job-1", 2, 40, 1))  # its retention deleted its own 40

    newer = _of_generation(_snap(40), 2)
    persist(_Hooked(root, "/shard-00001", older_persists), newer, keep=5)
    got = load(fast, "job-1", 2, 40)
    assert got.info.generation == 2 and bytes(got.data) == bytes(newer.data)
    assert fast.list(f"job-1/persisted/rank-00002-{40:012d}")  # its marker: it is persisted
