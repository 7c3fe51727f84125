"""The placeholder allocator: minimums first by weight, the rest spread evenly, never below a minimum."""

from __future__ import annotations

import random

from coordinator.allocation import Allocator, EvenAllocator
from coordinator.tasks import TaskSpec, parse_task_spec
from unicron.kernel.errors import InvalidRecord


def spec(name: str, **fields: object) -> TaskSpec:
    # elastic (Unicron's runtime) unless a test says otherwise: a "restart" task's size is fixed by default
    return parse_task_spec({"name": name, "command": ["train"], "recovery": "inprocess", **fields}, None)


def test_is_an_allocator() -> None:
    allocator: Allocator = EvenAllocator()
    assert allocator.allocate([spec("a")], 8, 8, {}, set()) == {"a": 8}


def test_minimums_in_weight_order_and_a_task_that_does_not_fit_waits() -> None:
    tasks = [
        spec("low", min_gpus=8, weight=0.5),
        spec("high", min_gpus=8, weight=2.0),
        spec("mid", min_gpus=4),
    ]
    counts = EvenAllocator().allocate(tasks, 12, 8, {}, set())
    assert counts == {"high": 8, "mid": 4, "low": 0}


def test_rest_spread_evenly_in_units_of_tp() -> None:
    tasks = [spec("a", tp_size=2, min_gpus=2), spec("b", tp_size=4, min_gpus=4), spec("c")]
    counts = EvenAllocator().allocate(tasks, 24, 8, {}, set())
    assert sum(counts.values()) == 24
    assert counts["a"] % 2 == 0 and counts["b"] % 4 == 0
    assert max(counts.values()) - min(counts.values()) <= 4


def test_running_task_keeps_its_place_among_equals() -> None:
    tasks = [spec("a", min_gpus=8), spec("b", min_gpus=8)]
    assert EvenAllocator().allocate(tasks, 8, 8, {"b": 8}, set()) == {"a": 0, "b": 8}


def test_random_inputs_always_satisfy_the_contract() -> None:
    rng = random.Random(4)
    model = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 32,
        "vocab_size": 100,
        "global_batch_size": 24,
    }
    for _ in range(300):
        tasks = []
        for i in range(rng.randint(1, 5)):
            tp = rng.choice([1, 2, 4])
            fields: dict[str, object] = {
                "tp_size": tp,
                "min_gpus": tp * rng.randint(1, 4),
                "weight": rng.choice([0.5, 1, 2]),
            }
            if rng.random() < 0.5:
                fields["model"] = model
            try:
                tasks.append(spec(f"t{i}", **fields))
            except InvalidRecord:
                continue  # min_gpus whose DP does not divide the batch: rejected at submission
        healthy = rng.randint(0, 40)
        counts = EvenAllocator().allocate(tasks, healthy, 8, {}, set())
        assert set(counts) == {t.name for t in tasks}
        assert sum(counts.values()) <= healthy
        for t in tasks:
            assert t.valid_count(counts[t.name]), (t, counts)
        # nobody waits while its minimum would fit in what was left over
        spare = healthy - sum(counts.values())
        for t in tasks:
            if counts[t.name] == 0:
                assert t.min_gpus > spare
