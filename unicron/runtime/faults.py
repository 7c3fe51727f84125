"""Scripted faults at exact points of the schedule, for tests and benchmarks without an agent.

``UNICRON_RUNTIME_FAULTS`` (set per rank by the launcher) is a comma-separated list of
``ACTION@ITERATION:POINT[:ARG]``:

* ACTION ``die``: SIGKILL this process (a real death: sockets close, the launcher sees exit -9);
  ``raise``: raise :class:`unicron.kernel.client.InjectedFault` of kind ARG (what ``unicron inject raise``
  does through the agent); ``stall``: sleep ARG seconds.
* POINT ``start`` (iteration start), ``mbN`` (before this rank's N-th micro-batch of the iteration,
  0-based, counting micro-batches taken over after a regroup), ``bucketN`` (before reducing gradient
  bucket N), ``commit`` (after the reduction, before the optimizer step), ``resume`` (``--resume``:
  before the ranks decide together whether a checkpoint exists; ITERATION is 0 there).

Faults fire only in a process's first incarnation, so a restarted rank does not die again. Before a
``die`` the time is written to the store (``fault/<rank>/ts``) so benchmarks can measure recovery from
the moment of death.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from unicron.kernel.client import InjectedFault
from unicron.kernel.errors import ConfigError
from unicron.kernel.types import ErrorKind
from unicron.runtime.comm import RendezvousStore

ENV = "UNICRON_RUNTIME_FAULTS"
ACTIONS = ("die", "raise", "stall")


@dataclass(frozen=True)
class Fault:
    action: str
    iteration: int
    point: str
    arg: str = ""


def parse(spec: str) -> list[Fault]:
    out: list[Fault] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            action, rest = item.split("@", 1)
            parts = rest.split(":")
            fault = Fault(action, int(parts[0]), parts[1], parts[2] if len(parts) > 2 else "")
        except (ValueError, IndexError) as exc:
            raise ConfigError(f"{ENV}: bad entry {item!r}; expected ACTION@ITERATION:POINT[:ARG]") from exc
        if fault.action not in ACTIONS:
            raise ConfigError(f"{ENV}: unknown action {fault.action!r} in {item!r}; one of {ACTIONS}")
        if fault.action == "raise":
            try:
                ErrorKind(fault.arg)
            except ValueError as exc:
                raise ConfigError(f"{ENV}: {item!r}: ARG must be an ErrorKind value") from exc
        out.append(fault)
    return out


class FaultScript:
    def __init__(self, faults: list[Fault], rank: int, incarnation: int, store: RendezvousStore | None) -> None:
        self.faults = faults if incarnation == 1 else []
        self.rank = rank
        self.store = store

    @classmethod
    def from_env(cls, rank: int, incarnation: int, store: RendezvousStore | None) -> FaultScript:
        return cls(parse(os.environ.get(ENV, "")), rank, incarnation, store)

    @property
    def armed(self) -> bool:
        """Whether any scripted fault is left (lets the hot loop skip formatting point names)."""
        return bool(self.faults)

    def at(self, iteration: int, point: str) -> None:
        for f in self.faults:
            if f.iteration == iteration and f.point == point:
                self.faults = [g for g in self.faults if g is not f]
                self._fire(f)

    def _fire(self, f: Fault) -> None:
        if f.action == "die":
            if self.store is not None:
                self.store.set(f"fault/{self.rank}/ts", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # not reached: SIGKILL is not deliverable late
        elif f.action == "raise":
            raise InjectedFault(ErrorKind(f.arg), f"scripted fault at iteration {f.iteration}:{f.point}")
        elif f.action == "stall":
            time.sleep(float(f.arg or "1"))
