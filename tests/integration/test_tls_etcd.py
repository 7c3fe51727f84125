"""etcd with TLS, --client-cert-auth and per-role auth set up by ``unicron certs etcd-auth``: a real
etcd, real certificates. Node A's certificate cannot write node B's records; no certificate, or
another CA's, gets nothing."""

from __future__ import annotations

import datetime
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from agent.daemon import Agent
from agent.settings import AgentSettings
from tests.conftest import make_certs
from unicron.cli import main as cli
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel import etcdauth, tls
from unicron.kernel.errors import StoreRejected, StoreUnavailable
from unicron.kernel.etcd import Store, connect_error, unreachable_remedy
from unicron.kernel.keyspace import Keyspace

KEYS = Keyspace("/sec")


@pytest.fixture(scope="module")
def secure_etcd(cert_dir: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tls_dir=str(cert_dir)).start()
    try:
        argv = ["certs", "etcd-auth", "--dir", str(cert_dir), "--etcd", server.endpoint, "--prefix", KEYS.prefix]
        assert cli.main(argv) == 0
        assert cli.main(argv) == 0  # idempotent: re-run after issuing a new node's certificate
        yield server
    finally:
        server.cleanup()


def store(server: EtcdServer, cfg: tls.TLSConfig | None) -> Store:
    return Store(server.endpoint, timeout_s=2.0, tls_config=cfg)


def test_a_node_writes_only_its_own_records(secure_etcd: EtcdServer, cert_dir: Path) -> None:
    node1 = store(secure_etcd, tls.TLSConfig.from_dir(cert_dir, "node1"))
    coordinator = store(secure_etcd, tls.TLSConfig.from_dir(cert_dir, "coordinator"))
    try:
        node1.put(KEYS.status("node1"), "{}")
        node1.put(KEYS.report("node1", "r1"), "{}")
        for key in (KEYS.status("node2"), KEYS.report("node2", "r1"), KEYS.assignment("node1"), KEYS.task("t")):
            with pytest.raises(StoreRejected, match="permission denied"):
                node1.put(key, "{}")
        coordinator.put(KEYS.assignment("node1"), "{}")
        assert node1.get(KEYS.assignment("node1")) is not None  # it reads its assignment
        assert coordinator.get(KEYS.status("node2")) is None  # nothing node1 tried landed
    finally:
        node1.close()
        coordinator.close()


def test_an_operator_cannot_write_node_records(secure_etcd: EtcdServer, cert_dir: Path) -> None:
    operator = store(secure_etcd, tls.TLSConfig.from_dir(cert_dir, "operator"))
    try:
        operator.put(KEYS.injection("node1", "i1"), "{}")
        with pytest.raises(StoreRejected, match="permission denied"):
            operator.put(KEYS.status("node1"), "{}")
    finally:
        operator.close()


def test_no_certificate_or_a_foreign_ca_gets_nothing(
    secure_etcd: EtcdServer, cert_dir: Path, foreign_cert_dir: Path,
) -> None:
    foreign = tls.TLSConfig(cert_dir / "ca.crt", foreign_cert_dir / "coordinator.crt",
                            foreign_cert_dir / "coordinator.key")
    for cfg in (None, foreign):
        s = Store(secure_etcd.endpoint, timeout_s=1.0, tls_config=cfg)
        try:
            with pytest.raises(StoreUnavailable):
                s.put(KEYS.task("t"), "{}")
        finally:
            s.close()


def test_a_restricted_user_reads_the_revision(secure_etcd: EtcdServer, cert_dir: Path) -> None:
    node1 = store(secure_etcd, tls.TLSConfig.from_dir(cert_dir, "node1"))
    try:
        before = node1.revision()
        node1.put(KEYS.status("node1"), "{}")
        assert node1.revision() == before + 1
    finally:
        node1.close()


