"""Micro-batch assignment: stable identities, blocks, round-robin redistribution (paper §6, Eq. 6-7)."""

from __future__ import annotations

import pytest

from unicron.kernel.errors import ConfigError
from unicron.runtime.plan import BatchLayout, Topology, initial_plan, mb_seed, redistribute


def test_each_replica_starts_with_its_contiguous_block_of_k() -> None:
    layout = BatchLayout(micro_batches=8, blocks=4)
    assert initial_plan(layout, [0, 1, 2, 3]) == {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]}


def test_fewer_replicas_than_blocks_split_the_last_blocks_round_robin() -> None:
    layout = BatchLayout(micro_batches=8, blocks=4)
    assert initial_plan(layout, [0, 1, 3]) == {0: [0, 1, 6], 1: [2, 3, 7], 3: [4, 5]}
    assert initial_plan(layout, [2]) == {2: list(range(8))}
    assert initial_plan(layout, [0, 1]) == {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}


def test_orphans_spread_so_each_survivor_gets_k_over_dp_minus_one() -> None:
    """B = 12, DP = 4, k = 3: losing one replica gives every survivor k' = k + k/(DP-1) = 4."""
    layout = BatchLayout(micro_batches=12, blocks=4)
    plan = initial_plan(layout, [0, 1, 2, 3])
    needed = [mb for mbs in plan.values() for mb in mbs]  # nothing computed yet
    after = redistribute(plan, [0, 1, 3], needed)
    assert {r: len(m) for r, m in after.items()} == {0: 4, 1: 4, 3: 4}
    assert sorted(mb for mbs in after.values() for mb in mbs) == list(range(12))
    assert after[0][:3] == [0, 1, 2] and after[1][:3] == [3, 4, 5]  # owners keep theirs


def test_only_needed_micro_batches_are_reassigned_least_loaded_first() -> None:
    layout = BatchLayout(micro_batches=8, blocks=4)
    plan = initial_plan(layout, [0, 1, 2, 3])
    # Survivors 0 and 1 finished; 2 still owes micro-batch 5; 3 died holding 6 and 7.
    after = redistribute(plan, [0, 1, 2], [5, 6, 7])
    assert after == {0: [6], 1: [7], 2: [5]}


def test_orphans_even_out_survivors_that_kept_unequal_loads() -> None:
    """Two replicas of four lost, survivor 0 done with its own and survivor 1 not: each orphan goes to
    whoever holds fewest at that moment, 3 and 3 (a fixed round-robin order gave 2 and 4)."""
    plan = initial_plan(BatchLayout(micro_batches=8, blocks=4), [0, 1, 2, 3])
    after = redistribute(plan, [0, 1], [2, 3, 4, 5, 6, 7])
    assert {r: len(m) for r, m in after.items()} == {0: 3, 1: 3}
    assert sorted(mb for mbs in after.values() for mb in mbs) == [2, 3, 4, 5, 6, 7]


def test_layout_and_topology_reject_bad_shapes_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="blocks=3"):
        BatchLayout(micro_batches=8, blocks=3)
    with pytest.raises(ConfigError, match="--tp 3"):
        Topology(world_size=4, tp=3)
    with pytest.raises(ConfigError, match="no live replica"):
        initial_plan(BatchLayout(4, 2), [])


def test_topology_replicas_and_groups() -> None:
    topo = Topology(world_size=4, tp=2)
    assert topo.replicas == 2 and topo.ranks_of(1) == [2, 3]
    assert topo.replicas_in([0, 1, 3]) == [0]
    assert topo.full_replica_members([0, 1, 3]) == [0, 1]
    assert topo.dp_peers([0, 1, 2, 3], 3) == [1, 3]


def test_seeds_derive_from_iteration_and_micro_batch_only() -> None:
    assert mb_seed(1, 5, 3) == mb_seed(1, 5, 3)
    seeds = {mb_seed(1, it, mb) for it in range(20) for mb in range(16)}
    assert len(seeds) == 320
