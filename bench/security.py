"""Forbidden requests against the secure cluster: how many get in (issue 17; target 0).

Real etcd (TLS, ``--client-cert-auth``, per-role auth), a coordinator and 2 agents on mutual TLS
(``LocalCluster(tls=True)``), real certificates. A scripted set of requests that must be refused is
sent: no certificate, a certificate of another CA, a node's certificate submitting or draining, node
A writing node B's status and reports in etcd, node A filing a fault of node B under its own key
(accepted when the coordinator records it as B's incident rather than deleting it unread), node A's
certificate saying hello as node B on the link (with B's real token: the certificate is the guard), an operator's certificate on the link,
an operator's certificate at a replica server, and (once per run) an operator's and a node's certificates
revoked with ``unicron certs revoke --etcd`` after they were used. ``unauthorized_accepted`` counts those that get past
the guard. An API call counts as refused only when answered PERMISSION_DENIED or UNAUTHENTICATED (the
role check) or UNAVAILABLE (the TLS handshake refused); any other answer (NOT_FOUND, ALREADY_EXISTS...)
came from the handler, past the guard, and counts as accepted. The task the forbidden cancel names
exists when it is sent (the operator submitted it first), so a missing role check shows as OK.

Controls in the same run (the figure means nothing if the allowed requests fail too): the operator
submits and cancels (both answered OK), node A writes its own status, node B's peer stores a replica,
the revoked certificates' requests before their revocation;
after the last round, node B's own certificate and token say hello on the link and must be welcomed
(last, because that hello replaces B's live link), so a link probe that cannot see a welcome does not
read as refusals. ``controls_ok`` says they all did.

    .venv/bin/python bench/security.py [--quick]

``--quick`` and a full run send the same set (it is a script, not a sample); the full run repeats it
3 times. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import ssl
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckpt.api import Snapshot, SnapshotInfo
from ckpt.codec import chunk_crcs, crc
from ckpt.replica import ReplicaClient, ReplicaServer
from unicron.cluster.localcluster import LocalCluster
from unicron.kernel import etcdauth, link, tls, wire
from unicron.kernel.errors import UnicronError
from unicron.kernel.etcd import Store
from unicron.kernel.proto import coordinator_pb2 as pb
from unicron.kernel.proto import coordinator_pb2_grpc as pb_grpc
from unicron.kernel.types import DetectionMethod, ErrorKind, NodeInfo, Report

SPEC = {"name": "probe", "command": [sys.executable, "-c", "import time; time.sleep(600)"], "min_gpus": 1}

#: the answers that mean the caller was turned away: the API's role check (coordinator.api.authorize)
#: or a TLS handshake the server would not complete; any other error came from past the guard
REFUSED = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                     grpc.StatusCode.UNAVAILABLE})


def api_status(address: str, cfg: tls.TLSConfig | None, rpc: str, request: object) -> grpc.StatusCode:
    """The coordinator's answer to one call: OK, or the error's status code."""
    creds = cfg.grpc_channel_credentials() if cfg is not None else None
    with (grpc.secure_channel(address, creds) if creds is not None else grpc.insecure_channel(address)) as ch:
        stub = pb_grpc.CoordinatorStub(ch)  # type: ignore[no-untyped-call]  # generated, unannotated
        try:
            getattr(stub, rpc)(request, timeout=3)
        except grpc.RpcError as exc:
            code: grpc.StatusCode = exc.code()
            return code
    return grpc.StatusCode.OK


def api_accepted(address: str, cfg: tls.TLSConfig | None, rpc: str, request: object) -> bool:
    """True when a forbidden call got past the guard: any answer but a refusal (a NOT_FOUND is the
    handler's, so the role check let it through)."""
    return api_status(address, cfg, rpc, request) not in REFUSED


def api_ok(address: str, cfg: tls.TLSConfig | None, rpc: str, request: object) -> bool:
    """True when an allowed call (a control) was answered OK."""
    return api_status(address, cfg, rpc, request) is grpc.StatusCode.OK


def etcd_put(endpoint: str, cfg: tls.TLSConfig | None, key: str) -> bool:
    store = Store(endpoint, timeout_s=2.0, tls_config=cfg)
    try:
        store.put(key, "{}")
    except UnicronError:
        return False
    finally:
        store.close()
    return True


def forged_report(c: LocalCluster, cfg: tls.TLSConfig | None) -> bool:
    """node0 writes, under its own key, an ECC error of node1: accepted when the coordinator records it
    as node1's incident (it isolates node1); refused when it deletes the report with no incident."""
    ts = time.time()
    report = Report(method=DetectionMethod.EXCEPTION_PROPAGATION, kind=ErrorKind.ECC_ERROR, node="node1",
                    message=f"forged by node0 {ts}", source_ts=ts, agent_ts=ts)
    key = c.keys.report("node0", report.report_id)
    store = Store(c.etcd.endpoint, timeout_s=2.0, tls_config=cfg)
    try:
        store.put(key, report.to_json())
        deadline = time.monotonic() + 10.0
        while store.get(key) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        read = store.get(key) is None  # the coordinator handled it: recorded or deleted
    finally:
        store.close()
    return not read or any(i.node == "node1" and i.message == report.message for i in c.incidents())


def link_hello(address: str, cfg: tls.TLSConfig | None, node: str, token: str) -> bool:
    """True when the coordinator welcomed the hello. A welcomed probe is closed at once."""
    host, _, port = address.rpartition(":")
    raw = socket.create_connection((host, int(port)), timeout=3.0)
    try:
        sock = cfg.client_context().wrap_socket(raw, server_hostname=host) if cfg is not None else raw
        conn = wire.LineSocket(sock)
        conn.send(link.LinkHello(node=node, token=token).to_wire())
        line = conn.recv_line()
        return line is not None and isinstance(link.parse(wire.decode(line)), link.Welcome)
    except (OSError, ssl.SSLError, UnicronError):
        return False
    finally:
        raw.close()


def replica_put(address: str, cfg: tls.TLSConfig | None) -> bool:
    meta, data = b"probe", memoryview(bytearray(4096))
    info = SnapshotInfo(job="probe", rank=0, iteration=1, meta_len=len(meta), meta_crc=crc(meta), data_len=len(data),
                        chunk_bytes=4096, chunk_crcs=chunk_crcs(data, 4096), created=0.0)
    try:
        ReplicaClient(address, timeout_s=3.0, tls_config=cfg).put(Snapshot(info, meta, data))
    except UnicronError:
        return False
    return True


def leader_addresses(c: LocalCluster) -> dict[str, str]:
    """The leading coordinator's addresses ("api", "link") from its leader key."""
    assert c.store is not None
    kv = c.store.get(c.keys.leader())
    assert kv is not None
    addrs: dict[str, str] = json.loads(kv.value)
    return addrs


def node_token(c: LocalCluster, node: str) -> str:
    """``node``'s link token from its registration (readable by any node: not the guard)."""
    assert c.store is not None
    info = c.store.get(c.keys.node(node))
    assert info is not None
    return NodeInfo.from_json(info.value).link_token


def run_once(c: LocalCluster, foreign: Path, replica: str, task: str) -> tuple[dict[str, bool], dict[str, bool]]:
    """(forbidden request -> accepted?, control request -> accepted?); ``task`` is this round's task name."""
    addrs = leader_addresses(c)
    api, link_addr, ep = addrs["api"], addrs["link"], c.etcd.endpoint
    cert: Callable[[str], tls.TLSConfig] = lambda name: tls.TLSConfig.from_dir(c.tls_dir, name)  # noqa: E731
    ca = Path(c.tls_dir) / tls.CA_CERT
    stranger = tls.TLSConfig(ca, foreign / "operator.crt", foreign / "operator.key")
    stranger_node = tls.TLSConfig(ca, foreign / "node0.crt", foreign / "node0.key")
    token_b = node_token(c, "node1")
    submit = pb.SubmitRequest(spec_json=json.dumps({**SPEC, "name": task}))
    cancel = pb.CancelRequest(name=task)
    # the task exists before the forbidden requests: a cancel that got past the guard is then answered OK
    submitted = api_ok(api, cert("operator"), "Submit", submit)
    forbidden: dict[str, Callable[[], bool]] = {
        "api submit, no certificate": lambda: api_accepted(api, None, "Submit", submit),
        "api submit, another CA's operator": lambda: api_accepted(api, stranger, "Submit", submit),
        "api submit, node certificate": lambda: api_accepted(api, cert("node0"), "Submit", submit),
        "api drain, node certificate": lambda: api_accepted(api, cert("node0"), "Drain", pb.NodeRequest(node="node1")),
        "api cancel, coordinator certificate": lambda: api_accepted(api, cert("coordinator"), "Cancel", cancel),
        "etcd: node A writes node B's status": lambda: etcd_put(ep, cert("node0"), c.keys.status("node1")),
        "etcd: node A writes node B's report": lambda: etcd_put(ep, cert("node0"), c.keys.report("node1", "x")),
        "etcd: node A files node B's fault under its own key": lambda: forged_report(c, cert("node0")),
        "etcd: node writes its own assignment": lambda: etcd_put(ep, cert("node0"), c.keys.assignment("node0")),
        "etcd: operator writes a node's status": lambda: etcd_put(ep, cert("operator"), c.keys.status("node0")),
        "etcd: no certificate": lambda: etcd_put(ep, None, c.keys.task("x")),
        "etcd: another CA's certificate": lambda: etcd_put(ep, stranger, c.keys.task("x")),
        "link: node A's certificate as node B": lambda: link_hello(link_addr, cert("node0"), "node1", token_b),
        "link: operator certificate": lambda: link_hello(link_addr, cert("operator"), "node1", token_b),
        "link: no certificate": lambda: link_hello(link_addr, None, "node1", token_b),
        "link: another CA's node certificate": lambda: link_hello(link_addr, stranger_node, "node1", token_b),
        "replica: operator certificate": lambda: replica_put(replica, cert("operator")),
        "replica: no certificate": lambda: replica_put(replica, None),
    }
    controls: dict[str, Callable[[], bool]] = {
        "api submit, operator": lambda: submitted,
        "etcd: node writes its own status": lambda: etcd_put(ep, cert("node0"), c.keys.status("node0")),
        "replica: peer node": lambda: replica_put(replica, cert("node0")),
        "api cancel, operator": lambda: api_ok(api, cert("operator"), "Cancel", cancel),
    }
    return ({k: f() for k, f in forbidden.items()}, {k: f() for k, f in controls.items()})


def revocation_probes(c: LocalCluster, replica: str, held: Path) -> tuple[dict[str, bool], dict[str, bool]]:
    """An operator and a node certificate issued and granted in etcd, used (controls: they get in),
    then revoked as an operator would (``unicron certs revoke --etcd``: the CA's revoked.crl, which
    the daemons read next to their ca.crt, and the etcd users deleted); the holders keep their copies
    (``held``) and try again (forbidden)."""
    directory = Path(c.tls_dir)
    names = {"retired-operator": tls.Role.OPERATOR, "retired-node": tls.Role.NODE}
    for name, role in names.items():
        tls.issue(directory, role, name)
        for suffix in (".crt", ".key"):
            shutil.copy(directory / f"{name}{suffix}", held / f"{name}{suffix}")
    shutil.copy(directory / tls.CA_CERT, held / tls.CA_CERT)
    admin = tls.TLSConfig.from_dir(directory, etcdauth.ROOT)
    etcdauth.setup(c.etcd.endpoint, admin, c.keys, [tls.Peer(role, name) for name, role in names.items()])
    op, node = tls.TLSConfig.from_dir(held, "retired-operator"), tls.TLSConfig.from_dir(held, "retired-node")
    api, ep = leader_addresses(c)["api"], c.etcd.endpoint
    probes: dict[str, Callable[[], bool]] = {
        "api undrain, revoked operator": lambda: api_accepted(api, op, "Undrain", pb.NodeRequest(node="node1")),
        "etcd: revoked operator writes an injection": lambda: etcd_put(ep, op, c.keys.injection("node0", "revoked")),
        "replica: revoked node": lambda: replica_put(replica, node),
    }
    before = {f"{k} (before its revocation)": f() for k, f in probes.items()}
    for name, role in names.items():
        tls.revoke(directory, name)
        etcdauth.revoke(c.etcd.endpoint, admin, c.keys, tls.Peer(role, name))
    time.sleep(tls.Revocations.STAT_INTERVAL_S + 0.2)  # what the daemons promise: read within a second
    return ({k: f() for k, f in probes.items()}, before)


def link_control(c: LocalCluster) -> bool:
    """Node B's own certificate and token say hello on the link: it must be welcomed. It replaces B's
    live link (and its close reads as B's loss), so it is sent once, after the last round."""
    return link_hello(leader_addresses(c)["link"], c.tls_config("node1"), "node1", node_token(c, "node1"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="send the script once (a full run: 3 times)")
    args = ap.parse_args()
    rounds = 1 if args.quick else 3
    foreign = Path(tempfile.mkdtemp(prefix="unicron-foreign-ca-"))
    tls.init_ca(foreign)
    (foreign / "held").mkdir()  # the revoked holders' own copies of their files
    for role, name in ((tls.Role.OPERATOR, "operator"), (tls.Role.NODE, "node0")):
        tls.issue(foreign, role, name)
    accepted: list[str] = []
    sent = 0
    controls_ok = True
    with LocalCluster(agents=2, gpus_per_agent=1, tls=True) as c:
        # a replica server as an agent runs it, with node1's certificate (agents run theirs on the same terms)
        server = ReplicaServer("127.0.0.1:0", 1 << 20, tls_config=c.tls_config("node1")).start()
        try:
            for i in range(rounds):
                refused, controls = run_once(c, foreign, server.address, f"probe{i}")
                sent += len(refused)
                accepted += [k for k, ok in refused.items() if ok]
                if i == rounds - 1:
                    controls["link: node B's own hello"] = link_control(c)
                if i == rounds - 1:
                    refused, before = revocation_probes(c, server.address, foreign / "held")
                    sent += len(refused)
                    accepted += [k for k, ok in refused.items() if ok]
                    controls.update(before)
                for k, ok in controls.items():
                    print(f"control {k}: {'ok' if ok else 'FAILED'}", file=sys.stderr)
                    controls_ok &= ok
        finally:
            server.stop()
    for k in sorted(set(accepted)):
        print(f"ACCEPTED (should be refused): {k}", file=sys.stderr)
    print(json.dumps({"forbidden_requests": sent, "unauthorized_accepted": len(accepted), "controls_ok": controls_ok,
                      "rounds": rounds, "accepted": sorted(set(accepted))}))
    return 0 if not accepted and controls_ok else 1


if __name__ == "__main__":
    sys.exit(main())
