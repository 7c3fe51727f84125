"""Rank failures inside an iteration, on real processes with gloo, checked for exact gradients.

Every job is 4 ranks of a Megatron-core GPT (or TP=2 x DP=2); ranks die by SIGKILL at scripted points
(``UNICRON_RUNTIME_FAULTS``), the launcher marks them failed as the agent would, and the survivors must
finish each iteration with the gradient of all B micro-batches. Reference: the same training without
failures. Default mode: float64 within 1e-12 (float32 within 1e-5) relative; deterministic mode: equal
bit for bit.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.runtime.conftest import Finished, Runner, train_args, wait_for
from unicron.cluster.launch import LocalJob
from unicron.runtime.compare import bitwise_equal, max_rel_diff

Params = dict[str, torch.Tensor]
TOLERANCE = {"float64": 1e-12, "float32": 1e-5}
MODES = [pytest.param(False, "float64", id="default-fp64"), pytest.param(True, "float32", id="deterministic-fp32")]
MODES_2 = [pytest.param(False, "float64", id="default-fp64"), pytest.param(True, "float64", id="deterministic-fp64")]


def assert_exact(got: Params, ref: Params, deterministic: bool, dtype: str) -> None:
    if deterministic:
        assert bitwise_equal(got, ref), f"not bit-identical: max rel diff {max_rel_diff(got, ref):.3e}"
    else:
        diff = max_rel_diff(got, ref)
        assert diff <= TOLERANCE[dtype], f"max rel diff {diff:.3e} > {TOLERANCE[dtype]}"


def failure_regroups(done: Finished, rank: int) -> list[dict[str, Any]]:
    return [e for e in done.events(rank, "regroup") if e["reason"] == "failure"]


@pytest.mark.parametrize(("deterministic", "dtype"), MODES)
def test_kill_before_allreduce_at_several_positions(runner: Runner, deterministic: bool, dtype: str) -> None:
    """Deaths before any micro-batch, between micro-batches, and after the last one (just before the
    all-reduce), in three iterations: DP 4 -> 3 -> 2 -> 1."""
    args = train_args(5, dtype, deterministic)
    faults = {3: "die@1:mb0", 2: "die@2:mb1", 1: "die@3:bucket0"}
    done = runner.run(4, args, faults=faults)
    assert done.codes == {0: 0, 1: -9, 2: -9, 3: -9}, done.job.logs()
    regroups = failure_regroups(done, 0)
    assert [(e["it"], e["members"]) for e in regroups] == [(1, [0, 1, 2]), (2, [0, 1]), (3, [0])]
    # Rank 3 died before its first micro-batch: its k=2 go round-robin, one to rank 0 (k' = k + k/(DP-1)).
    assert regroups[0]["redo_mbs"] == 1
    assert [e["dp"] for e in done.events(0, "iteration")] == [4, 3, 2, 1, 1]
    assert_exact(done.params(0), runner.reference(args), deterministic, dtype)


@pytest.mark.parametrize(("deterministic", "dtype"), MODES_2)
def test_kill_during_allreduce_then_two_failures_in_one_iteration(
    runner: Runner, deterministic: bool, dtype: str
) -> None:
    """Iteration 1: rank 2 dies after two of the four gradient buckets were reduced; those stay reduced
    and only the rest is recomputed. Iteration 2: rank 3 dies mid-way and rank 0 dies while computing
    the micro-batch it took over from rank 3; rank 1 finishes the iteration alone."""
    args = train_args(4, dtype, deterministic)
    faults = {2: "die@1:bucket2", 3: "die@2:mb1", 0: "die@2:mb3"}
    done = runner.run(4, args, faults=faults)
    assert done.codes == {0: -9, 1: 0, 2: -9, 3: -9}, done.job.logs()
    regroups = failure_regroups(done, 1)
    assert [(e["it"], e["members"]) for e in regroups] == [(1, [0, 1, 3]), (2, [0, 1]), (2, [1])]
    assert regroups[0]["kept_buckets"] == 2, "the two buckets reduced before the death must be kept"
    assert regroups[2]["redo_mbs"] >= 4  # rank 0's three micro-batches and the orphan it was computing
    assert_exact(done.params(1), runner.reference(args), deterministic, dtype)


def test_inplace_reattempt_then_failure_and_rejoin(runner: Runner) -> None:
    """A sev3 exception (connection reset) on rank 1 regroups the same members in place; then rank 2
    dies, the launcher restarts it, and it rejoins with state broadcast from a healthy replica."""
    args = train_args(0, "float64", False, "--iter-sleep", "0.05")
    faults = {1: "raise@1:mb1:connection_refused_reset", 2: "die@3:mb1"}

    def rejoin_then_stop(job: LocalJob) -> None:
        def rejoined() -> bool:
            return any(2 in e.members and e.incarnations.get(2) == 2 for e in job.epochs())

        wait_for(rejoined, 90, "rank 2 to rejoin")
        time.sleep(1.0)  # a few iterations with the rejoined replica
        job.set_key("stop", "1")

    done = runner.run(4, args, faults=faults, restart={2: 0.2}, while_running=rejoin_then_stop)
    assert all(c == 0 for c in done.codes.values()), done.job.logs()
    reattempt = [e for e in done.events(1, "regroup") if e["reason"] == "reattempt"]
    assert [(e["it"], e["members"]) for e in reattempt] == [(1, [0, 1, 2, 3])]
    assert done.events(1, "injected")[0]["error_kind"] == "connection_refused_reset"
    assert [e["reason"] for e in done.events(2, "regroup", incarnation=2)] == ["join"]
    iterations = done.result(0)["iterations"]
    assert done.result(2, incarnation=2)["iterations"] == iterations
    assert done.result(2, incarnation=2)["losses"], "the rejoined rank must have trained"
    assert_exact(done.params(0), runner.reference(train_args(iterations, "float64", False)), False, "float64")
    assert bitwise_equal(done.params(2, incarnation=2), done.params(0)), "a rejoined replica must equal the others"


def test_regroups_delete_the_rendezvous_keys_of_older_epochs(runner: Runner) -> None:
    """Epochs 0 -> 1 (a sev3 reattempt, same members) -> 2 (rank 3 died): once past an epoch's
    barrier, each member deletes what it wrote for older ones (ready key, gloo rendezvous keys: W²
    bytes a group) and the lowest member those of the dead rank. Before, every epoch's stayed in the
    store sidecar for the job's life. The small epoch records stay (a joiner bisects over them)."""
    faults = {1: "raise@1:mb1:connection_refused_reset", 3: "die@2:mb1"}
    done = runner.run(4, train_args(4, "float32", False), faults=faults)
    assert done.codes == {0: 0, 1: 0, 2: 0, 3: -9}, done.job.logs()
    epochs = [(e.epoch, e.members, e.reason) for e in done.job.epochs()]
    assert epochs == [(0, (0, 1, 2, 3), "start"), (1, (0, 1, 2, 3), "reattempt"), (2, (0, 1, 2), "failure")], epochs

    def present(key: str) -> bool:
        return bool(done.job._store.check([key]))

    for g in (0, 1):
        left = [k for r in range(4) for k in (f"e{g}/dp/0/{r}", f"epoch/{g}/ready/{r}") if present(k)]
        assert not left, f"epoch {g}'s keys stayed: {left}"
        assert present(f"epoch/{g}")
    assert all(present(k) for r in range(3) for k in (f"e2/dp/0/{r}", f"epoch/2/ready/{r}"))


