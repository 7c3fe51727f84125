"""Where a rank's in-memory replicas go (GEMINI-style placement).

Nodes are ordered on a ring (sorted by name, so every agent computes the same answer without talking);
the ranks of node ``i`` replicate to nodes ``i+1 .. i+copies``. A replica is therefore never on its own
node, and the loss of any single node leaves every rank with a copy elsewhere: its own local copy if
the lost node held its replica, its replica if the lost node was its own.

A restore asks the servers that may hold the rank's replicas (:func:`restore_order`): the successors of
the nodes the rank ran on before (its previous placement), then the rest nearest first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from unicron.kernel.errors import ConfigError


def replica_targets(node: str, nodes: Iterable[str], copies: int = 1) -> list[str]:
    """The peer nodes holding replicas of the ranks on ``node``; empty when ``node`` is alone."""
    ring = sorted(set(nodes))
    if node not in ring:
        raise ConfigError(f"replica placement: node {node!r} is not among the job's nodes {ring}")
    if copies < 1:
        raise ConfigError(f"replica placement: copies={copies}; must be at least 1")
    i = ring.index(node)
    return [ring[(i + k) % len(ring)] for k in range(1, min(copies, len(ring) - 1) + 1)]


def replica_plan(
    node_of_rank: Mapping[int, str], nodes: Iterable[str] | None = None, copies: int = 1
) -> dict[int, list[str]]:
    """``replica_targets`` for every rank: rank -> peer nodes (``nodes`` defaults to the ranks' nodes)."""
    all_nodes = set(node_of_rank.values()) if nodes is None else set(nodes)
    return {rank: replica_targets(node, all_nodes, copies) for rank, node in sorted(node_of_rank.items())}


#: ring successors of a rank's previous node asked on restore: its push target, and the next one in case
#: a node registered between them since the push (the ring then puts that newcomer first)
HOLDER_SPAN = 2


def previous_holders(previous: Sequence[str], nodes: Iterable[str], span: int = HOLDER_SPAN) -> list[str]:
    """The nodes that may hold the replicas a rank pushed from its ``previous`` nodes (newest first):
    each one's ring successors among ``nodes``, found with the previous node on the ring even if it is
    gone (its successor, which took its pushes, still follows its name)."""
    ring = set(nodes)
    out: list[str] = []
    for prev in previous:
        for holder in replica_targets(prev, ring | {prev}, span):
            if holder in ring and holder not in out:
                out.append(holder)
    return out


def restore_order(node: str, nodes: Iterable[str], previous: Sequence[str] = (), limit: int | None = None) -> list[str]:
    """The nodes whose replica servers a rank on ``node`` asks on restore, at most ``limit``: ``node``
    first, then the holders of the replicas it pushed from its ``previous`` nodes
    (:func:`previous_holders`), then every other node in ring order from ``node``. The holders come
    before the ring, so a bound on the list never leaves them out, however far round the ring they are."""
    ring = sorted(set(nodes))
    i = ring.index(node) if node in ring else 0
    out = [node] if node in ring else []
    seen = set(out)
    for n in (*previous_holders(previous, ring), *ring[i:], *ring[:i]):
        if n not in seen:
            seen.add(n)
            out.append(n)
    return out if limit is None else out[:limit]
