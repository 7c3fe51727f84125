"""CheckpointManager end to end: save, restore by the nearest principle, verification and fallbacks."""

from __future__ import annotations

import errno
import json
import logging
import random
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt.api import (
    Buffer,
    CheckpointError,
    NoValidCheckpoint,
    SaveOutcome,
    Snapshot,
    StorageUnavailable,
    Tier,
    UnsafeSnapshot,
)
from ckpt.codec import crc
from ckpt.manager import CheckpointConfig, CheckpointManager
from ckpt.persist import _canonical, manifest_key
from ckpt.persist import iterations as persisted_iterations
from ckpt.replica import CONNECT_TIMEOUT_S, ReplicaClient, ReplicaMemory, ReplicaServer
from ckpt.rng import restore_rng_state
from ckpt.storage import FilesystemStorage
from tests.ckpt.helpers import FakePeer, Respond, assert_same, filled_state, frame, train_state
from tests.ckpt.test_storage import _fail_scandir_under

Make = Callable[..., CheckpointConfig]
MakePeer = Callable[[Respond], FakePeer]

#: a SnapshotInfo of job-1 rank 0 as a peer lists it (no tensor bytes)
_INFO = {
    "job": "job-1", "rank": 0, "iteration": 9, "meta_len": 1, "meta_crc": 0, "data_len": 0,
    "chunk_bytes": 4096, "chunk_crcs": [], "created": 0.0, "format": 1,
}


def _draws() -> list[float]:
    return [random.random(), float(np.random.rand()), float(torch.rand(1))]


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_restored_state_equals_saved_rng_streams_included(make_config: Make) -> None:
    state, _, _ = train_state()
    expected = _draws()  # what the streams yield right after the captured point
    with CheckpointManager(make_config()) as m:
        t0 = time.perf_counter()
        ticket = m.save(state, 7)
        call_s = time.perf_counter() - t0
        outcome = ticket.result(30)
        assert outcome.published and not outcome.errors
        # what save() cost its caller: its parts and its bookkeeping, within the call's own time
        assert 0 < ticket.encode_s + ticket.wait_s + ticket.copy_s <= ticket.blocking_s <= call_s
    torch.manual_seed(123)  # move every stream away from the captured point
    random.seed(123)
    np.random.seed(123)
    with CheckpointManager(make_config()) as m:  # a new process would do the same: reopen and restore
        r = m.restore()
    assert (r.iteration, r.tier) == (7, Tier.LOCAL)
    assert_same(state, r.state)
    restore_rng_state(r.state["rng"])
    assert _draws() == expected


