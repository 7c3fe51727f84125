"""A daemon given a bad setting prints one line naming it and exits 2, before it touches etcd."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.main import main as agent_main
from coordinator.main import main as coordinator_main
from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.etcd import Store
from unicron.kernel.keyspace import Keyspace


@pytest.mark.parametrize("main", [agent_main, coordinator_main], ids=["agent", "coordinator"])
@pytest.mark.parametrize("etcd", ["bad:port:x", ":", "h:99999", " , "])
def test_a_bad_etcd_endpoint_is_one_line_naming_the_flag(
    main: Callable[[list[str]], int], etcd: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--node", "n1", "--etcd", etcd] if main is agent_main else ["--etcd", etcd]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "--etcd / UNICRON_ETCD" in err and "Traceback" not in err


@pytest.mark.parametrize(("main", "argv", "flag"), [
    (agent_main, ["--node", "n1", "--heartbeat-s", "nan"], "--heartbeat-s / UNICRON_HEARTBEAT"),
    (agent_main, ["--node", "n1", "--stop-grace-s", "inf"], "--stop-grace-s / UNICRON_STOP_GRACE"),
    (coordinator_main, ["--heartbeat-timeout-s", "nan"], "--heartbeat-timeout-s / UNICRON_HEARTBEAT_TIMEOUT"),
], ids=["agent-nan", "agent-inf", "coordinator-nan"])
def test_a_float_setting_must_be_finite(
    main: Callable[[list[str]], int], argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """NaN passed every "must be > 0" check (a comparison with NaN is false) and reached the daemon."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag}: bad value" in err and "not a finite number" in err


@pytest.mark.parametrize(("main", "argv", "message"), [
    # each of these ran, or died in a traceback far from the flag, before the bounds
    (agent_main, ["--node", "n1", "--status-interval-s=-1"], "--status-interval-s / UNICRON_STATUS_INTERVAL: -1.0 must be > 0"),
    (agent_main, ["--node", "n1", "--etcd-timeout-s=0"], "--etcd-timeout-s / UNICRON_ETCD_TIMEOUT: 0.0 must be > 0"),
    (agent_main, ["--node", "n1", "--replica-budget-mb=-5"], "--replica-budget-mb / UNICRON_REPLICA_BUDGET_MB: -5 must be >= 0"),
    (agent_main, ["--node", "n1", "--lease-ttl-s=0"], "--lease-ttl-s / UNICRON_LEASE_TTL: 0 must be >= 1"),
    (coordinator_main, ["--link-port=-1"], "--link-port / UNICRON_LINK_PORT: -1 must be >= 0"),
    (coordinator_main, ["--api-port=70000"], "--api-port / UNICRON_API_PORT: 70000 must be <= 65535"),
    (coordinator_main, ["--regroup-grace-s=-1"], "--regroup-grace-s / UNICRON_REGROUP_GRACE: -1.0 must be >= 0"),
    (coordinator_main, ["--alert-webhook-timeout-s=0"], "--alert-webhook-timeout-s / UNICRON_ALERT_WEBHOOK_TIMEOUT: 0.0 must be > 0"),
    (coordinator_main, ["--leader-ttl-s=1"], "--leader-ttl-s / UNICRON_LEADER_TTL: 1 must be >= 2"),
    (coordinator_main, ["--restart-deadline-s=-1"], "--restart-deadline-s / UNICRON_RESTART_DEADLINE: -1.0 must be > 0"),
    # more faults than a node's entry keeps: the rule could never fire
    (coordinator_main, ["--flap-faults=9"], "--flap-faults / UNICRON_FLAP_FAULTS: 9 must be <= 8"),
    (agent_main, ["--node", "n1", "--warmup-iterations=-1"], "--warmup-iterations / UNICRON_WARMUP_ITERATIONS: -1 must be >= 0"),
    # published for peers to dial, and refused by every client that read it
    (agent_main, ["--node", "n1", "--advertise-host", "x y"],
     "--advertise-host / UNICRON_ADVERTISE_HOST: 'x y' is neither an IP address nor a host name; give one peers can dial"),
    (coordinator_main, ["--advertise-host", "bad_host!"], "--advertise-host / UNICRON_COORDINATOR_ADVERTISE_HOST: "
     "'bad_host!' is neither an IP address nor a host name; give one peers can dial"),
], ids=["status-interval", "agent-etcd-timeout", "replica-budget", "lease-ttl", "link-port", "api-port",
        "regroup-grace", "webhook-timeout", "leader-ttl", "restart-deadline", "flap-faults", "warmup", "agent-advertise",
        "coordinator-advertise"])
