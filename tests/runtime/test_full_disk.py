"""Real ranks on full disks: a full log disk or a full snapshot directory is not a reason to die."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import fill
from tests.runtime.conftest import Runner, train_args, wait_for
from unicron.cluster.launch import LocalJob


def test_a_full_log_disk_does_not_kill_a_restoring_rank(runner: Runner, tmp_path: Path, tiny_tmpfs: Path) -> None:
    """Review (ENOSPC): the rank's stdout is its log; on a full log disk the restore's status line
    raised ENOSPC and killed the rank at every relaunch (a crash loop)."""
    ck = tmp_path / "ck"
    first = runner.run(1, train_args(4, "float32", False, "--ckpt", "memory", "--ckpt-dir", str(ck),
                                     "--ckpt-every", "2"))
    assert first.codes == {0: 0}, first.job.logs()
    out = tiny_tmpfs / "job"  # LocalJob writes rank<R>.<inc>.log here: stdout (and stderr) on the full disk
    out.mkdir()
    results = tmp_path / "results"
    results.mkdir()
    (out / "inc1").symlink_to(results)  # the rank's --out-dir (its events) on a disk with room
    fill(tiny_tmpfs / "filler")
    args = train_args(6, "float32", False, "--ckpt", "memory", "--ckpt-dir", str(ck), "--ckpt-every", "2",
                      "--resume", "--log-iterations")
    with LocalJob(1, args, str(out), spawner=runner.spawner) as job:
        codes = job.wait(90)
    assert codes == {0: 0}, (results / "rank0.json").exists()
    events = job.result(0)["events"]
    assert [e["data"]["it"] for e in events if e["kind"] == "restored"] == [4]
    assert [e["data"]["it"] for e in events if e["kind"] == "iteration"] == [4, 5]


def test_a_full_snapshot_directory_skips_snapshots_until_it_has_room(
    runner: Runner, tmp_path: Path, tiny_tmpfs: Path,
) -> None:
    """Review (ENOSPC): ``--ckpt memory`` whose slot directory was full died at its first checkpoint
    ("no room for a ...-byte snapshot slot"), storage having room, at every relaunch."""
    filler = tiny_tmpfs / "filler"
    fill(filler)
    args = train_args(12, "float32", False, "--iter-sleep", "0.1", "--ckpt", "memory",
                      "--ckpt-dir", str(tiny_tmpfs / "ck"), "--ckpt-storage", str(tmp_path / "persisted"),
                      "--ckpt-every", "2")

    def make_room(job: LocalJob) -> None:
        wait_for(lambda: "checkpoint not saved" in job.logs() or job.procs[0].proc.poll() is not None, 60,
                 "a checkpoint skipped for want of room (or the rank's exit)")
        filler.unlink()

    done = runner.run(1, args, while_running=make_room)
    assert done.codes == {0: 0}, done.job.logs()[-3000:]
    failed = [e["it"] for e in done.events(0, "checkpoint_failed")]
    saved = [e["it"] for e in done.events(0, "checkpoint")]
    assert failed and all("no room" in e["error"] for e in done.events(0, "checkpoint_failed")), failed
    assert saved and min(saved) > max(failed), (failed, saved)  # a later save tried again, and took
