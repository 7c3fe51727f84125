"""Storage backends against the contract, and the persisted layout (manifests, shards, retention)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from ckpt.api import CheckpointCorrupt, Snapshot, SnapshotInfo, Storage
from ckpt.codec import byte_view, chunk_crcs, crc
from ckpt.persist import apply_retention, iterations, load, manifest_key, persist
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
        assert storage.list("") == ["a/b"]


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


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("flip_shard", "checksum mismatch in shard 1"),
        ("truncate_shard", "partial: shard"),
        ("drop_shard", "partial: shard"),
        ("flip_meta", "checksum mismatch in metadata"),
        ("edit_manifest", "checksum mismatch in job-1/rank-00002/manifest"),
        ("garble_manifest", "unreadable"),
    ],
)
def test_every_damage_is_detected(storage: Storage, damage: str, reason: str) -> None:
    persist(storage, _snap(3), keep=2)
    shard = f"job-1/rank-00002/iter-{3:012d}/shard-00001.bin"
    mkey = manifest_key("job-1", 2, 3)
    if damage == "flip_shard":
        b = bytearray(storage.read(shard))
        b[100] ^= 1
        storage.write(shard, b)
    elif damage == "truncate_shard":
        storage.write(shard, storage.read(shard)[:-1])
    elif damage == "drop_shard":
        storage.delete(shard)
    elif damage == "flip_meta":
        storage.write(f"job-1/rank-00002/iter-{3:012d}/meta.bin", b"meta-4")
    elif damage == "edit_manifest":
        m = json.loads(storage.read(mkey))
        m["body"]["info"]["iteration"] = 4  # a consistent-looking edit still breaks the manifest's CRC
        storage.write(mkey, json.dumps(m).encode())
    else:
        storage.write(mkey, b"{not json")
    with pytest.raises(CheckpointCorrupt, match=reason):
        load(storage, "job-1", 2, 3)


def test_persisting_an_older_iteration_discards_newer_ones(storage: Storage) -> None:
    for it in (5, 6):
        persist(storage, _snap(it), keep=3)
    persist(storage, _snap(3), keep=3)  # the rank rolled back: 5 and 6 must never be restored
    assert iterations(storage, "job-1", 2) == [3]
