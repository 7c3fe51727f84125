"""The checkpoint replica server with mutual TLS: node certificates of the cluster CA only."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt.api import ReplicaUnavailable
from ckpt.replica import ReplicaClient, ReplicaServer
from tests.ckpt.test_replica import held, snap
from unicron.kernel import tls


@pytest.fixture
def server(cert_dir: Path) -> Iterator[ReplicaServer]:
    s = ReplicaServer("127.0.0.1:0", 1 << 22, io_timeout_s=5.0,
                      tls_config=tls.TLSConfig.from_dir(cert_dir, "node1")).start()
    try:
        yield s
    finally:
        s.stop()


def test_a_peer_node_round_trips_a_snapshot_over_tls(server: ReplicaServer, cert_dir: Path) -> None:
    client = ReplicaClient(server.address, timeout_s=5.0, tls_config=tls.TLSConfig.from_dir(cert_dir, "node2"))
    s = snap(1, 4, nbytes=200_000)
    client.put(s)
    got = client.get("job-1", 1, 4)
    assert got is not None and bytes(got.data) == bytes(s.data) and got.info == s.info


def test_others_are_refused(server: ReplicaServer, cert_dir: Path, foreign_cert_dir: Path) -> None:
    foreign = tls.TLSConfig(cert_dir / "ca.crt", foreign_cert_dir / "node2.crt", foreign_cert_dir / "node2.key")
    for cfg in (None, tls.TLSConfig.from_dir(cert_dir, "operator"), foreign):
        with pytest.raises(ReplicaUnavailable):
            ReplicaClient(server.address, timeout_s=2.0, tls_config=cfg).put(snap(0, 1))
    assert held(ReplicaClient(server.address, tls_config=tls.TLSConfig.from_dir(cert_dir, "node2"))) == []


def test_a_revoked_node_can_neither_put_nor_read_replicas(
        cert_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas are model and optimizer state: a revoked node's certificate must not fetch them."""
    monkeypatch.setattr(tls.Revocations, "STAT_INTERVAL_S", 0.0)
    d, held_by_node2 = tmp_path / "certs", tmp_path / "node2"
    shutil.copytree(cert_dir, d)
    shutil.copytree(cert_dir, held_by_node2)  # its own machine's copy: revoking moves the CA's aside
    node2 = tls.TLSConfig.from_dir(held_by_node2, "node2")
    s = ReplicaServer("127.0.0.1:0", 1 << 22, io_timeout_s=5.0, tls_config=tls.TLSConfig.from_dir(d, "node1")).start()
    try:
        ReplicaClient(s.address, timeout_s=2.0, tls_config=node2).put(snap(1, 4))
        tls.revoke(d, "node2")
        with pytest.raises(ReplicaUnavailable):
            ReplicaClient(s.address, timeout_s=2.0, tls_config=node2).get("job-1", 1, 4)
        with pytest.raises(ReplicaUnavailable):
            ReplicaClient(s.address, timeout_s=2.0, tls_config=node2).put(snap(2, 4))
    finally:
        s.stop()