def test_a_joiner_waiting_during_a_failure_regroup_is_admitted_only_at_the_boundary(runner: Runner) -> None:
    """Iteration 2: rank 3 dies before bucket 2 (buckets 0 and 1 final everywhere) and is restarted at
    once; rank 1 stalls there 6 s, then dies. The survivors' failure regroup used to admit the waiting
    rank 3: it reduced from bucket 0 against the others' bucket 2, so the gradient was wrong (3.1e-3
    relative) and survivor rank 2 aborted in gloo on the last bucket's size mismatch. Now the failure
    regroup keeps to the survivors, and rank 3 is admitted at the next boundary."""
    args = train_args(4, "float64", False)
    faults = {3: "die@2:bucket2", 1: "stall@2:bucket2:6,die@2:bucket2"}
    done = runner.run(4, args, faults=faults, restart={3: 0.2}, timeout=150)
    assert (done.codes[0], done.codes[2]) == (0, 0), done.job.logs()[-2000:]
    for e in failure_regroups(done, 0):
        assert 3 not in e["members"] or e["it"] != 2, e  # no joiner in a failure regroup of iteration 2
    assert_exact(done.params(0), runner.reference(args), False, "float64")


def test_tp2_dp2_losing_a_data_parallel_rank(runner: Runner) -> None:
    """TP=2 x DP=2: rank 2 dies, so replica {2, 3} is lost; replica {0, 1} finishes every iteration
    with all micro-batches and rank 3 waits as a standby until the job ends."""
    args = train_args(3, "float64", False, "--tp", "2")
    done = runner.run(4, args, faults={2: "die@1:mb1"})
    assert done.codes == {0: 0, 1: 0, 2: -9, 3: 0}, done.job.logs()
    assert [(e["it"], e["members"]) for e in failure_regroups(done, 0)] == [(1, [0, 1])]
    assert done.events(3, "finished"), "rank 3 must have waited to rejoin until the job finished"
    for rank in (0, 1):  # each tensor-parallel shard against the failure-free TP=2 run's
        assert_exact(done.params(rank), runner.reference(args, world=2, blocks=2, rank=rank), False, "float64")
    # The TP=2 model computes the TP=1 loss: same initial parameters, same first batch.
    tp1_loss = runner.reference_result(train_args(3, "float64", False))["losses"][0]
    assert abs(done.result(0)["losses"][0] - tp1_loss) <= 1e-12 * tp1_loss


