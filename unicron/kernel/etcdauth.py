"""etcd's own auth, per role, for a cluster whose etcd runs with ``--client-cert-auth`` (issue 17).

With client certificate auth, etcd takes a request's certificate CN as its user. :func:`setup`
creates one etcd user per Unicron certificate and grants it a role of key ranges under the cluster's
prefix (:func:`grants`), then enables auth. Users get a random password no one keeps: they
authenticate by certificate only.

What etcd can express is key ranges, not record contents, so:

* a node may write only its own ``nodes/<node>``, ``status/<node>``, ``results/<node>``,
  ``reports/<node>/`` and ``inject/<node>/`` (it deletes requests it handled); it reads everything
  under the prefix (it needs peers' registrations for checkpoint replicas, the leader key, its
  assignment);
* a node also writes ``stores/``, the whole range: a store address is keyed by task, not node, so
  etcd cannot tell one node's from another's (docs/api.md says so);
* the coordinator reads and writes the whole prefix; an operator (the CLI) reads it and writes
  ``inject/`` and ``drain/``.

:func:`revoke` deletes a revoked certificate's user and role (``unicron certs revoke --etcd``).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from pyetcd.etcdrpc import auth_pb2, rpc_pb2, rpc_pb2_grpc

from unicron.kernel.errors import ConfigError
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.tls import ETCD_SUPERUSER, Peer, Role, TLSConfig

READ, WRITE, READWRITE = "READ", "WRITE", "READWRITE"
#: etcd's superuser; its certificate (CN=root) is the one that sets auth up
ROOT = ETCD_SUPERUSER


@dataclass(frozen=True)
class Grant:
    """Permission ``perm`` on ``key`` (exact) or, with ``prefix``, on every key starting with it."""

    perm: str
    key: str
    prefix: bool = False

    def range_end(self) -> bytes:
        if not self.prefix:
            return b""
        end = bytearray(self.key.encode())
        end[-1] += 1  # etcd's prefix range: [key, key with its last byte + 1)
        return bytes(end)


def grants(keys: Keyspace, peer: Peer) -> list[Grant]:
    """The key ranges ``peer``'s etcd role holds (see the module doc)."""
    everything = Grant(READ, keys.prefix.rstrip("/") + "/", prefix=True)
    if peer.role is Role.COORDINATOR:
        return [Grant(READWRITE, everything.key, prefix=True)]
    if peer.role is Role.OPERATOR:
        # drain/ is the coordinator's record of a drain decided through its API: an operator's write
        # there would drain nothing, so it is not granted
        return [everything, Grant(READWRITE, keys.injections("")[:-1], prefix=True)]
    if peer.role is Role.NODE:
        n = peer.name
        return [everything, Grant(READWRITE, keys.node(n)), Grant(READWRITE, keys.status(n)),
                Grant(READWRITE, keys.result(n)), Grant(READWRITE, keys.report(n, ""), prefix=True),
                Grant(READWRITE, keys.injections(n), prefix=True), Grant(READWRITE, keys.stores(), prefix=True)]
    raise ConfigError(f"etcd auth: {peer} has no Unicron etcd role (roles: coordinator, operator, node)")


def role_name(keys: Keyspace, peer: Peer) -> str:
    """One etcd role per user and cluster prefix, so clusters sharing an etcd do not share grants."""
    return f"unicron{keys.prefix.rstrip('/').replace('/', '.')}.{peer.role.value}.{peer.name}"


def _ignore_exists(call: grpc.UnaryUnaryMultiCallable, request: object) -> None:
    try:
        call(request, timeout=10)
    except grpc.RpcError as exc:
        # re-running setup (a node added) finds the earlier users and roles: that is fine
        if "already exists" not in (exc.details() or ""):
            raise


def setup(endpoint: str, admin: TLSConfig, keys: Keyspace, peers: Iterable[Peer]) -> list[str]:
    """Create the users and roles of ``peers`` in the etcd at ``endpoint`` and enable auth, as ``root``
    (``admin`` must be a certificate with CN=root). Idempotent; returns the role names granted."""
    creds = admin.grpc_channel_credentials()
    done: list[str] = []
    try:
        with grpc.secure_channel(endpoint, creds) as channel:
            stub = rpc_pb2_grpc.AuthStub(channel)
            _ignore_exists(stub.UserAdd, rpc_pb2.AuthUserAddRequest(name=ROOT, password=secrets.token_urlsafe(24)))
            stub.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user=ROOT, role=ROOT), timeout=10)
            for peer in peers:
                role = role_name(keys, peer)
                _ignore_exists(stub.UserAdd, rpc_pb2.AuthUserAddRequest(name=peer.name,
                                                                        password=secrets.token_urlsafe(24)))
                _ignore_exists(stub.RoleAdd, rpc_pb2.AuthRoleAddRequest(name=role))
                for g in grants(keys, peer):
                    perm = auth_pb2.Permission(permType=g.perm, key=g.key.encode(), range_end=g.range_end())
                    stub.RoleGrantPermission(rpc_pb2.AuthRoleGrantPermissionRequest(name=role, perm=perm), timeout=10)
                stub.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user=peer.name, role=role), timeout=10)
                done.append(role)
            stub.AuthEnable(rpc_pb2.AuthEnableRequest(), timeout=10)
    except grpc.RpcError as exc:
        raise ConfigError(
            f"etcd auth setup at {endpoint} failed ({exc.code().name}: {exc.details()}); "
            "it needs etcd with TLS and --client-cert-auth, and a certificate named root "
            "('unicron certs issue --role etcd root')"
        ) from exc
    return done


def revoke(endpoint: str, admin: TLSConfig, keys: Keyspace, peer: Peer) -> bool:
    """Delete ``peer``'s etcd user and role (a revoked certificate), as ``root``: etcd takes a
    certificate's CN as its user, so its requests are refused from now on, on connections it holds
    too. False if etcd had no such user (never granted, or revoked before)."""
    try:
        with grpc.secure_channel(endpoint, admin.grpc_channel_credentials()) as channel:
            stub = rpc_pb2_grpc.AuthStub(channel)
            found = True
            try:
                stub.UserDelete(rpc_pb2.AuthUserDeleteRequest(name=peer.name), timeout=10)
            except grpc.RpcError as exc:
                if "not found" not in (exc.details() or ""):
                    raise
                found = False
            try:
                stub.RoleDelete(rpc_pb2.AuthRoleDeleteRequest(role=role_name(keys, peer)), timeout=10)
            except grpc.RpcError as exc:
                if "not found" not in (exc.details() or ""):
                    raise
    except grpc.RpcError as exc:
        raise ConfigError(
            f"etcd auth at {endpoint}: removing user {peer.name!r} failed ({exc.code().name}: {exc.details()}); "
            "it needs the etcd admin's certificate (DIR/root.crt); the certificate is revoked in DIR/revoked.crl "
            "regardless: run the command again to remove the user"
        ) from exc
    return found
