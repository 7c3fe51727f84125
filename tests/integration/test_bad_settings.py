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