def test_a_number_outside_its_bounds_is_one_line_naming_the_flag(
    main: Callable[[list[str]], int], argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip("\n").endswith(message), err


def test_a_fence_below_the_lease_ttl_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert agent_main(["--node", "n1", "--fence-s", "2", "--lease-ttl-s", "3"]) == 2
    assert "--fence-s / UNICRON_FENCE: 2.0 is below the lease TTL (3 s)" in capsys.readouterr().err


@pytest.mark.parametrize("main", [agent_main, coordinator_main], ids=["agent", "coordinator"])
def test_a_bad_log_level_is_one_line(main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]) -> None:
    """Was logging's ValueError, a traceback with exit 1."""
    assert main(["--node", "n1", "--log-level", "bogus"] if main is agent_main else ["--log-level", "bogus"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "log level 'bogus'" in err and "expected one of DEBUG" in err


def _daemon(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """A daemon in a process of its own: these fail only once run() started (threads, sockets)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNICRON_")}
    return subprocess.run([sys.executable, "-m", module, *argv], env=env, capture_output=True, text=True, timeout=60)


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("{")]  # JSON logs aside
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    return lines[0]


def test_an_agent_run_dir_that_cannot_be_made_is_one_line_before_it_registers(
        etcd_server: EtcdServer, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    line = _one_line(_daemon("agent.main", "--etcd", etcd_server.endpoint, "--node", "rundir", "--gpu-backend",
                             "simulated", "--run-dir", str(tmp_path / "file" / "run")))
    assert "--run-dir / UNICRON_RUN_DIR" in line
    store = Store(etcd_server.endpoint)
    try:
        assert store.get(Keyspace().node("rundir")) is None  # it never registered
    finally:
        store.close()


def _agent_in(etcd_server: EtcdServer, run_dir: Path, node: str) -> tuple[str, bool]:
    """The agent's one line and whether etcd was written at all (nodes/<node> or anything else)."""
    store = Store(etcd_server.endpoint)
    try:
        before = store.get_prefix("/")[1]
        line = _one_line(_daemon("agent.main", "--etcd", etcd_server.endpoint, "--node", node, "--gpu-backend",
                                 "simulated", "--run-dir", str(run_dir), "--prefork", "", "--replica-budget-mb", "0"))
        assert store.get(Keyspace().node(node)) is None
        return line, store.get_prefix("/")[1] != before
    finally:
        store.close()


def test_an_agent_whose_logs_dir_cannot_be_made_is_one_line_before_it_registers(
        etcd_server: EtcdServer, tmp_path: Path) -> None:
    """logs/ was made only at a rank's launch: the node registered and took ranks it could not log."""
    (tmp_path / "logs").write_text("x")
    line, written = _agent_in(etcd_server, tmp_path, "nologs")
    assert line.startswith(f"unicron-agent: --run-dir / UNICRON_RUN_DIR {str(tmp_path)!r}: ") and not written


def test_an_agent_whose_socket_cannot_be_bound_withdraws_its_registration(
        etcd_server: EtcdServer, tmp_path: Path) -> None:
    """Its socket's path is a directory: the bind, made once registered, failed with a traceback (exit 1)
    and left nodes/<node> to its lease. Now: one line, exit 2, the registration revoked."""
    (tmp_path / "nosock.sock" / "x").mkdir(parents=True)
    line, _ = _agent_in(etcd_server, tmp_path, "nosock")
    assert line.startswith(f"unicron-agent: --run-dir / UNICRON_RUN_DIR {str(tmp_path)!r}: Is a directory")


@pytest.fixture
def full_fs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with no inode left (root only)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=16", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (mnt / "run").mkdir()
        for i in range(64):
            try:
                (mnt / f"f{i}").touch()
            except OSError:
                break
        else:
            pytest.fail("the tmpfs did not run out of inodes")
        yield mnt / "run"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_an_agent_on_a_full_run_dir_is_one_line_and_never_registers(etcd_server: EtcdServer, full_fs: Path) -> None:
    """The agent registered, then died binding its socket (OSError ENOSPC, a traceback) in a loop under
    systemd: the node flapped in the coordinator. Now it stops before writing anything to etcd."""
    line, written = _agent_in(etcd_server, full_fs, "full0")
    assert line.startswith(f"unicron-agent: --run-dir / UNICRON_RUN_DIR {str(full_fs)!r}: No space left on device")
    assert not written



@pytest.mark.parametrize("flag", ["--link-port", "--api-port"])
def test_a_coordinator_port_in_use_is_one_line(etcd_server: EtcdServer, flag: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        line = _one_line(_daemon("coordinator.main", "--etcd", etcd_server.endpoint, "--listen-host", "127.0.0.1",
                                 flag, str(busy.getsockname()[1])))
    assert "in use" in line, line
