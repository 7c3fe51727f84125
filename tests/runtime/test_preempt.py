"""Work-conserving stop and the remote tier on real processes (issue 13 items 2-3): SIGTERM makes every
rank stop at one iteration boundary with an on-demand snapshot; a relaunch with another data-parallel
size resumes exactly there; with every local copy gone, ``--ckpt memory`` restores from its storage."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.runtime.conftest import Runner, train_args, wait_for
from unicron.cluster.launch import LocalJob
from unicron.runtime.compare import max_rel_diff


def memory_args(ck: Path, every: int = 4) -> list[str]:
    return ["--ckpt", "memory", "--ckpt-dir", str(ck), "--ckpt-every", str(every), "--resume"]


def persisted(ck: Path, rank: int = 0) -> list[int]:
    """Iterations whose manifest rank ``rank`` persisted to the remote tier (``<ckpt-dir>/persisted``)."""
    found = (ck / "persisted").glob(f"*/rank-{rank:05d}/manifest-*.json")
    return sorted(int(p.stem.split("-")[1]) for p in found)


def sigterm_after_persisted(ck: Path, ranks: list[int], delay_s: float) -> Callable[[LocalJob], None]:
    """SIGTERM every live rank ``delay_s`` after each of ``ranks`` persisted a first snapshot."""

    def sigterm(job: LocalJob) -> None:
        wait_for(lambda: all(persisted(ck, r) for r in ranks), 60, f"a persisted snapshot of ranks {ranks}")
        time.sleep(delay_s)
        for rp in job.procs.values():
            if rp.proc.poll() is None:
                os.kill(rp.proc.pid, signal.SIGTERM)

    return sigterm


def test_sigterm_saves_at_the_boundary_and_a_smaller_relaunch_resumes_there(runner: Runner, tmp_path: Path) -> None:
    """4 ranks checkpoint every 4 iterations; all get SIGTERM between two checkpoints: each exits 0 after
    an on-demand snapshot of the same iteration N. Relaunched with 2 ranks (another layout), both
    resume at N (0 iterations redone) and end where an uninterrupted run ends (float64, 1e-12)."""
    ck = tmp_path / "ck"
    args = train_args(0, "float64", False, "--blocks", "4", "--iter-sleep", "0.05", *memory_args(ck))

    first = runner.run(4, args, while_running=sigterm_after_persisted(ck, [0], 0.3))  # into the next interval
    assert all(c == 0 for c in first.codes.values()), first.job.logs()
    stops = {r: [e["it"] for e in first.events(r, "stop_snapshot")] for r in range(4)}
    n = stops[0][0]
    assert stops == {r: [n] for r in range(4)}, stops  # one boundary, every rank
    assert all(first.result(r)["iterations"] == n for r in range(4))
    assert "stopped at iteration" in first.job.logs() and "on-demand snapshot" in first.job.logs()
    assert n in persisted(ck), (n, persisted(ck))  # the stop's snapshot reached storage before exit

    end = n + 2
    second = runner.run(2, train_args(end, "float64", False, "--blocks", "4", *memory_args(ck)))
    assert second.codes == {0: 0, 1: 0}, second.job.logs()
    restored = [second.events(r, "restored") for r in range(2)]
    assert [[e["it"] for e in ev] for ev in restored] == [[n], [n]], restored  # nothing redone
    assert {ev[0]["source"] for ev in restored} == {"local", "replica"}, restored  # one reads, one receives
    assert [e["it"] for e in second.events(0, "iteration")] == [n, n + 1]
    diff = max_rel_diff(second.params(0), runner.reference(train_args(end, "float64", False)))
    assert diff <= 1e-12, f"max rel diff {diff:.3e} against the uninterrupted run"


def test_memory_checkpoint_survives_losing_every_local_copy(runner: Runner, tmp_path: Path) -> None:
    """Every rank SIGKILLed (no stop snapshot) and every node-local copy deleted: the relaunch restores
    the newest snapshot the ranks persisted in the background, from the remote tier."""
    ck = tmp_path / "ck"
    args = train_args(0, "float32", False, "--iter-sleep", "0.05", *memory_args(ck, every=2))

    def lose_everything(job: LocalJob) -> None:
        wait_for(lambda: len(persisted(ck, 1)) >= 2, 60, "two persisted snapshots")
        job.stop()  # SIGKILL every rank: nodes gone

    first = runner.run(2, args, while_running=lose_everything)
    assert set(first.codes.values()) == {-9}, first.codes
    for local in ck.glob("rank-*"):
        shutil.rmtree(local)  # node memory and disk lost; only <ckpt-dir>/persisted remains
    newest = max(persisted(ck, 0)[-1], persisted(ck, 1)[-1])  # the newest holder restores it
    second = runner.run(2, train_args(newest + 1, "float32", False, *memory_args(ck, every=2)))
    assert second.codes == {0: 0, 1: 0}, second.job.logs()
    restored = [second.events(r, "restored")[0] for r in range(2)]
    assert [e["it"] for e in restored] == [newest, newest], restored
    assert {e["source"] for e in restored} == {"remote", "replica"}, restored


def test_a_stop_at_a_periodic_checkpoint_persists_it_whatever_persist_every_says(
        runner: Runner, tmp_path: Path) -> None:
    """With a checkpoint every iteration and --ckpt-persist-every 1000, the stop's boundary always had
    its periodic checkpoint, so the stop's own (persisted) save was skipped for it, and that one was
    not persisted: the stopped task's newest state stayed in node memory only. Now it is persisted."""
    ck = tmp_path / "ck"
    args = train_args(0, "float32", False, "--iter-sleep", "0.05", *memory_args(ck, every=1),
                      "--ckpt-persist-every", "1000")

    # each rank's first snapshot is persisted (a new timeline's): both train, their SIGTERM handler is in
    first = runner.run(2, args, while_running=sigterm_after_persisted(ck, [0, 1], 0.5))  # a few iterations in
    assert all(c == 0 for c in first.codes.values()), first.job.logs()
    n = first.events(0, "stop_snapshot")[0]["it"]
    assert n > 1 and [e["it"] for e in first.events(0, "checkpoint")][-1] == n  # a periodic one was there
    assert n in persisted(ck, 0) and n in persisted(ck, 1), (n, persisted(ck, 0), persisted(ck, 1))


