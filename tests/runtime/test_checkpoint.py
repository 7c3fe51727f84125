"""torch.save checkpoints on real processes: one directory per model-parallel shard, written by one live
data-parallel replica and restored by every rank of the shard, whatever the job's size on resume."""

from __future__ import annotations

import time
from pathlib import Path

from tests.runtime.conftest import Runner, train_args, wait_for
from tests.runtime.test_failures import assert_exact
from unicron.cluster.launch import LocalJob
from unicron.runtime.checkpoint import TorchSaveCheckpointer
from unicron.runtime.compare import bitwise_equal, max_rel_diff


def ckpt_args(directory: Path, every: int = 1) -> list[str]:
    return ["--ckpt", "torch-save", "--ckpt-dir", str(directory), "--ckpt-every", str(every), "--resume"]


def held(directory: Path) -> list[int]:
    return TorchSaveCheckpointer(str(directory), rank=0).held()


def test_restart_after_a_rank_rejoined_resumes_the_newest_snapshot(runner: Runner, tmp_path: Path) -> None:
    """Rank 3 dies and is restarted; the moment it is admitted again, the whole job is SIGKILLed (a
    node lost right after a sev2 restart). A new launch restores the newest snapshot: the rejoined rank
    has no older files of its own that would pull the job back to an iteration since pruned."""
    ck = tmp_path / "ck"
    args = train_args(0, "float32", False, "--iter-sleep", "0.05", *ckpt_args(ck))

    def kill_when_rejoined(job: LocalJob) -> None:
        wait_for(lambda: any(3 in e.members and e.incarnations.get(3) == 2 for e in job.epochs()), 60,
                 "rank 3 to rejoin")
        job.stop()  # SIGKILL every rank

    first = runner.run(4, args, faults={3: "die@2:mb1"}, restart={3: 0.1}, while_running=kill_when_rejoined)
    assert first.codes[3] == -9, first.job.logs()
    newest = held(ck)[-1]
    assert newest >= 2, f"no snapshot written after rank 3's death: {held(ck)}"
    second = runner.run(4, train_args(newest + 2, "float32", False, *ckpt_args(ck)))
    assert all(c == 0 for c in second.codes.values()), second.job.logs()
    assert [e["it"] for e in second.events(3, "restored")] == [newest]
    assert second.result(3)["iterations"] == newest + 2
    # Only the lowest-ranked replica wrote: every other rank skipped its checkpoints.
    assert second.events(0, "checkpoint") and not second.events(3, "checkpoint")


def test_resume_with_fewer_ranks_restores_the_newest_iteration(runner: Runner, tmp_path: Path) -> None:
    """4 ranks save every iteration; the job is relaunched with 2 ranks and ``--resume``: both restore
    the shard's newest snapshot and train on to the parameters of an uninterrupted run."""
    ck = tmp_path / "ck"
    first = runner.run(4, train_args(3, "float64", False, "--blocks", "4", *ckpt_args(ck)))
    assert all(c == 0 for c in first.codes.values()), first.job.logs()
    assert held(ck) == [2, 3]
    second = runner.run(2, train_args(5, "float64", False, "--blocks", "4", *ckpt_args(ck)))
    assert second.codes == {0: 0, 1: 0}, second.job.logs()
    assert [e["it"] for e in second.events(0, "restored")] == [3]
    assert [e["it"] for e in second.events(1, "restored")] == [3]
    assert [e["dp"] for e in second.events(0, "iteration")] == [2, 2]
    diff = max_rel_diff(second.params(1), runner.reference(train_args(5, "float64", False)))
    assert diff <= 1e-12, f"max rel diff {diff:.3e} against the uninterrupted run"


