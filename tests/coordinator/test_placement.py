"""Placement: whole TP groups per node, determinism, and fewest moved workers against brute force."""

from __future__ import annotations

import random

import pytest

from coordinator.placement import moved_workers, place
from unicron.kernel.errors import PermanentError

Placement = dict[str, dict[str, int]]


def brute_force_moves(
    counts: dict[str, int], nodes: dict[str, int], current: Placement, tp: dict[str, int]
) -> int | None:
    """Fewest moved workers over every valid placement (None: no valid placement)."""
    tasks = sorted(t for t in counts if counts[t] > 0)
    names = sorted(nodes)
    best: list[int] = []

    def per_task(i: int, free: dict[str, int], acc: Placement) -> None:
        if i == len(tasks):
            moves = moved_workers(acc, current)
            if not best or moves < best[0]:
                best[:] = [moves]
            return
        task, size = tasks[i], tp[tasks[i]]

        def per_node(j: int, left: int, row: dict[str, int]) -> None:
            if j == len(names):
                if left == 0:
                    acc[task] = {n: g for n, g in row.items() if g}
                    per_task(i + 1, free, acc)
                return
            node = names[j]
            for g in range(0, min(left, free[node]) + 1, size):
                row[node] = g
                free[node] -= g
                per_node(j + 1, left - g, row)
                free[node] += g
            row[node] = 0

        per_node(0, counts[task], {})

    per_task(0, dict(nodes), {})
    return best[0] if best else None


