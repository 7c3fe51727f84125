"""The local launcher the runtime tests and benchmarks run jobs with (unicron.cluster.launch)."""

from __future__ import annotations

import time
from pathlib import Path

from unicron.cluster.launch import LocalJob


def test_wait_after_stop_returns_the_killed_ranks_exits_at_once(tmp_path: Path) -> None:
    """Before the fix, ``stop`` ended the watcher before its kills were recorded and a killed rank
    with a restart delay counted as a restart still to come: ``wait`` ran out its whole timeout."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(600)\n")
    job = LocalJob(2, [], str(tmp_path / "job"), restart={1: 0.1}, script=str(script))
    with job:
        pass  # ``__exit__`` is ``stop``: SIGKILL every rank
    t0 = time.monotonic()
    codes = job.wait(60.0)
    assert codes == {0: -9, 1: -9}
    assert time.monotonic() - t0 < 30.0, "wait after stop waited for exits or restarts that never come"
    exits = sorted((h["rank"], h["code"]) for h in job.history if h["event"] == "exit")
    assert exits == [(0, -9), (1, -9)]
