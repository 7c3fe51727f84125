"""The coordinator's gRPC API with mutual TLS: who may call what, over real gRPC with real certificates.

Mutating RPCs (submit, cancel, drain, undrain, forget) take an operator certificate; a node's or the
coordinator's certificate, one from another CA, or none are refused, and the CLI says why in one line.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from coordinator.api import ControlPlane, serve, stop
from tests.coordinator.test_api import EXAMPLE, FakeControlPlane
from unicron.cli import main as cli
from unicron.kernel import tls
from unicron.kernel.proto import coordinator_pb2 as pb
from unicron.kernel.proto import coordinator_pb2_grpc as pb_grpc


@pytest.fixture
def plane() -> FakeControlPlane:
    return FakeControlPlane()


@pytest.fixture
def api(plane: FakeControlPlane, cert_dir: Path) -> Iterator[str]:
    control_plane: ControlPlane = plane
    server, address = serve(control_plane, "127.0.0.1", 0, tls_config=tls.TLSConfig.from_dir(cert_dir, "coordinator"))
    try:
        yield address
    finally:
        stop(server, 0.1)


def call(address: str, creds: grpc.ChannelCredentials | None, rpc: str, request: Any) -> grpc.StatusCode:
    channel = grpc.secure_channel(address, creds) if creds is not None else grpc.insecure_channel(address)
    with channel:
        try:
            getattr(pb_grpc.CoordinatorStub(channel), rpc)(request, timeout=5)  # type: ignore[no-untyped-call]
        except grpc.RpcError as exc:
            code: grpc.StatusCode = exc.code()
            return code
    return grpc.StatusCode.OK


def creds(directory: Path, name: str) -> grpc.ChannelCredentials:
    return tls.TLSConfig.from_dir(directory, name).grpc_channel_credentials()


def test_only_an_operator_mutates(api: str, plane: FakeControlPlane, cert_dir: Path, foreign_cert_dir: Path) -> None:
    submit = pb.SubmitRequest(spec_json=EXAMPLE.read_text())
    # the node's and the coordinator's own certificates are the cluster's, but not an operator's
    for name in ("node1", "coordinator"):
        assert call(api, creds(cert_dir, name), "Submit", submit) == grpc.StatusCode.PERMISSION_DENIED
        assert call(api, creds(cert_dir, name), "Drain", pb.NodeRequest(node="n1")) == grpc.StatusCode.PERMISSION_DENIED
        assert call(api, creds(cert_dir, name), "Forget", pb.NodeRequest(node="n1")) == grpc.StatusCode.PERMISSION_DENIED
    # read-only calls are open to any certificate the cluster CA signed
    assert call(api, creds(cert_dir, "node1"), "ListTasks", pb.ListTasksRequest()) == grpc.StatusCode.OK
    # no certificate, or another CA's: the handshake fails, nothing is served
    plain = call(api, None, "ListTasks", pb.ListTasksRequest())
    foreign = tls.TLSConfig(cert_dir / "ca.crt", foreign_cert_dir / "operator.crt", foreign_cert_dir / "operator.key")
    stranger = call(api, foreign.grpc_channel_credentials(), "Submit", submit)
    assert plain == stranger == grpc.StatusCode.UNAVAILABLE
    assert plane.specs == {} and plane.drained == set() and plane.node_names == ["n1", "n2"]
    assert call(api, creds(cert_dir, "operator"), "Submit", submit) == grpc.StatusCode.OK
    assert call(api, creds(cert_dir, "operator"), "Drain", pb.NodeRequest(node="n1")) == grpc.StatusCode.OK
    assert list(plane.specs) == ["gpt-1p3b"] and plane.drained == {"n1"}


def test_cli_over_tls_and_its_refusal_is_one_line(
    api: str, plane: FakeControlPlane, cert_dir: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["--api", api, "--tls-dir", str(cert_dir)]
    assert cli.main(["submit", str(EXAMPLE), *base, "--tls-name", "node1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refused this certificate" in err and "node 'node1'" in err
    assert cli.main(["submit", str(EXAMPLE), *base]) == 0  # --tls-name defaults to "operator"
    assert cli.main(["tasks", *base, "--json"]) == 0
    assert [t["name"] for t in json.loads(capsys.readouterr().out.split("\n", 1)[1])] == ["gpt-1p3b"]


def test_cli_tls_dir_of_files_that_are_not_pem_names_the_file(
    api: str, plane: FakeControlPlane, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: --tls-dir files that exist but are not PEM went to gRPC unparsed, and the handshake that
    could not start was reported as the coordinator being unavailable. Now: one line naming the file."""
    bad = tmp_path / "certs"
    bad.mkdir()
    for name in (tls.CA_CERT, "operator.crt", "operator.key"):
        (bad / name).write_text("garbage\n")
    assert cli.main(["tasks", "--api", api, "--tls-dir", str(bad), "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert err == (f"unicron tasks: TLS: {bad / tls.CA_CERT}: not a PEM certificate; create it with "
                   f"'unicron certs init {bad}' / 'unicron certs issue --role ROLE operator --dir {bad}'\n")


def test_a_revoked_operator_certificate_is_refused(
        plane: FakeControlPlane, cert_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tls.Revocations, "STAT_INTERVAL_S", 0.0)
    d = tmp_path / "certs"
    shutil.copytree(cert_dir, d)
    operator = creds(d, "operator")  # the holder keeps its files; the CA's copies move aside
    server, address = serve(plane, "127.0.0.1", 0, tls_config=tls.TLSConfig.from_dir(d, "coordinator"))
    try:
        assert call(address, operator, "Drain", pb.NodeRequest(node="n1")) == grpc.StatusCode.OK
        tls.revoke(d, "operator")
        assert call(address, operator, "Drain", pb.NodeRequest(node="n2")) == grpc.StatusCode.PERMISSION_DENIED
        assert call(address, operator, "ListTasks", pb.ListTasksRequest()) == grpc.StatusCode.PERMISSION_DENIED
        assert plane.drained == {"n1"}
    finally:
        stop(server, 0.1)
