"""Accumulation and reduction: the canonical fold is bit-identical for any split, and completed
buckets are never reduced again. Collectives run on real gloo groups (two ranks as threads)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.runtime.threads import run_ranks
from unicron.runtime.comm import CommGroup, HashStore, new_group
from unicron.runtime.grads import (
    TAIL,
    Contributions,
    DirectSum,
    FlatGrads,
    ReduceProgress,
    RuntimeInvariantError,
    bucket_bounds,
    canonical_order,
    fold,
    reduce_gather,
    reduce_sum,
)
from unicron.runtime.plan import BatchLayout

LAYOUT = BatchLayout(micro_batches=8, blocks=4)


def grads_of(mb: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + mb)
    return [torch.randn(5, 3, generator=g) * 10 ** (mb % 4), torch.randn(7, generator=g)]


def make_flat() -> FlatGrads:
    params = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(7))]
    return FlatGrads(params, torch.float32)


def run_mb(acc: Any, mb: int, keep: bool = True) -> None:
    """What a backward does: the micro-batch's gradient lands in the parameters' .grad views."""
    acc.begin_mb()
    for p, g in zip(acc.flat.params, grads_of(mb), strict=True):
        p.grad += g
    acc.end_mb(mb, float(mb), keep)


def contributions(order: list[int]) -> Contributions:
    acc = Contributions(make_flat(), LAYOUT)
    acc.reset()
    for mb in order:
        run_mb(acc, mb)
    return acc


def table(*accs: Contributions) -> list[list[tuple[int, int]]]:
    return [[(c.start, c.length) for c in a.items] for a in accs]


def folded(*accs: Contributions) -> torch.Tensor:
    blocks = canonical_order(table(*accs), LAYOUT)
    return fold([[accs[r].items[i].vec for r, i in blk] for blk in blocks])


def test_fold_is_bit_identical_for_any_split_of_the_micro_batches() -> None:
    one = folded(contributions(list(range(8))))  # one rank did everything, in order
    four = folded(*(contributions([2 * r, 2 * r + 1]) for r in range(4)))  # DP = 4
    # Rank 3 died; its micro-batches 6 and 7 were redistributed to ranks 0 and 1 as singles.
    after_failure = folded(contributions([0, 1, 6]), contributions([2, 3, 7]), contributions([4, 5]))
    assert torch.equal(one, four) and torch.equal(one, after_failure)
    plain = torch.stack([torch.cat([g.reshape(-1) for g in grads_of(mb)]) for mb in range(8)]).sum(0)
    assert not torch.equal(one[:-TAIL], plain)  # the order matters: that is why it is fixed
    torch.testing.assert_close(one[:-TAIL], plain)


def test_only_a_block_prefix_is_folded_the_rest_stays_single() -> None:
    acc = contributions([1, 2, 3])  # starts mid-block 0: single 1, then block 1's prefix 2+3
    assert [(c.start, c.length) for c in acc.items] == [(1, 1), (2, 2)]


def test_canonical_order_rejects_double_or_missing_micro_batches() -> None:
    with pytest.raises(RuntimeInvariantError, match="twice"):
        canonical_order([[(0, 2)], [(0, 1)]], LAYOUT)
    with pytest.raises(RuntimeInvariantError, match="missing"):
        canonical_order([[(0, 2), (2, 2), (4, 2)]], LAYOUT)
    with pytest.raises(RuntimeInvariantError, match="mid-block"):
        canonical_order([[(0, 1), (1, 2)], [(3, 3)]], BatchLayout(6, 2))


def test_direct_sum_refuses_to_discard() -> None:
    acc = DirectSum(make_flat())
    acc.reset()
    with pytest.raises(RuntimeInvariantError):
        run_mb(acc, 0, keep=False)


def on_two_ranks(fn: Callable[[CommGroup, int], Any]) -> list[Any]:
    store = HashStore()
    return run_ranks(2, lambda rank: fn(new_group("gloo", store, "t", rank, 2, 30.0), rank))


def test_gather_reduction_over_gloo_equals_the_single_rank_fold_bit_for_bit() -> None:
    ref = folded(contributions(list(range(8))))
    split = {0: [0, 1, 4, 5, 6], 1: [2, 3, 7]}

    def body(group: CommGroup, rank: int) -> torch.Tensor:
        acc = contributions(split[rank])
        prog = ReduceProgress(bucket_bounds(ref.numel(), 7), ref.dtype)
        reduce_gather(group, acc, prog, lambda b: None, (0, 0))
        assert prog.complete
        return prog.span(0, len(prog.bounds))

    for reduced in on_two_ranks(body):
        assert torch.equal(reduced, ref)


def test_completed_buckets_are_kept_and_only_the_rest_is_reduced() -> None:
    """Scenario #2: buckets reduced before a failure hold the final sum and are not touched again;
    the accumulation itself is never reduced in place."""

    def body(group: CommGroup, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = DirectSum(make_flat())
        acc.reset()
        for mb in range(rank * 4, rank * 4 + 4):
            run_mb(acc, mb)
        before = acc.vector.clone()
        bounds = bucket_bounds(acc.vector.numel(), 8)
        prog = ReduceProgress(bounds, acc.vector.dtype, done=2)
        prog.put(0, torch.full((8,), -1.0))  # "already reduced"
        prog.put(1, torch.full((8,), -2.0))
        reduce_sum(group, acc.vector, prog, lambda b: None)
        return prog.span(0, len(bounds)), acc.vector, before

    (red0, vec0, before0), (red1, _, before1) = on_two_ranks(body)
    kept = 16
    assert torch.equal(red0[:kept], torch.tensor([-1.0] * 8 + [-2.0] * 8)), "completed buckets were overwritten"
    torch.testing.assert_close(red0[kept:], (before0 + before1)[kept:])
    assert torch.equal(red0, red1)
    assert torch.equal(vec0, before0), "the accumulation buffer was reduced in place"


def test_flat_grads_views_survive_backward() -> None:
    model = torch.nn.Linear(4, 3)
    flat = FlatGrads(list(model.parameters()), torch.float32)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
    flat.check_views()
    assert float(flat.grads.abs().sum()) > 0


def test_parts_hold_the_scaled_gradient_with_a_raw_tail_and_are_read_in_place() -> None:
    numel, bounds = 10, bucket_bounds(10 + TAIL, 4)
    prog = ReduceProgress(bounds, torch.float64, numel=numel, scale=0.25)
    raw = torch.arange(numel + TAIL, dtype=torch.float64)
    for it in range(2):  # parts alternate between the two buffers, bucket by bucket
        prog.reset()
        for b, (s, e) in enumerate(bounds):
            prog.store(b, prog.stage(b, raw[s:e] + it))
        grads = prog.final_grads()
        assert grads is not None and grads.numel() == numel
        assert torch.equal(grads, (raw[:numel] + it) * 0.25)
        assert prog.tail().tolist() == (raw[numel:] + it).tolist()  # loss sum and flags are not scaled
    with pytest.raises(RuntimeInvariantError):
        prog.store(0, torch.zeros(4, dtype=torch.float64))  # only a bucket's scratch can become final


def test_after_a_recovery_that_reduced_some_buckets_twice_the_gradient_is_gathered_from_both_buffers() -> None:
    numel, bounds = 10, bucket_bounds(10 + TAIL, 4)
    prog = ReduceProgress(bounds, torch.float64, numel=numel, scale=0.5)
    raw = torch.arange(numel + TAIL, dtype=torch.float64)
    for b, (s, e) in enumerate(bounds):
        prog.store(b, prog.stage(b, raw[s:e]))
    prog.reset()  # --recovery rerun: bucket 0 reduced again, the others not yet
    prog.store(0, prog.stage(0, raw[0:4]))
    assert prog.final_grads() is None
    out = torch.full((numel + TAIL,), -1.0, dtype=torch.float64)
    prog.copy_grads_into(out)
    assert torch.equal(out[:numel], raw[:numel] * 0.5)
    assert torch.equal(out[numel:], torch.full((TAIL,), -1.0, dtype=torch.float64))


def test_the_optimizer_reads_the_reduced_buffer_and_accumulation_returns_to_the_flat_buffer() -> None:
    model = torch.nn.Linear(4, 3)
    flat = FlatGrads(list(model.parameters()), torch.float32)
    reduced = torch.arange(flat.numel + TAIL, dtype=torch.float32)
    flat.bind(reduced[: flat.numel])
    assert model.weight.grad is not None and model.weight.grad.data_ptr() == reduced.data_ptr()
    with pytest.raises(RuntimeInvariantError):
        flat.check_views()  # accumulating now would miss the flat buffer
    acc = DirectSum(flat)
    acc.reset()
    model(torch.randn(2, 4)).sum().backward()
    flat.check_views()
    assert float(flat.grads.abs().sum()) > 0 and torch.equal(reduced, torch.arange(flat.numel + TAIL, dtype=torch.float32))


def test_perf_plain_step_after_a_deterministic_iteration_uses_only_its_own_gradient() -> None:
    """The perf benchmark alternates kinds on one trainer; a deterministic iteration ends with
    Contributions.reset(), which leaves its last micro-batch's gradient in the flat buffer (the next
    micro-batch zeroes it), and plain_step backpropagated onto it: the plain loop's first step after a
    deterministic round used a wrong gradient. Now plain_step zeroes the buffer as it begins."""
    from types import SimpleNamespace

    from unicron.runtime.job import Job
    from unicron.runtime.perf import plain_step
    from unicron.runtime.plan import Topology
    from unicron.runtime.state import OptimConfig, ReplicaState

    layout = BatchLayout(4, 1)
    data = SimpleNamespace(batch=lambda it, mb: torch.full((2, 3), float(it * 10 + mb + 1), dtype=torch.float64))
    group = new_group("gloo", HashStore(), "t", 0, 1, 20.0)

    def trainer() -> SimpleNamespace:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2).double()
        state = ReplicaState(model, OptimConfig(lr=0.1))
        job = Job(model_provider=lambda c: model, forward_step=lambda b, m: m(b).pow(2).mean(),
                  data=data)
        return SimpleNamespace(state=state, flat=FlatGrads(state.params, torch.float64), job=job, layout=layout,
                               topo=Topology(1, 1), replica=0,
                               groups=SimpleNamespace(dp=group, record=SimpleNamespace(members=(0,))))

    after, fresh = trainer(), trainer()
    acc = Contributions(after.flat, layout)  # a deterministic iteration on ``after``
    acc.reset()
    for mb in range(4):
        acc.begin_mb()
        after.job.loss(after.state.model, 0, mb).backward()
        acc.end_mb(mb, 0.0, True)
    acc.reset()  # what Trainer._new_iteration does after the commit
    for t in (after, fresh):
        plain_step(t, 1)  # type: ignore[arg-type]
    # Adam's first moment after one step: (1 - beta1) * the gradient
    moment = [t.state.optimizer.state[t.state.params[0]]["exp_avg"] for t in (after, fresh)]
    assert torch.equal(moment[0], moment[1])


def test_the_tail_is_never_split_across_buckets() -> None:
    for total in range(TAIL, 40):
        for size in range(1, 12):
            bounds = bucket_bounds(total, size)
            assert bounds[0][0] == 0 and bounds[-1][1] == total
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
            assert bounds[-1][1] - bounds[-1][0] >= TAIL
