"""The agent-side replica holder: budget and eviction, the TCP protocol, partial transfers, standalone use."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckpt import wire
from ckpt.api import ReplicaRejected, ReplicaUnavailable, Snapshot, SnapshotInfo
from ckpt.codec import chunk_crcs, crc
from ckpt.replica import ReplicaClient, ReplicaMemory, ReplicaServer
from tests.ckpt.helpers import frame
from unicron.kernel.errors import InvalidRecord

ROOT = Path(__file__).resolve().parents[2]


def snap(rank: int, iteration: int, nbytes: int = 1000, job: str = "job-1") -> Snapshot:
    data = bytearray(nbytes)
    data[:64] = os.urandom(min(64, nbytes))
    meta = f"meta {rank} {iteration}".encode()
    info = SnapshotInfo(
        job=job,
        rank=rank,
        iteration=iteration,
        meta_len=len(meta),
        meta_crc=crc(meta),
        data_len=nbytes,
        chunk_bytes=4096,
        chunk_crcs=chunk_crcs(memoryview(data), 4096),
        created=time.time(),
    )
    return Snapshot(info, meta, memoryview(data))


def held(store: ReplicaMemory | ReplicaClient) -> list[tuple[int, int]]:
    return [(i.rank, i.iteration) for i in store.list("job-1")]


def test_eviction_oldest_first_never_newest_of_a_rank() -> None:
    one = snap(0, 1).info.nbytes
    mem = ReplicaMemory(budget_bytes=4 * one)
    for it in (1, 2):
        mem.put(snap(0, it))
        mem.put(snap(1, it))
    assert held(mem) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    mem.put(snap(0, 3))  # full: the oldest iteration goes first
    assert held(mem) == [(0, 2), (0, 3), (1, 1), (1, 2)]
    mem.put(snap(2, 1))  # a new rank: room comes from the oldest iteration that is not a rank's newest
    assert held(mem) == [(0, 2), (0, 3), (1, 2), (2, 1)]
    assert mem.used_bytes <= mem.budget


def test_rejects_when_only_newest_snapshots_are_held() -> None:
    one = snap(0, 1).info.nbytes
    mem = ReplicaMemory(budget_bytes=2 * one)
    mem.put(snap(0, 1))
    mem.put(snap(1, 1))
    with pytest.raises(ReplicaRejected, match="only 0 evictable"):
        mem.put(snap(2, 1))
    with pytest.raises(ReplicaRejected, match="exceeds the whole budget"):
        mem.put(snap(3, 1, nbytes=3 * one))
    assert held(mem) == [(0, 1), (1, 1)]


def test_the_newest_snapshot_of_a_rank_that_stopped_pushing_makes_room_for_a_live_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's newest snapshot was never evicted, and nothing dropped it when its job ended (or its
    replicas moved): the finished ranks pinned the budget for good, and every push of the node's
    current ranks was refused. Now a rank that pushed nothing for ``idle_s`` gives up its newest, the
    least recently pushed first, and never the pushing rank's own."""
    clock = [1000.0]
    monkeypatch.setattr("ckpt.replica.time.monotonic", lambda: clock[0])
    one = snap(0, 1).info.nbytes
    mem = ReplicaMemory(budget_bytes=2 * one, idle_s=600)
    mem.put(snap(0, 1))  # a job that then ended
    clock[0] += 100
    mem.put(snap(1, 1))
    clock[0] += 400  # rank 0 idle 500 s, rank 1 400 s: neither idle yet
    with pytest.raises(ReplicaRejected, match=r"only 0 evictable.*pushed nothing for 600 s"):
        mem.put(snap(2, 1))
    clock[0] += 150  # rank 0 idle 650 s
    mem.put(snap(2, 1))
    assert held(mem) == [(1, 1), (2, 1)]
    clock[0] += 1000  # both idle now; rank 2 pushes again: rank 1's goes, never rank 2's own
    mem.put(snap(2, 2))
    assert held(mem) == [(2, 1), (2, 2)]


