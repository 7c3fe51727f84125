"""``unicron certs init|issue|revoke|etcd-auth``: the cluster CA and role certificates for mutual TLS (docs/api.md).

``init DIR`` creates the CA; ``issue --role ROLE NAME`` a certificate signed by it, whose subject
names the holder (CN=NAME) and its role (OU=ROLE). Copy ``ca.crt`` and the holder's ``NAME.crt`` /
``NAME.key`` to the holder's machine and point its ``--tls-dir`` there; ``ca.key`` never leaves the
machine that issues.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from unicron.kernel import etcdauth, tls
from unicron.kernel.errors import ConfigError
from unicron.kernel.keyspace import DEFAULT_PREFIX, Keyspace


def _default_dir() -> str:
    return os.environ.get("UNICRON_TLS_DIR") or "certs"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("certs", help="create the cluster CA and role certificates for mutual TLS")
    certs = p.add_subparsers(dest="certs_command", metavar="ACTION", required=True)
    q = certs.add_parser("init", help="create a cluster CA (ca.crt, ca.key) in DIR")
    q.add_argument("dir", metavar="DIR")
    q.add_argument("--force", action="store_true", help="replace an existing CA (every issued certificate stops working)")
    q.add_argument("--days", type=_days, default=tls.CA_DAYS,
                   help=f"how long the CA is valid; every certificate stops working with it (default {tls.CA_DAYS})")
    q.set_defaults(func=cmd_init)
    q = certs.add_parser("issue", help="issue NAME.crt / NAME.key for a role, signed by the CA in --dir")
    q.add_argument("name", metavar="NAME", help="the holder: a node's name, an operator's user name, 'coordinator'")
    q.add_argument("--role", required=True, choices=[r.value for r in tls.Role],
                   help="operator (submit/cancel/drain), node (an agent), coordinator, etcd (the etcd server)")
    q.add_argument("--dir", default=_default_dir(), help="the CA's directory (env: UNICRON_TLS_DIR; default ./certs)")
    q.add_argument("--host", action="append", default=[], metavar="HOST",
                   help="a DNS name or IP address the holder serves on (repeatable; NAME and loopback are always in)")
    q.add_argument("--force", action="store_true",
                   help="replace an existing NAME.crt / NAME.key (its holder's certificate stops working)")
    q.add_argument("--days", type=_days, default=tls.LEAF_DAYS,
                   help=f"how long the certificate is valid (default {tls.LEAF_DAYS}); daemons warn 30 days before")
    q.set_defaults(func=cmd_issue)
    q = certs.add_parser("revoke", help="revoke NAME's certificate: add it to DIR/revoked.crl (copy that next to "
                                         "ca.crt everywhere) and, with --etcd, delete its etcd user")
    q.add_argument("name", metavar="NAME", help="the holder whose certificate is revoked (a lost or retired node, ...)")
    q.add_argument("--dir", default=_default_dir(), help="the CA's directory (env: UNICRON_TLS_DIR; default ./certs)")
    q.add_argument("--etcd", default="", metavar="HOST:PORT",
                   help="also delete NAME's etcd user and role there, as DIR/root.crt (etcd auth)")
    q.add_argument("--prefix", default=os.environ.get("UNICRON_PREFIX", DEFAULT_PREFIX),
                   help=f"the cluster's etcd key prefix (env: UNICRON_PREFIX; default {DEFAULT_PREFIX})")
    q.set_defaults(func=cmd_revoke)
    q = certs.add_parser("etcd-auth", help="create etcd users/roles for every certificate in --dir and enable "
                                            "etcd auth (run as root: DIR/root.crt)")
    q.add_argument("--dir", default=_default_dir(), help="the certificates (env: UNICRON_TLS_DIR; default ./certs)")
    q.add_argument("--etcd", default=os.environ.get("UNICRON_ETCD", "127.0.0.1:2379"),
                   help="one etcd endpoint host:port (env: UNICRON_ETCD)")
    q.add_argument("--prefix", default=os.environ.get("UNICRON_PREFIX", DEFAULT_PREFIX),
                   help=f"the cluster's etcd key prefix (env: UNICRON_PREFIX; default {DEFAULT_PREFIX})")
    q.set_defaults(func=cmd_etcd_auth)


def _days(text: str) -> int:
    try:
        days = int(text)
    except ValueError:
        days = 0
    if days < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of days, at least 1")
    return days


@contextlib.contextmanager
def _writing(directory: str) -> Iterator[None]:
    """An unwritable directory is one line naming it, not a traceback."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(f"{directory}: cannot write certificates there ({exc.strerror}); pick another --dir") from exc


def cmd_init(args: argparse.Namespace) -> int:
    with _writing(args.dir):
        path = tls.init_ca(Path(args.dir), force=args.force, days=args.days)
    print(f"CA written: {path} (keep {Path(args.dir) / tls.CA_KEY} on this machine only)")
    return 0


def cmd_issue(args: argparse.Namespace) -> int:
    with _writing(args.dir):
        crt, key = tls.issue(Path(args.dir), tls.Role(args.role), args.name, hosts=args.host, days=args.days,
                             force=args.force)
    print(f"{args.role} certificate for {args.name!r}: {crt} {key}")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    with _writing(args.dir):
        crl, peer, serial = tls.revoke(directory, args.name)
    print(f"revoked the certificate of {peer} (serial {serial:x}): copy {crl} next to ca.crt on the "
          "coordinator's and every node's machine, and where etcd's --client-crl-file names it "
          "(read within a second, by etcd at each connection; no restart)")
    if args.etcd and peer.name == etcdauth.ROOT:
        # etcd cannot delete its root user while auth is on; the list is what refuses the old certificate
        print(f"etcd user {peer.name!r} kept (etcd's administrator): etcd refuses the revoked certificate by "
              "the list; issue a new root certificate to administer etcd")
    elif args.etcd:
        admin = tls.TLSConfig.from_dir(directory, etcdauth.ROOT)
        found = etcdauth.revoke(args.etcd, admin, Keyspace(args.prefix), peer)
        print(f"etcd user {peer.name!r} " + ("deleted" if found else "was not there") + f" at {args.etcd}")
    return 0


def holders(directory: Path) -> list[tls.Peer]:
    """The Unicron certificates issued into ``directory`` (not the CA's, etcd's or root's)."""
    stray = "every *.crt in --dir but ca.crt must be one from 'unicron certs issue'; move it out of --dir"
    peers = []
    for crt in sorted(directory.glob("*.crt")):
        if crt.name == tls.CA_CERT:
            continue
        try:
            peer = tls.peer_of(tls.read_certificate(crt, stray))
        except tls.Unauthorized as exc:  # a certificate, but not one of this cluster's roles
            raise ConfigError(f"{crt}: {exc}; {stray}") from exc
        tls.check_name(peer.name, peer.role)  # e.g. an operator named root: etcd's superuser
        if peer.role is not tls.Role.ETCD:
            peers.append(peer)
    return peers


def cmd_etcd_auth(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    admin = tls.TLSConfig.from_dir(directory, etcdauth.ROOT)
    peers = holders(directory)
    etcdauth.setup(args.etcd, admin, Keyspace(args.prefix), peers)
    print(f"etcd auth enabled at {args.etcd}: " + ", ".join(str(p) for p in peers))
    return 0
