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