def test_put_get_list_drop_over_tcp(replica_server: ReplicaServer) -> None:
    client = ReplicaClient(replica_server.address)
    s = snap(3, 9, nbytes=300_000)
    client.put(s)
    got = client.get("job-1", 3, 9)
    assert got is not None and got.info == s.info and got.meta == s.meta and bytes(got.data) == bytes(s.data)
    assert client.get("job-1", 3, 10) is None
    assert held(client) == [(3, 9)]
    assert client.stat()["used"] == s.info.nbytes
    assert client.drop("job-1", rank=3) == 1
    assert held(client) == [] and client.stat()["used"] == 0


def test_partial_transfer_is_never_committed(replica_server: ReplicaServer) -> None:
    client = ReplicaClient(replica_server.address)
    client.put(snap(0, 1))
    s = snap(0, 2, nbytes=100_000)
    with socket.create_connection(wire.parse_addr(replica_server.address)) as sock:  # a sender that dies
        wire.send(sock, {"op": "put", "info": s.info.to_dict()})
        assert wire.recv_header(sock)["ok"]
        sock.sendall(s.meta + bytes(s.data[:50_000]))
    deadline = time.monotonic() + 10
    while client.stat()["used"] != snap(0, 1).info.nbytes:  # the reservation is given back
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert held(client) == [(0, 1)]


def test_over_budget_refused_before_payload(replica_server: ReplicaServer) -> None:
    client = ReplicaClient(replica_server.address)
    with pytest.raises(ReplicaRejected, match="exceeds the whole budget"):
        client.put(snap(0, 1, nbytes=replica_server.memory.budget + 1))


def test_garbage_request_gets_an_error_not_a_crash(replica_server: ReplicaServer) -> None:
    with socket.create_connection(wire.parse_addr(replica_server.address)) as sock:
        wire.send(sock, {"op": "explode"})
        reply = wire.recv_header(sock)
    assert not reply["ok"] and "unknown op" in reply["error"]
    assert ReplicaClient(replica_server.address).stat()["ok"]


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"[" * 100_000, id="deeply-nested"),
        pytest.param(b'{"n": ' + b"9" * 5000 + b"}", id="5000-digit-int"),
    ],
)
def test_a_header_json_cannot_parse_is_an_invalid_record(body: bytes) -> None:
    """A header under MAX_HEADER that json.loads cannot parse raised RecursionError or a plain
    ValueError, which no caller handles (a restore died on one broken peer); now InvalidRecord."""
    a, b = socket.socketpair()
    with a, b:
        b.sendall(frame(body))
        b.close()
        with pytest.raises(InvalidRecord, match="replica protocol: header"):
            wire.recv_header(a)


def test_a_put_of_a_snapshot_of_no_finite_time_gets_an_error(replica_server: ReplicaServer) -> None:
    """`created` as a 400-digit integer made SnapshotInfo.from_dict raise OverflowError: the handler
    thread died and the client was hung up on; it now gets the `ok: false` of a malformed request."""
    info = dict(snap(0, 9).info.to_dict(), created=10**400)
    with socket.create_connection(wire.parse_addr(replica_server.address), timeout=5) as sock:
        wire.send(sock, {"op": "put", "info": info})
        reply = wire.recv_header(sock)
    assert reply["ok"] is False and "SnapshotInfo.created" in reply["error"]


def test_standalone_server_process() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt.replica", "--listen", "127.0.0.1:0", "--budget-bytes", "8M"],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        assert proc.stdout is not None
        addr = proc.stdout.readline().split()[-1]
        client = ReplicaClient(addr)
        client.put(snap(0, 1))
        assert client.stat()["budget"] == 8 << 20 and held(client) == [(0, 1)]
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
    with pytest.raises(ReplicaUnavailable):
        ReplicaClient(addr, timeout_s=2).list()


def test_a_push_replaces_newer_snapshots_of_its_rank() -> None:
    mem = ReplicaMemory(budget_bytes=1 << 20)
    for it in (5, 6):
        mem.put(snap(0, it))
    mem.put(snap(1, 9))
    mem.put(snap(0, 3))  # rank 0 rolled back to 3: its 5 and 6 belong to an abandoned timeline
    assert held(mem) == [(0, 3), (1, 9)]


