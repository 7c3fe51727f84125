"""Resharding a snapshot into another tensor-parallel size, in one process: the split is Megatron's own
(a TP=2 model built from a seed holds exactly the shards :func:`reshard.split` cuts from the TP=1
model of that seed), Adam's moments follow their parameters, and a launch that lacks a shard says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.runtime.conftest import Runner, train_args
from tests.runtime.threads import run_ranks
from unicron.runtime.checkpoint import TorchSaveCheckpointer
from unicron.runtime.comm import HashStore, ensure_torch_distributed, new_group, solo_group
from unicron.runtime.compare import max_rel_diff
from unicron.runtime.model import ModelConfig, build_gpt
from unicron.runtime.reshard import (
    NO_CLAIM,
    Partition,
    ReshardError,
    TpLayout,
    choose,
    claim_of,
    join,
    reshard,
    restore_resharded,
    shard_tensors,
    split,
)
from unicron.runtime.state import OptimConfig, ReplicaState

CFG = ModelConfig(layers=2, hidden=64, heads=4, seq=16, vocab=128, dtype="float64")


class FakeTpGroup:
    """Rank ``rank`` of a TP group of ``size``: all Megatron's CPU initialisation asks of a group."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def replica(tp: int, rank: int) -> ReplicaState:
    ensure_torch_distributed()
    group = solo_group() if tp == 1 else FakeTpGroup(tp, rank)
    return ReplicaState(build_gpt(CFG, group), OptimConfig(), TpLayout(tp, rank))  # type: ignore[arg-type]


def with_moments(state: ReplicaState, seed: int) -> ReplicaState:
    """Adam moments and step as after some training (random, reproducible), iteration 7."""
    gen = torch.Generator().manual_seed(seed)
    for p in state.params:
        s = state.optimizer.state[p]
        s["exp_avg"].copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
        s["exp_avg_sq"].copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype))
        s["step"].fill_(7.0)
    state.iteration = 7
    return state


