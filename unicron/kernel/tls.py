"""Mutual TLS and roles: the cluster CA, certificates, and who a peer is (issue 17).

One module for every channel (the coordinator's gRPC API, the agent link, etcd, the checkpoint
replica server): it issues certificates (``unicron certs``), loads a :class:`TLSConfig` (CA,
certificate, key), turns it into gRPC credentials or :mod:`ssl` contexts, and reads a verified
peer's :class:`Peer` (role and name) from its certificate.

A certificate names its holder in the subject: ``CN`` is the identity (a node's name, an operator's
user name, ``coordinator``) and ``OU`` the role. TLS itself checks that the certificate was signed by
the cluster CA; what is read here is only trusted because of that check, so :meth:`TLSConfig.admit` is
called only on certificates a handshake verified.

Files in a certificate directory: ``ca.crt`` (and ``ca.key`` on the machine that issues), and
``NAME.crt`` / ``NAME.key`` for each issued certificate. Keys are written mode 0600.
"""

from __future__ import annotations

import datetime
import math
import os
import secrets
import ssl
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes, PublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from unicron.kernel import log as ulog
from unicron.kernel.address import ip_literal
from unicron.kernel.errors import ConfigError, PermanentError
from unicron.kernel.net import check_host

log = ulog.get(__name__)

#: the environment variables every Unicron process reads its certificate from (flags override them)
ENV_DIR, ENV_NAME = "UNICRON_TLS_DIR", "UNICRON_TLS_NAME"
CA_CERT = "ca.crt"
CA_KEY = "ca.key"
#: the CA-signed list of revoked certificates, copied next to ca.crt on every machine
CRL_FILE = "revoked.crl"
#: the O of every certificate this module issues
ORGANIZATION = "unicron"
#: how long a CA and a certificate are valid by default ('unicron certs init|issue --days'); the
#: certificates issued together expire together, so every daemon warns a month ahead
CA_DAYS = 3650
LEAF_DAYS = 825
EXPIRY_WARNING_DAYS = 30
#: a running daemon reads its certificates' dates again this often (``--tls-check-interval-s``): it runs
#: for weeks, and a warning only at start came too late
EXPIRY_CHECK_INTERVAL_S = 6 * 3600.0
#: and warns again at most this often while they are within ``EXPIRY_WARNING_DAYS`` of their end
EXPIRY_WARNING_REPEAT = datetime.timedelta(days=1)
#: the hosts every leaf certificate serves besides its own name (the local demo and tests dial loopback)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
#: the longest CN X.509 allows (ub-common-name, RFC 5280); a certificate name is its CN
MAX_NAME_CHARS = 64
#: systemd's directory of the credentials it gave a unit (``LoadCredential=``): a daemon whose user may
#: not read the root-owned key in its TLS directory (the coordinator's unit has ``DynamicUser=yes``) is
#: given the key there, under the name NAME.key, and looks there first (docs/api.md, "Running under systemd")
CREDENTIALS_ENV = "CREDENTIALS_DIRECTORY"
#: etcd's superuser: with client-certificate auth etcd takes a certificate's CN as its user, so a
#: certificate of this name is etcd's admin whatever its role; only the etcd role may have it
ETCD_SUPERUSER = "root"


class Role(StrEnum):
    OPERATOR = "operator"  #: the CLI: submit, cancel, drain, undrain, forget
    NODE = "node"  #: an agent; the certificate's CN is its node name
    COORDINATOR = "coordinator"  #: the coordinator daemon
    ETCD = "etcd"  #: etcd's server certificate and its admin (CN=root); no Unicron channel accepts it


class Unauthorized(PermanentError):
    """A peer's certificate does not allow what it asked for (gRPC PERMISSION_DENIED)."""


@dataclass(frozen=True)
class Peer:
    """Who a verified certificate names."""

    role: Role
    name: str
    serial: int | None = field(default=None, compare=False)
    """The certificate's serial, when read from one (a long-lived connection checks it against the
    revocation list again)."""

    def __str__(self) -> str:
        return f"{self.role.value} {self.name!r}"


# --- issuing --------------------------------------------------------------------------------------


