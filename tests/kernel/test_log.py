"""One logging style: structlog through ``unicron.kernel.log.get`` with bound context."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from unicron.kernel import log as ulog
from unicron.kernel.errors import ConfigError


def test_bound_context_appears_and_unknown_fields_are_left_out() -> None:
    stream = io.StringIO()
    ulog.configure("INFO", stream=stream)
    try:
        ulog.get("t", task="a", node="n0", rank=None, gpu=1).info("hello", step=7)
    finally:
        ulog.configure("INFO")  # back to stderr for the rest of the session
    line = json.loads(stream.getvalue().strip().splitlines()[-1])
    assert (line["event"], line["task"], line["node"], line["gpu"], line["step"]) == ("hello", "a", "n0", 1, 7)
    assert "rank" not in line


def test_an_unconfigured_process_logs_to_stderr_not_stdout() -> None:
    # A user's training script imports our client without configuring logging: its stdout is its own.
    code = "from unicron.kernel import log; log.get('x', rank=3).warning('careful', why='test')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout == ""
    line = json.loads(out.stderr.strip().splitlines()[-1])
    assert (line["event"], line["rank"], line["why"]) == ("careful", 3, "test")


@pytest.mark.parametrize("level", ["warn", "WARN", "fatal", "Debug", "NOTSET"])
def test_every_level_the_stdlib_names_is_taken(level: str) -> None:
    ulog.configure(level, stream=io.StringIO())


def test_an_unknown_level_is_a_config_error_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match="UNICRON_LOG_LEVEL"):
        ulog.configure("bogus")


PROCESS_FIELDS = """
import logging, sys, threading
from unicron.kernel import log as ulog
ulog.configure("INFO", stream=sys.stdout)
ulog.bind_process(node="n7")
t = threading.Thread(target=lambda: ulog.get("agent.supervisor", rank=3).info("rank started"))
t.start(); t.join()
logging.getLogger("third.party").warning("plain stdlib")
ulog.get("agent.link", node="other").info("its own node")
"""


def test_process_fields_reach_every_threads_lines_and_a_line_may_name_its_own() -> None:
    """An agent's node was bound nowhere its threads saw: most of its lines had no node."""
    out = subprocess.run([sys.executable, "-c", PROCESS_FIELDS], capture_output=True, text=True, check=True).stdout
    lines = {(line := json.loads(raw))["event"]: line for raw in out.splitlines()}
    assert lines["rank started"]["node"] == "n7" and lines["rank started"]["rank"] == 3
    assert lines["plain stdlib"]["node"] == "n7"
    assert lines["its own node"]["node"] == "other"
