"""Released process groups are destroyed off the caller's thread (unicron/runtime/reaper.py): a peer
blocked in a collective with the released group still fails fast, a group kept by a reference cycle
is collected, and one the caller still holds is reported. Real gloo groups, two ranks in one process."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any

import structlog
import torch

from unicron.runtime.comm import CommGroup, HashStore, ensure_torch_distributed, new_group
from unicron.runtime.reaper import destroy


def pair(prefix: str) -> tuple[CommGroup, CommGroup]:
    """Two gloo ranks' groups of one world, formed on two threads (each waits for the other)."""
    ensure_torch_distributed()
    store, made = HashStore(), {}

    def make(r: int) -> None:
        made[r] = new_group("gloo", store, prefix, r, 2, 30.0)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return made[0], made[1]


def test_a_peer_blocked_with_the_released_group_fails_once_the_reaper_destroys_it() -> None:
    survivor, failed = pair("reaper-blocked")
    outcome: list[object] = []

    def blocked() -> None:
        try:
            survivor.allreduce([torch.ones(4)]).wait()
            outcome.append("completed")
        except RuntimeError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=blocked, daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # rank 1 never joins the all-reduce
    released, gone = [failed], weakref.ref(failed)
    del failed
    reaper = destroy(released)
    assert reaper is not None and reaper.name == "unicron-group-reaper"
    waiter.join(10)  # well within the group's 30 s timeout
    assert not waiter.is_alive() and isinstance(outcome[0], RuntimeError), outcome
    reaper.join(10)
    assert released == [] and gone() is None


def test_a_group_kept_by_a_cycle_is_collected_and_one_still_held_is_reported() -> None:
    cycled, held = pair("reaper-leak")
    ring: list[Any] = [cycled]
    ring.append(ring)  # only the cycle collector frees the group now
    gone = weakref.ref(cycled)
    released = [cycled]
    del cycled, ring
    gc.disable()  # the collector must not run on its own before the reaper's turn
    try:
        with structlog.testing.capture_logs() as logs:
            reaper = destroy(released)
            assert reaper is not None
            reaper.join(10)
        assert gone() is None and not [e for e in logs if e["log_level"] == "warning"]
        with structlog.testing.capture_logs() as logs:
            reaper = destroy([held])  # the caller keeps ``held``: its peers would wait for the timeout
            assert reaper is not None
            reaper.join(10)
    finally:
        gc.enable()
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "a released process group is still referenced; peers may wait for the collective timeout"]


def test_nothing_released_starts_no_thread() -> None:
    assert destroy([]) is None