def random_instance(
    rng: random.Random, caps: list[int], tps: list[int]
) -> tuple[dict[str, int], dict[str, int], Placement, dict[str, int]]:
    nodes = {f"n{i}": rng.choice(caps) for i in range(rng.randint(2, 4))}
    tp = {f"t{i}": rng.choice(tps) for i in range(rng.randint(1, 3))}
    free = dict(nodes)
    current: Placement = {}
    for t in sorted(tp):
        row = {}
        for n in sorted(nodes):
            g = rng.randint(0, free[n] // tp[t]) * tp[t] if rng.random() < 0.6 else 0
            if g:
                row[n] = g
                free[n] -= g
        current[t] = row
    if rng.random() < 0.3:  # a node was lost
        del nodes[rng.choice(sorted(nodes))]
    left = sum(nodes.values())
    counts = {}
    for t in sorted(tp):
        g = rng.randint(0, left // tp[t]) * tp[t] if rng.random() < 0.85 else 0
        counts[t] = g
        left -= g
    return counts, nodes, current, tp


def check_valid(out: Placement, counts: dict[str, int], nodes: dict[str, int], tp: dict[str, int]) -> None:
    for task, row in out.items():
        assert sum(row.values()) == counts[task], task
        assert all(g > 0 and g % tp[task] == 0 and n in nodes for n, g in row.items()), (task, row)
    for node, cap in nodes.items():
        assert sum(row.get(node, 0) for row in out.values()) <= cap, node


@pytest.mark.parametrize(
    ("caps", "tps", "seed"), [([2, 4, 4], [1, 1, 2, 4], 1), ([8, 8, 4], [1, 2, 4, 8], 2)]
)
def test_fewest_moves_matches_brute_force(caps: list[int], tps: list[int], seed: int) -> None:
    rng = random.Random(seed)
    checked = feasible = 0
    while checked < 400:
        counts, nodes, current, tp = random_instance(rng, caps, tps)
        best = brute_force_moves(counts, nodes, current, tp)
        checked += 1
        if best is None:
            with pytest.raises(PermanentError):
                place(counts, nodes, current, tp)
            continue
        feasible += 1
        out = place(counts, nodes, current, tp)
        check_valid(out, counts, nodes, tp)
        assert moved_workers(out, current) == best, (counts, nodes, current, tp, out)
    assert feasible > 300


def test_non_chain_tp_sizes_still_give_valid_placements() -> None:
    # TP 2 and 3 on 6-GPU nodes do not divide each other: placement is then a heuristic, but valid
    rng = random.Random(3)
    for _ in range(200):
        counts, nodes, current, tp = random_instance(rng, [6, 6, 3], [1, 2, 3])
        best = brute_force_moves(counts, nodes, current, tp)
        try:
            out = place(counts, nodes, current, tp)
        except PermanentError:
            assert best is None
            continue
        check_valid(out, counts, nodes, tp)
        assert best is not None and moved_workers(out, current) >= best


def test_keeps_existing_workers_and_keeps_tp_groups_whole() -> None:
    current = {"a": {"n1": 4, "n2": 4}, "b": {"n1": 4, "n2": 4}}
    out = place({"a": 8, "b": 8}, {"n1": 8, "n2": 8, "n3": 8}, current, {"a": 1, "b": 4})
    assert out == current  # nothing to change: nothing moves
    # n2 lost: b (tp 4) needs a whole 4-block; a must give way on n1 or go to n3
    out = place({"a": 8, "b": 8}, {"n1": 8, "n3": 8}, current, {"a": 1, "b": 4})
    check_valid(out, {"a": 8, "b": 8}, {"n1": 8, "n3": 8}, {"a": 1, "b": 4})
    assert moved_workers(out, current) == 8  # exactly the workers that were on n2


def test_a_shrinking_task_on_a_node_that_shrank_lets_go_there_first() -> None:
    """The task shrink ran before the node's capacity cut: "a" let go of n3's 4 GPUs, then n1's cut
    took 4 more, and 4 workers moved to make up the count. Now the cut runs first (taking a shrinking
    task's blocks), and nobody moves."""
    current = {"a": {"n0": 8, "n1": 8, "n3": 4}}
    out = place({"a": 16}, {"n0": 8, "n1": 6, "n2": 8, "n3": 8}, current, {"a": 4})
    assert out == {"a": {"n0": 8, "n1": 4, "n3": 4}}
    # two tasks on the shrunk node: the one that shrinks anyway gives way there, the other stays
    current = {"a": {"n0": 4, "n1": 4}, "b": {"n1": 4}}
    out = place({"a": 4, "b": 4}, {"n0": 8, "n1": 4}, current, {"a": 4, "b": 1})
    assert out == {"a": {"n0": 4}, "b": {"n1": 4}}


def test_fragmentation_forces_a_move_of_a_healthy_task() -> None:
    # a (tp 1) sits on both nodes; b needs a whole 8-GPU node: a must consolidate
    out = place({"a": 8, "b": 8}, {"n1": 8, "n2": 8}, {"a": {"n1": 4, "n2": 4}}, {"a": 1, "b": 8})
    assert sorted(out["b"].values()) == [8] and sorted(out["a"].values()) == [8]
    assert moved_workers(out, {"a": {"n1": 4, "n2": 4}}) == 12


def test_deterministic_and_independent_of_input_order() -> None:
    rng = random.Random(5)
    for _ in range(50):
        counts, nodes, current, tp = random_instance(rng, [8, 8, 4], [1, 2, 4, 8])
        try:
            first = place(counts, nodes, current, tp)
        except PermanentError:
            continue
        shuffled = dict(reversed(list(nodes.items())))
        again = place(dict(reversed(list(counts.items()))), shuffled, current, tp)
        assert first == again


def test_large_cluster_is_placed_quickly() -> None:
    rng = random.Random(11)
    nodes = {f"n{i:03d}": 8 for i in range(128)}
    tp = {"a": 1, "b": 2, "c": 4, "d": 8}
    current: Placement = {t: {} for t in tp}
    free = dict(nodes)
    for t in sorted(tp):
        for n in sorted(nodes):
            if rng.random() < 0.3 and free[n] >= tp[t]:
                g = rng.randint(1, free[n] // tp[t]) * tp[t]
                current[t][n] = g
                free[n] -= g
    for gone in ("n005", "n077"):
        del nodes[gone]
    counts = {"a": 301, "b": 200, "c": 240, "d": 256}
    out = place(counts, nodes, current, tp)
    check_valid(out, counts, nodes, tp)


@pytest.mark.parametrize(
    ("counts", "nodes", "tp", "message"),
    [
        ({"a": 3}, {"n1": 8}, {"a": 2}, "not a multiple of its tp=2"),
        ({"a": 16}, {"n1": 8}, {"a": 1}, "16 GPUs asked for, only 8 usable"),
        ({"a": 8}, {"n1": 4, "n2": 4}, {"a": 8}, "whole tensor-parallel groups"),
        ({"a": 2}, {"n1": 8}, {}, "no valid tensor-parallel size"),
    ],
)
def test_impossible_requests_raise_permanent_error(
    counts: dict[str, int], nodes: dict[str, int], tp: dict[str, int], message: str
) -> None:
    with pytest.raises(PermanentError, match=message):
        place(counts, nodes, {}, tp)
