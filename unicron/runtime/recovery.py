"""Recovery after a regroup: the typed status every member publishes, and the pure decisions taken from
the table of them.

A recovery is five named steps; the Trainer (:mod:`unicron.runtime.scheduler`) runs the collectives,
this module decides what they are:

1. **release groups**: the old epoch's groups are dropped so peers blocked with us fail fast;
2. **regroup**: the members agree on the next epoch (:mod:`unicron.runtime.membership`);
3. **agree**: every member publishes a :class:`RankStatus`; from the :data:`StatusTable`,
   :func:`plan_catch_up` (a rank one iteration behind takes the missing reduced buckets and steps)
   and :func:`plan_share` (buckets some member reduced this iteration go to those that lack them);
4. **transfer**: joiners (members holding no state) get parameters, optimizer state and the
   iteration counter from a healthy replica (:func:`state_holders`, :func:`joiners`);
5. **resume**: the micro-batches some group's sum lacks are assigned to live replicas
   (:func:`plan_resume`), and the iteration goes on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import torch

from unicron.runtime.grads import RuntimeInvariantError
from unicron.runtime.plan import BatchLayout, Plan, Topology, initial_plan, redistribute


class RegroupReason(StrEnum):
    """Why a regroup happens (logged in the ``regroup`` event and the agent's RegroupDone)."""

    START = "start"  # epoch 0
    FAILURE = "failure"  # a collective failed
    REATTEMPT = "reattempt"  # a sev3 error of our own: same members, in place
    ADMISSION = "admission"  # joiners are waiting
    AGENT = "agent"  # the agent's Regroup (a sev3 reattempt the ranks did not run themselves)
    JOIN = "join"  # this rank joined (restarted or excluded)


@dataclass(frozen=True)
class RegroupDue:
    """A regroup decided during an iteration and run before the next attempt at it."""

    reason: RegroupReason
    #: propose at once with the same members (no failure knowledge to wait for)
    assume_same: bool


_HEAD = 5
"""Integers before the per-micro-batch flags in the encoded status."""


@dataclass(frozen=True)
class RankStatus:
    """What one member holds after a regroup, exchanged by all-gather as one int64 vector."""

    rank: int
    #: the iteration it is in; -1 when it holds no state
    iteration: int
    #: gradient buckets of that iteration already reduced
    buckets: int
    #: False for a joiner (or a rank that must restore from a checkpoint)
    holds_state: bool
    #: epoch whose plan the iteration's accumulated micro-batches follow
    base_epoch: int
    #: micro-batches accumulated in this iteration
    done: frozenset[int]

    def encode(self, micro_batches: int) -> torch.Tensor:
        flags = [1 if mb in self.done else 0 for mb in range(micro_batches)]
        head = [self.rank, self.iteration, self.buckets, int(not self.holds_state), self.base_epoch]
        return torch.tensor(head + flags, dtype=torch.int64)

    @classmethod
    def decode(cls, row: torch.Tensor) -> RankStatus:
        v = [int(x) for x in row.tolist()]
        done = frozenset(i for i, flag in enumerate(v[_HEAD:]) if flag)
        return cls(v[0], v[1], v[2], v[3] == 0, v[4], done)


StatusTable = dict[int, RankStatus]
"""Every member's status, by global rank."""


def table_of(rows: list[torch.Tensor]) -> StatusTable:
    return {s.rank: s for s in map(RankStatus.decode, rows)}


def state_holders(table: StatusTable) -> list[int]:
    return [r for r, s in table.items() if s.holds_state]


def joiners(table: StatusTable, dp_ranks: list[int]) -> list[int]:
    """Members of this data-parallel group that hold no state."""
    return [r for r in dp_ranks if not table[r].holds_state]


@dataclass(frozen=True)
class CatchUp:
    """Ranks of this data-parallel group one iteration behind ``top``."""

    behind: tuple[int, ...]
    top: int
    #: first bucket some behind rank lacks (== buckets: none lacks one)
    lo: int
    #: global rank that broadcasts buckets [lo, nb) (None when lo == nb)
    source: int | None
    #: base epoch of the ranks already at ``top``
    ahead_base: int


def top_iteration(table: StatusTable) -> int:
    return max(table[r].iteration for r in state_holders(table))


def plan_catch_up(table: StatusTable, dp_ranks: list[int], nb: int, me: int) -> CatchUp | None:
    holders = state_holders(table)
    top = top_iteration(table)
    behind = tuple(r for r in dp_ranks if r in holders and table[r].iteration == top - 1)
    if not behind:
        return None
    lo = min(table[r].buckets for r in behind)
    source = None
    if lo < nb:
        src = [r for r in dp_ranks if r in holders and (table[r].iteration == top or table[r].buckets == nb)]
        if not src or (table[src[0]].iteration == top and table[src[0]].buckets != 0):
            raise RuntimeInvariantError(f"rank {me}: no holder of iteration {top - 1}'s sums")
        source = src[0]
    ahead_base = max(table[r].base_epoch for r in holders if table[r].iteration == top)
    return CatchUp(behind, top, lo, source, ahead_base)


def after_catch_up(table: StatusTable, catch: CatchUp) -> StatusTable:
    """The table once the behind ranks stepped: at ``top``, nothing reduced or accumulated yet."""
    out = dict(table)
    for r in catch.behind:
        out[r] = dataclasses.replace(table[r], iteration=catch.top, buckets=0, base_epoch=catch.ahead_base,
                                     done=frozenset())
    return out


def best_buckets(table: StatusTable, topo: Topology, nb: int) -> dict[int, int]:
    """Per tensor-parallel index: the most buckets any state holder of that shard reduced."""
    holders = state_holders(table)
    best: dict[int, int] = {}
    for t in range(topo.tp):
        group = [r for r in holders if topo.tp_rank(r) == t]
        best[t] = max(table[r].buckets for r in group) if group else nb
    return best


@dataclass(frozen=True)
class Share:
    """Broadcast reduced buckets [lo, hi) from ``source`` to the members of the group lacking them."""

    lo: int
    hi: int
    source: int


def plan_share(table: StatusTable, dp_ranks: list[int], mine_best: int) -> Share | None:
    holders = state_holders(table)
    lacking = [r for r in dp_ranks if r in holders and table[r].buckets < mine_best]
    if not lacking or mine_best <= 0:
        return None
    lo = min(table[r].buckets for r in lacking)
    src = [r for r in dp_ranks if r in holders and table[r].buckets == mine_best]
    return Share(lo, mine_best, src[0])


@dataclass(frozen=True)
class Resume:
    """How the current iteration goes on after a recovery."""

    base_epoch: int
    plan: Plan
    #: micro-batches of this rank's shard some member already holds (not accumulated again)
    keep_mask: frozenset[int]


def plan_resume(
    table: StatusTable, *, layout: BatchLayout, topo: Topology, me: int, epoch: int, members: list[int],
    rerun: bool, members_of: Callable[[int], tuple[int, ...]],
) -> Resume:
    """Whatever some group's sum lacks is (re)computed by a live replica. ``base_members``: epoch ->
    ``members_of``: an epoch's members (the epoch whose plan the iteration's work followed)."""
    b = layout.micro_batches
    holders = state_holders(table)
    complete: dict[int, set[int]] = {t: set() for t in range(topo.tp)}
    for r in holders:
        complete[topo.tp_rank(r)] |= table[r].done
    if rerun:
        complete = {t: set() for t in complete}
    progress = any(complete.values()) or any(table[r].buckets for r in holders)
    alive = topo.replicas_in(members)
    if not progress:
        # Nothing computed yet: plan afresh for the new membership.
        return Resume(epoch, initial_plan(layout, alive), frozenset(complete[topo.tp_rank(me)]))
    bases = {table[r].base_epoch for r in holders}
    if len(bases) != 1:
        raise RuntimeInvariantError(f"members disagree on the iteration's base epoch: {sorted(bases)}")
    base = bases.pop()
    needed = [mb for mb in range(b) if any(mb not in c for c in complete.values())]
    plan = redistribute(initial_plan(layout, topo.replicas_in(members_of(base))), alive, needed)
    return Resume(base, plan, frozenset(complete[topo.tp_rank(me)]))
