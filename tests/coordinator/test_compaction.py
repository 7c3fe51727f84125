"""The leader's etcd compaction (``coordinator.compaction``) on a real etcd: history older than the
retention goes, current values stay, and a compaction that etcd refuses does not stop the next."""

from __future__ import annotations

import threading

import pytest

from coordinator.compaction import Compactor, run
from unicron.kernel.errors import StoreRejected
from unicron.kernel.etcd import Store


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _read_at(store: Store, key: str, revision: int) -> bytes | None:
    with store.converted(f"get {key} at {revision}"):
        value, _ = store.client.get(key, revision=revision)
    return value if value is None else bytes(value)


def test_compacts_to_the_revision_seen_one_retention_ago(store: Store) -> None:
    clock = Clock()
    compactor = Compactor(store, retention_s=60.0, clock=clock)
    store.put("/c/k", "v0")
    first = store.revision()
    assert compactor.step() is None  # nothing seen long enough ago
    for i in range(1, 20):
        store.put("/c/k", f"v{i}")
    clock.now = 30.0
    assert compactor.step() is None and _read_at(store, "/c/k", first) == b"v0"  # still kept
    clock.now = 61.0
    assert compactor.step() == first  # the revision noted at t=0, not the one at t=30
    assert compactor.compacted == first
    with pytest.raises(StoreRejected):
        _read_at(store, "/c/k", first - 1)  # history before it is gone
    assert _read_at(store, "/c/k", first) == b"v0"  # the compaction revision itself is kept
    kv = store.get("/c/k")
    assert kv is not None and kv.value == b"v19"
    assert compactor.step() is None  # the t=30 revision is not yet a retention old
    clock.now = 91.0
    assert compactor.step() is not None and compactor.compacted > first


def test_the_loop_compacts_and_goes_on_after_a_refusal(store: Store) -> None:
    """A predecessor already compacted further (etcd answers 'compacted'): logged, and the next step
    compacts again."""
    store.put("/c/x", "0")
    compactor = Compactor(store, retention_s=0.4)
    stop = threading.Event()
    t = threading.Thread(target=run, args=(compactor, stop), daemon=True)
    t.start()
    try:
        for i in range(40):
            store.put("/c/x", str(i))
            stop.wait(0.05)
        assert compactor.compacted > 0
        ahead = store.revision()
        store.compact(ahead)  # ahead of the loop: its next compaction is refused
        for i in range(60):
            store.put("/c/x", str(i))
            stop.wait(0.05)
            if compactor.compacted > ahead + 1:
                break
    finally:
        stop.set()
        t.join(timeout=5.0)
    assert compactor.compacted > ahead + 1, "no compaction after the refused one"
    with pytest.raises(StoreRejected):  # and it landed: the history before it is gone
        _read_at(store, "/c/x", compactor.compacted - 1)