class _Tiered:
    """A checkpointer with tiers (``persist=``) and background work (``wait``), as CheckpointManager."""

    def __init__(self) -> None:
        self.saves: list[tuple[int, bool]] = []
        self.waited = 0

    def save(self, state: object, iteration: int, persist: bool = False) -> None:
        self.saves.append((iteration, persist))

    def wait(self) -> None:
        self.waited += 1


def test_the_stop_snapshot_is_persisted_once_and_waited_for() -> None:
    from unicron.runtime.preempt import Preemption

    p = Preemption()
    p._on_signal(signal.SIGTERM, None)
    assert p.requested and p.signalled_at is not None
    ck = _Tiered()
    p.save(ck, dict, 7, writer=True, already_saved=False)  # type: ignore[arg-type]
    assert ck.saves == [(7, True)] and ck.waited == 1 and p.saved == (7, "_Tiered")
    p.save(ck, dict, 8, writer=True, already_saved=True)  # type: ignore[arg-type]
    assert ck.saves == [(7, True)] and ck.waited == 2  # the periodic one of this iteration stands
    p.save(ck, dict, 9, writer=False, already_saved=False)  # type: ignore[arg-type]
    off = Preemption(snapshot=False)
    off.save(ck, dict, 10, writer=True, already_saved=False)  # type: ignore[arg-type]
    assert ck.saves == [(7, True)] and off.saved is None


def test_storage_root_defaults_under_the_checkpoint_directory() -> None:
    from unicron.runtime.checkpoint import storage_root

    assert storage_root("", "/ck") == "/ck/persisted"
    assert storage_root("/shared/ck", "/ck") == "/shared/ck"
    assert storage_root("none", "/ck") == "" and storage_root("", "") == ""


def test_resume_with_the_remote_tier_out_of_reach_does_not_start_afresh(runner: Runner, tmp_path: Path) -> None:
    """No rank holds a snapshot and the storage cannot be listed (here a file where the job's
    directory should be: NotADirectoryError, as an I/O error would): every rank ends with one line
    instead of starting afresh, whose persisted saves would later discard the snapshots out of reach."""
    ck = tmp_path / "ck"
    (ck / "persisted").mkdir(parents=True)
    (ck / "persisted" / "local").write_text("not a directory")
    done = runner.run(2, train_args(2, "float32", False, *memory_args(ck)))
    assert done.codes == {0: 1, 1: 1}, done.job.logs()
    assert done.job.logs().count("the remote tier of rank(s) [0, 1] could not be listed") == 2, done.job.logs()


@pytest.fixture
def full_storage(tmp_path: Path) -> Iterator[Path]:
    """A directory on a full 1 MiB tmpfs, for --ckpt-storage: every persist fails with a real ENOSPC."""
    root = tmp_path / "full"
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs (needs root)")
    try:
        (root / "persisted").mkdir()
        fd = os.open(root / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"x" * 4096):
                pass
        except OSError:
            pass  # full
        finally:
            os.close(fd)
        yield root / "persisted"
    finally:
        subprocess.run(["umount", "-l", str(root)], check=True)


def test_a_stop_snapshot_the_storage_refused_is_reported_not_persisted(
    runner: Runner, tmp_path: Path, full_storage: Path
) -> None:
    """The checkpoint filesystem is full: each failed persist was a warning in the rank's log and nothing
    else read the saves' outcomes, so the stop line said "on-demand snapshot of iteration N saved" while
    storage held nothing (review). The runtime now reads them: a persist_failed event per failed
    persist, and the stop line says the snapshot is not persisted."""
    ck = tmp_path / "ck"
    args = train_args(0, "float32", False, "--iter-sleep", "0.05", "--ckpt", "memory", "--ckpt-dir", str(ck),
                      "--ckpt-storage", str(full_storage), "--ckpt-every", "2", "--resume")

    def stop(job: LocalJob) -> None:
        wait_for(lambda: "persistence failed" in job.logs(), 60, "a failed persist")
        for rp in job.procs.values():
            if rp.proc.poll() is None:
                os.kill(rp.proc.pid, signal.SIGTERM)

    done = runner.run(2, args, while_running=stop)
    logs = done.job.logs()
    assert done.codes == {0: 0, 1: 0}, logs[-3000:]
    assert not list(full_storage.rglob("manifest-*"))
    for r in range(2):
        stopped_at = [e["it"] for e in done.events(r, "stop_snapshot")]
        failed = [e["it"] for e in done.events(r, "persist_failed")]
        assert len(stopped_at) == 1 and stopped_at[0] in failed, (stopped_at, failed)
    lines = [ln for ln in logs.splitlines() if "stopped at iteration" in ln]
    assert len(lines) == 2 and all("NOT persisted" in ln and "No space left" in ln for ln in lines), lines
