"""GEMINI-style placement: a replica is never on its own node, and no single node loss loses both copies."""

from __future__ import annotations

import pytest

from ckpt.placement import previous_holders, replica_plan, replica_targets, restore_order
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


def test_a_restore_asks_the_previous_placements_holders_first_past_any_bound() -> None:
    """2,000 nodes: the rank ran on n1500 (lost since), which pushed to n1501; a bound of 1,024 in
    ring order from this node (n0000) left n1501 out."""
    nodes = [f"n{i:04d}" for i in range(2000) if i != 1500]
    order = restore_order("n0000", nodes, ["n1500"], limit=1024)
    assert order[:2] == ["n0000", "n1501"] and len(order) == len(set(order)) == 1024
    assert order[2:5] == ["n1502", "n0001", "n0002"]  # the next one too (a node may have joined between)
    assert order[-1] == "n1021"  # then the nearest on the ring, as before
    # a node that registered between n1500 and n1501 since the push is first on the ring now
    assert previous_holders(["n1500"], [*nodes, "n1500a"]) == ["n1500a", "n1501"]
    # the rank never moved: its own node's successors, once each; no previous placement: the ring
    assert restore_order("n0000", nodes, ["n0000"], limit=4) == ["n0000", "n0001", "n0002", "n0003"]
    assert restore_order("n0000", nodes, limit=3) == ["n0000", "n0001", "n0002"]
    # a node not registered (yet) starts from the ring's first, as the agent did
    assert restore_order("zz", ["b", "a"], ["a"]) == ["b", "a"]