def test_deterministic_mode_is_independent_of_dp(runner: Runner) -> None:
    """Deterministic mode without failures: DP=4 equals DP=1 bit for bit (same blocks)."""
    args = train_args(3, "float64", True)
    done = runner.run(4, args)
    assert all(c == 0 for c in done.codes.values()), done.job.logs()
    assert bitwise_equal(done.params(0), runner.reference(args))
    assert bitwise_equal(done.params(3), done.params(0))


@pytest.mark.parametrize("kind", ["torch-save", "memory"])
def test_resume_without_any_checkpoint_starts_fresh_then_resumes(runner: Runner, tmp_path: Any, kind: str) -> None:
    """``--resume`` on a first launch (no checkpoint on any rank) starts from scratch, decided by all
    ranks together; the next launch, with no replica holding state, restores every rank from its
    checkpoint (torch.save files, or the ckpt subsystem's in-memory snapshots) through the same
    StateSource chain a joiner uses."""
    ckpt = ["--ckpt", kind, "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "1", "--resume"]
    first = runner.run(2, train_args(3, "float32", False, *ckpt))
    assert first.codes == {0: 0, 1: 0}, first.job.logs()
    kinds = [e["kind"] for e in first.result(0)["events"]]
    assert "fresh_start" in kinds and "restored" not in kinds
    second = runner.run(2, train_args(5, "float32", False, *ckpt))
    assert second.codes == {0: 0, 1: 0}, second.job.logs()
    assert [e["it"] for e in second.events(0, "restored")] == [3]
    # Parameters and Adam state came back exactly: 3 + 2 iterations equal 5 without a restart.
    assert bitwise_equal(second.params(0), runner.reference(train_args(5, "float32", False), world=2, blocks=2))
