"""GEMINI-style placement: a replica is never on its own node, and no single node loss loses both copies."""

from __future__ import annotations

import pytest

from ckpt.placement import replica_plan, replica_targets
from unicron.kernel.errors import ConfigError


@pytest.mark.parametrize("n_nodes", [2, 3, 5, 8])
@pytest.mark.parametrize("copies", [1, 2])
def test_any_single_node_loss_leaves_a_copy(n_nodes: int, copies: int) -> None:
    nodes = [f"node-{i}" for i in range(n_nodes)]
    node_of_rank = {r: nodes[r // 4] for r in range(4 * n_nodes)}  # 4 ranks per node
    plan = replica_plan(node_of_rank, copies=copies)
    for rank, targets in plan.items():
        assert node_of_rank[rank] not in targets
        assert len(targets) == len(set(targets)) == min(copies, n_nodes - 1)
    for lost in nodes:
        for rank, targets in plan.items():
            survivors = [n for n in [node_of_rank[rank], *targets] if n != lost]
            assert survivors, f"losing {lost} loses every copy of rank {rank}"


def test_ring_is_deterministic_and_balanced() -> None:
    nodes = ["c", "a", "b"]
    assert [replica_targets(n, nodes) for n in ("a", "b", "c")] == [["b"], ["c"], ["a"]]


def test_single_node_has_no_peer_and_unknown_node_is_an_error() -> None:
    assert replica_targets("solo", ["solo"]) == []
    with pytest.raises(ConfigError, match="not among"):
        replica_targets("x", ["a", "b"])
