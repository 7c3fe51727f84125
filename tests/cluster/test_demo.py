"""``unicron demo`` (unicron/cli/demo.py) when its cluster cannot start: one line."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from unicron.cli.main import main
from unicron.cluster import etcd_server


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

