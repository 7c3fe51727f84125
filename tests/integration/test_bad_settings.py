"""A daemon given a bad setting prints one line naming it and exits 2, before it touches etcd."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from agent.main import main as agent_main
from coordinator.main import main as coordinator_main


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
], ids=["status-interval", "agent-etcd-timeout", "replica-budget", "lease-ttl", "link-port", "api-port",
        "regroup-grace", "webhook-timeout", "leader-ttl"])
def test_a_number_outside_its_bounds_is_one_line_naming_the_flag(
    main: Callable[[list[str]], int], argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip("\n").endswith(message), err


def test_a_fence_below_the_lease_ttl_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert agent_main(["--node", "n1", "--fence-s", "2", "--lease-ttl-s", "3"]) == 2
    assert "--fence-s / UNICRON_FENCE: 2.0 is below the lease TTL (3 s)" in capsys.readouterr().err
