"""The runtime's status lines on stdout (``rank R: restored iteration N ...``, ``iteration N done``,
the stop's exit line).

A rank's stdout is its log file (the agent hands it an O_APPEND descriptor), and a log disk fills:
``print`` then raises ENOSPC (or EIO on a failing disk). A status line is for the operator, never a
reason to die: a rank that died at its restore line on a full log disk died again at every relaunch
(a crash loop). So a line that cannot be written is dropped, and said once on stderr (the agent's
pipe, usually on another disk).
"""

from __future__ import annotations

from unicron.kernel import log as ulog

log = ulog.get(__name__)

_dropping = False  # lines are being dropped now: the warning was given for this run of failures


def status(line: str) -> None:
    """Write ``line`` on stdout and flush it; an OSError (ENOSPC, EIO) drops the line."""
    global _dropping
    try:
        print(line, flush=True)
    except OSError as exc:
        if not _dropping:
            _dropping = True
            log.warning("stdout unwritable: status lines dropped until it takes them again", error=str(exc))
        return
    _dropping = False
