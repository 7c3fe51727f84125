"""``unicron certs init|issue``: the cluster CA and role certificates for mutual TLS (docs/api.md).

``init DIR`` creates the CA; ``issue --role ROLE NAME`` a certificate signed by it, whose subject
names the holder (CN=NAME) and its role (OU=ROLE). Copy ``ca.crt`` and the holder's ``NAME.crt`` /
``NAME.key`` to the holder's machine and point its ``--tls-dir`` there; ``ca.key`` never leaves the
machine that issues.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from unicron.kernel import tls


def _default_dir() -> str:
    return os.environ.get("UNICRON_TLS_DIR") or "certs"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("certs", help="create the cluster CA and role certificates for mutual TLS")
    certs = p.add_subparsers(dest="certs_command", metavar="ACTION", required=True)
    q = certs.add_parser("init", help="create a cluster CA (ca.crt, ca.key) in DIR")
    q.add_argument("dir", metavar="DIR")
    q.add_argument("--force", action="store_true", help="replace an existing CA (every issued certificate stops working)")
    q.set_defaults(func=cmd_init)
    q = certs.add_parser("issue", help="issue NAME.crt / NAME.key for a role, signed by the CA in --dir")
    q.add_argument("name", metavar="NAME", help="the holder: a node's name, an operator's user name, 'coordinator'")
    q.add_argument("--role", required=True, choices=[r.value for r in tls.Role],
                   help="operator (submit/cancel/drain), node (an agent), coordinator, etcd (the etcd server)")
    q.add_argument("--dir", default=_default_dir(), help="the CA's directory (env: UNICRON_TLS_DIR; default ./certs)")
    q.add_argument("--host", action="append", default=[], metavar="HOST",
                   help="a DNS name or IP address the holder serves on (repeatable; NAME and loopback are always in)")
    q.set_defaults(func=cmd_issue)


def cmd_init(args: argparse.Namespace) -> int:
    path = tls.init_ca(Path(args.dir), force=args.force)
    print(f"CA written: {path} (keep {Path(args.dir) / tls.CA_KEY} on this machine only)")
    return 0


def cmd_issue(args: argparse.Namespace) -> int:
    crt, key = tls.issue(Path(args.dir), tls.Role(args.role), args.name, hosts=args.host)
    print(f"{args.role} certificate for {args.name!r}: {crt} {key}")
    return 0
