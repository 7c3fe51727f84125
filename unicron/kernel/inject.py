"""Fault-injection requests (``inject/<node>/<id>``): the record the CLI, the demo and the tests write and
the node's agent executes, and the client-side round trip."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field, replace
from typing import ClassVar, Self

from unicron.kernel.errors import InvalidRecord, TemporaryError
from unicron.kernel.etcd import Store
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.protocol import MAX_SLOW_DELAY_S
from unicron.kernel.types import ErrorKind, Record, new_id

#: the most iterations one 'slow' injection may delay (over eleven days of one-second iterations)
MAX_SLOW_ITERATIONS = 1_000_000
#: the TTL of a request's lease (seconds): kept alive while its asker waits, it bounds how long the
#: request of an asker that died outlives it
REQUEST_LEASE_TTL_S = 5


class Fault(enum.StrEnum):
    """Faults a node's agent executes (``kill-node``/``silence-node`` signal the agent itself, see the CLI)."""

    KILL_RANK = "kill-rank"
    RAISE = "raise"
    STALL = "stall"
    XID = "xid"
    SLOW = "slow"


@dataclass(frozen=True)
class Injection(Record):
    """One request; the agent writes it back with ``executed_ts``, ``ok`` and ``detail`` set."""

    #: an operator's request: a field the agent does not know is a mistake to refuse, not to skip
    REFUSES_UNKNOWN_FIELDS: ClassVar[bool] = True

    fault: Fault
    task: str | None = None
    rank: int | None = None
    #: raise: the error kind the rank raises
    kind: ErrorKind | None = None
    #: xid: the XID code and the simulated GPU it hits
    code: int | None = None
    gpu: int = 0
    #: slow: seconds added per iteration, for how many iterations
    delay_s: float = 1.0
    iterations: int = 1
    requested_ts: float = field(default_factory=time.time)
    executed_ts: float | None = None
    ok: bool | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        # the rank counts these down; a count of 2**62 was once a list of that length (a MemoryError
        # that ended the rank's instruction reader), and a NaN or negative delay breaks time.sleep()
        if not 1 <= self.iterations <= MAX_SLOW_ITERATIONS:
            raise InvalidRecord(f"Injection.iterations: {self.iterations} is not in [1, {MAX_SLOW_ITERATIONS}]")
        if not (math.isfinite(self.delay_s) and 0 <= self.delay_s <= MAX_SLOW_DELAY_S):
            raise InvalidRecord(f"Injection.delay_s: {self.delay_s} is not a number of seconds in "
                                f"[0, {MAX_SLOW_DELAY_S:g}]")

    def answered(self, ok: bool, detail: str) -> Self:
        return replace(self, executed_ts=time.time(), ok=ok, detail=detail)


def request(store: Store, keys: Keyspace, node: str, req: Injection, timeout_s: float = 5.0) -> Injection:
    """Ask ``node``'s agent to execute ``req``; returns the agent's answer (``executed_ts`` set).

    The request lives under a lease of the asker's: an asker killed before its ``finally`` left the
    request behind, and the node's agent executed it whenever it next started (a rank killed hours
    after the drill). Now it expires with the asker."""
    key = keys.injection(node, new_id())
    lease = store.lease(REQUEST_LEASE_TTL_S)
    try:
        store.put(key, req.to_json(), lease=lease)
    except BaseException:
        lease.revoke()
        raise
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            kv = store.get(key)
            if kv is not None:
                answer = Injection.from_json(kv.value)
                if answer.executed_ts is not None:
                    return answer
            time.sleep(0.01)
    finally:
        try:
            store.delete(key)
        finally:
            lease.revoke()
    raise TemporaryError(f"node {node}'s agent did not execute the injection within {timeout_s}s")
