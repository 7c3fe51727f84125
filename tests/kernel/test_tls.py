"""unicron.kernel.tls and ``unicron certs``: real certificates, read back by TLS and by ``cryptography``."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import queue
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from prometheus_client import CollectorRegistry

from unicron.cli import certs as certs_cli
from unicron.cli import main as cli
from unicron.kernel import metrics as umetrics
from unicron.kernel import tls
from unicron.kernel.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_certs_cli_issues_a_role_certificate_with_its_sans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "ca"
    assert cli.main(["certs", "init", str(d)]) == 0
    assert cli.main(["certs", "issue", "--role", "node", "gpu-07", "--dir", str(d), "--host", "10.1.2.3"]) == 0
    cert = x509.load_pem_x509_certificate((d / "gpu-07.crt").read_bytes())
    assert tls.peer_of(cert) == tls.Peer(tls.Role.NODE, "gpu-07")
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "gpu-07" in san.get_values_for_type(x509.DNSName)
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} >= {"10.1.2.3", "127.0.0.1"}
    assert (d / "gpu-07.key").stat().st_mode & 0o077 == 0  # the key is private
    assert (d / "ca.key").stat().st_mode & 0o077 == 0
    # a second init would replace the CA under every issued certificate: refused, one line
    assert cli.main(["certs", "init", str(d)]) == 1
    assert "exists" in capsys.readouterr().err


def test_certs_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["certs", "issue", "--role", "node", "n1", "--dir", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert "unicron certs init" in err and err.count("\n") == 1
    tls.init_ca(tmp_path)
    assert cli.main(["certs", "issue", "--role", "operator", "../evil", "--dir", str(tmp_path)]) == 1
    assert "certificate name" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert cli.main(["certs", "init", str(tmp_path / "file" / "ca")]) == 1  # a path through a file
    err = capsys.readouterr().err
    assert "cannot write certificates there" in err and err.count("\n") == 1


def _one_line(code: int, err: str) -> None:
    assert code == 1 and "Traceback" not in err
    assert err.startswith("unicron certs: ") and err.count("\n") == 1, err


def test_certs_issue_refuses_a_name_or_host_no_certificate_can_carry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: a name over 64 characters (the CN's limit) or a non-ASCII one, and a non-ASCII --host, were
    cryptography's ValueError tracebacks. Now: one line naming the name or the --host."""
    tls.init_ca(tmp_path)
    for name in ("a" * 65, "bücher"):
        code = cli.main(["certs", "issue", "--role", "operator", name, "--dir", str(tmp_path)])
        err = capsys.readouterr().err
        _one_line(code, err)
        assert "certificate name" in err and "1 to 64 ASCII characters" in err
    assert cli.main(["certs", "issue", "--role", "operator", "a" * 64, "--dir", str(tmp_path)]) == 0
    code = cli.main(["certs", "issue", "--role", "node", "n1", "--dir", str(tmp_path), "--host", "bücher.example"])
    err = capsys.readouterr().err
    _one_line(code, err)
    assert "--host 'bücher.example'" in err and "IDNA" in err
    assert not (tmp_path / "n1.crt").exists()


