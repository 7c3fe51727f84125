"""Where a rank's in-memory replicas go (GEMINI-style placement).

Nodes are ordered on a ring (sorted by name, so every agent computes the same answer without talking);
the ranks of node ``i`` replicate to nodes ``i+1 .. i+copies``. A replica is therefore never on its own
node, and the loss of any single node leaves every rank with a copy elsewhere: its own local copy if
the lost node held its replica, its replica if the lost node was its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

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
