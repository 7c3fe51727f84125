"""An in-place shrink's rank side: a rank the agent tells to ``Leave`` finishes the iteration under way,
the others agree an epoch without it at the next commit, it exits 0, and they go on at the smaller DP
with the global batch unchanged: no iteration is redone and the parameters equal a failure-free run's
(float64, 1e-12 relative)."""

from __future__ import annotations

import pytest

from tests.runtime.conftest import Runner, train_args, wait_for
from tests.runtime.test_agent_contract import FakeAgentSocket, agent_socket  # noqa: F401 (fixture)
from unicron.cluster.launch import LocalJob
from unicron.kernel import protocol
from unicron.runtime.compare import max_rel_diff

pytestmark = pytest.mark.usefixtures("agent_socket")


def test_a_rank_told_to_leave_leaves_at_a_boundary_and_the_rest_train_on_exactly(
    runner: Runner, agent_socket: FakeAgentSocket  # noqa: F811
) -> None:
    args = train_args(8, "float64", False, "--iter-sleep", "0.02")
    env = {"UNICRON_AGENT_SOCKET": agent_socket.path}

    def drive(job: LocalJob) -> None:
        wait_for(lambda: len(agent_socket.of(3, protocol.IterEnd)) >= 2, 60, "two iterations on rank 3")
        agent_socket.send(3, protocol.Leave(membership_epoch=1, reason="test"))

    done = runner.run(4, args, while_running=drive, env={r: env for r in range(4)})
    assert done.codes == {0: 0, 1: 0, 2: 0, 3: 0}, done.job.logs()
    assert done.result(3)["mode"] == "left"
    its = [e["it"] for e in done.events(0, "iteration")]
    assert its == list(range(8)), f"an iteration was redone or skipped: {its}"
    dps = [e["dp"] for e in done.events(0, "iteration")]
    assert dps[0] == 4 and dps[-1] == 3 and dps == sorted(dps, reverse=True), dps
    regroups = [e for e in done.events(0, "regroup") if e["members"] == [0, 1, 2]]
    assert regroups and regroups[0]["reason"] == "admission"
    diff = max_rel_diff(done.params(0), runner.reference(args))
    assert diff <= 1e-12, f"max rel diff {diff:.3e}"