def test_the_coordinator_may_compact_the_history(secure_etcd: EtcdServer, cert_dir: Path) -> None:
    """The leader compacts etcd (coordinator.compaction); with per-role auth its certificate must
    still be allowed to, or etcd fills its quota on a large cluster."""
    coordinator = store(secure_etcd, tls.TLSConfig.from_dir(cert_dir, "coordinator"))
    try:
        coordinator.put(KEYS.task("compacted"), "{}")
        revision = coordinator.revision()
        coordinator.put(KEYS.task("compacted"), "{}")
        coordinator.compact(revision)
        with pytest.raises(StoreRejected, match="compacted"):
            coordinator.compact(revision)
    finally:
        coordinator.close()


def test_the_cli_tells_a_tls_mismatch_from_etcd_not_running(
    secure_etcd: EtcdServer, etcd_server: EtcdServer, cert_dir: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Both mismatches read "cannot reach etcd ...: start it", sending an operator to start an etcd
    that was running; now each names the likely cause, from gRPC's own error."""
    assert cli.main(["tasks", "--etcd", secure_etcd.endpoint]) == 1  # plaintext to a TLS server
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does etcd require TLS? pass --tls-dir" in err, err
    assert cli.main(["tasks", "--etcd", etcd_server.endpoint, "--tls-dir", str(cert_dir)]) == 1  # the reverse
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is etcd serving TLS there?" in err, err
    assert cli.main(["tasks", "--etcd", "127.0.0.1:1"]) == 1  # nothing listening
    err = capsys.readouterr().err
    assert "(Failed to connect to remote host: Connection refused): start it or pass --etcd" in err, err


def test_a_revoked_nodes_etcd_user_is_gone_for_the_connection_it_holds(
        secure_etcd: EtcdServer, cert_dir: Path) -> None:
    """``unicron certs revoke --etcd``: etcd takes a certificate's CN as its user; deleting the user
    refuses the revoked node's connection at once (the list refuses its next handshakes)."""
    admin = tls.TLSConfig.from_dir(cert_dir, etcdauth.ROOT)
    node1 = store(secure_etcd, tls.TLSConfig.from_dir(cert_dir, "node1"))
    peer = tls.Peer(tls.Role.NODE, "node1")
    try:
        node1.put(KEYS.status("node1"), "{}")
        assert etcdauth.revoke(secure_etcd.endpoint, admin, KEYS, peer) is True
        with pytest.raises(StoreRejected):
            node1.put(KEYS.status("node1"), "{}")
        assert etcdauth.revoke(secure_etcd.endpoint, admin, KEYS, peer) is False  # gone already
    finally:
        node1.close()
        etcdauth.setup(secure_etcd.endpoint, admin, KEYS, [peer])  # the module's other tests use node1


def _copied(src: Path, dst: Path, name: str) -> tls.TLSConfig:
    """A holder's certificate as it was stolen, kept outside DIR (revoking moves DIR's copy aside)."""
    dst.mkdir(exist_ok=True)
    for f in ("ca.crt", f"{name}.crt", f"{name}.key"):
        shutil.copy(src / f, dst / f)
    return tls.TLSConfig(dst / "ca.crt", dst / f"{name}.crt", dst / f"{name}.key")


def _refused(server: EtcdServer, cfg: tls.TLSConfig) -> bool:
    s = store(server, cfg)
    try:
        s.put(KEYS.status("node1"), "{}")
        return False
    except (StoreRejected, StoreUnavailable):
        return True
    finally:
        s.close()


def test_etcd_refuses_a_revoked_certificate_by_the_list_after_its_name_is_issued_again_and_roots_too(
        tmp_path: Path) -> None:
    """etcd grants by the certificate's CN: before etcd read the CA's list (``--client-crl-file``), a
    revoked node certificate worked again once the name was re-issued and ``etcd-auth`` re-run (the
    documented flow), and ``root``'s could not be revoked at all (its user cannot be deleted)."""
    d = make_certs(tmp_path / "ca")
    server = EtcdServer(tls_dir=str(d)).start()
    try:
        auth = ["certs", "etcd-auth", "--dir", str(d), "--etcd", server.endpoint, "--prefix", KEYS.prefix]
        assert cli.main(auth) == 0
        stolen = _copied(d, tmp_path / "stolen", "node1")
        stolen_root = _copied(d, tmp_path / "stolen", etcdauth.ROOT)
        assert not _refused(server, stolen)
        revoke = ["certs", "revoke", "--dir", str(d), "--etcd", server.endpoint, "--prefix", KEYS.prefix]
        assert cli.main([*revoke, "node1"]) == 0
        assert cli.main(["certs", "issue", "--role", "node", "node1", "--dir", str(d)]) == 0
        assert cli.main(auth) == 0
        assert _refused(server, stolen)
        assert not _refused(server, tls.TLSConfig.from_dir(d, "node1"))  # the new certificate works
        assert cli.main([*revoke, etcdauth.ROOT]) == 0
        assert _refused(server, stolen_root)
        assert cli.main(["certs", "issue", "--role", "etcd", etcdauth.ROOT, "--dir", str(d)]) == 0
        assert cli.main(auth) == 0  # the new root administers etcd
    finally:
        server.cleanup()


def test_a_handshake_refused_for_the_certificate_says_tls_not_start_etcd(
        secure_etcd: EtcdServer, cert_dir: Path, foreign_cert_dir: Path, tmp_path: Path) -> None:
    """A certificate that stops fitting while a daemon runs (it expires; from_dir refuses one at start)
    read "etcd unreachable ... Hint: start etcd" with etcd running; now the hint is about TLS."""
    ca = tmp_path / "ca"
    shutil.copytree(cert_dir, ca)
    crt, _ = tls.issue(ca, tls.Role.OPERATOR, "expired", days=0)  # valid until the second it was issued
    expires = x509.load_pem_x509_certificate(crt.read_bytes()).not_valid_after_utc
    while datetime.datetime.now(datetime.UTC) <= expires:
        time.sleep(0.1)
    fits = {  # gRPC words these "Failed to create security handshaker" and "Unwrap failed (TSI_...)"
        "expired": tls.TLSConfig(ca / "ca.crt", ca / "expired.crt", ca / "expired.key"),
        "another key": tls.TLSConfig(ca / "ca.crt", ca / "operator.crt", ca / "node1.key"),
        "another CA": tls.TLSConfig(ca / "ca.crt", foreign_cert_dir / "operator.crt", foreign_cert_dir / "operator.key"),
    }
    for what, cfg in fits.items():
        client = store(secure_etcd, cfg)
        try:
            with pytest.raises(StoreUnavailable) as caught:
                client.revision()
        finally:
            client.close()
        remedy = unreachable_remedy(connect_error(caught.value), tls=True)
        assert remedy.startswith("the TLS handshake with etcd failed"), (what, str(caught.value), remedy)


def test_a_running_agent_reads_its_certificate_again_and_exports_the_days_left(
        secure_etcd: EtcdServer, cert_dir: Path, tmp_path: Path) -> None:
    """The agent checks its certificate's end only at start no more: from its status loop, every
    --tls-check-interval-s, exported as unicron_tls_expiry_days. A process's clock cannot be moved, so
    node1's certificate is replaced by one 10 days from its end while the agent runs."""
    ca = tmp_path / "ca"
    shutil.copytree(cert_dir, ca)
    assert cli.main(["certs", "issue", "--force", "--role", "node", "node1", "--dir", str(ca), "--days", "40"]) == 0
    agent = Agent(AgentSettings(node="node1", etcd=secure_etcd.endpoint, prefix=KEYS.prefix, tls_dir=str(ca),
                                gpu_backend="simulated", gpus=1, run_dir=str(tmp_path / "run"), replica_budget_mb=0,
                                prefork="", advertise_host="127.0.0.1", status_interval_s=0.1,
                                tls_check_interval_s=0.2))

    def days_left() -> float:
        return agent.metrics.registry.get_sample_value("unicron_tls_expiry_days") or 0.0

    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        assert agent.ready.wait(30)
        assert 39 < days_left() <= 40
        assert cli.main(["certs", "issue", "--force", "--role", "node", "node1", "--dir", str(ca), "--days", "10"]) == 0
        deadline = time.monotonic() + 30
        while days_left() > 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 9 < days_left() <= 10
    finally:
        agent.stop()
        thread.join(30)
