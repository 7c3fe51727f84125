"""Ranks as threads of the test process, for tests of one collective or one regroup."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def run_ranks(world: int, fn: Callable[[int], Any], timeout_s: float = 60.0) -> list[Any]:
    """Run ``fn(rank)`` for every rank in its own thread; their results by rank. The first error any
    rank raised is raised here."""
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    return out