def test_certs_issue_refuses_a_host_nobody_can_dial_and_takes_a_bracketed_v6_as_an_address(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: ``--host 'bad host!'`` was issued as a DNS name no client could ever match, and
    ``--host [fd00::7]`` as the DNS name ``[fd00::7]``, not the address. Now the first is one line naming it
    (no certificate written) and the second is an IP SAN; a wildcard DNS name is still taken."""
    from cryptography import x509

    tls.init_ca(tmp_path)
    for bad in ("bad host!", "a/b", "-x"):
        code = cli.main(["certs", "issue", "--role", "node", "n1", "--dir", str(tmp_path), f"--host={bad}"])
        err = capsys.readouterr().err
        _one_line(code, err)
        assert f"--host: {bad!r} is neither an IP address nor a host name" in err
    assert not (tmp_path / "n1.crt").exists()
    assert cli.main(["certs", "issue", "--role", "node", "n1", "--dir", str(tmp_path),
                     "--host", "[fd00::7]", "--host", "*.nodes.example", "--host", "10.0.0.7"]) == 0
    san = x509.load_pem_x509_certificate((tmp_path / "n1.crt").read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert "[fd00::7]" not in san.get_values_for_type(x509.DNSName)
    assert "*.nodes.example" in san.get_values_for_type(x509.DNSName)
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} >= {"fd00::7", "10.0.0.7"}


def test_only_the_etcd_admin_may_be_named_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """etcd takes a client certificate's CN as its user, and ``root`` is etcd's superuser: an operator's
    (or a node's, or a coordinator's) certificate named root could do anything in etcd, past every key
    range 'unicron certs etcd-auth' grants its role. Before, 'unicron certs issue' took the name for any
    role. Now only '--role etcd root' (the admin that sets auth up) may have it, and a daemon or the CLI
    refuses such a certificate issued earlier, each with one line."""
    tls.init_ca(tmp_path)
    for role in ("operator", "node", "coordinator"):
        code = cli.main(["certs", "issue", "--role", role, "root", "--dir", str(tmp_path)])
        err = capsys.readouterr().err
        _one_line(code, err)
        assert "certificate name 'root': etcd's superuser" in err
    assert not (tmp_path / "root.crt").exists()
    assert cli.main(["certs", "issue", "--role", "etcd", "root", "--dir", str(tmp_path)]) == 0
    assert tls.load(str(tmp_path), "root") is not None
    monkeypatch.setattr(tls, "check_name", lambda name, role: name)  # as an earlier version issued it
    tls.issue(tmp_path, tls.Role.OPERATOR, "root", force=True)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="certificate name 'root': etcd's superuser"):
        tls.load(str(tmp_path), "root")
    code = cli.main(["certs", "etcd-auth", "--dir", str(tmp_path), "--etcd", "127.0.0.1:1"])
    err = capsys.readouterr().err
    _one_line(code, err)
    assert "certificate name 'root': etcd's superuser" in err


def test_certs_issue_refuses_to_replace_a_certificate_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: 'unicron certs issue' silently overwrote an existing NAME.crt / NAME.key, even with another
    role, and since etcd's user is the certificate's CN the new certificate inherited the old holder's etcd
    grants (a node certificate named coordinator could write the whole prefix). Now: one line naming the
    file and --force, nothing written; with --force it is replaced as before."""
    tls.init_ca(tmp_path)
    assert cli.main(["certs", "issue", "--role", "coordinator", "coordinator", "--dir", str(tmp_path)]) == 0
    capsys.readouterr()
    before = {p: (tmp_path / p).read_bytes() for p in ("coordinator.crt", "coordinator.key")}
    for role in ("node", "coordinator"):  # another role, or the same one
        code = cli.main(["certs", "issue", "--role", role, "coordinator", "--dir", str(tmp_path)])
        err = capsys.readouterr().err
        _one_line(code, err)
        assert f"{tmp_path / 'coordinator.crt'} exists" in err and "--force" in err and "another name" in err
        assert {p: (tmp_path / p).read_bytes() for p in before} == before
    (tmp_path / "coordinator.crt").unlink()  # a key left behind is a holder's too
    code = cli.main(["certs", "issue", "--role", "node", "coordinator", "--dir", str(tmp_path)])
    err = capsys.readouterr().err
    _one_line(code, err)
    assert f"{tmp_path / 'coordinator.key'} exists" in err
    assert not (tmp_path / "coordinator.crt").exists()
    assert cli.main(["certs", "issue", "--role", "node", "coordinator", "--dir", str(tmp_path), "--force"]) == 0
    assert tls.TLSConfig.from_dir(tmp_path, "coordinator").peer() == tls.Peer(tls.Role.NODE, "coordinator")
    with pytest.raises(ConfigError, match="exists"):
        tls.issue(tmp_path, tls.Role.NODE, "coordinator")


def test_a_key_written_over_an_existing_file_is_private(tmp_path: Path) -> None:
    """Before: keys were written with os.open(O_CREAT, 0o600), which sets the mode only on a file it
    creates, so a key re-issued (--force) over a world-readable file (copied with cp, restored from a
    backup) stayed world-readable. Now every key is 0600, and nothing else is left in the directory."""
    tls.init_ca(tmp_path)
    tls.issue(tmp_path, tls.Role.NODE, "n1")
    for key in (tmp_path / "n1.key", tmp_path / tls.CA_KEY):
        key.chmod(0o644)
    tls.issue(tmp_path, tls.Role.NODE, "n1", force=True)
    tls.init_ca(tmp_path, force=True)
    assert (tmp_path / "n1.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / tls.CA_KEY).stat().st_mode & 0o777 == 0o600
    # the CA's revocation list is init's too (etcd's --client-crl-file needs it from the start)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.crt", "ca.key", "n1.crt", "n1.key", tls.CRL_FILE]


@pytest.mark.parametrize("damaged", [tls.CA_KEY, tls.CA_CERT])
def test_certs_issue_with_a_damaged_ca_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damaged: str,
) -> None:
    """Before: a ca.key or ca.crt that is not PEM was cryptography's ValueError traceback. Now: one line
    naming the file and 'unicron certs init'."""
    tls.init_ca(tmp_path)
    (tmp_path / damaged).write_text("not PEM\n")
    code = cli.main(["certs", "issue", "--role", "node", "n1", "--dir", str(tmp_path)])
    err = capsys.readouterr().err
    _one_line(code, err)
    assert f"{tmp_path / damaged}: not a PEM" in err and "unicron certs init" in err


def test_certs_etcd_auth_names_a_stray_crt_in_the_dir(
    tmp_path: Path, foreign_cert_dir: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: any *.crt in --dir that was not a certificate (notes, a backup) was a ValueError traceback.
    Now: one line naming the file, before etcd is dialled; so is a certificate with no role of ours."""
    tls.init_ca(tmp_path)
    tls.issue(tmp_path, tls.Role.ETCD, "root")
    argv = ["certs", "etcd-auth", "--dir", str(tmp_path), "--etcd", "127.0.0.1:1"]
    (tmp_path / "notes.crt").write_text("not a certificate\n")
    code = cli.main(argv)
    err = capsys.readouterr().err
    _one_line(code, err)
    assert f"{tmp_path / 'notes.crt'}: not a PEM certificate" in err and "move it out of --dir" in err
    (tmp_path / "notes.crt").write_bytes((foreign_cert_dir / tls.CA_CERT).read_bytes())  # a CA: no OU
    code = cli.main(argv)
    err = capsys.readouterr().err
    _one_line(code, err)
    assert f"{tmp_path / 'notes.crt'}: certificate" in err and "move it out of --dir" in err


def test_load_checks_files_and_role(cert_dir: Path, tmp_path: Path) -> None:
    assert tls.load("", "x") is None
    cfg = tls.load(str(cert_dir), "node1", tls.Role.NODE)
    assert cfg is not None and cfg.peer() == tls.Peer(tls.Role.NODE, "node1")
    with pytest.raises(ConfigError, match="node 'node1', not of coordinator"):
        tls.load(str(cert_dir), "node1", tls.Role.COORDINATOR)
    with pytest.raises(ConfigError, match="missing"):
        tls.load(str(tmp_path), "node1")


def test_require_names_role_and_identity() -> None:
    node_a = tls.Peer(tls.Role.NODE, "a")
    tls.require(node_a, tls.Role.NODE, "the link", "a")
    with pytest.raises(tls.Unauthorized, match="cannot act for node 'b'"):
        tls.require(node_a, tls.Role.NODE, "the link", "b")
    with pytest.raises(tls.Unauthorized, match="needs a operator certificate"):
        tls.require(node_a, tls.Role.OPERATOR, "Submit")


def _handshake(server_cfg: tls.TLSConfig, client_cfg: tls.TLSConfig) -> tls.Peer | str:
    """One real TLS handshake over loopback: the peer the server read, or the client's error."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[tls.Peer | str] = []

    def serve() -> None:
        sock, _ = listener.accept()
        try:
            with server_cfg.server_context().wrap_socket(sock, server_side=True) as s:
                seen.append(server_cfg.peer_of_socket(s))
                s.sendall(b"ok")
        except (OSError, tls.Unauthorized) as exc:
            seen.append(f"server: {exc}")

    t = threading.Thread(target=serve)
    t.start()
    try:
        with socket.create_connection(listener.getsockname()[:2], timeout=5) as raw, \
                client_cfg.client_context().wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.recv(2)
    except (OSError, ssl.SSLError) as exc:
        seen.append(f"client: {exc}")
    t.join(5)
    listener.close()
    return seen[0]


def test_mutual_tls_reads_the_client_and_refuses_a_foreign_ca(cert_dir: Path, foreign_cert_dir: Path) -> None:
    server = tls.TLSConfig.from_dir(cert_dir, "coordinator")
    assert _handshake(server, tls.TLSConfig.from_dir(cert_dir, "node2")) == tls.Peer(tls.Role.NODE, "node2")
    # a certificate of another CA, even with the same name and role, is no one here
    stranger = tls.TLSConfig(cert_dir / "ca.crt", foreign_cert_dir / "node2.crt", foreign_cert_dir / "node2.key")
    refused = _handshake(server, stranger)
    # the server refuses the client's certificate; which side reports it first is a race
    assert isinstance(refused, str) and ("certificate" in refused.lower() or "unknown ca" in refused.lower())


def test_a_revoked_certificate_is_refused_within_a_second_and_its_name_can_be_issued_again(
        cert_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a lost or compromised node's certificate stayed good for its 825 days: the only way out
    was a new CA and every certificate issued again."""
    monkeypatch.setattr(tls.Revocations, "STAT_INTERVAL_S", 0.0)
    d = tmp_path / "certs"
    shutil.copytree(cert_dir, d)
    held = tmp_path / "node2-machine"  # what the node keeps on its own machine
    held.mkdir()
    for f in ("ca.crt", "node2.crt", "node2.key"):
        shutil.copy(d / f, held / f)
    node2 = tls.TLSConfig(held / "ca.crt", held / "node2.crt", held / "node2.key")
    server = tls.TLSConfig.from_dir(d, "coordinator")  # its revoked.crl is read next to its ca.crt
    assert _handshake(server, node2) == tls.Peer(tls.Role.NODE, "node2")
    assert cli.main(["certs", "revoke", "node2", "--dir", str(d)]) == 0
    assert "revoked the certificate of node 'node2'" in capsys.readouterr().out
    refused = _handshake(server, node2)
    assert isinstance(refused, str) and "revoked" in refused, refused
    assert server.still_admitted(tls.Peer(tls.Role.NODE, "node2")) is True  # no serial: not from a cert
    # the name is free again: a new key and serial, admitted; the revoked files are kept aside
    assert not (d / "node2.crt").exists() and (d / "node2.crt.revoked").exists()
    assert "node2" not in [p.name for p in certs_cli.holders(d)]  # etcd-auth grants it no more
    tls.issue(d, tls.Role.NODE, "node2")
    assert _handshake(server, tls.TLSConfig.from_dir(d, "node2")) == tls.Peer(tls.Role.NODE, "node2")
    # revoking a second one keeps the first in the list
    assert cli.main(["certs", "revoke", "node1", "--dir", str(d)]) == 0
    crl = tls.read_crl(d / tls.CRL_FILE, x509.load_pem_x509_certificates((d / "ca.crt").read_bytes()))
    assert len(list(crl)) == 2
    assert cli.main(["certs", "revoke", "node1", "--dir", str(d)]) == 1  # nothing named so is issued now
    _one_line(1, capsys.readouterr().err)


def test_a_revocation_list_not_of_this_ca_or_damaged_is_named_at_start(
        cert_dir: Path, foreign_cert_dir: Path, tmp_path: Path) -> None:
    d, other = tmp_path / "certs", tmp_path / "other"
    shutil.copytree(cert_dir, d)
    shutil.copytree(foreign_cert_dir, other)
    tls.revoke(other, "node2")  # signed by the other CA: anyone able to write the file cannot revoke
    shutil.copy(other / tls.CRL_FILE, d / tls.CRL_FILE)
    with pytest.raises(ConfigError, match="not signed by this cluster's CA"):
        tls.TLSConfig.from_dir(d, "coordinator")
    (d / tls.CRL_FILE).write_text("garbage")
    with pytest.raises(ConfigError, match="not a PEM revocation list"):
        tls.TLSConfig.from_dir(d, "coordinator")


def test_a_revocation_list_damaged_after_start_leaves_the_one_read_in_force(cert_dir: Path, tmp_path: Path) -> None:
    """The list is read when the daemon starts: one damaged later (a copy half done when the first peer
    arrives) refused every peer with a ConfigError, which the link's handshake did not catch."""
    d = tmp_path / "certs"
    shutil.copytree(cert_dir, d)
    revoked = x509.load_pem_x509_certificate((d / "node1.crt").read_bytes())
    tls.revoke(d, "node1")
    server = tls.TLSConfig.from_dir(d, "coordinator")
    (d / tls.CRL_FILE).write_text("-----BEGIN X509 CRL-----\ntrunc")
    node2 = x509.load_pem_x509_certificate((d / "node2.crt").read_bytes())
    assert server.admit(node2) == tls.Peer(tls.Role.NODE, "node2")
    with pytest.raises(tls.Unauthorized, match="revoked"):
        server.admit(revoked)


def _unreadable_to_this_process(path: Path) -> list[str]:
    """Make ``path`` unreadable; the command prefix under which it is so. Root reads any file through
    CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH, so as root the command runs without them (the access a
    systemd dynamic user has to root's 0600 key)."""
    path.chmod(0)
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot drop the capabilities that read any file")
    return ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]


def _tls_dir_with_an_unreadable_key(cert_dir: Path, tmp_path: Path, name: str) -> tuple[Path, list[str]]:
    d = tmp_path / "tls"
    d.mkdir()
    for f in ("ca.crt", f"{name}.crt", f"{name}.key"):
        shutil.copy(cert_dir / f, d / f)
    return d, _unreadable_to_this_process(d / f"{name}.key")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNICRON_") and k != "CREDENTIALS_DIRECTORY"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def test_a_key_the_daemon_cannot_read_stops_it_with_one_line_and_exit_2(cert_dir: Path, tmp_path: Path) -> None:
    """The documented deployment: root's 0600 key, read by the coordinator's DynamicUser. Before: a
    PermissionError traceback, and under systemd a restart every 2 s forever; now one line naming the
    file, why and what to do, and the exit status of a configuration error."""
    d, prefix = _tls_dir_with_an_unreadable_key(cert_dir, tmp_path, "coordinator")
    proc = subprocess.run([*prefix, sys.executable, "-m", "coordinator.main"], capture_output=True, text=True,
                          timeout=60, env=_clean_env(UNICRON_TLS_DIR=str(d), UNICRON_ETCD="127.0.0.1:1"))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{d / 'coordinator.key'}: cannot read it (Permission denied)" in proc.stderr
    assert "LoadCredential=" in proc.stderr


def test_the_cli_with_a_key_it_cannot_read_says_so_in_one_line(cert_dir: Path, tmp_path: Path) -> None:
    d, prefix = _tls_dir_with_an_unreadable_key(cert_dir, tmp_path, "operator")
    proc = subprocess.run([*prefix, sys.executable, "-m", "unicron.cli.main", "nodes", "--tls-dir", str(d),
                           "--etcd", "127.0.0.1:1"], capture_output=True, text=True, timeout=60, env=_clean_env())
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{d / 'operator.key'}: cannot read it (Permission denied)" in proc.stderr


def test_a_key_systemd_passed_as_a_credential_is_read_before_the_directorys(cert_dir: Path, tmp_path: Path) -> None:
    """``LoadCredential=coordinator.key:...``: systemd copies the key where the unit's user may read it
    and names that directory in $CREDENTIALS_DIRECTORY; the certificates stay in the TLS directory."""
    d, prefix = _tls_dir_with_an_unreadable_key(cert_dir, tmp_path, "coordinator")
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    shutil.copy(cert_dir / "coordinator.key", credentials / "coordinator.key")
    probe = (f"from unicron.kernel import tls; cfg = tls.load({str(d)!r}, 'coordinator', tls.Role.COORDINATOR); "
             "assert cfg is not None; print(cfg.key); cfg.server_context()")
    proc = subprocess.run([*prefix, sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          env=_clean_env(CREDENTIALS_DIRECTORY=str(credentials)))
    assert proc.returncode == 0 and proc.stdout.strip() == str(credentials / "coordinator.key"), proc.stderr


def _holder_dir(cert_dir: Path, tmp_path: Path, name: str = "operator") -> Path:
    d = tmp_path / "holder"
    d.mkdir()
    for f in ("ca.crt", f"{name}.crt", f"{name}.key"):
        shutil.copy(cert_dir / f, d / f)
    return d


def test_a_key_not_of_its_certificate_is_named_at_start(cert_dir: Path, tmp_path: Path) -> None:
    """Before: loaded, and every handshake failed as "etcd unreachable; start etcd", retried forever."""
    d = _holder_dir(cert_dir, tmp_path)
    shutil.copy(cert_dir / "node1.key", d / "operator.key")  # a copy mix-up after a re-issue
    with pytest.raises(ConfigError, match=f"{d / 'operator.key'} is not the key of {d / 'operator.crt'}"):
        tls.load(str(d), "operator")


def test_a_certificate_of_another_ca_is_named_at_start(cert_dir: Path, foreign_cert_dir: Path, tmp_path: Path) -> None:
    d = _holder_dir(cert_dir, tmp_path)
    for f in ("operator.crt", "operator.key"):  # the CA was re-created with 'certs init --force' elsewhere
        shutil.copy(foreign_cert_dir / f, d / f)
    with pytest.raises(ConfigError, match=f"{d / 'operator.crt'} was not issued by the CA in {d / 'ca.crt'}"):
        tls.load(str(d), "operator")


def test_an_expired_certificate_is_named_at_start(cert_dir: Path, tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    shutil.copytree(cert_dir, ca)
    crt, _ = tls.issue(ca, tls.Role.OPERATOR, "old", days=0)  # valid until the second it was issued
    expires = x509.load_pem_x509_certificate(crt.read_bytes()).not_valid_after_utc
    while datetime.datetime.now(datetime.UTC) <= expires:
        time.sleep(0.1)
    with pytest.raises(ConfigError, match=f"{crt} expired on .* UTC; issue it again"):
        tls.load(str(ca), "old")


def test_a_certificate_not_valid_yet_is_named_at_start(cert_dir: Path, tmp_path: Path) -> None:
    """A clock behind the CA's (a machine without NTP): the handshake fails as for an expired one."""
    ca = tmp_path / "ca"
    shutil.copytree(cert_dir, ca)
    crt, _ = tls.issue(ca, tls.Role.OPERATOR, "early")
    ca_cert, ca_key = tls._load_ca(ca)
    issued = x509.load_pem_x509_certificate(crt.read_bytes())
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)
    builder = (x509.CertificateBuilder().subject_name(issued.subject).issuer_name(ca_cert.subject)
               .public_key(issued.public_key()).serial_number(issued.serial_number)
               .not_valid_before(later).not_valid_after(later + datetime.timedelta(days=1)))
    crt.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    with pytest.raises(ConfigError, match=f"{crt} is not valid before .* check this machine's clock"):
        tls.load(str(ca), "early")


def test_certs_days_sets_the_validity_and_a_daemon_warns_a_month_ahead(
    cert_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Certificates expired together after LEAF_DAYS (825, undocumented, no flag) with no warning."""
    ca = tmp_path / "ca"
    assert cli.main(["certs", "init", str(ca), "--days", "400"]) == 0
    assert cli.main(["certs", "issue", "--role", "coordinator", "coordinator", "--dir", str(ca), "--days", "10"]) == 0
    with pytest.raises(SystemExit) as refused:  # argparse's usage error
        cli.main(["certs", "issue", "--role", "operator", "operator", "--dir", str(ca), "--days", "0"])
    assert refused.value.code == 2 and "at least 1" in capsys.readouterr().err
    now = datetime.datetime.now(datetime.UTC)
    for name, days in (("ca", 400), ("coordinator", 10)):
        left = x509.load_pem_x509_certificate((ca / f"{name}.crt").read_bytes()).not_valid_after_utc - now
        assert abs(left - datetime.timedelta(days=days)) < datetime.timedelta(hours=1), (name, left)
    daemon = subprocess.Popen([sys.executable, "-m", "coordinator.main"], stderr=subprocess.PIPE, text=True,
                              env=_clean_env(UNICRON_TLS_DIR=str(ca), UNICRON_ETCD="127.0.0.1:1"))
    try:
        assert daemon.stderr is not None
        lines = [daemon.stderr.readline() for _ in range(3)]  # the warning comes before etcd is dialled
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
    warned = [json.loads(line) for line in lines if "expires soon" in line]
    assert len(warned) == 1 and warned[0]["path"] == str(ca / "coordinator.crt"), lines
    assert 9 < warned[0]["days_left"] <= 10 and warned[0]["level"] == "warning"


def test_a_running_daemon_warns_once_a_day_as_its_certificate_nears_its_end(tmp_path: Path) -> None:
    """Daemons run for weeks: the warning came only at start, so a certificate that came within the
    month while one ran was never warned of before every handshake failed at once. Now the dates are
    read again every interval (here a driven clock) and a warning repeats at most once a day."""
    ca = tmp_path / "ca"
    assert cli.main(["certs", "init", str(ca)]) == 0
    assert cli.main(["certs", "issue", "--role", "node", "n1", "--dir", str(ca), "--days", "40"]) == 0
    cfg = tls.load(str(ca), "n1", tls.Role.NODE)
    assert cfg is not None
    now = [datetime.datetime.now(datetime.UTC)]
    elapsed = [0.0]
    watch = tls.ExpiryWatch(cfg, interval_s=6 * 3600.0, clock=lambda: now[0], monotonic=lambda: elapsed[0])
    registry = CollectorRegistry()
    registry.register(umetrics.TLSExpiry(watch.days_left))

    def warnings_after(days: float) -> list[MutableMapping[str, Any]]:
        now[0] += datetime.timedelta(days=days)
        elapsed[0] += days * 86400.0
        with structlog.testing.capture_logs() as logs:
            watch.poll()
        return [e for e in logs if "expires soon" in e["event"]]

    assert registry.get_sample_value("unicron_tls_expiry_days") is None  # nothing read yet
    assert warnings_after(0) == []  # at start: 40 days left
    assert 39.9 < (registry.get_sample_value("unicron_tls_expiry_days") or 0) <= 40
    warned = warnings_after(10.5)  # running since: 29.5 days left, within the month
    assert [(w["path"], w["log_level"]) for w in warned] == [(str(ca / "n1.crt"), "warning")]
    assert 29.4 < warned[0]["days_left"] <= 29.5
    assert warnings_after(0.25) == []  # read again 6 h later: warned today already
    assert warnings_after(0.1) == []  # not due
    assert len(warnings_after(0.7)) == 1  # a day after the last warning: again
    assert 28.3 < (registry.get_sample_value("unicron_tls_expiry_days") or 0) < 28.5


def test_a_wall_clock_stepped_back_stops_no_check(tmp_path: Path) -> None:
    """An agent started with its clock a month ahead (a bad RTC), which NTP then stepped back: the checks
    were timed by the wall clock, so none came until it caught up with the month, and the certificate
    reached its end unwarned. They are timed by the monotonic clock; the dates still by the wall's."""
    ca = tmp_path / "ca"
    assert cli.main(["certs", "init", str(ca)]) == 0
    assert cli.main(["certs", "issue", "--role", "node", "n1", "--dir", str(ca), "--days", "40"]) == 0
    cfg = tls.load(str(ca), "n1", tls.Role.NODE)
    assert cfg is not None
    true_now = datetime.datetime.now(datetime.UTC)
    wall, elapsed = [true_now + datetime.timedelta(days=30)], [0.0]
    watch = tls.ExpiryWatch(cfg, interval_s=6 * 3600.0, clock=lambda: wall[0], monotonic=lambda: elapsed[0])
    with structlog.testing.capture_logs() as logs:
        watch.check()  # at start, a month ahead: 10 days left, warned
    assert [e["days_left"] for e in logs if "expires soon" in e["event"]] == [10.0]
    warned: list[tuple[int, float]] = []
    for hour in range(1, 24 * 27):  # stepped back to the truth; the status loop polls hourly
        wall[0], elapsed[0] = true_now + datetime.timedelta(hours=hour), hour * 3600.0
        with structlog.testing.capture_logs() as logs:
            watch.poll()
        warned += [(hour // 24, e["days_left"]) for e in logs if "expires soon" in e["event"]]
    # within the 30 days before the end from day 10 on: one warning a day, each with the true days left
    assert [day for day, _ in warned] == list(range(10, 27)), warned
    assert all(abs(left - (40 - day)) <= 1 for day, left in warned), warned
    assert watch.days_left() is not None and 12 < (watch.days_left() or 0) < 14


def test_a_running_coordinator_reads_its_certificate_again_and_warns(tmp_path: Path) -> None:
    """The real daemon's check, without a restart: a process's clock cannot be moved, so the
    certificate it reads is replaced by one 10 days from its end while the coordinator runs (waiting
    for an etcd that is not there, as a daemon may for long)."""
    ca = tmp_path / "ca"
    assert cli.main(["certs", "init", str(ca)]) == 0
    assert cli.main(["certs", "issue", "--role", "coordinator", "coordinator", "--dir", str(ca), "--days", "40"]) == 0
    daemon = subprocess.Popen([sys.executable, "-m", "coordinator.main"], stderr=subprocess.PIPE, text=True,
                              env=_clean_env(UNICRON_TLS_DIR=str(ca), UNICRON_ETCD="127.0.0.1:1",
                                             UNICRON_TLS_CHECK_INTERVAL="0.2"))
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert daemon.stderr is not None
        for line in daemon.stderr:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()

    def warned_within(seconds: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + seconds
        found: list[dict[str, Any]] = []
        while not found and (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(queue.Empty):
                line = lines.get(timeout=left)
                if "expires soon" in line:
                    found.append(json.loads(line))
        return found

    try:
        assert warned_within(2.0) == []  # 40 days left
        assert cli.main(["certs", "issue", "--force", "--role", "coordinator", "coordinator", "--dir", str(ca),
                         "--days", "10"]) == 0
        warned = warned_within(30.0)
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
    assert warned and warned[0]["path"] == str(ca / "coordinator.crt") and 9 < warned[0]["days_left"] <= 10


def _bundle_dir(d: Path, cas: list[Path], holders: dict[str, Path]) -> Path:
    """``d``, a holder's directory whose ca.crt is the bundle of ``cas`` (in that order), with each holder's
    certificate and key copied from the CA directory that issued it."""
    d.mkdir()
    (d / tls.CA_CERT).write_bytes(b"".join((ca / tls.CA_CERT).read_bytes() for ca in cas))
    for name, ca in holders.items():
        for ext in ("crt", "key"):
            shutil.copy(ca / f"{name}.{ext}", d / f"{name}.{ext}")
    return d


def test_a_ca_bundle_admits_holders_of_each_of_its_cas(tmp_path: Path) -> None:
    """A CA rollover puts the old and the new CA in one ca.crt (gRPC, OpenSSL and etcd trust both). Before:
    from_dir read only the bundle's first CA, so every holder of the second exited 2 at start, and once the
    old CA expired (still in the bundle) every daemon did. Now a holder issued by any valid CA of the
    bundle loads, the revocation list of either CA is read, and a CA outside the bundle is still refused."""
    old, new, stranger = tmp_path / "old", tmp_path / "new", tmp_path / "stranger"
    tls.init_ca(old)
    tls.init_ca(new, name="unicron cluster CA 2027")
    tls.init_ca(stranger)
    tls.issue(old, tls.Role.NODE, "n-old")
    tls.issue(new, tls.Role.NODE, "n-new")
    tls.issue(new, tls.Role.NODE, "n-revoked")
    tls.issue(stranger, tls.Role.NODE, "n-stranger")
    tls.revoke(new, "n-revoked")
    d = _bundle_dir(tmp_path / "bundle", [old, new], {"n-old": old, "n-new": new, "n-stranger": stranger})
    shutil.copy(new / tls.CRL_FILE, d / tls.CRL_FILE)  # the new CA's list, signed by the bundle's second CA
    for name in ("n-old", "n-new"):
        assert tls.load(str(d), name, tls.Role.NODE) is not None
    revoked = x509.load_pem_x509_certificate((new / "n-revoked.crt.revoked").read_bytes())
    with pytest.raises(tls.Unauthorized, match="is revoked"):
        tls.TLSConfig.from_dir(d, "n-new").admit(revoked)
    with pytest.raises(ConfigError, match=f"{d / 'n-stranger.crt'} was not issued by the CA in {d / 'ca.crt'}"):
        tls.load(str(d), "n-stranger")


def test_a_ca_bundle_whose_first_ca_expired_still_admits_a_holder_of_the_second(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    ca_crt = tls.init_ca(old, days=0)  # valid until the second it was made
    tls.init_ca(new, name="unicron cluster CA 2027")
    tls.issue(new, tls.Role.NODE, "n-new")
    expires = x509.load_pem_x509_certificate(ca_crt.read_bytes()).not_valid_after_utc
    while datetime.datetime.now(datetime.UTC) <= expires:
        time.sleep(0.1)
    d = _bundle_dir(tmp_path / "bundle", [old, new], {"n-new": new})
    assert tls.load(str(d), "n-new", tls.Role.NODE) is not None
    # a holder whose only issuer in the bundle expired is still named, with its CA's date
    tls.issue(old, tls.Role.NODE, "n-old")
    d = _bundle_dir(tmp_path / "old-holder", [old, new], {"n-old": old})
    with pytest.raises(ConfigError, match=f"{d / 'ca.crt'} expired on .* UTC; create a new CA"):
        tls.load(str(d), "n-old")