def _write(path: Path, data: bytes, private: bool) -> None:
    # a new file renamed over ``path``: O_CREAT's mode applies only to a file it creates, so a key
    # written over an existing one kept that file's mode (world-readable after a cp or a restore), and
    # a reader holding the old file open would have read the new key
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            if private:
                os.fchmod(f.fileno(), 0o600)  # whatever the umask
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def init_ca(directory: Path, name: str = "unicron cluster CA", force: bool = False, days: int = CA_DAYS) -> Path:
    """Create ``ca.crt`` / ``ca.key`` in ``directory``, valid for ``days``; refuses to overwrite an
    existing CA unless ``force``."""
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / CA_CERT).exists() and not force:
        raise ConfigError(f"{directory / CA_CERT} exists: this directory has a CA already (pass --force to replace it)")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(directory / CA_KEY, _key_pem(key), private=True)
    _write(directory / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), private=False)
    _sign_crl(directory, cert, key, [])  # a new CA revokes nothing yet; etcd needs the file from its start
    return directory / CA_CERT


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in dict.fromkeys(hosts):  # ordered, deduplicated
        ip = ip_literal(h)
        if ip is not None:
            names.append(x509.IPAddress(ip))
            continue
        if not h.isascii():  # x509 takes a DNS name only in its IDNA (A-label) form
            raise ConfigError(f"--host {h!r}: not an IP address or an ASCII DNS name; give an "
                              "internationalised name in its IDNA form (xn--...)")
        names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def check_name(name: str, role: Role) -> str:
    """A certificate name must be usable as a file name, an etcd user name, a CN and a DNS SAN, and
    must not make a holder of ``role`` etcd's superuser."""
    if not name or name in (".", "..") or "/" in name or name.startswith("-") or name == "ca" \
            or any(c.isspace() for c in name) or len(name) > MAX_NAME_CHARS or not name.isascii():
        raise ConfigError(f"certificate name {name!r}: must be 1 to {MAX_NAME_CHARS} ASCII characters, not 'ca', "
                          "with no '/', spaces or leading '-'")
    _check_superuser(name, role)
    return name


def _check_superuser(name: str, role: Role) -> None:
    if name == ETCD_SUPERUSER and role is not Role.ETCD:
        raise ConfigError(f"certificate name {name!r}: etcd's superuser (etcd takes a certificate's name as its "
                          f"user), so only the etcd admin may have it ('--role etcd {name}'); give this "
                          f"{role.value} another name")


def _unreadable(path: Path, exc: OSError, remedy: str) -> ConfigError:
    """The one line for a TLS file that exists but cannot be read (its mode or owner, an I/O error)."""
    if isinstance(exc, PermissionError):
        remedy = (f"this process (uid {os.geteuid()}) may not read it: make it readable by that user "
                  "(chown), or under systemd give the unit the key with LoadCredential= (docs/api.md, "
                  "'Running under systemd')")
    return ConfigError(f"TLS: {path}: cannot read it ({exc.strerror or type(exc).__name__}); {remedy}")


def read_tls_file(path: Path, remedy: str) -> bytes:
    """The bytes of a certificate, key or list; :class:`ConfigError` naming the file, why it cannot be
    read and ``remedy`` (a traceback at start, and under systemd a restart every few seconds, before)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"TLS: {path} missing; {remedy}") from None
    except OSError as exc:
        raise _unreadable(path, exc, remedy) from None


def read_certificate(path: Path, remedy: str) -> x509.Certificate:
    """The PEM certificate in ``path``; :class:`ConfigError` naming the file (and ``remedy``) if it is not one."""
    data = read_tls_file(path, remedy)
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise ConfigError(f"TLS: {path}: not a PEM certificate; {remedy}") from None


def read_ca_bundle(path: Path, remedy: str) -> list[x509.Certificate]:
    """Every PEM certificate in ``path`` (a ``ca.crt`` holds two CAs during a CA rollover, and gRPC,
    OpenSSL and etcd trust each); :class:`ConfigError` naming the file (and ``remedy``) if it holds none."""
    data = read_tls_file(path, remedy)
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ConfigError(f"TLS: {path}: not a PEM certificate; {remedy}") from None


def read_private_key(path: Path, remedy: str) -> PrivateKeyTypes:
    """The unencrypted PEM private key in ``path``; :class:`ConfigError` naming the file if it is not one."""
    data = read_tls_file(path, remedy)
    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):  # TypeError: a key with a passphrase
        raise ConfigError(f"TLS: {path}: not a PEM private key without a passphrase; {remedy}") from None


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA certificate and key in ``directory`` (the machine that issues)."""
    remedy = f"restore it, or create a new CA with 'unicron certs init --force {directory}' (and reissue every certificate)"
    for path in (directory / CA_CERT, directory / CA_KEY):
        if not path.exists():
            raise ConfigError(f"{path}: no CA there; run 'unicron certs init {directory}' first")
    ca_cert = read_certificate(directory / CA_CERT, remedy)
    ca_key = read_private_key(directory / CA_KEY, remedy)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{directory / CA_KEY}: not an EC key written by 'unicron certs init'")
    return ca_cert, ca_key


