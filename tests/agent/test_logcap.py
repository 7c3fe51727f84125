"""Ranks' logs bounded on disk (agent/logcap.py): rotated in place, the rank's descriptor kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agent import logcap


def test_a_log_past_its_cap_is_kept_once_and_the_rank_writes_on_from_its_start(tmp_path: Path) -> None:
    """Reviews (jobs, agent): a rank's log grew for the job's weeks in a memory-backed run dir."""
    task = tmp_path / "logs" / "t"
    task.mkdir(parents=True)
    path = task / "rank0.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # as the agent hands it to a rank
    try:
        # a real child writing through the inherited descriptor, as a rank does
        subprocess.run([sys.executable, "-c", f"import os; os.write({fd}, b'x' * 5000)"], pass_fds=(fd,), check=True)
        assert logcap.cap_all(str(tmp_path / "logs"), 4096) == 1
        assert path.stat().st_size == 0 and (task / "rank0.log.1").read_bytes() == b"x" * 5000
        subprocess.run([sys.executable, "-c", f"import os; os.write({fd}, b'after')"], pass_fds=(fd,), check=True)
        assert path.read_bytes() == b"after"  # at the new end, not at offset 5000 behind a hole
        assert logcap.cap_all(str(tmp_path / "logs"), 4096) == 0  # under the cap: left alone
        (task / "rank0.err").write_bytes(b"e" * 5000)  # the rank's stderr, as bounded
        assert logcap.cap_all(str(tmp_path / "logs"), 4096) == 1 and (task / "rank0.err.1").stat().st_size == 5000
    finally:
        os.close(fd)


def test_a_log_that_cannot_be_rotated_is_left_and_nothing_raises(tmp_path: Path) -> None:
    assert logcap.cap(str(tmp_path / "gone.log"), 1) is False
    assert logcap.cap_all(str(tmp_path / "no-logs-yet"), 1) == 0