def test_restore_into_live_model_and_optimizer(make_config: Make) -> None:
    state, _, _ = train_state(seed=1)
    with CheckpointManager(make_config()) as m:
        m.save(state, 3)
        m.wait()
        _, model, opt = train_state(seed=2)  # a fresh process: same structure, other values
        live = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        r = m.restore(into=live)
    assert r.state["model"]["0.weight"] is live["model"]["0.weight"]  # filled in place, no new tensor
    first = next(model.parameters())  # "0.weight"
    assert torch.equal(first, state["model"]["0.weight"])
    assert torch.equal(opt.state[first]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert_same(state, r.state)


def test_restore_into_a_state_with_a_tensor_held_twice_leaves_no_view_of_the_slot(make_config: Make) -> None:
    """Tied weights: one tensor under two keys, stored once. Once the first key took the value into
    its template, the second key was handed the raw view of the shared-memory slot, which the next
    snapshots written into that slot changed under the caller. Likewise when only the second key's
    template matched."""
    for templates in ("both", "second only"):
        with CheckpointManager(make_config(slots=2)) as m:
            tied = torch.full((1024,), 1.0)
            m.save({"a": tied, "b": tied}, 1).result(30)
            first = torch.zeros(1024) if templates == "both" else None
            template = {"a": first, "b": torch.zeros(1024)}
            r = m.restore(1, into=template)
            held = (r.state["a"], r.state["b"])
            for it in (2, 3, 4):  # through both slots: the one iteration 1 was restored from is written again
                m.save({"a": torch.full((1024,), float(it)), "b": torch.zeros(1)}, it).result(30)
            assert [t[0].item() for t in held] == [1.0, 1.0], templates
            assert r.state["b"] is template["b"]


def test_double_buffering_keeps_newest_and_previous(make_config: Make) -> None:
    with CheckpointManager(make_config()) as m:
        for it in (1, 2, 3):
            m.save(filled_state(it), it)
        m.wait()
        assert m.available()[0][2] == [2, 3]
        assert m.restore(2).state["iteration"] == 2
        with pytest.raises(CheckpointError, match="not after"):
            m.save(filled_state(2), 2)


def test_first_save_without_restore_starts_a_new_timeline(make_config: Make) -> None:
    with CheckpointManager(make_config()) as m:
        m.save(filled_state(5), 5)
        m.save(filled_state(6), 6)
    with CheckpointManager(make_config()) as m:  # the runtime starts over from scratch
        m.save(filled_state(0), 0)
        m.wait()
        assert m.available()[0][2] == [0]
        assert m.restore().iteration == 0


def test_node_lost_restores_from_peer(make_config: Make, replica_server: ReplicaServer) -> None:
    state, _, _ = train_state()
    peer = ReplicaClient(replica_server.address)
    with CheckpointManager(make_config(node="node-a"), peers=[peer]) as m:
        out = m.save(state, 5).result(30)
        assert out.replicas == (replica_server.address,)
        first_root = m.local_root
    shutil.rmtree(first_root.parent)  # node-a is gone, and its memory with it
    with CheckpointManager(make_config(node="node-c"), peers=[peer]) as m:  # replacement node
        r = m.restore()
    assert (r.tier, r.source, r.iteration) == (Tier.PEER, replica_server.address, 5)
    assert [a.reason for a in r.skipped] == ["holds nothing"]
    assert_same(state, r.state)


def test_a_failed_local_publish_is_no_published_snapshot_and_still_reaches_peers_and_storage(
    make_config: Make, replica_server: ReplicaServer, tmp_path: Path
) -> None:
    """The local disk refuses the metadata (ENOSPC). Before, the outcome said published, and the
    snapshot, whose bytes were good, went to neither the peer nor storage."""
    storage = FilesystemStorage(tmp_path / "remote")
    peer = ReplicaClient(replica_server.address)
    state = filled_state(4, nbytes=5 * 4096)
    with CheckpointManager(make_config(persist_every=1), peers=[peer], storage=storage) as m:

        def full_disk(slot: int, info: object, meta: bytes) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        m._store.publish = full_disk  # type: ignore[method-assign]
        out = m.save(state, 4).result(30)
        assert not out.published and "No space left on device" in out.errors[0]
        assert out.replicas == (replica_server.address,) and out.persisted
        held = {tier: its for tier, _, its in m.available()}
        assert held == {"local": [], "peer": [4], "remote": [4]}, held
        assert m._inflight == []  # a finished ticket is not kept


def test_flipped_byte_skips_tier_and_names_reason(
    make_config: Make, replica_server: ReplicaServer, tmp_path: Path
) -> None:
    storage = FilesystemStorage(tmp_path / "remote")
    peer = ReplicaClient(replica_server.address)
    state = filled_state(4, nbytes=5 * 4096)
    cfg = make_config(persist_every=1)
    with CheckpointManager(cfg, peers=[peer], storage=storage) as m:
        assert m.save(state, 4).result(30).persisted
        slot = next(iter(m._store.published()))
    _flip_byte(Path(cfg.local_dir) / f"slot-{slot}.data", 3 * 4096 + 17)  # a bit flip in local memory
    with CheckpointManager(cfg, peers=[peer], storage=storage) as m:
        r = m.restore()
    assert r.tier == Tier.PEER
    assert "checksum mismatch in chunk 3" in r.skipped[0].reason
    assert_same(state, r.state)

    replica_server.memory.drop("job-1")  # now only remote storage holds it, and one shard goes bad
    [shard] = (tmp_path / "remote" / "job-1" / "rank-00000" / f"iter-{4:012d}").glob("*/shard-00002.bin")
    _flip_byte(shard, 5)
    with CheckpointManager(cfg, peers=[peer], storage=storage) as m, pytest.raises(NoValidCheckpoint) as err:
        m.restore()
    text = str(err.value)
    assert "local" in text and "checksum mismatch in chunk 3" in text
    assert f"peer ({replica_server.address})" in text and "holds nothing" in text
    assert "remote" in text and "checksum mismatch in shard 2" in text
    assert len(err.value.attempts) == 3


def test_corrupt_newest_falls_back_to_older_valid(make_config: Make) -> None:
    cfg = make_config()
    with CheckpointManager(cfg) as m:
        m.save(filled_state(1), 1)
        m.save(filled_state(2), 2)
        m.wait()
        slot2 = next(k for k, v in m._store.published().items() if v.iteration == 2)
    _flip_byte(Path(cfg.local_dir) / f"slot-{slot2}.data", 100)
    with CheckpointManager(cfg) as m:
        r = m.restore()
        assert r.iteration == 1 and "checksum mismatch" in r.skipped[0].reason
        assert m.available()[0][2] == [1]  # the bad newer one is withdrawn: the timeline went back


def test_nonfinite_state_rejected_when_asked(make_config: Make) -> None:
    cfg = make_config(verify_finite=True)
    with CheckpointManager(cfg) as m:
        m.save({"w": torch.tensor([1.0, float("nan")])}, 1)
        m.wait()
        with pytest.raises(NoValidCheckpoint, match="non-finite"):
            m.restore()


def test_persistence_every_n_and_retention(make_config: Make, tmp_path: Path) -> None:
    storage = FilesystemStorage(tmp_path / "remote")
    with CheckpointManager(make_config(persist_every=2, keep_remote=2), storage=storage) as m:
        outcomes = [m.save(filled_state(it), it).result(30) for it in range(1, 8)]
    # the first save of a process starts its timeline: persisted whatever persist_every says
    assert [o.persisted for o in outcomes] == [True, True, None, True, None, True, None]
    assert persisted_iterations(storage, "job-1", 0) == [4, 6]


def test_restore_with_nothing_anywhere(make_config: Make, tmp_path: Path) -> None:
    with CheckpointManager(make_config(), storage=FilesystemStorage(tmp_path / "r")) as m:
        with pytest.raises(NoValidCheckpoint) as err:
            m.restore()
        assert "local" in str(err.value) and "remote" in str(err.value)
        m.save(filled_state(0), 0)  # a fresh start is then possible


def test_unreachable_peer_is_skipped(make_config: Make) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    dead = ReplicaClient(addr, timeout_s=1)
    with CheckpointManager(make_config(), peers=[dead]) as m:
        out = m.save(filled_state(1), 1).result(30)
        assert out.published and out.replicas == () and addr in out.errors[0]
        r = m.restore()
    assert r.tier == Tier.LOCAL and "unreachable" in r.skipped[0].reason


def test_a_peer_answering_unparsable_json_is_skipped(make_config: Make, fake_peer: MakePeer) -> None:
    """A peer answering `list` with deeply nested JSON made restore() die of RecursionError; it is now
    skipped as unreachable, and the local snapshot restored."""
    peer = fake_peer(lambda h: frame(b"[" * 100_000))
    state = filled_state(3)
    with CheckpointManager(make_config()) as m:
        assert m.save(state, 3).result(30).published
    with CheckpointManager(make_config(), peers=[ReplicaClient(peer.addr, timeout_s=5)]) as m:
        r = m.restore()
    assert (r.tier, r.iteration) == (Tier.LOCAL, 3)
    assert "unreachable" in r.skipped[0].reason
    assert_same(state, r.state)


@pytest.mark.parametrize("created", [10**400, float("nan")], ids=["400-digit-int", "nan"])
def test_a_peer_listing_a_snapshot_of_no_finite_time_is_skipped(
    make_config: Make, fake_peer: MakePeer, created: float
) -> None:
    """`created` as a 400-digit integer passed SnapshotInfo.from_dict's number check, then float()
    raised OverflowError out of restore(); it is now an InvalidRecord and the peer is skipped."""
    info = dict(_INFO, created=created)
    peer = fake_peer(lambda h: frame(json.dumps({"ok": True, "items": [info]}).encode()))
    with CheckpointManager(make_config()) as m:
        assert m.save(filled_state(3), 3).result(30).published
    with CheckpointManager(make_config(), peers=[ReplicaClient(peer.addr, timeout_s=5)]) as m:
        r = m.restore()
    assert (r.tier, r.iteration) == (Tier.LOCAL, 3)
    assert "SnapshotInfo.created" in r.skipped[0].reason


@pytest.mark.parametrize("meta_len", [1 << 45, 1 << 70], ids=["32-TiB", "beyond-int64"])
def test_a_peer_claiming_a_huge_snapshot_costs_no_memory(
    make_config: Make, fake_peer: MakePeer, tmp_path: Path, meta_len: int
) -> None:
    """A peer answering `get` with an info claiming 32 TiB of metadata: the client allocated (and
    zero-filled) bytearray(meta_len) before reading a byte, so MemoryError (or an OOM kill, for tens
    of GiB; OverflowError beyond 2**63) escaped restore(). Now only arriving bytes take memory, the
    size is bounded, and the peer is skipped for the persisted copy."""
    storage = FilesystemStorage(tmp_path / "remote")
    with CheckpointManager(make_config(persist_every=1), storage=storage) as m:
        assert m.save(filled_state(5), 5).result(30).persisted
        good = m._store.published()[0].to_dict()

    def respond(h: dict[str, object]) -> bytes:
        if h.get("op") == "list":
            return frame(json.dumps({"ok": True, "items": [good]}).encode())
        return frame(json.dumps({"ok": True, "info": dict(good, meta_len=meta_len)}).encode())

    peer = fake_peer(respond)
    with CheckpointManager(make_config(node="node-b"), peers=[ReplicaClient(peer.addr, timeout_s=5)],
                           storage=storage) as m:  # a replacement node: nothing local
        r = m.restore()
    assert (r.tier, r.iteration) == (Tier.REMOTE, 5)
    assert "get" in peer.ops


class _BuggyPeer(ReplicaMemory):
    """A peer whose client has a bug: every put raises an error that is no UnicronError."""

    def put(self, snapshot: Snapshot) -> None:
        raise ValueError("a bug in this peer's client")


def test_a_peer_failing_with_any_error_costs_neither_the_other_peers_nor_persistence(
    make_config: Make, replica_server: ReplicaServer, tmp_path: Path
) -> None:
    """The replicate stage caught only UnicronError: any other error from one peer's put ended the
    stage, so the later peers never got the snapshot and a persistence that was due (here a stop's
    save(persist=True)) was skipped. Now it is recorded against that peer and the rest goes on."""
    storage = FilesystemStorage(tmp_path / "remote")
    peers = [_BuggyPeer(1 << 20, name="buggy"), ReplicaClient(replica_server.address)]
    with CheckpointManager(make_config(), peers=peers, storage=storage) as m:
        out = m.save(filled_state(1), 1, persist=True).result(30)
    assert out.published and out.persisted is True, out.errors
    assert out.replicas == (replica_server.address,)
    assert out.errors == ("replicate to buggy: ValueError: a bug in this peer's client",)


def test_second_writer_for_same_rank_refused(make_config: Make) -> None:
    with CheckpointManager(make_config()), pytest.raises(CheckpointError, match="in use"):
        t0 = time.monotonic()
        try:
            CheckpointManager(make_config(lock_wait_s=0.3))
        finally:
            assert time.monotonic() - t0 >= 0.3  # it waited for the holder first


def test_a_new_writer_takes_over_once_the_previous_one_exits(make_config: Make) -> None:
    """A relaunch may start while the previous generation's rank still saves its last snapshot: the
    new writer waits for it and then restores what it saved."""
    old = CheckpointManager(make_config())
    old.save(filled_state(7), 7).result(30)
    closer = threading.Timer(0.5, old.close)
    closer.start()
    t0 = time.monotonic()
    with CheckpointManager(make_config(lock_wait_s=30)) as new:
        assert time.monotonic() - t0 >= 0.4
        assert new.restore().iteration == 7
    closer.join()


def test_overlap_copies_in_background_until_fence(make_config: Make) -> None:
    state, model, opt = train_state(seed=3)
    before = {k: v.clone() for k, v in state["model"].items()}
    with CheckpointManager(make_config(overlap=True)) as m:
        ticket = m.save(state, 1)
        model(torch.randn(8, 32)).pow(2).mean().backward()  # the next forward/backward overlaps the copy
        m.fence()  # ... and the optimizer step waits for it
        opt.step()
        assert ticket.result(30).published
        r = m.restore()
    assert_same(before, r.state["model"])


def test_state_modified_before_its_copy_is_never_published_torn(make_config: Make) -> None:
    w = torch.zeros(4 << 20)
    with CheckpointManager(make_config(overlap=True, chunk_bytes=1 << 20)) as m:
        m.save({"w": torch.ones(8 << 20)}, 1)  # keeps the background stage busy for a while
        ticket = m.save({"w": w}, 2)
        w.add_(1)  # no fence(): modified while (most likely) not yet copied
        out = ticket.result(30)
        if out.published:  # the copy won the race: then it must hold the values from before add_
            assert torch.equal(m.restore(2).state["w"], torch.zeros(4 << 20))
        else:
            assert "torn snapshot discarded" in out.errors[0]
            assert m.restore().iteration == 1  # the previous snapshot is what remains


def _fs_type(path: Path) -> str:
    """The type of the filesystem holding ``path`` (the longest mount point above it)."""
    best, kind = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, point, fstype = line.split()[:3]
        if str(path.resolve()).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, kind = point, fstype
    return kind


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["shm", "tmp_path"])
def test_gpu_state_snapshot_fence_and_restore_into_gpu(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The slots are page-locked on tmpfs (the default /dev/shm). CUDA refuses to page-lock a file on
    ext4 (cudaErrorInvalidValue, seen on an H100): the snapshot must still be taken, copied unpinned."""
    local = Path(tempfile.mkdtemp(dir="/dev/shm")) if where == "shm" else tmp_path / "slots"
    try:
        model = torch.nn.Linear(256, 256).cuda()
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(4, 256, device="cuda")).sum().backward()
        opt.step()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        expected = {"w": model.weight.detach().cpu().clone()}
        config = CheckpointConfig(job="job-1", rank=0, local_dir=str(local), chunk_bytes=4096)
        with caplog.at_level(logging.WARNING, logger="ckpt.local"), CheckpointManager(config) as m:
            ticket = m.save(state, 1)
            m.fence()  # the optimizer step below must not overwrite the weights before they are copied
            opt.step()
            assert ticket.result(60).published
            r = m.restore(into={"model": model.state_dict(), "optimizer": opt.state_dict()})
        assert r.state["model"]["weight"].is_cuda
        assert torch.equal(model.weight.detach().cpu(), expected["w"])
        assert ("cannot be page-locked" in caplog.text) == (_fs_type(local) != "tmpfs"), caplog.text
    finally:
        shutil.rmtree(local, ignore_errors=True)


@pytest.mark.gpu
def test_a_fence_after_the_gpu_snapshot_was_published_finds_nothing_to_check() -> None:
    """On an H100 the copy and the publish of a GPU snapshot finished before the training thread's
    fence() (after a forward/backward), and fence() died comparing the emptied tensor list with the
    version counters (a zip of unequal lengths)."""
    local = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        w = torch.randn(1 << 20, device="cuda")
        with CheckpointManager(CheckpointConfig(job="job-1", rank=0, local_dir=str(local))) as m:
            expected = w.cpu()
            ticket = m.save({"w": w}, 1)
            assert ticket.result(60).published  # published before the fence
            m.fence()
            w.add_(1)
            restored = m.restore()
            assert restored.iteration == 1 and torch.equal(restored.state["w"], expected)
    finally:
        shutil.rmtree(local, ignore_errors=True)


@pytest.mark.gpu
def test_gpu_snapshots_stay_right_when_the_views_of_a_slot_are_reused_and_when_the_slot_grows() -> None:
    """save() keeps each slot's views for the next GPU snapshot of the same layout; a state that grows
    remaps the slot, and the views must follow it."""
    local = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        w = torch.randn(1 << 16, device="cuda")
        with CheckpointManager(CheckpointConfig(job="job-1", rank=0, local_dir=str(local))) as m:
            for it in range(1, 6):  # two slots: iterations 3 and 5 reuse the views of 1 and 3
                state = {"w": w, "b": torch.full((8,), float(it), device="cuda")}
                if it == 5:
                    state["extra"] = torch.randn(1 << 20, device="cuda")  # grows the slot
                ticket = m.save(state, it)
                m.fence()
                expected = {k: v.cpu() for k, v in state.items()}
                assert ticket.result(60).published
                restored = m.restore()
                assert restored.iteration == it
                assert all(torch.equal(restored.state[k], v) for k, v in expected.items()), it
                w.add_(1)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def test_unreadable_storage_is_not_reported_as_holding_nothing(
    make_config: Make, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank on a new node whose only copy is persisted: an I/O error listing the storage makes the
    manager say the remote tier 'holds nothing' (a fresh start) instead of 'unreachable'."""
    storage = FilesystemStorage(tmp_path / "remote")
    with CheckpointManager(make_config(persist_every=1), storage=storage) as m:
        assert m.save(filled_state(5), 5).result(30).persisted
    _fail_scandir_under(monkeypatch, tmp_path / "remote" / "job-1")
    with CheckpointManager(make_config(node="node-b"), storage=storage) as m:
        remote = [a for a in m.available() if a[0] == Tier.REMOTE.value]
        assert remote and remote[0][2] is None, f"unreadable storage reported as {remote}"
        with pytest.raises(NoValidCheckpoint) as exc:
            m.restore()
    reasons = [a.reason for a in exc.value.attempts if a.tier == Tier.REMOTE]
    assert any("unreachable" in r for r in reasons), reasons


class _Flaky(FilesystemStorage):
    """A filesystem whose first read of an object whose key holds ``flaky`` fails with StorageUnavailable
    (a storage service's timeout, an EIO on a network filesystem): a TemporaryError."""

    def __init__(self, root: Path, flaky: str) -> None:
        super().__init__(root)
        self.flaky = flaky
        self.failed = 0

    def read_into(self, key: str, out: memoryview) -> int:
        if self.flaky in key and not self.failed:
            self.failed += 1
            raise StorageUnavailable(f"reading {key}: [Errno 5] Input/output error")
        return super().read_into(key, out)


def test_a_temporary_read_error_discards_nothing_from_that_source(make_config: Make, tmp_path: Path) -> None:
    """A replaced node, whose snapshots only storage holds (4 and 5, both valid): reading 5 failed once
    with a temporary error, restore() fell back to 4 and then, the timeline being linear, deleted 5
    from storage: a durable checkpoint destroyed by an I/O hiccup. Now a source out of reach keeps what
    it holds, and the next save is persisted (which replaces it)."""
    root = tmp_path / "remote"
    with CheckpointManager(make_config(persist_every=1), storage=FilesystemStorage(root)) as m:
        for it in (4, 5):
            assert m.save(filled_state(it), it).result(30).persisted
    storage = _Flaky(root, flaky="iter-000000000005/")
    with CheckpointManager(make_config(node="node-b"), storage=storage) as m:
        r = m.restore()
        assert (r.tier, r.iteration, storage.failed) == (Tier.REMOTE, 4, 1)
        assert persisted_iterations(storage, "job-1", 0) == [4, 5]
        assert m.save(filled_state(5), 5).result(30).persisted  # persist_every=0: the rolled-back 5 goes


@pytest.mark.parametrize("damage", ["meta entry without its key", "shard offsets as strings"])
def test_a_malformed_manifest_is_skipped_not_a_crash(make_config: Make, tmp_path: Path, damage: str) -> None:
    """A manifest whose CRC is right but whose meta entry lacks its key, or whose shard offsets and
    lengths are strings (a writer bug, another version), raised KeyError / TypeError out of restore()
    instead of being skipped for the older valid snapshot."""
    storage = FilesystemStorage(tmp_path / "remote")
    with CheckpointManager(make_config(persist_every=1, keep_remote=3), storage=storage) as m:
        for it in (1, 2):
            assert m.save(filled_state(it), it).result(30).persisted
    key = manifest_key("job-1", 0, 2)
    raw = json.loads(storage.read(key))
    if damage == "meta entry without its key":
        del raw["body"]["meta"]["key"]
    else:
        for shard in raw["body"]["shards"]:
            shard["offset"], shard["length"] = str(shard["offset"]), str(shard["length"])
    raw["crc32"] = crc(_canonical(raw["body"]))
    storage.write(key, _canonical(raw))
    with CheckpointManager(make_config(node="node-b"), storage=storage) as m:
        r = m.restore()
    assert (r.tier, r.iteration) == (Tier.REMOTE, 1)
    assert_same(filled_state(1), r.state)


def test_a_first_save_not_persisted_leaves_no_abandoned_future_in_storage(make_config: Make, tmp_path: Path) -> None:
    """A process that starts a new timeline at 3 without restore withdraws its newer local snapshots, but
    storage only drops 5 and 6 when a persisted snapshot reaches it (persist_every=2: the next one): a
    node lost meanwhile restores the rolled-back future 6."""
    storage = FilesystemStorage(tmp_path / "remote")
    with CheckpointManager(make_config(persist_every=1), storage=storage) as m:
        for it in (5, 6):
            assert m.save(filled_state(it), it).result(30).persisted
    with CheckpointManager(make_config(persist_every=2), storage=storage) as m:  # no restore: a new timeline
        out = m.save(filled_state(3), 3).result(30)
        assert out.published and out.persisted  # a first save is persisted whatever persist_every says
    with CheckpointManager(make_config(node="node-c"), storage=storage) as m:  # the node was lost
        try:
            r = m.restore()
        except NoValidCheckpoint:
            return
    assert r.iteration <= 3, f"restored iteration {r.iteration} of the abandoned timeline from {r.tier}"


class _Outage(FilesystemStorage):
    """A filesystem storage that is unreachable while ``down``: every write, list and delete raises
    StorageUnavailable."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.down = False

    def _check(self, key: str) -> None:
        if self.down:
            raise StorageUnavailable(f"{key}: storage service unreachable")

    def write(self, key: str, data: Buffer, progress: Callable[[], None] | None = None) -> None:
        self._check(key)
        super().write(key, data, progress)

    def list(self, prefix: str) -> list[str]:
        self._check(prefix)
        return super().list(prefix)

    def delete(self, key: str) -> None:
        self._check(key)
        super().delete(key)


def test_saves_are_persisted_until_the_first_persist_of_a_new_timeline_succeeds(
    make_config: Make, tmp_path: Path
) -> None:
    """Only the very first save of a new timeline was persisted whatever persist_every says: with
    storage out of reach for that one write, the next (persist_every=5) was not persisted, storage kept
    the abandoned 5 and 6, and a node lost then restored 6. Now saves are persisted until one is."""
    root = tmp_path / "remote"
    with CheckpointManager(make_config(persist_every=1), storage=FilesystemStorage(root)) as m:
        for it in (5, 6):
            assert m.save(filled_state(it), it).result(30).persisted
    storage = _Outage(root)
    with CheckpointManager(make_config(persist_every=5), storage=storage) as m:  # no restore: a new timeline
        storage.down = True
        assert m.save(filled_state(3), 3).result(30).persisted is False
        storage.down = False
        assert m.save(filled_state(4), 4).result(30).persisted is True
        assert m.save(filled_state(5), 5).result(30).persisted is None  # back to persist_every
    assert persisted_iterations(storage, "job-1", 0) == [4]
    with CheckpointManager(make_config(node="node-c"), storage=storage) as m:  # the node was lost
        r = m.restore()
    assert (r.tier, r.iteration) == (Tier.REMOTE, 4)


def test_a_snapshot_naming_a_class_off_the_allow_list_stops_the_restore_and_deletes_nothing(
    make_config: Make, replica_server: ReplicaServer, tmp_path: Path
) -> None:
    """Its refusal was taken for a damaged copy: the restore fell back to the older iteration and
    discarded the newest, valid one from every tier, so the remedy the error named (adding the class
    to safe_globals) found it gone. Now the restore stops with that error and nothing is deleted."""
    storage = FilesystemStorage(tmp_path / "remote")
    peer = ReplicaClient(replica_server.address)
    with CheckpointManager(make_config(persist_every=1), peers=[peer], storage=storage) as m:
        m.save({"w": torch.ones(10), "data": {"epoch": 1}}, 1).result(30)
        m.save({"w": torch.ones(10) * 2, "data": {"pos": Path("/x")}}, 2).result(30)  # a class it lacks
    with CheckpointManager(make_config(persist_every=1), peers=[peer], storage=storage) as m:
        with pytest.raises(UnsafeSnapshot, match=r"iteration 2 from .*node-a.*add 'pathlib:PosixPath'.*nothing was"):
            m.restore()
        assert [claimed for tier, _, claimed in m.available() if tier == "local"] == [[1, 2]]
    assert persisted_iterations(storage, "job-1", 0) == [1, 2]
    assert [i.iteration for i in replica_server.memory.list("job-1")] == [1, 2]
    with CheckpointManager(make_config(persist_every=1, safe_globals="pathlib:PosixPath"),
                           peers=[peer], storage=storage) as m:
        r = m.restore()
    assert r.iteration == 2 and r.state["data"]["pos"] == Path("/x")


def test_a_stopping_generations_late_snapshot_cannot_replace_its_relaunchs(
    make_config: Make, replica_server: ReplicaServer, tmp_path: Path
) -> None:
    """Generation 1 saved 10; its relaunch (generation 2, another node) restored 10 and saved 11-13;
    then generation 1's stop snapshot of 11 arrived. Peers and storage keep a rank's timeline linear
    by dropping what is newer than a push, so it replaced 11 and deleted 12 and 13 everywhere, and
    was reported saved. Now a snapshot of an older generation than one held for the rank is refused."""
    storage = FilesystemStorage(tmp_path / "remote")
    peer = ReplicaClient(replica_server.address)
    old = CheckpointManager(make_config(node="node-a", persist_every=1, keep_remote=5, generation=1),
                            peers=[peer], storage=storage)
    try:
        assert old.save(filled_state(10), 10).result(30).persisted
        with CheckpointManager(make_config(node="node-b", persist_every=1, keep_remote=5, generation=2),
                               peers=[peer], storage=storage) as new:
            assert new.restore().iteration == 10
            for it in (11, 12, 13):
                assert new.save(filled_state(it), it).result(30).persisted
        late = old.save(filled_state(99), 11, persist=True).result(30)
    finally:
        old.close()
    assert not late.persisted and late.replicas == ()
    assert any("generation 1" in e and "generation 2" in e for e in late.errors), late.errors
    assert persisted_iterations(storage, "job-1", 0)[-3:] == [11, 12, 13]
    assert [i.iteration for i in replica_server.memory.list("job-1")][-3:] == [11, 12, 13]
    with CheckpointManager(make_config(node="node-c"), peers=[peer], storage=storage) as m:
        r = m.restore()
    assert (r.tier, r.iteration) == (Tier.PEER, 13)
    assert_same(filled_state(13), r.state)


def test_a_nearer_copy_of_an_abandoned_generation_is_not_restored(make_config: Make, tmp_path: Path) -> None:
    """Generation 0 on node A saved 50 (persisted) and 100 (A's memory only); with A out of reach,
    generation 1 on node B restored 50, trained on and persisted its own 100. Back on A, generation 2
    restored A's 100, the nearest copy, of the abandoned timeline; now the tiers' generations decide."""
    storage = FilesystemStorage(tmp_path / "remote")
    with CheckpointManager(make_config(node="node-a", generation=0), storage=storage) as m:
        assert m.save(filled_state(50), 50).result(30).persisted  # a first save: persisted
        m.save(filled_state(999), 100).result(30)
        m.save(filled_state(998), 120).result(30)  # newer still, as abandoned (A's two slots: 100, 120)
    with CheckpointManager(make_config(node="node-b", generation=1), storage=storage) as m:
        assert m.restore().iteration == 50
        assert m.save(filled_state(100), 100, persist=True).result(30).persisted
    with CheckpointManager(make_config(node="node-a", generation=2), storage=storage) as m:
        assert [(tier, its) for tier, _, its in m.available()] == [("local", []), ("remote", [50, 100])]
        r = m.restore(iteration=100)
        assert (r.tier, r.iteration) == (Tier.REMOTE, 100)
        assert_same(filled_state(100), r.state)
        assert any("generation 0's copy; generation 1 holds iteration 100" in a.reason for a in r.skipped), r.skipped
        assert m.restore().iteration == 100  # the newest: not the abandoned 120


def test_a_rank_relaunched_on_another_node_restores_from_the_replica_of_its_previous_node(
    make_config: Make, replica_server: ReplicaServer
) -> None:
    """Ranks push to their node's ring successor, and restore asked only that node's successor: a rank
    relaunched on another node after its node's loss never asked the server holding its replica (a
    review's DP=1 task restarted from iteration 0 while node2 held its iterations 2, 4, 6). Restore
    now also asks the restore peers (every node's replica server, from the agent)."""
    other = ReplicaServer("127.0.0.1:0", 64 << 20).start()
    try:
        was, now = ReplicaClient(replica_server.address), ReplicaClient(other.address)
        with CheckpointManager(make_config(node="node-a", generation=1), peers=[was]) as m:
            for it in (2, 4, 6):
                assert m.save(filled_state(it), it).result(30).replicas == (replica_server.address,)
        # node-a lost with its memory; the relaunch on node-c pushes to its own successor
        with CheckpointManager(make_config(node="node-c", generation=2), peers=[now],
                               restore_peers=[ReplicaClient(other.address), was]) as m:
            assert [(tier, src, its) for tier, src, its in m.available()][1:] == [
                ("peer", other.address, []), ("peer", replica_server.address, [2, 4, 6])]
            r = m.restore()
            assert (r.tier, r.source, r.iteration) == (Tier.PEER, replica_server.address, 6)
            assert_same(filled_state(6), r.state)
    finally:
        other.stop()


def test_restore_peers_never_bring_back_an_abandoned_older_generation(
    make_config: Make, replica_server: ReplicaServer
) -> None:
    """Generation 1 replicated 2, 4, 6 to server A; its relaunch (generation 2), with A out of its
    reach, restored 2 elsewhere and trained on, replicating 3 and 4 to server B. Generation 3, asking
    both, restores generation 2's 4, never generation 1's newer 6 (an abandoned timeline)."""
    other = ReplicaServer("127.0.0.1:0", 64 << 20).start()
    try:
        a, b = ReplicaClient(replica_server.address), ReplicaClient(other.address)
        with CheckpointManager(make_config(node="node-a", generation=1), peers=[a]) as m:
            for it in (2, 4, 6):
                m.save(filled_state(it), it).result(30)
        with CheckpointManager(make_config(node="node-b", generation=2), peers=[b]) as m:
            for it in (3, 4):
                assert m.save(filled_state(it + 100), it).result(30).replicas == (other.address,)
        with CheckpointManager(make_config(node="node-c", generation=3), restore_peers=[a, b]) as m:
            assert [its for _, _, its in m.available()] == [[], [2], [3, 4]]  # 2: the shared past
            r = m.restore()
            assert (r.source, r.iteration) == (other.address, 4)
            assert_same(filled_state(104), r.state)
            assert any("generation 1's copy; generation 2 holds iteration" in x.reason for x in r.skipped), r.skipped
        # the abandoned future is gone from the restore peer too (the linear timeline)
        assert [i.iteration for i in replica_server.memory.list("job-1")] == [2, 4]
    finally:
        other.stop()


@pytest.fixture
def frozen_peers() -> Iterator[list[ReplicaClient]]:
    """Four replica "servers" of frozen nodes: the kernel accepts the TCP connection (its backlog), nothing
    ever answers, so each request costs the client a connect timeout."""
    sockets = [socket.create_server(("127.0.0.1", 0), backlog=16) for _ in range(4)]
    try:
        yield [ReplicaClient(f"127.0.0.1:{s.getsockname()[1]}") for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _two_iterations_replicated(make_config: Make, peer: ReplicaClient) -> None:
    with CheckpointManager(make_config(generation=1), peers=[peer]) as m:
        for it in (2, 4):
            m.save(filled_state(it), it).result(30)


def test_resume_from_asks_frozen_peers_in_parallel(
    make_config: Make, replica_server: ReplicaServer, frozen_peers: list[ReplicaClient]
) -> None:
    """resume_from (after a reshard to an older iteration) dropped the newer replicas peer after peer:
    every frozen restore peer added a connect timeout (4 of them: 20 s) to the rank's reshard, and a
    healthy cluster's 1,024 restore peers were that many round trips in turn. The wait is now the
    slowest peer's; the reachable one still drops what is newer."""
    peer = ReplicaClient(replica_server.address)
    _two_iterations_replicated(make_config, peer)
    with CheckpointManager(make_config(generation=2), peers=[peer], restore_peers=frozen_peers) as m:
        t0 = time.monotonic()
        m.resume_from(2)  # no restore() here first: every peer is asked
        waited = time.monotonic() - t0
    assert waited < 2 * CONNECT_TIMEOUT_S, waited  # one connect timeout, not one per frozen peer
    assert [i.iteration for i in replica_server.memory.list("job-1")] == [2]


def test_resume_from_after_restore_skips_the_peers_restore_found_out_of_reach(
    make_config: Make, replica_server: ReplicaServer, frozen_peers: list[ReplicaClient]
) -> None:
    """The reshard's restore() had just found the frozen restore peers out of reach (and discarded
    nothing there); resume_from asked each of them again, in turn (restore 5 s, resume_from 20 s)."""
    peer = ReplicaClient(replica_server.address)
    _two_iterations_replicated(make_config, peer)
    with CheckpointManager(make_config(generation=2), peers=[peer], restore_peers=frozen_peers) as m:
        assert m.restore().iteration == 4
        t0 = time.monotonic()
        m.resume_from(2)  # the reshard chose an older iteration than this rank's own newest
        waited = time.monotonic() - t0
        assert [its for _, _, its in m.available()][:2] == [[2], [2]]  # local and the reachable peer
    assert waited < 2 * CONNECT_TIMEOUT_S, waited


class _Hung(FilesystemStorage):
    """A filesystem storage whose writes block while ``hung`` is set, until ``thawed`` (a frozen or dead
    mount: fsfreeze, an NFS server gone)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.hung = threading.Event()
        self.thawed = threading.Event()
        self.blocked = threading.Event()

    def write(self, key: str, data: Buffer, progress: Callable[[], None] | None = None) -> None:
        if self.hung.is_set() and not self.thawed.is_set():
            self.blocked.set()
            self.thawed.wait()
        super().write(key, data, progress)


def _in_thread(fn: Callable[[], object], limit_s: float = 60.0) -> bool:
    """Run ``fn`` in a daemon thread; whether it returned within ``limit_s`` (a liveness bound, not a speed)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(limit_s)
    return not t.is_alive()


def test_a_hung_storage_stalls_no_save_and_its_snapshots_are_reported_not_persisted(
    make_config: Make, tmp_path: Path
) -> None:
    """The persist stage held its slot until its write returned, and save() waited for that slot on the
    training thread: a hung mount stopped training until it came back. The stalled persist is now
    abandoned (not persisted), later ones are skipped while its writer is blocked, and training goes on
    with memory snapshots; the writer that resumes later leaves no manifest of memory no longer its own."""
    storage = _Hung(tmp_path / "remote")
    m = CheckpointManager(make_config(persist_every=1), storage=storage)
    try:
        for it in (1, 2):
            assert m.save(filled_state(it), it).result(30).persisted
        storage.hung.set()
        tickets = []

        def train() -> None:
            for it in range(3, 9):
                tickets.append(m.save(filled_state(it), it))

        assert _in_thread(train), "save() waited for a persist blocked in the hung storage"
        outcomes = [t.result(30) for t in tickets]
        assert storage.blocked.is_set()
        assert [o.persisted for o in outcomes] == [False] * 6
        assert all(o.published for o in outcomes)
        assert "abandoned" in " ".join(outcomes[0].errors)
        assert all("skipped" in " ".join(o.errors) for o in outcomes[1:])
        assert _in_thread(m.close), "close() waited for the hung storage"
    finally:
        storage.thawed.set()
    writer = m._writer
    assert writer is not None
    writer.join(30)
    assert persisted_iterations(storage, "job-1", 0) == [1, 2]
    with CheckpointManager(make_config(node="node-b"), storage=storage) as m2:  # the node was lost
        r = m2.restore()
    assert (r.tier, r.iteration) == (Tier.REMOTE, 2)
    assert_same(r.state, filled_state(2))


def test_a_wait_for_a_persist_blocked_in_a_hung_storage_ends_not_persisted(make_config: Make, tmp_path: Path) -> None:
    """A stopping rank saves its on-demand snapshot with persist=True and waits for it: with the mount
    hung, wait() (and close()) blocked until the agent's SIGKILL, and the rank never said the snapshot
    was not persisted. wait() now gives up on a persist that completed no write for persist_stall_s."""
    storage = _Hung(tmp_path / "remote")
    m = CheckpointManager(make_config(persist_every=0), storage=storage)
    try:
        m.save(filled_state(1), 1).result(30)  # a new timeline's first save is persisted
        storage.hung.set()
        m.save(filled_state(2), 2, persist=True)
        got: list[list[SaveOutcome]] = []
        assert _in_thread(lambda: got.append(m.wait())), "wait() blocked on the hung storage"
        assert [(o.iteration, o.persisted) for o in got[0]] == [(2, False)]
        assert _in_thread(m.close)
    finally:
        storage.thawed.set()
    assert persisted_iterations(storage, "job-1", 0) == [1]


class _SlowPerByte(FilesystemStorage):
    """Healthy but slow: every write moves its bytes steadily, 1 KiB each ``PART_S``, so a 4 KiB shard
    takes longer than the persist_stall_s below (64 MiB at ~10 MB/s with the default 5 s)."""

    PROGRESS_BYTES = 1024
    PART_S = 0.15

    def _write_part(self, fd: int, part: memoryview) -> int:
        time.sleep(self.PART_S)
        return super()._write_part(fd, part[: self.PROGRESS_BYTES])


def test_a_slow_storage_that_moves_bytes_is_not_taken_for_hung(make_config: Make, tmp_path: Path) -> None:
    """Review: progress was counted by whole writes (64 MiB shards), so any storage under ~13 MB/s per
    rank was "hung": every persist abandoned, the later ones skipped, nothing persisted while training,
    and the stop's on-demand snapshot abandoned too. Bytes that reach the storage are progress now."""
    storage = _SlowPerByte(tmp_path / "remote")
    m = CheckpointManager(make_config(persist_every=1, persist_stall_s=0.5), storage=storage)
    try:
        tickets = [m.save(filled_state(it, 1 << 12), it) for it in range(1, 4)]  # each waits for a slot
        outcomes = [t.result(60) for t in tickets]
        m.save(filled_state(4, 1 << 12), 4, persist=True)
        (stop,) = [o for o in m.wait() if o.iteration == 4]
    finally:
        m.close()
    assert [(o.iteration, o.persisted, o.errors) for o in outcomes] == [(it, True, ()) for it in range(1, 4)]
    assert (stop.persisted, stop.errors) == (True, ())
    assert 4 in persisted_iterations(storage, "job-1", 0)


class _SlowDeletes(FilesystemStorage):
    """Deletes one request each, slowly (an object store's retention of 64 MiB shards)."""

    def delete(self, key: str) -> None:
        time.sleep(0.2)
        super().delete(key)


def test_a_persist_whose_manifest_is_written_is_persisted_however_slow_its_retention(
    make_config: Make, tmp_path: Path,
) -> None:
    """Review: a persist whose data, manifest and marker were written was abandoned during its
    retention's deletes and reported "NOT persisted" while the storage held it."""
    storage = _SlowDeletes(tmp_path / "remote")
    m = CheckpointManager(make_config(persist_every=0, keep_remote=1, persist_stall_s=0.5), storage=storage)
    try:
        m.save(filled_state(1, 1 << 14), 1).result(60)  # a new timeline's first save is persisted
        m.save(filled_state(2, 1 << 14), 2)
        m.save(filled_state(3, 1 << 14), 3, persist=True)  # the stop's on-demand snapshot
        (stop,) = [o for o in m.wait() if o.iteration == 3]
    finally:
        m.close()
    assert (stop.persisted, stop.errors) == (True, ())
    assert persisted_iterations(storage, "job-1", 0) == [3]
