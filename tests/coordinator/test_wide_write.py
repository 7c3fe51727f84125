"""Leader writes wider than one etcd transaction (etcd refuses more than 128 operations), on a real
etcd: they land whole, a deposed leader's lands nothing, and a leader that dies half-way leaves a
write the next leader finishes (committed) or discards (not committed)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence

import pytest

from coordinator.leader import CHUNK_OPS, KeyPresent, Leadership, chunks
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.errors import NotLeader, StoreRejected, StoreUnavailable
from unicron.kernel.etcd import MAX_TXN_OPS, Lease, Store
from unicron.kernel.keyspace import Keyspace

NODES = 300  # node records: more than twice etcd's 128-operation limit


def _records(keys: Keyspace, tag: str) -> dict[str, str]:
    return {keys.assignment(f"n{i:04d}"): f'{{"node": "n{i:04d}", "by": "{tag}", "pad": "{"x" * 900}"}}'
            for i in range(NODES)}


def _leader(store: Store, keys: Keyspace, name: str, cls: type[Leadership] = Leadership) -> Leadership:
    lead = cls(store, keys, name, ttl_s=3, on_deposed=lambda: None)
    assert lead.campaign(threading.Event())
    return lead


def _values(store: Store, prefix: str) -> dict[str, bytes]:
    kvs, _ = store.get_prefix(prefix)
    return {kv.key: kv.value for kv in kvs}


def test_etcd_refuses_a_transaction_over_its_limit(store: Store) -> None:
    """The limit this module works around is real (a default etcd)."""
    keys = Keyspace("/limit")
    lead = _leader(store, keys, "a")
    assert lead.token is not None
    puts = {f"/limit/k{i}": "v" for i in range(MAX_TXN_OPS + 1)}
    with pytest.raises(StoreRejected, match="too many operations"):
        store.guarded_txn(keys.leader(), lead.token, puts=puts)
    lead.resign()


def test_a_write_requiring_a_key_absent_lands_nothing_while_it_exists(store: Store) -> None:
    """``absent`` (a forget's node registration) is a compare of the write itself, narrow or wide (of the
    commit): refused, nothing lands, no staging is left, and the leader still leads and writes."""
    keys = Keyspace("/absent")
    lead = _leader(store, keys, "a")
    registration = keys.node("n0001")
    store.put(registration, "{}")
    for puts in ({"/absent/one": "x"}, _records(keys, "a")):
        with pytest.raises(KeyPresent, match=registration):
            lead.write(puts=puts, absent=[registration])
        assert set(_values(store, "/absent/")) == {keys.leader(), registration}
    store.delete(registration)
    lead.write(puts={"/absent/one": "x"}, absent=[registration])
    assert set(_values(store, "/absent/")) == {keys.leader(), "/absent/one"}
    assert lead.token is not None and not lead.deposed
    lead.resign()


def test_a_wide_write_lands_whole_and_leaves_no_staging(store: Store) -> None:
    keys = Keyspace("/wide")
    lead = _leader(store, keys, "a")
    stale = {f"/wide/drain/old{i}": "1" for i in range(40)}
    lead.write(puts=stale)
    puts = {**_records(keys, "a"), keys.state(): '{"counter": 7}'}
    assert len(chunks(puts, list(stale))) > 2
    lead.write(puts=puts, deletes=list(stale))
    got = _values(store, "/wide/")
    assert {k: v.decode() for k, v in got.items() if k in puts} == puts
    assert not set(stale) & set(got)
    assert _values(store, keys.txns()) == {}
    lead.resign()


def test_a_deposed_leaders_wide_write_lands_nothing(store: Store) -> None:
    keys = Keyspace("/deposed")
    a = _leader(store, keys, "a")
    assert a.lease is not None
    a.lease.revoke()  # a's key is gone (its lease expired) and b takes over
    b = _leader(store, keys, "b")
    with pytest.raises(NotLeader):
        a.write(puts=_records(keys, "a"))
    assert _values(store, keys.assignments()) == {}
    assert _values(store, keys.txns()) == {}
    b.resign()


class _Died(Exception):
    pass


class _DiesMidApply(Leadership):
    """Dies after applying one chunk of a committed wide write."""

    applied = 0

    def _apply_committed(self, token: int, puts: Mapping[str, str], deletes: Sequence[str]) -> None:
        if self.applied == 1:
            raise _Died
        self.applied += 1
        super()._apply_committed(token, puts, deletes)


class _DiesBeforeCommit(Leadership):
    """Dies after staging the first chunk (no commit record yet)."""

    def _guarded(self, token: int, puts: Mapping[str, str | bytes], deletes: Sequence[str],
                 absent: Sequence[str] = ()) -> None:
        if any(k == self.keys.txn(k.rsplit("/", 1)[-1]) for k in puts):
            raise _Died  # the staging transaction that carries the commit record
        super()._guarded(token, puts, deletes, absent)


def test_the_next_leader_finishes_a_committed_wide_write(store: Store) -> None:
    keys = Keyspace("/rollfwd")
    a = _leader(store, keys, "a", _DiesMidApply)
    puts = _records(keys, "a")
    with pytest.raises(_Died):
        a.write(puts=puts)
    half = _values(store, keys.assignments())
    assert 0 < len(half) < NODES  # one chunk applied: the write is half-way
    a.resign()
    b = _leader(store, keys, "b")
    assert b.recover() >= 1
    assert {k: v.decode() for k, v in _values(store, keys.assignments()).items()} == puts
    assert _values(store, keys.txns()) == {}
    b.resign()


def test_a_damaged_chunk_of_a_committed_wide_write_costs_its_part_not_the_next_leader(store: Store) -> None:
    """A staged chunk etcd holds damaged (or nested past the parser's recursion) raised out of
    recover(): every coordinator taking the lead died there in turn. Now it is deleted with an error
    logged and the rest of the write lands."""
    keys = Keyspace("/damagedchunk")
    a = _leader(store, keys, "a", _DiesMidApply)
    puts = _records(keys, "a")
    with pytest.raises(_Died):
        a.write(puts=puts)
    a.resign()
    staged = sorted(_values(store, keys.txns()))
    victims = [k for k in staged if k != keys.txn(k.rsplit("/", 1)[-1])][:2]
    assert len(victims) == 2, staged
    stored = _values(store, keys.txns())
    lost = {k for v in victims for k in json.loads(stored[v])["puts"]}
    store.put(victims[0], "not json")
    store.put(victims[1], "[" * 100_000 + "]" * 100_000)
    b = _leader(store, keys, "b")
    assert b.recover() >= 2
    got = {k: v.decode() for k, v in _values(store, keys.assignments()).items()}
    assert lost and got == {k: v for k, v in puts.items() if k not in lost}  # the readable chunks landed
    assert _values(store, keys.txns()) == {}
    b.resign()


def test_the_next_leader_discards_an_uncommitted_wide_write(store: Store) -> None:
    keys = Keyspace("/rollback")
    a = _leader(store, keys, "a", _DiesBeforeCommit)
    with pytest.raises(_Died):
        a.write(puts=_records(keys, "a"))
    assert _values(store, keys.txns()) != {}  # staged chunks, no commit record
    a.resign()
    b = _leader(store, keys, "b")
    assert b.recover() == 0
    assert _values(store, keys.assignments()) == {}
    assert _values(store, keys.txns()) == {}
    b.resign()


def _wide_records(keys: Keyspace, tag: str, n: int = 300) -> dict[str, str]:
    return {keys.assignment(f"n{i:04d}"): f'{{"node": "n{i:04d}", "by": "{tag}", "pad": "{"x" * 900}"}}'
            for i in range(n)}


class _CommitAnsweredLate(Leadership):
    """etcd applies the staging transaction that carries the commit record, but its answer is lost
    (a deadline exceeded after the server applied it); the discard that follows fails too (etcd is
    still flapping)."""

    stage = 0  # 0: armed; 1: commit landed, next call fails; 2: done

    def _guarded(self, token: int, puts: Mapping[str, str | bytes], deletes: Sequence[str],
                 absent: Sequence[str] = ()) -> None:
        if self.stage == 0 and any(k == self.keys.txn(k.rsplit("/", 1)[-1]) for k in puts):
            super()._guarded(token, puts, deletes, absent)  # landed ...
            self.stage = 1
            raise StoreUnavailable("deadline exceeded (injected: the commit landed, its answer did not)")
        if self.stage == 1:
            self.stage = 2
            raise StoreUnavailable("etcd unavailable (injected: the discard)")
        super()._guarded(token, puts, deletes, absent)


def test_a_wide_write_reported_failed_is_not_replayed_over_newer_writes(store: Store) -> None:
    """_wide treats a StoreUnavailable from the commit-carrying staging transaction as 'not committed'
    and raises StoreUnavailable (the daemon keeps its old memory and retries the input). If the commit
    did land and the best-effort discard fails, the committed chunks stay in txn/. The retried decision
    writes newer values; the next recover() (a re-election, or the next leader) then applies the stale
    committed chunks over them."""
    keys = Keyspace("/late")
    lead = _CommitAnsweredLate(store, keys, "a", ttl_s=3, on_deposed=lambda: None)
    assert lead.campaign(threading.Event())
    old = _wide_records(keys, "first try")
    with pytest.raises(StoreUnavailable):
        lead.write(puts=old)  # reported as not landed: the daemon retries the input ...
    new = _wide_records(keys, "retry")
    lead.write(puts=new)  # ... and its decision lands
    lead.recover()  # what _load_state does on Reelected, and every new leader before reading state
    kvs, _ = store.get_prefix(keys.assignments())
    got = {kv.key: kv.value.decode() for kv in kvs}
    stale = sorted(k for k, v in got.items() if v != new[k])
    assert stale == [], f"{len(stale)} of {len(new)} records reverted to the failed write's values"
    lead.resign()


def test_a_wide_write_of_non_ascii_records_fits_etcds_request_limit(store: Store) -> None:
    """chunks() sizes a chunk by len() of its str values (characters), at most CHUNK_BYTES = 512 K, and
    stages it as json.dumps(...) with ensure_ascii: every non-ASCII character becomes a 6-byte \\uXXXX
    escape. A chunk of records carrying non-ASCII text (a task's env or argv, copied into every node's
    assignment) is staged as ~3 MB, over etcd's 1.5 MiB request limit: the decision is refused every
    time it is retried."""
    keys = Keyspace("/utf")
    lead = Leadership(store, keys, "a", ttl_s=3, on_deposed=lambda: None)
    assert lead.campaign(threading.Event())
    text = "训练任务说明" * 850  # 5,100 characters, 15 kB of UTF-8
    puts = {keys.assignment(f"n{i:04d}"): f'{{"node": "n{i:04d}", "env": {{"RUN_NOTE": "{text}"}}}}'
            for i in range(300)}
    try:
        lead.write(puts=puts)
        for key in sorted(puts)[::37]:  # a sample (all 300 together exceed gRPC's 4 MiB answer limit)
            kv = store.get(key)
            assert kv is not None and kv.value.decode() == puts[key]
    finally:
        lead.resign()


class _LosesLeaseMidApply(Store):
    """A store whose second chunk apply of a wide write sees the leader's lease lost: an interim leader
    finishes the write (its recover()), writes a newer value and resigns, and the first regains."""

    def __init__(self, endpoint: str, other: Store, keys: Keyspace) -> None:
        super().__init__(endpoint)
        self.other, self.keys, self.calls = other, keys, 0
        self.leader: Leadership | None = None

    def guarded_txn(self, guard_key: str, guard_revision: int, puts: Mapping[str, str | bytes] = {},
                    deletes: Sequence[str] = (), lease: Lease | None = None, absent: Sequence[str] = ()) -> bool:
        self.calls += 1
        if self.calls == 5 and self.leader is not None:  # 3 chunks staged; the first applied
            a = self.leader
            assert a.lease is not None
            a.lease.stop()
            self.client.revoke_lease(a.lease.lease_id)
            b = Leadership(self.other, self.keys, "b", ttl_s=2, on_deposed=lambda: None)
            assert b.campaign(threading.Event())
            b.recover()
            b.write(puts={"/lose/x": "B"})
            b.resign()
            a._start_regain()
            deadline = time.monotonic() + 10
            while a.token is None and time.monotonic() < deadline:
                time.sleep(0.05)
            raise StoreUnavailable("the answer was lost (injected by the test)")
        return super().guarded_txn(guard_key, guard_revision, puts=puts, deletes=deletes, lease=lease, absent=absent)


def test_a_committed_wide_write_is_not_applied_over_an_interim_leaders_writes(etcd_server: EtcdServer) -> None:
    """A's lease is lost while it applies a committed wide write; B finishes the write and writes
    anew; A regains. A's apply went on from memory under its new token, over B's value, before A had
    reloaded anything. Now it stops (StoreUnavailable: reload, then retry) and B's value stands."""
    keys = Keyspace("/lose")
    other = Store(etcd_server.endpoint)
    store = _LosesLeaseMidApply(etcd_server.endpoint, other, keys)
    a = Leadership(store, keys, "a", ttl_s=2, on_deposed=lambda: None, poll_s=0.05)
    store.leader = a
    try:
        assert a.campaign(threading.Event())
        puts = {f"/lose/k{i:05d}": "v" for i in range(2 * CHUNK_OPS)}
        puts["/lose/x"] = "A"
        with pytest.raises(StoreUnavailable, match="lost while a committed wide write was applied"):
            a.write(puts=puts)
        assert a.token is not None and a.must_reload
        kv = other.get("/lose/x")
        assert kv is not None and kv.value == b"B"
        assert a.recover() == 0  # B finished it: nothing left staged
    finally:
        a.resign()
        store.close()
        other.close()
