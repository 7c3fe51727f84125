"""Process liveness by PID, for records that name a process (an agent's registration, a harness's
namespace network): is its owner still running on this host?"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (signal 0 probes without delivering anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by another user
    return True
