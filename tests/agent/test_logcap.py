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
        assert logcap.cap_all(str(tmp_path / "logs"), ["t"], 4096) == 1
        assert path.stat().st_size == 0 and (task / "rank0.log.1").read_bytes() == b"x" * 5000
        subprocess.run([sys.executable, "-c", f"import os; os.write({fd}, b'after')"], pass_fds=(fd,), check=True)
        assert path.read_bytes() == b"after"  # at the new end, not at offset 5000 behind a hole
        assert logcap.cap_all(str(tmp_path / "logs"), ["t"], 4096) == 0  # under the cap: left alone
        (task / "rank0.err").write_bytes(b"e" * 5000)  # the rank's stderr, as bounded
        assert logcap.cap_all(str(tmp_path / "logs"), ["t"], 4096) == 1 and (task / "rank0.err.1").stat().st_size == 5000
    finally:
        os.close(fd)


def test_a_log_that_cannot_be_rotated_is_left_and_nothing_raises(tmp_path: Path) -> None:
    assert logcap.cap(str(tmp_path / "gone.log"), 1) is False
    assert logcap.cap_all(str(tmp_path / "no-logs-yet"), ["t"], 1) == 0


def test_a_log_that_filled_its_disk_is_truncated_keeping_its_tail(tiny_tmpfs: Path) -> None:
    """Review (ENOSPC): the copy needs as much room as the log, so on the disk the log filled a
    rotation failed every time, left an empty ``.1`` and never freed a byte."""
    task = tiny_tmpfs / "t"
    task.mkdir()
    path = task / "rank0.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        # a real child writing numbered lines through the inherited descriptor until the disk is full
        code = (f"import os\ni = 0\ntry:\n    while os.write({fd}, b'line %08d\\n' % i) == 14:\n        i += 1\n"
                "except OSError as exc:\n    assert exc.errno == 28, exc\nprint(i - 1)  # the last whole line")
        last = int(subprocess.run([sys.executable, "-c", code], pass_fds=(fd,), check=True,
                                  capture_output=True, text=True).stdout)
        assert logcap.cap(str(path), 64 << 10) is True
        assert path.stat().st_size == 0  # the space is free again
        kept = (task / "rank0.log.1").read_bytes()
        assert 0 < len(kept) <= 64 << 10
        # the newest lines (the last one may be cut where the disk filled), from a line's start
        assert b"line %08d\n" % last in kept[-40:] and kept.startswith(b"line "), kept[-40:]
        subprocess.run([sys.executable, "-c", f"import os; os.write({fd}, b'after')"], pass_fds=(fd,), check=True)
        assert path.read_bytes() == b"after"
    finally:
        os.close(fd)