def test_replicas_restored_from_a_checkpoint_keep_one_learning_rate(runner: Runner, tmp_path: Path) -> None:
    """A relaunch with a new --lr (unicron update of the command) restores the snapshot: the group's
    root loads it with Optimizer.load_state_dict, which also takes the snapshot's param_groups (old lr),
    while the other rank gets the tensors by broadcast and keeps the flag's lr. The two data-parallel
    replicas then step differently and diverge (no error)."""
    ckpt = ["--ckpt", "torch-save", "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "1", "--resume"]
    first = runner.run(2, train_args(2, "float64", False, *ckpt))
    assert first.codes == {0: 0, 1: 0}, first.job.logs()
    second = runner.run(2, train_args(4, "float64", False, *ckpt, "--lr", "3e-3"))
    assert second.codes == {0: 0, 1: 0}, second.job.logs()
    assert [e["it"] for e in second.events(1, "restored")] == [2]
    diff = max_rel_diff(second.params(1), second.params(0))
    assert bitwise_equal(second.params(1), second.params(0)), f"replicas diverged after the relaunch: {diff:.3e}"


def test_a_rank_dying_while_the_job_resumes_is_recovered_in_place(runner: Runner, tmp_path: Path) -> None:
    """A rank died while a ``--resume`` launch decided whether to restore (a collective of the start
    epoch): the failed collective escaped as a traceback on the survivor, the restarted rank was a
    joiner, and nobody was left to admit it (review reproduction: every rank waited out its join
    timeout, again and again). Now the survivor regroups without it, restores, trains, and admits the
    restarted rank at a boundary; the job ends at its last iteration with both ranks."""
    ckpt = ["--ckpt", "torch-save", "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "1"]
    first = runner.run(2, train_args(2, "float64", False, *ckpt))
    assert first.codes == {0: 0, 1: 0}, first.job.logs()
    done = runner.run(2, train_args(5, "float64", False, *ckpt, "--resume"), faults={1: "die@0:resume"},
                      restart={1: 0.2})
    exits = [(h["rank"], h["incarnation"], h["code"]) for h in done.job.history if h["event"] == "exit"]
    assert sorted(exits) == [(0, 1, 0), (1, 1, -9), (1, 2, 0)], done.job.logs()
    assert [e["it"] for e in done.events(0, "restored")] == [2]
    assert done.result(0)["iterations"] == done.result(1, incarnation=2)["iterations"] == 5
    assert done.events(0, "restore_retried"), "the fault must land in the resume's decision"


#: rank 1's first process sees the last collective of the ``--resume`` restore fail after its peer's
#: succeeded, as a ring all-gather can when a third rank dies in it (the trigger simulated; the rest
#: is the real runtime)
LAST_RESTORE_FAILS = """
import sys
from unicron.runtime import scheduler

restored = scheduler.Trainer._restored_iterations
fired = []

def failing_once(self):
    out = restored(self)
    if self.rank == 1 and self.incarnation == 1 and not fired:
        fired.append(1)
        self._broken("restore", RuntimeError("[gloo] simulated: Connection closed by peer"))
    return out

scheduler.Trainer._restored_iterations = failing_once
from unicron.runtime.train import main
sys.exit(main())
"""


def test_a_restore_that_failed_on_one_rank_only_takes_the_state_of_its_peer(runner: Runner, tmp_path: Path) -> None:
    """The restore's last collective fails on rank 1 only: rank 0 trains already and meets rank 1 in
    its regroup's agreement (a status all-gather). rank 1's retry first decided again whether any
    checkpoint exists (a one-int all-gather): gloo aborted rank 1 on the size mismatch. Now every
    attempt enters through the status exchange; rank 1 takes rank 0's state and both train on."""
    script = tmp_path / "last_restore_fails.py"
    script.write_text(LAST_RESTORE_FAILS)
    ckpt = ["--ckpt", "torch-save", "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "1"]
    first = runner.run(2, train_args(2, "float64", False, *ckpt))
    assert first.codes == {0: 0, 1: 0}, first.job.logs()
    done = runner.run(2, train_args(4, "float64", False, *ckpt, "--resume"), script=str(script), timeout=60)
    assert done.codes == {0: 0, 1: 0}, done.job.logs()
    assert done.events(1, "restore_retried"), "the simulated failure must land in the restore"
    assert done.result(0)["iterations"] == done.result(1)["iterations"] == 4
    assert bitwise_equal(done.params(0), done.params(1))
    diff = max_rel_diff(done.params(1), runner.reference(train_args(4, "float64", False), world=2, blocks=2))
    assert diff <= 1e-12, f"max rel diff {diff:.3e} against the uninterrupted run"


def test_tp2_single_replica_losing_a_rank_restores_the_checkpoint(runner: Runner, tmp_path: Path) -> None:
    """TP=2 x DP=1 (one replica): rank 1 dies in iteration 2 and is restarted. No complete replica
    survives, so the agreed epoch has no member; before, nobody was left to admit anyone and every
    rank waited out its join timeout ("not admitted"), again after every restart. Now the joiners
    (the excluded survivor, the restarted rank) form the next epoch themselves, restore the newest
    checkpoint and redo the iteration: the parameters of a failure-free run."""
    ck = ["--ckpt", "torch-save", "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "1"]
    plain = train_args(4, "float64", False, "--tp", "2", "--join-timeout", "30")
    done = runner.run(2, [*plain, *ck], faults={1: "die@2:mb1"}, restart={1: 0.2}, timeout=60)
    assert done.codes == {0: 0, 1: 0}, done.job.logs()
    reasons = [(e.members, e.reason) for e in done.job.epochs()]
    assert reasons[-2:] == [((), "failure"), ((0, 1), "restart")], reasons
    assert [e["it"] for e in done.events(0, "restored")] == [2]
    for rank in (0, 1):
        assert_exact(done.params(rank), runner.reference(plain, world=2, blocks=1, rank=rank), False, "float64")


def test_complementary_shards_surviving_restore_the_checkpoint(runner: Runner, tmp_path: Path) -> None:
    """TP=2 x DP=2: ranks 0 and 3 die in one iteration, so survivors 1 and 2 hold complementary
    shards and no complete replica (before: the job never finished). The first complete replica of
    joiners forms the restart epoch and restores; the other is admitted at a boundary."""
    ck = ["--ckpt", "torch-save", "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "1"]
    plain = train_args(4, "float64", False, "--tp", "2", "--join-timeout", "30")
    done = runner.run(4, [*plain, *ck], faults={0: "die@2:mb1", 3: "die@2:mb1"}, restart={0: 0.2, 3: 0.2},
                      timeout=90)
    assert done.codes == {0: 0, 1: 0, 2: 0, 3: 0}, done.job.logs()
    assert any(e.reason == "restart" for e in done.job.epochs()), done.job.epochs()
    trained = [r for r in range(4) if done.result(r)["mode"] == "finished"]
    assert len(trained) >= 2, [done.result(r)["mode"] for r in range(4)]
    for rank in trained:  # each shard against the failure-free TP=2 run's
        ref = runner.reference(plain, world=2, blocks=2, rank=rank % 2)
        assert_exact(done.params(rank), ref, False, "float64")


def test_joiners_restore_the_checkpoint_when_every_member_died(runner: Runner, tmp_path: Path) -> None:
    """DP=2: rank 1 dies (restarted late), then rank 0, the last member, dies before admitting it:
    the newest epoch's members are all dead and nobody wrote an empty epoch. Before, the restarted
    ranks waited out the join timeout for an admission nobody could give; now they form the restart
    epoch, restore the checkpoint and train to the parameters of a failure-free run."""
    ck = ["--ckpt", "torch-save", "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "1"]
    plain = train_args(4, "float64", False, "--join-timeout", "20")
    done = runner.run(2, [*plain, *ck], faults={1: "die@1:mb1", 0: "die@2:start"}, restart={0: 0.2, 1: 2.0},
                      timeout=60)
    assert done.codes == {0: 0, 1: 0}, done.job.logs()
    assert [(e.members, e.reason) for e in done.job.epochs()][1:3] == [((0,), "failure"), ((0,), "restart")]
    assert [e["it"] for e in done.events(0, "restored")] == [2]
    assert_exact(done.params(0), runner.reference(plain, world=2, blocks=2), False, "float64")


def test_no_complete_replica_without_a_checkpointer_fails_fast(runner: Runner) -> None:
    """TP=2 x DP=1 with no checkpointer: rank 1's death leaves nothing to restore from. The survivor
    exits at once naming the cause, where it waited out the join timeout to say "not admitted"."""
    t0 = time.monotonic()
    done = runner.run(2, train_args(4, "float64", False, "--tp", "2", "--join-timeout", "60"),
                      faults={1: "die@1:mb1"}, timeout=50)
    assert done.codes == {0: 1, 1: -9}, done.job.logs()
    assert time.monotonic() - t0 < 30
    assert "no complete replica survived" in done.job.logs()


#: the write of iteration 2's checkpoint fails as on a full disk (ENOSPC in its fsync)
FULL_DISK_AT_2 = """
import errno, os, sys
real = os.fsync

def fsync(fd):
    if "/it2.pt." in os.readlink(f"/proc/self/fd/{fd}"):
        raise OSError(errno.ENOSPC, "No space left on device")
    real(fd)

os.fsync = fsync
from unicron.runtime.train import main
sys.exit(main())
"""


def test_a_torch_save_checkpoint_failing_on_a_full_disk_leaves_training_going(runner: Runner, tmp_path: Path) -> None:
    """The save's OSError killed the rank with a traceback, and its relaunch died again at the same
    save: a crash loop, then a sev1. Now the rank logs one line and trains on, as memory mode does for a
    failed persist; the previous checkpoint stays and the next one is saved."""
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK_AT_2)
    ck = tmp_path / "ck"
    done = runner.run(1, train_args(3, "float64", False, "--ckpt", "torch-save", "--ckpt-dir", str(ck),
                                     "--ckpt-every", "1"), script=str(script), timeout=60)
    assert done.codes == {0: 0}, done.job.logs()
    assert done.result(0)["iterations"] == 3
    assert [e["it"] for e in done.events(0, "checkpoint_failed")] == [2]
    assert held(ck) == [1, 3] and not list((ck / "tp0").glob("*.tmp"))
