"""The contract every :class:`ckpt.api.Storage` backend must meet, as a reusable test class.

To test a new backend (an object store, say), subclass :class:`StorageContract` in a ``test_*.py``
file and implement ``make_storage`` returning a fresh, empty instance; every test below then runs on it.
"""

from __future__ import annotations

import threading

import pytest

from ckpt.api import ObjectMissing, Storage
from unicron.kernel.errors import InvalidRecord


class StorageContract:
    def make_storage(self) -> Storage:
        raise NotImplementedError

    @pytest.fixture
    def storage(self) -> Storage:
        return self.make_storage()

    def test_write_then_read_back(self, storage: Storage) -> None:
        storage.write("a/b/c.bin", b"hello")
        assert storage.size("a/b/c.bin") == 5
        assert storage.read("a/b/c.bin") == b"hello"
        out = bytearray(8)
        assert storage.read_into("a/b/c.bin", memoryview(out)) == 5 and out[:5] == b"hello"

    def test_write_accepts_memoryview_slices(self, storage: Storage) -> None:
        data = bytearray(range(200))
        storage.write("k", memoryview(data)[50:150])
        assert storage.read("k") == bytes(range(50, 150))

    def test_empty_object(self, storage: Storage) -> None:
        storage.write("empty", b"")
        assert storage.size("empty") == 0 and storage.read("empty") == b""

    def test_overwrite_replaces_whole_object(self, storage: Storage) -> None:
        storage.write("k", b"x" * 1000)
        storage.write("k", b"y" * 10)
        assert storage.read("k") == b"y" * 10

    def test_missing_key(self, storage: Storage) -> None:
        with pytest.raises(ObjectMissing):
            storage.size("nope")
        with pytest.raises(ObjectMissing):
            storage.read("nope")
        storage.delete("nope")  # deleting a missing key is fine

    def test_list_by_prefix_sorted(self, storage: Storage) -> None:
        for key in ("j/r1/m-2", "j/r1/m-1", "j/r1/x/s-1", "j/r2/m-1", "other"):
            storage.write(key, b"1")
        assert storage.list("j/r1/") == ["j/r1/m-1", "j/r1/m-2", "j/r1/x/s-1"]
        assert storage.list("j/r1/m-") == ["j/r1/m-1", "j/r1/m-2"]
        assert storage.list("j/r3/") == []
        assert len(storage.list("")) == 5

    def test_completed_writes_are_not_incomplete(self, storage: Storage) -> None:
        storage.write("a/b", b"1")
        storage.write("a/b", b"2")
        assert storage.list_incomplete("") == []

    def test_delete(self, storage: Storage) -> None:
        storage.write("d/x", b"1")
        storage.write("d/y", b"2")
        storage.delete("d/x")
        assert storage.list("d/") == ["d/y"]

    def test_bad_keys_rejected(self, storage: Storage) -> None:
        for key in ("../escape", "/abs", "a//b", "a/../b", ".hidden", ""):
            with pytest.raises(InvalidRecord):
                storage.write(key, b"1")

    def test_concurrent_writers_never_expose_a_mix(self, storage: Storage) -> None:
        blobs = [bytes([i]) * 300_000 for i in range(4)]
        threads = [threading.Thread(target=storage.write, args=("race", b)) for b in blobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert storage.read("race") in blobs
