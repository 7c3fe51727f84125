"""A rank restarted after its peers finished the job: it must exit 0 and say so, not crash (a
launcher that restarts failed ranks would otherwise restart it for ever)."""

from __future__ import annotations

from tests.runtime.conftest import Runner, train_args


def test_rank_restarted_after_the_job_finished_exits_0(runner: Runner) -> None:
    """2 ranks, 4 iterations; rank 1 dies in iteration 2 and is restarted 4 s later, when rank 0 has
    finished alone. The restarted rank finds the job finished: exit 0, one restart only."""
    args = train_args(4, "float32", False)
    done = runner.run(2, args, faults={1: "die@2:mb1"}, restart={1: 4.0}, timeout=60)
    spawns = [h for h in done.job.history if h["event"] == "spawn" and h["rank"] == 1]
    exits = [(h["incarnation"], h["code"]) for h in done.job.history if h["event"] == "exit" and h["rank"] == 1]
    assert exits == [(1, -9), (2, 0)], done.job.logs()
    assert len(spawns) == 2, f"rank 1 restarted {len(spawns) - 1} times\n{done.job.logs()}"
    assert done.codes == {0: 0, 1: 0}, done.job.logs()
    assert done.result(0)["iterations"] == 4
    late = done.result(1, incarnation=2)
    assert late["events"][-1]["kind"] == "finished", late
    with open(done.job.procs[1].log_path) as fh:
        assert "job already finished" in fh.read(), "the late rank must say why it exits"