def issue(directory: Path, role: Role, name: str, hosts: list[str] | None = None,
          days: int = LEAF_DAYS, force: bool = False) -> tuple[Path, Path]:
    """Issue ``NAME.crt`` / ``NAME.key`` signed by the CA in ``directory``: CN=name, OU=role, with
    SANs for ``name``, loopback and ``hosts`` (where the holder serves: replica server, API, etcd).
    Refuses to replace an existing ``NAME.crt`` or ``NAME.key`` unless ``force``."""
    check_name(name, role)
    crt, keyfile = directory / f"{name}.crt", directory / f"{name}.key"
    # etcd's user is the CN: a new certificate of the same name (even of another role) inherits
    # every etcd grant of the one it replaces, and the old holder's files are gone
    for existing in (crt, keyfile):
        if existing.exists() and not force:
            raise ConfigError(f"{existing} exists: a certificate named {name!r} was issued already "
                              "(pass --force to replace it, or choose another name)")
    for host in hosts or []:
        if host.isascii():  # a non-ASCII one gets _san's advice (its IDNA form)
            check_host(host.removeprefix("*."), "--host")  # a wildcard's DNS name is one too
    ca_cert, ca_key = _load_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role.value),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        # every holder is a client of something, and all but the operator serve something
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(_san([name, *LOOPBACK_HOSTS, *(hosts or [])]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write(keyfile, _key_pem(key), private=True)
    _write(crt, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return crt, keyfile


# --- revoking ------------------------------------------------------------------------------------


def read_crl(path: Path, cas: Sequence[x509.Certificate]) -> x509.CertificateRevocationList:
    """The CA-signed revocation list in ``path``; :class:`ConfigError` naming the file unless it is one
    a cluster CA in ``cas`` signed (anyone who can write the file must not be able to revoke or unrevoke;
    during a CA rollover ``ca.crt`` holds both CAs, and the list is either's)."""
    remedy = "copy the CA's revoked.crl again (written by 'unicron certs revoke')"
    data = read_tls_file(path, remedy)
    try:
        crl = x509.load_pem_x509_crl(data)
    except ValueError:
        raise ConfigError(f"TLS: {path}: not a PEM revocation list; {remedy}") from None
    if not any(_signed_by(crl, ca) for ca in cas):
        raise ConfigError(f"TLS: {path}: not signed by this cluster's CA; {remedy}")
    return crl


def _signed_by(crl: x509.CertificateRevocationList, ca: x509.Certificate) -> bool:
    public = ca.public_key()
    return crl.issuer == ca.subject and isinstance(public, ec.EllipticCurvePublicKey) and crl.is_signature_valid(public)


def revoke(directory: Path, name: str) -> tuple[Path, Peer, int]:
    """Add ``NAME.crt``'s serial to the CA's ``revoked.crl`` and move ``NAME.crt``/``NAME.key`` aside
    (``.revoked``): ``etcd-auth`` no longer grants the name, and it can be issued again (a new key).
    Returns the list's path, who was revoked, and the serial."""
    ca_cert, ca_key = _load_ca(directory)
    crt = directory / f"{name}.crt"
    if not crt.is_file():
        raise ConfigError(f"{crt} missing: no certificate named {name!r} is issued in {directory} "
                          "(revoke a name 'ls DIR/*.crt' shows)")
    cert = read_certificate(crt, "it is not one 'unicron certs issue' wrote; remove it")
    peer = peer_of(cert)
    path = directory / CRL_FILE
    kept = [e for e in read_crl(path, [ca_cert]) if e.serial_number != cert.serial_number] if path.exists() else []
    entry = (x509.RevokedCertificateBuilder().serial_number(cert.serial_number)
             .revocation_date(datetime.datetime.now(datetime.UTC)).build())
    _sign_crl(directory, ca_cert, ca_key, [*kept, entry])
    for f in (crt, directory / f"{name}.key"):
        if f.exists():
            os.replace(f, f.with_name(f.name + ".revoked"))
    return path, peer, cert.serial_number


def _sign_crl(directory: Path, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
              revoked: list[x509.RevokedCertificate]) -> Path:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject).last_update(now)
               .next_update(now + datetime.timedelta(days=CA_DAYS)))
    for entry in revoked:
        builder = builder.add_revoked_certificate(entry)
    path = directory / CRL_FILE
    _write(path, builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM), private=False)
    return path