def test_a_refused_push_evicts_nothing() -> None:
    """reserve() evicts victims one by one and only then finds the push cannot fit: the older snapshots
    are destroyed for a push that is refused anyway."""
    one = snap(0, 1).info.nbytes
    mem = ReplicaMemory(budget_bytes=4 * one)
    for it in (1, 2):
        mem.put(snap(0, it))
        mem.put(snap(1, it))
    before = held(mem)
    big = snap(2, 1, nbytes=3 * one)  # fits the budget, but not beside the two ranks' newest
    with pytest.raises(ReplicaRejected):
        mem.put(big)
    assert held(mem) == before, "a refused push evicted snapshots"


# ------------------------------------------------------------------------------------------ replica server


def test_a_trickling_put_does_not_hold_its_reservation_forever() -> None:
    """The server's io timeout is per recv: a sender that trickles a byte now and then keeps its
    reservation (here the whole budget) far beyond any transfer deadline, refusing every other push."""
    s = snap(0, 1, nbytes=100_000)
    server = ReplicaServer("127.0.0.1:0", s.info.nbytes, io_timeout_s=1.0).start()
    try:
        with socket.create_connection(wire.parse_addr(server.address)) as sock:
            wire.send(sock, {"op": "put", "info": s.info.to_dict()})
            assert wire.recv_header(sock)["ok"]
            # transfer_timeout(1.0, 100 kB) is ~1 s; trickle for 4 s, a byte every 0.1 s
            deadline = time.monotonic() + 4.0
            try:
                while time.monotonic() < deadline:
                    sock.sendall(b"x")
                    time.sleep(0.1)
            except OSError:
                pass  # the server cut us off: what a fix does
            used = server.memory.used_bytes
        assert used == 0, f"a stalled transfer still holds {used} reserved bytes after 4 s (io timeout 1 s)"
    finally:
        server.stop()


def test_a_trickling_request_header_does_not_hold_a_server_thread() -> None:
    """A request's header was read with only the per-recv timeout: a client announcing a large header
    and sending a byte inside every timeout held a handler thread (and its socket) as long as it liked.
    Now the server gives the whole header its io timeout and closes the connection."""
    server = ReplicaServer("127.0.0.1:0", 1 << 20, io_timeout_s=1.0).start()
    try:
        with socket.create_connection(wire.parse_addr(server.address)) as sock:
            sock.sendall(frame(b" " * 100)[:8])  # a header of 100 bytes announced
            t0, closed = time.monotonic(), False
            while time.monotonic() - t0 < 5.0:
                try:
                    sock.sendall(b" ")
                    sock.settimeout(0.2)
                    closed = sock.recv(1) == b""
                except TimeoutError:
                    pass
                except OSError:
                    closed = True
                if closed:
                    break
            assert closed, "the server still waits for the header after 5 s (io timeout 1 s)"
            assert time.monotonic() - t0 < 3.0
    finally:
        server.stop()


def test_a_peer_trickling_a_snapshot_does_not_stall_the_restore() -> None:
    """The client read a snapshot with only the per-recv timeout: a peer sending a byte inside every
    timeout held get() for as long as the bytes lasted (16 s for 40 bytes at 1 s), and the restore
    never reached the other peers or storage. Now the whole transfer has its deadline."""
    info = {"job": "j", "rank": 0, "iteration": 5, "meta_len": 0, "meta_crc": 0, "data_len": 40,
            "chunk_bytes": 4096, "chunk_crcs": [0], "created": 0.0, "format": 1}
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            wire.recv_header(conn)
            wire.send(conn, {"ok": True, "info": info})
            try:
                for _ in range(40):  # a byte every 0.4 s
                    time.sleep(0.4)
                    conn.sendall(b"x")
            except OSError:
                pass

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ReplicaUnavailable, match=r"timed out|before the deadline"):
            ReplicaClient(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=1.0).get("j", 0, 5)
        assert time.monotonic() - t0 < 4.0
    finally:
        listener.close()


def test_a_server_that_accepts_but_never_answers_is_found_within_the_connect_timeout() -> None:
    """A frozen server's kernel still accepts connections: the client waited its whole timeout (60 s)
    for the first answer, which a live server gives at once. Now that answer has the connect timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)  # never accepted: the backlog completes the handshake, as for a SIGSTOPped server
    try:
        client = ReplicaClient(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=600, connect_timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(ReplicaUnavailable, match=r"timed out|before the deadline"):
            client.list("j")
        assert time.monotonic() - t0 < 60  # 600 s before
    finally:
        listener.close()