@given(tp=st.integers(1, 4), stride=st.integers(1, 3), dim=st.integers(0, 1), cols=st.integers(1, 3))
def test_join_undoes_split_for_any_stride(tp: int, stride: int, dim: int, cols: int) -> None:
    shape = [tp * stride * 2, cols] if dim == 0 else [cols, tp * stride * 2]
    full = torch.arange(shape[0] * shape[1], dtype=torch.float64).reshape(shape)
    part = Partition(dim, stride)
    shards = [split(full, part, tp, r) for r in range(tp)]
    assert torch.equal(join(shards, part), full)
    assert all(s.size(dim) == full.size(dim) // tp for s in shards)


@pytest.mark.parametrize("to_tp", [2, 4])
def test_a_tp1_snapshot_resharded_is_exactly_megatrons_own_tp_split(to_tp: int) -> None:
    """Parameters against the TP-``to_tp`` model Megatron builds from the same seed; Adam's moments
    against the split of the full moments; step and iteration carried over."""
    full = with_moments(replica(1, 0), seed=1)
    snapshot = full.state_dict()
    for rank in range(to_tp):
        megatron = replica(to_tp, rank)
        ours = replica(to_tp, rank)
        reshard(ours.slots(), [shard_tensors(snapshot, full.names)], to_tp, rank)
        for name, p, q in zip(ours.names, ours.params, megatron.params, strict=True):
            assert torch.equal(p, q), name
        for slot, want in zip(ours.slots(), full.slots(), strict=True):
            expected = want.target if slot.part is None else split(want.target, slot.part, to_tp, rank)
            assert torch.equal(slot.target, expected)


def test_tp2_snapshots_resharded_into_tp1_give_the_full_state_back() -> None:
    full = with_moments(replica(1, 0), seed=2)
    halves = []
    for rank in range(2):  # the TP=2 shards of the same state
        half = replica(2, rank)
        reshard(half.slots(), [shard_tensors(full.state_dict(), full.names)], 2, rank)
        halves.append(shard_tensors(half.state_dict(), half.names))
    back = replica(1, 0)
    reshard(back.slots(), halves, 1, 0)
    for got, want in zip(back.tensors(), full.tensors(), strict=True):
        assert torch.equal(got, want)


def test_claims_name_a_snapshots_layout_only_when_its_shapes_fit_that_layout() -> None:
    half = with_moments(replica(2, 1), seed=3)
    target = replica(1, 0)
    assert claim_of(half.state_dict(), target.slots(), target.names, tp=1) == (7, 2, 1)
    lying = {**half.state_dict(), "layout": TpLayout(4, 1).to_dict()}  # TP=2 shapes said to be TP=4
    assert claim_of(lying, target.slots(), target.names, tp=1) == NO_CLAIM
    unrecorded = {k: v for k, v in half.state_dict().items() if k != "layout"}
    assert claim_of(unrecorded, target.slots(), target.names, tp=1) == NO_CLAIM


def test_the_newest_iteration_with_every_shard_wins_and_a_missing_shard_is_named() -> None:
    # iteration 9 of TP=2 lacks shard 1; iteration 8 of TP=2 is complete (ranks 1 and 3 own it)
    claims = [(9, 2, 0), (8, 2, 0), (8, 2, 0), (8, 2, 1), NO_CLAIM]
    assert choose(claims) == (8, 2, [1, 3])
    assert choose([(5, 1, 0), (6, 2, 0)]) == (5, 1, [0])
    with pytest.raises(ReshardError, match=r"shard 0/2.*relaunch with the old --tp"):
        choose([(6, 2, 0), NO_CLAIM])


def tp_linear(tp: int, seed: int) -> torch.nn.Module:
    """A column-parallel Linear(4 -> 6) shard of ``tp`` (Megatron's attributes on weight and bias)."""
    torch.manual_seed(seed)
    lin = torch.nn.Linear(4, 6 // tp).double()
    for p in lin.parameters():
        p.tensor_model_parallel = True  # type: ignore[attr-defined]
        p.partition_dim = 0  # type: ignore[attr-defined]
        p.partition_stride = 1  # type: ignore[attr-defined]
    return lin


def test_reshard_finds_the_newest_iteration_every_shard_holds_not_only_each_ranks_newest(tmp_path: Path) -> None:
    """TP=2 with torch-save: both shards saved iteration 8, only shard 0 saved 10 (shard 1's writer died
    first). Each rank claimed only its shard's newest file, so the relaunch at TP=1 stopped with 'no
    iteration has every tensor-parallel shard'; now each claims every file it holds and 8 is restored."""
    root = str(tmp_path / "ckpt")
    at8 = [ReplicaState(tp_linear(2, 10 + k), OptimConfig(), TpLayout(2, k)) for k in range(2)]
    for k, shard in enumerate(at8):
        shard.iteration = 8
        TorchSaveCheckpointer(root, rank=k, shard=k).save(shard.state_dict(), 8)
    at10 = ReplicaState(tp_linear(2, 99), OptimConfig(), TpLayout(2, 0))
    at10.iteration = 10
    TorchSaveCheckpointer(root, rank=0, shard=0).save(at10.state_dict(), 10)
    store = HashStore()

    def rank(r: int) -> tuple[int, torch.Tensor]:
        world = new_group("gloo", store, "t", r, 2, 20.0)
        state = ReplicaState(tp_linear(1, 0), OptimConfig(), TpLayout(1, 0))
        ck = TorchSaveCheckpointer(root, rank=r, shard=0)  # TP=1: every rank writes shard 0's files
        assert restore_resharded(state, ck, world, tp=1, tp_rank=0, mine=None) == ("remote", 2)
        return state.iteration, state.params[0].detach().clone()

    want = join([shard.params[0].detach() for shard in at8], Partition(0))
    for it, weight in run_ranks(2, rank, timeout_s=30):
        assert it == 8 and torch.equal(weight, want)


def test_a_reshard_carries_the_models_buffers(tmp_path: Path) -> None:
    """A buffer training changes (a MoE router's expert bias) is not a parameter: the reshard restored
    only parameters and Adam's state, and left it at the new launch's initial value. Replicated on every
    TP rank, it now comes from the owner of old shard 0."""
    root = str(tmp_path / "ckpt")
    trained = torch.tensor([0.25, -1.5, 3.0], dtype=torch.float64)
    for k in range(2):
        shard = ReplicaState(tp_linear(2, 10 + k), OptimConfig(), TpLayout(2, k))
        shard.model.register_buffer("expert_bias", trained.clone())
        shard.iteration = 8
        TorchSaveCheckpointer(root, rank=k, shard=k).save(shard.state_dict(), 8)
    store = HashStore()

    def rank(r: int) -> torch.Tensor:
        world = new_group("gloo", store, "b", r, 2, 20.0)
        model = tp_linear(1, 0)
        model.register_buffer("expert_bias", torch.zeros(3, dtype=torch.float64))
        state = ReplicaState(model, OptimConfig(), TpLayout(1, 0))
        ck = TorchSaveCheckpointer(root, rank=r, shard=0)
        restore_resharded(state, ck, world, tp=1, tp_rank=0, mine=None)
        return model.get_buffer("expert_bias").clone()

    for got in run_ranks(2, rank, timeout_s=30):
        assert torch.equal(got, trained)


def test_a_snapshot_whose_buffers_are_not_the_models_claims_nothing() -> None:
    half = with_moments(replica(2, 1), seed=3)
    target = replica(1, 0)
    bias = [("expert_bias", torch.zeros(3, dtype=torch.float64))]
    assert claim_of(half.state_dict(), target.slots(), target.names, 1, bias) == NO_CLAIM  # lacks it
    with_bias = {**half.state_dict(), "model": {**half.state_dict()["model"], "expert_bias": torch.zeros(4)}}
    assert claim_of(with_bias, target.slots(), target.names, 1, bias) == NO_CLAIM  # another shape
    fits = {**half.state_dict(), "model": {**half.state_dict()["model"], "expert_bias": torch.ones(3).double()}}
    assert claim_of(fits, target.slots(), target.names, 1, bias) == (7, 2, 1)


@pytest.mark.parametrize(("kind", "old_tp", "new_tp"), [("torch-save", 2, 1), ("memory", 1, 2)])
def test_a_relaunch_with_another_tp_size_restores_the_snapshot_resharded(
        runner: Runner, tmp_path: Path, kind: str, old_tp: int, new_tp: int) -> None:
    """Two ranks train 3 iterations at ``old_tp`` with a snapshot every iteration, then are relaunched
    at ``new_tp`` (DP changes with it; the global batch does not): they restore iteration 3 resharded
    and train on to 5, ending where a run at ``new_tp`` throughout ends. Not bit for bit: the first
    three iterations summed their products in another TP split (float64 rounding: 3.5e-15 and 6.4e-15 measured)."""
    ckpt = ["--ckpt", kind, "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "1", "--resume"]
    first = runner.run(2, train_args(3, "float64", False, "--tp", str(old_tp), *ckpt))
    assert first.codes == {0: 0, 1: 0}, first.job.logs()
    second = runner.run(2, train_args(5, "float64", False, "--tp", str(new_tp), *ckpt))
    assert second.codes == {0: 0, 1: 0}, second.job.logs()
    for rank in (0, 1):
        assert [(e["it"], e["resharded_from"]) for e in second.events(rank, "restored")] == [(3, old_tp)]
    reference = train_args(5, "float64", False, "--tp", str(new_tp))
    for rank in range(new_tp):  # each shard of the new layout
        diff = max_rel_diff(second.params(rank), runner.reference(reference, world=2, blocks=2, rank=rank))
        assert diff <= 1e-12, f"shard {rank}: max rel diff {diff:.3e}"


def test_a_reshard_to_an_older_iteration_than_a_rank_restored_saves_on_from_it(runner: Runner, tmp_path: Path) -> None:
    """Four ranks at TP 2 snapshot every iteration to 4, and only rank 2 still holds 4 (the others lost
    it, as ranks killed before their snapshot of 4 was published). Relaunched at TP 1, rank 2 restores
    its 4 (the newest claimed) but the reshard takes 3, the newest every shard holds: rank 2's
    checkpointer still counted 4 restored, refused the save of 4 and the rank died."""
    from ckpt.manager import CheckpointConfig, CheckpointManager
    from ckpt.storage import FilesystemStorage

    ck = tmp_path / "ck"
    ckpt = ["--ckpt", "memory", "--ckpt-dir", str(ck), "--ckpt-every", "1", "--resume"]
    first = runner.run(4, train_args(4, "float64", False, "--tp", "2", *ckpt))
    assert first.codes == dict.fromkeys(range(4), 0), first.job.logs()
    for rank in (0, 1, 3):  # restoring 3 discards their 4 in every tier
        cfg = CheckpointConfig(job="local", rank=rank, local_dir=str(ck / f"rank-{rank}"))
        with CheckpointManager(cfg, storage=FilesystemStorage(ck / "persisted")) as m:
            assert m.restore(iteration=3).iteration == 3
    second = runner.run(4, train_args(6, "float64", False, "--tp", "1", *ckpt))
    assert second.codes == dict.fromkeys(range(4), 0), second.job.logs()
    for rank in range(4):
        assert [(e["it"], e["resharded_from"]) for e in second.events(rank, "restored")] == [(3, 2)]
        assert [e["it"] for e in second.events(rank, "checkpoint")] == [4, 5, 6]