def ensure_crl(directory: Path) -> Path:
    """The CA's ``revoked.crl`` in ``directory``, written empty where there is none yet (a CA made before
    ``init`` wrote one): etcd, started with ``--client-crl-file``, refuses every client while the file
    it names is missing. Needs the CA key only to write it."""
    path = directory / CRL_FILE
    if not path.exists():
        ca_cert, ca_key = _load_ca(directory)
        _sign_crl(directory, ca_cert, ca_key, [])
    return path


class Revocations:
    """The serials a directory's ``revoked.crl`` lists, read again when the file changes (an operator
    copies a new list in; no restart). No file: nothing is revoked. A list that stops being valid
    keeps the last valid one in force (never less revoked because a copy was half done)."""

    #: how often the file is looked at, at most (every authenticated message may ask)
    STAT_INTERVAL_S = 1.0

    def __init__(self, path: Path, cas: Sequence[x509.Certificate]) -> None:
        self.path, self._cas = path, tuple(cas)
        self._serials: frozenset[int] = frozenset()
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) of the file last read
        self._checked = -math.inf
        self._lock = threading.Lock()
        # not strict: TLSConfig.from_dir checked the list at start; one damaged since (a copy half done
        # when the first peer arrives) must leave what was read in force, not refuse every peer
        self._refresh(time.monotonic())

    def _refresh(self, now: float) -> None:
        self._checked = now
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return  # never made smaller by a file that went away: revocation is for good
        if self._seen == (st.st_mtime_ns, st.st_size):
            return
        try:
            crl = read_crl(self.path, self._cas)
        except (ConfigError, OSError):
            log.warning("revocation list unreadable; the last one read stays in force", path=str(self.path))
            return  # the last valid list stays (a copy in progress, a damaged file)
        self._serials = self._serials | {e.serial_number for e in crl}
        self._seen = (st.st_mtime_ns, st.st_size)

    def revoked(self, serial: int) -> bool:
        """Whether the certificate of this serial is revoked (the file looked at, at most once a second)."""
        with self._lock:
            now = time.monotonic()
            if now - self._checked >= self.STAT_INTERVAL_S:
                self._refresh(now)
            return serial in self._serials


# --- reading who a peer is ----------------------------------------------------------------------


def peer_of(cert: x509.Certificate) -> Peer:
    """The role (OU) and name (CN) a certificate carries; :class:`Unauthorized` if it has neither."""
    subject = cert.subject
    cns = subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ous = subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    if len(cns) != 1 or len(ous) != 1:
        raise Unauthorized(f"certificate {subject.rfc4514_string()!r} names no single role (OU) and name (CN)")
    try:
        role = Role(str(ous[0].value))
    except ValueError:
        raise Unauthorized(f"certificate {subject.rfc4514_string()!r}: unknown role {ous[0].value!r}") from None
    return Peer(role, str(cns[0].value), cert.serial_number)


def peer_from_pem(pem: bytes) -> Peer:
    return peer_of(x509.load_pem_x509_certificate(pem))


def require(peer: Peer, role: Role, what: str, name: str | None = None) -> None:
    """Raise :class:`Unauthorized` unless ``peer`` has ``role`` (and, if given, is ``name``)."""
    if peer.role is not role:
        raise Unauthorized(f"{what} needs a {role.value} certificate; this one is {peer}")
    if name is not None and peer.name != name:
        raise Unauthorized(f"{what}: certificate of {peer} cannot act for {role.value} {name!r}")


