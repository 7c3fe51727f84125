"""Whether a new allocation can be reached in place, and how: pure rank arithmetic.

A task keeps its launch's rank ids (``world_size`` stays); a replica is ``unit = tp * pp``
consecutive ranks and every node holds whole tensor-parallel groups. The new allocation (GPU count per
node) is reached in place when

* it is no larger than the launch (growing past it needs more rank ids: a new generation), and
* at least one complete replica survives on the nodes that keep the task.

A store node that keeps no rank (gone, or drained: still in service) gives the store up: the new
membership names a new store node, the member node holding the lowest surviving rank (its agent
starts a fresh sidecar or takes its spare; the survivors re-seed it from what they hold, see
:mod:`unicron.runtime.membership`). A drained one's agent stops its own sidecar first, so no rank
agrees anything on a store the others have left: to every rank, the hand-over is the loss of the
store's node, whose ranks leave instead of dying.

Survivors: on each node that keeps the task, its lowest ranks up to the node's new count, then only
those in complete replicas. Joiners: the lowest missing replicas, whole tensor-parallel groups placed
on the free slots in node order. Everything else that ran leaves (its node is still in service) or is
lost (its node is gone).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class InPlace:
    """The in-place membership that reaches the new allocation."""

    placement: dict[str, list[int]]
    """node -> its ranks in the new membership (survivors and joiners)."""
    joiners: tuple[int, ...]
    leaving: tuple[int, ...]
    lost: tuple[int, ...]
    store_node: str = ""
    """The node hosting the task's store in the new membership (a new one when the old one is gone)."""
    fresh_store: bool = False
    """A new store even where ``store_node`` is the old one's node (its sidecar died there)."""

    @property
    def members(self) -> tuple[int, ...]:
        return tuple(sorted(r for ranks in self.placement.values() for r in ranks))


def plan_in_place(
    old: Mapping[str, Sequence[int]],
    new: Mapping[str, int],
    *,
    world_size: int,
    unit: int,
    tp: int,
    gone: Collection[str],
    store_node: str = "",
) -> InPlace | None:
    """The in-place change from ``old`` (node -> ranks) to ``new`` (node -> GPU count), or None when it
    must be a new generation. ``gone``: nodes out of service whose processes are lost with them.
    ``store_node``: the node hosting the task's store ("": the launch's, :func:`launch_store_node`)."""
    total = sum(new.values())
    if not old or world_size <= 0 or total == 0 or total > world_size or total % unit:
        return None
    store_node = store_node or launch_store_node(old)
    if not store_node:
        return None
    kept = {n: sorted(old[n])[: new[n]] for n in old if new.get(n)}
    alive = {r for ranks in kept.values() for r in ranks}
    replicas = {r // unit for r in alive if all(x in alive for x in range(r // unit * unit, (r // unit + 1) * unit))}
    if not replicas:
        return None  # no complete replica survives: nobody holds the state
    placement = {n: [r for r in ranks if r // unit in replicas] for n, ranks in kept.items()}
    survivors = {r for ranks in placement.values() for r in ranks}
    missing = [rep for rep in range(world_size // unit) if rep not in replicas]
    need = (total - len(replicas) * unit) // unit
    groups = [list(range(g, g + tp)) for rep in missing[:need] for g in range(rep * unit, (rep + 1) * unit, tp)]
    order = sorted(new, key=lambda n: (n not in old, n))  # nodes that keep the task first
    for node in order:
        slots = new[node] - len(placement.get(node, []))
        while slots >= tp and groups:
            placement.setdefault(node, []).extend(groups.pop(0))
            slots -= tp
    if groups or any(len(placement.get(n, [])) != c for n, c in new.items() if c):
        return None  # the free slots cannot take whole tensor-parallel groups
    members = {r for ranks in placement.values() for r in ranks}
    joiners = tuple(sorted(members - survivors))
    before = [(n, r) for n, ranks in old.items() for r in ranks]
    leaving = tuple(sorted(r for n, r in before if n not in gone and (r not in members or r in joiners)))
    lost = tuple(sorted(r for n, r in before if n in gone))
    if not joiners and not leaving and not lost:
        return None  # nothing changes: a forced re-plan of the same membership is a new generation
    final = {n: sorted(r) for n, r in sorted(placement.items()) if r}
    if not final.get(store_node):  # the store goes with its node: the lowest survivor's node hosts the next one
        store_node = next(n for n, ranks in sorted(final.items(), key=lambda kv: min(kv[1]))
                          if set(ranks) & survivors)
    return InPlace(final, joiners, leaving, lost, store_node)


def store_move(placement: Mapping[str, Sequence[int]], store_node: str) -> InPlace:
    """The same membership on a fresh store, the old one's sidecar having died on a node still in
    service: hosted by the node :func:`successor_store_node` names (where the spare store waits), or
    by the same node when no other holds ranks. The survivors re-seed it as after a lost store node."""
    final = {n: sorted(r) for n, r in sorted(placement.items()) if r}
    return InPlace(final, (), (), (), successor_store_node(final, store_node) or store_node, fresh_store=True)


def successor_store_node(placement: Mapping[str, Sequence[int]], store_node: str) -> str:
    """The node that hosts the store if ``store_node`` alone is lost: the lowest survivor's, as
    :func:`plan_in_place` picks it then; "" when no other node holds ranks."""
    return launch_store_node({n: ranks for n, ranks in placement.items() if n != store_node})


def launch_store_node(placement: Mapping[str, Sequence[int]]) -> str:
    """The node that hosts a launch's store: the one holding its lowest rank (rank 0's; the store is
    the agent's sidecar, never a rank, which may die); "" for no placement."""
    held = {n: ranks for n, ranks in placement.items() if ranks}
    return min(held, key=lambda n: min(held[n]), default="")
