"""The agent's failure marker (agent.marker) against a real task store sidecar started the agent's way."""

from __future__ import annotations

import time

from agent.marker import FailureMarker
from agent.sidecar import StoreSidecar
from unicron.runtime import store as keys
from unicron.runtime.membership import failed_key


def test_mark_adds_to_the_ranks_failed_counter_in_the_tasks_store() -> None:
    sidecar = StoreSidecar.start("127.0.0.1", "t")
    marker = FailureMarker().start()
    try:
        client = keys.connect(sidecar.host, sidecar.port)
        marker.mark(sidecar.host, sidecar.port, 2)
        marker.mark(sidecar.host, sidecar.port, 2)
        deadline = time.monotonic() + 60.0  # the helper imports torch before it answers
        while keys.counter(client, failed_key(2)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert keys.counter(client, failed_key(2)) == 2
        assert keys.counter(client, failed_key(1)) == 0
    finally:
        marker.stop()
        sidecar.stop()


def test_mark_current_raises_failed_to_started_and_never_beyond() -> None:
    """An in-place shrink's mark: the rank's newest process is gone, whether or not its own agent
    marked it first; twice is once (a later incarnation must not look dead at its start)."""
    sidecar = StoreSidecar.start("127.0.0.1", "t")
    marker = FailureMarker().start()
    try:
        client = keys.connect(sidecar.host, sidecar.port)
        client.add(keys.started_key(3), 2)  # incarnation 2 runs
        client.add(failed_key(3), 1)  # incarnation 1 was marked dead long ago
        marker.mark(sidecar.host, sidecar.port, 3, current=True)
        marker.mark(sidecar.host, sidecar.port, 3, current=True)
        marker.mark(sidecar.host, sidecar.port, 4, current=True)  # never started: nothing to mark
        marker.mark(sidecar.host, sidecar.port, 5)  # a plain mark after them: all answered once it is
        deadline = time.monotonic() + 60.0
        while keys.counter(client, failed_key(5)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert keys.counter(client, failed_key(3)) == 2
        assert keys.counter(client, failed_key(4)) == 0
    finally:
        marker.stop()
        sidecar.stop()
