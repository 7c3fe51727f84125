"""``unicron demo`` (unicron/cli/demo.py) when its cluster cannot start: one line, nothing left behind."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from unicron.cli.demo import run_demo
from unicron.cli.main import main
from unicron.cluster import etcd_server
from unicron.kernel.errors import StartFailed


@pytest.fixture
def etcd_port_taken(taken_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's etcd gets a port someone else holds; its temporary dirs go under ``tmp_path``."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(etcd_server, "free_port", lambda host="127.0.0.1": taken_port)


@pytest.mark.usefixtures("etcd_port_taken")
def test_the_demo_reports_an_etcd_that_fails_to_start_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """etcd's failed start was a RuntimeError's traceback; it is now one line with etcd's own error."""
    assert main(["demo"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "address already in use" in err, err


@pytest.mark.usefixtures("etcd_port_taken")
def test_the_demo_leaves_no_spec_dir_behind(tmp_path: Path) -> None:
    """The task specs' ``unicron-demo-*`` dir was never removed; it goes with the demo, however it ends."""
    with pytest.raises(StartFailed):
        run_demo()
    assert not list(tmp_path.glob("unicron-demo-*"))
