"""Replicas that compute no micro-batch in an iteration (B < DP with ``--blocks``): they still reduce,
step with the whole gradient, and agree the iteration's flags (review reproductions; real gloo ranks)."""

from __future__ import annotations

from tests.runtime.conftest import Runner, train_args, wait_for
from tests.runtime.test_agent_contract import FakeAgentSocket, agent_socket  # noqa: F401 (fixture)
from unicron.cluster.launch import LocalJob
from unicron.kernel import protocol
from unicron.runtime.compare import bitwise_equal, max_rel_diff

TINY = ["--layers", "1", "--hidden", "16", "--heads", "2", "--seq", "8", "--vocab", "32"]


def test_a_replica_with_no_micro_batches_survives_the_periodic_view_check(runner: Runner) -> None:
    """Deterministic mode, B = 1 micro-batch (--blocks 1) on DP = 2: rank 1 computes nothing. Its .grad
    stay bound to the reduced buffer of the last commit (Contributions.reset never rebinds them), so the
    view check at iteration 100 raises RuntimeInvariantError and the rank dies on a valid config."""
    args = train_args(101, "float64", True, *TINY, "--global-batch-size", "4", "--blocks", "1")
    done = runner.run(2, args, timeout=90)
    assert done.codes == {0: 0, 1: 0}, done.job.logs()[-1500:]


def test_an_idle_replica_steps_with_the_whole_gradient_after_a_rerun_recovery(runner: Runner) -> None:
    """Deterministic, --recovery rerun, B = 2 on DP = 4 (--blocks 2): ranks 2 and 3 compute nothing.
    Rank 0 dies before bucket 2 of iteration 1; the survivors reduce every bucket again, so the parts
    end up in both buffers and _commit copies them into the flat buffer, but idle rank 3's .grad still
    view the previous commit's reduced buffer: it steps with iteration 0's gradient for buckets 2-3 and
    silently diverges from the other replicas."""
    args = train_args(3, "float64", True, "--global-batch-size", "8", "--blocks", "2", "--recovery", "rerun")
    done = runner.run(4, args, faults={0: "die@1:bucket2"})
    assert [done.codes[r] for r in (1, 2, 3)] == [0, 0, 0], done.job.logs()[-1500:]
    diffs = {r: max_rel_diff(done.params(r), done.params(1)) for r in (2, 3)}
    assert all(bitwise_equal(done.params(r), done.params(1)) for r in (2, 3)), f"replicas diverged: {diffs}"


def test_a_leave_of_a_rank_with_no_micro_batches_is_agreed_in_deterministic_mode(
    runner: Runner, agent_socket: FakeAgentSocket  # noqa: F811
) -> None:
    """Deterministic, B = 2 on DP = 4: rank 3 holds no contribution, and _reduce writes the join/stop
    flags only into a rank's first contribution, so its Leave never reaches the others: it trains to the
    end (mode finished) instead of leaving at the next boundary (default mode: it leaves)."""
    args = train_args(8, "float64", True, "--global-batch-size", "8", "--blocks", "2", "--iter-sleep", "0.05")
    env = {"UNICRON_AGENT_SOCKET": agent_socket.path}

    def drive(job: LocalJob) -> None:
        wait_for(lambda: len(agent_socket.of(3, protocol.IterEnd)) >= 2, 60, "two iterations on rank 3")
        agent_socket.send(3, protocol.Leave(membership_epoch=1, reason="test"))

    done = runner.run(4, args, while_running=drive, env={r: env for r in range(4)})
    assert done.codes == {0: 0, 1: 0, 2: 0, 3: 0}, done.job.logs()[-1500:]
    assert done.result(3)["mode"] == "left", f"rank 3 ended {done.result(3)['mode']!r}: its Leave was never agreed"
