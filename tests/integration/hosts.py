"""Which cluster the end-to-end tests run on: the multi-host namespace cluster where this machine
can make one (root with iproute2: CI), skipped with the reason elsewhere."""

from __future__ import annotations

import pytest

from unicron.cluster.netns import unavailable_reason


def require_netns() -> None:
    """Skip the calling test (or fixture) when network namespaces cannot be made here, saying why."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"needs the namespace cluster (LocalCluster(netns=True)): {reason}")