# --- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TLSConfig:
    """The files one holder needs: the cluster CA and its own certificate and key."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_dir(cls, directory: str | Path, name: str) -> TLSConfig:
        """``DIR/ca.crt``, ``DIR/NAME.crt``, ``DIR/NAME.key`` (the key from systemd's credentials directory
        where the unit passed one: :func:`key_path`); :class:`ConfigError` naming a file missing,
        unreadable or not PEM."""
        d = Path(directory)
        cfg = cls(d / CA_CERT, d / f"{name}.crt", key_path(d, name))
        remedy = f"create it with 'unicron certs init {d}' / 'unicron certs issue --role ROLE {name} --dir {d}'"
        for path in (cfg.ca, cfg.cert, cfg.key):
            try:
                found = path.stat()
            except FileNotFoundError:
                raise ConfigError(f"TLS: {path} missing; {remedy}") from None
            except OSError as exc:  # a directory this user may not search: not "missing"
                raise _unreadable(path, exc, remedy) from None
            if not stat.S_ISREG(found.st_mode):
                raise ConfigError(f"TLS: {path}: not a file; {remedy}")
        # parsed here, so a damaged file is named now, not taken later for a peer refusing the handshake
        cas = read_ca_bundle(cfg.ca, remedy)
        cert = read_certificate(cfg.cert, remedy)
        key = read_private_key(cfg.key, remedy)
        _check_holder(cfg, name, cas, cert, key)
        if (crl := d / CRL_FILE).exists():
            read_crl(crl, cas)  # a damaged list is named at start, not taken for "nothing revoked"
        cfg.revocations()  # read now, while known good: a later damaged copy leaves this one in force
        return cfg

    def expiries(self) -> dict[Path, datetime.datetime]:
        """When the CA and the own certificate expire, read from their files now; :class:`ConfigError`
        naming a file that cannot be read."""
        cert = read_certificate(self.cert, "restore it")
        cas = read_ca_bundle(self.ca, "restore it")
        # the issuer's date, not that of an old CA a rollover's bundle still holds (it may expire first)
        issuers = [ca for ca in cas if _issued_by(cert, ca)] or cas
        return {self.ca: max(ca.not_valid_after_utc for ca in issuers), self.cert: cert.not_valid_after_utc}

    def peer(self) -> Peer:
        """Who this configuration's own certificate names."""
        return peer_from_pem(read_tls_file(self.cert, "restore it"))

    def revocations(self) -> Revocations:
        """The revocation list next to this configuration's CA (one reader per CA file and process)."""
        with _REVOCATIONS_LOCK:
            found = _REVOCATIONS.get(self.ca)
            if found is None:
                cas = read_ca_bundle(self.ca, "restore the cluster's ca.crt")
                found = _REVOCATIONS[self.ca] = Revocations(self.ca.with_name(CRL_FILE), cas)
            return found

    def admit(self, cert: x509.Certificate) -> Peer:
        """Who a certificate a handshake verified names; :class:`Unauthorized` if the CA revoked it."""
        peer = peer_of(cert)
        if self.revocations().revoked(cert.serial_number):
            raise Unauthorized(f"the certificate of {peer} (serial {cert.serial_number:x}) is revoked "
                               f"({self.ca.with_name(CRL_FILE)}); issue its holder a new one")
        return peer

    def still_admitted(self, peer: Peer) -> bool:
        """Whether a peer admitted earlier (a long-lived connection) is not revoked since."""
        return peer.serial is None or not self.revocations().revoked(peer.serial)

    def peer_of_socket(self, sock: ssl.SSLSocket) -> Peer:
        """The admitted peer of a verified TLS connection."""
        der = sock.getpeercert(binary_form=True)
        if not der:
            raise Unauthorized("the peer showed no certificate on this connection")
        return self.admit(x509.load_der_x509_certificate(der))

    def peer_of_grpc(self, context: Any) -> Peer:
        """The admitted client of a gRPC call (``context.auth_context()``)."""
        pems = context.auth_context().get("x509_pem_cert") or []
        if not pems:
            raise Unauthorized("no client certificate on this call; use one issued by 'unicron certs issue'")
        return self.admit(x509.load_pem_x509_certificate(pems[0]))

    def _pem(self) -> tuple[bytes, bytes, bytes]:
        return self.ca.read_bytes(), self.key.read_bytes(), self.cert.read_bytes()

    def grpc_server_credentials(self) -> grpc.ServerCredentials:
        ca, key, cert = self._pem()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials:
        ca, key, cert = self._pem()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def server_context(self) -> ssl.SSLContext:
        """For a TCP server that requires a client certificate signed by the cluster CA."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca))
        ctx.load_cert_chain(str(self.cert), str(self.key))
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """For a TCP client: checks the server's certificate and host name, presents its own."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca))
        ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class ExpiryWatch:
    """A daemon's check of its CA's and certificate's end while it runs: certificates issued together
    expire together, and then every handshake of the cluster fails at once. Checked at start, then
    every ``interval_s`` (:meth:`poll` from a loop the daemon has, or :meth:`start`'s thread); within
    ``within_days`` of the end a warning at most once a day (a daemon runs for weeks: a warning only at
    start was never repeated). :meth:`days_left` is for a metrics gauge. The wall ``clock`` is compared
    with the certificates' dates only; the checks and the warnings' repeats are timed by ``monotonic``
    (an agent whose clock was stepped back, say from a bad RTC by NTP, checked nothing again until its
    wall clock caught up with the time of its last check)."""

    def __init__(self, cfg: TLSConfig, interval_s: float = EXPIRY_CHECK_INTERVAL_S,
                 within_days: int = EXPIRY_WARNING_DAYS,
                 clock: Callable[[], datetime.datetime] = _utcnow,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.clock, self.monotonic = cfg, clock, monotonic
        self.interval_s = interval_s
        self.within = datetime.timedelta(days=within_days)
        self._expires: datetime.datetime | None = None  # the sooner end, as last read
        self._checked_at: float | None = None  # monotonic
        self._warned_at: float | None = None  # monotonic

    def poll(self) -> None:
        """:meth:`check` when ``interval_s`` has passed since the last check (or there was none)."""
        if self._checked_at is None or self.monotonic() - self._checked_at >= self.interval_s:
            self.check()

    def check(self) -> None:
        """Read the dates again; warn of those within the window unless a warning came in the last day."""
        now, self._checked_at = self.clock(), self.monotonic()
        try:
            expiries = self.cfg.expiries()
        except ConfigError as exc:  # moved or damaged since start: the daemon runs on with what it read
            log.warning("TLS certificate expiry not checked", error=str(exc))
            return
        self._expires = min(expiries.values())
        soon = {path: end for path, end in expiries.items() if end - now < self.within}
        repeat_s = EXPIRY_WARNING_REPEAT.total_seconds()
        if not soon or (self._warned_at is not None and self._checked_at - self._warned_at < repeat_s):
            return
        self._warned_at = self._checked_at
        for path, expires in soon.items():
            log.warning("TLS certificate expires soon; issue a new one ('unicron certs issue --force') and "
                        "copy it here before then, or every handshake fails", path=str(path),
                        expires=expires.isoformat(), days_left=round((expires - now) / datetime.timedelta(days=1), 1))

    def days_left(self) -> float | None:
        """Days until the sooner of the CA's and the certificate's end, as last read (None: unread)."""
        expires = self._expires
        return None if expires is None else (expires - self.clock()) / datetime.timedelta(days=1)

    def start(self, stop: threading.Event) -> threading.Thread:
        """Check every ``interval_s`` on a daemon thread until ``stop`` is set (for a daemon with no
        periodic loop that always runs: a standby coordinator's)."""
        def run() -> None:
            while not stop.wait(self.interval_s):
                self.check()

        thread = threading.Thread(target=run, name="tls-expiry", daemon=True)
        thread.start()
        return thread


def _public_der(key: PublicKeyTypes) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _check_holder(cfg: TLSConfig, name: str, cas: Sequence[x509.Certificate], cert: x509.Certificate,
                  key: PrivateKeyTypes) -> None:
    """:class:`ConfigError` unless ``key`` is ``cert``'s, a CA of the bundle ``cas`` issued ``cert`` and both
    are within their dates: otherwise every handshake fails, which gRPC reports as the peer unreachable
    ("start etcd"), and a daemon retried it forever. Only the issuer's dates count: during a CA rollover
    the bundle still holds the old CA, perhaps expired, and TLS trusts the new one regardless."""
    reissue = (f"issue it again on the CA's machine ('unicron certs issue --force --role ROLE {name} --dir CA_DIR') "
               f"and copy ca.crt, {name}.crt and {name}.key here")
    if _public_der(cert.public_key()) != _public_der(key.public_key()):
        raise ConfigError(f"TLS: {cfg.key} is not the key of {cfg.cert} (another holder's key, or one from an "
                          f"earlier issue); copy the {name}.key issued with it, or {reissue}")
    issuers = [ca for ca in cas if _issued_by(cert, ca)]
    if not issuers:
        raise ConfigError(f"TLS: {cfg.cert} was not issued by the CA in {cfg.ca} (another CA's certificate, or the CA "
                          f"was re-created with 'unicron certs init --force'); copy this cluster's ca.crt here, "
                          f"or {reissue}") from None
    now = datetime.datetime.now(datetime.UTC)
    # a valid issuer where there is one (two CAs of one name, the old expired); else the first is named
    ca = next((c for c in issuers if c.not_valid_before_utc <= now <= c.not_valid_after_utc), issuers[0])
    for path, c in ((cfg.ca, ca), (cfg.cert, cert)):
        if now < c.not_valid_before_utc:
            raise ConfigError(f"TLS: {path} is not valid before {c.not_valid_before_utc:%Y-%m-%d %H:%M} UTC and it "
                              f"is {now:%Y-%m-%d %H:%M} UTC here: check this machine's clock")
        if now > c.not_valid_after_utc:
            renew = ("create a new CA ('unicron certs init --force') and issue every certificate again" if c is ca
                     else reissue)
            raise ConfigError(f"TLS: {path} expired on {c.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; {renew}")


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def key_path(directory: Path, name: str) -> Path:
    """Where NAME's key is read from: the systemd credential NAME.key when the unit was given one
    (``LoadCredential=NAME.key:...``; the coordinator's dynamic user cannot read root's 0600 key in the
    TLS directory), else ``DIR/NAME.key``. Certificates and the revocation list stay in the directory:
    they are public, and the list is read again there while the daemon runs."""
    credentials = os.environ.get(CREDENTIALS_ENV, "")
    if credentials and (given := Path(credentials) / f"{name}.key").exists():
        return given
    return directory / f"{name}.key"


_REVOCATIONS: dict[Path, Revocations] = {}
_REVOCATIONS_LOCK = threading.Lock()


def load(directory: str, name: str, role: Role | None = None) -> TLSConfig | None:
    """The TLS configuration of a daemon's ``--tls-dir`` (None: empty, plaintext); with ``role``,
    :class:`ConfigError` unless the certificate there is that role's, named ``name``, and in any case
    for a certificate named etcd's superuser that is not the etcd admin's."""
    if not directory:
        return None
    cfg = TLSConfig.from_dir(directory, name)
    try:
        peer = cfg.peer()
    except (ValueError, Unauthorized) as exc:
        raise ConfigError(f"TLS: {cfg.cert}: not a certificate from 'unicron certs issue' ({exc})") from exc
    _check_superuser(peer.name, peer.role)  # one issued before 'unicron certs issue' refused it
    if role is not None and peer != Peer(role, name):
        raise ConfigError(f"TLS: {cfg.cert} is the certificate of {peer}, not of {role.value} {name!r}; "
                          f"issue one with 'unicron certs issue --role {role.value} {name}'")
    return cfg


def from_env() -> TLSConfig | None:
    """The certificate named by ``UNICRON_TLS_DIR`` / ``UNICRON_TLS_NAME`` (None: plaintext): what a
    rank the agent launched uses for its node's channels (the checkpoint replica servers)."""
    directory = os.environ.get(ENV_DIR, "")
    return load(directory, os.environ.get(ENV_NAME, "")) if directory else None


def plaintext_warning(what: str, flag: str = "--tls-dir / UNICRON_TLS_DIR") -> str:
    """The one line a daemon logs when it starts without TLS."""
    return (f"plaintext: anyone who can reach {what} can act on this cluster, unauthenticated; "
            f"use {flag} (see 'unicron certs' and docs/api.md)")
