"""The rank side of a store that moves (its node was lost; an in-place resize named another): told by
its agent (``StoreMoved``), every rank re-seeds the new store, moves its heartbeat there and goes on
with its processes and state; no iteration is redone and the parameters equal a failure-free run's
(float64, 1e-12 relative). The old store here still answers, the harder case: no rank may agree
anything on it once told (the node-loss case, where it is gone, is the end-to-end test's,
``tests/integration/test_inplace.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.runtime.conftest import Runner, train_args, wait_for
from tests.runtime.test_agent_contract import FakeAgentSocket, agent_socket  # noqa: F401 (fixture)
from unicron.cluster.launch import LocalJob
from unicron.kernel import protocol
from unicron.kernel.net import free_port
from unicron.runtime import store as keys
from unicron.runtime.compare import max_rel_diff
from unicron.runtime.membership import SEEDED_KEY

pytestmark = pytest.mark.usefixtures("agent_socket")


def test_every_rank_moves_to_the_new_store_and_trains_on_exactly(
    runner: Runner, agent_socket: FakeAgentSocket  # noqa: F811
) -> None:
    args = train_args(8, "float64", False, "--iter-sleep", "0.02")
    env = {"UNICRON_AGENT_SOCKET": agent_socket.path}
    moved: list[Any] = []  # the new store's server lives until the job is done

    def drive(job: LocalJob) -> None:
        wait_for(lambda: len(agent_socket.of(0, protocol.IterEnd)) >= 2, 60, "two iterations on rank 0")
        port = free_port()
        moved.append(keys.serve_store("127.0.0.1", port))
        msg = protocol.StoreMoved(store_epoch=1, host="127.0.0.1", port=port, lost=[])
        for r in range(4):
            agent_socket.send(r, msg)
        moved.append(keys.connect("127.0.0.1", port))

    done = runner.run(4, args, while_running=drive, env={r: env for r in range(4)})
    assert done.codes == {0: 0, 1: 0, 2: 0, 3: 0}, done.job.logs()
    for r in range(4):
        assert [e["store_epoch"] for e in done.events(r, "store_moved")] == [1], r
    its = [e["it"] for e in done.events(0, "iteration")]
    assert its == list(range(8)), f"an iteration was redone or skipped: {its}"
    assert {e["dp"] for e in done.events(0, "iteration")} == {4}
    new = moved[1]
    assert new.check([SEEDED_KEY, "finished"]), "the ranks did not go on on the new store"
    assert all(keys.counter(new, keys.started_key(r)) == 1 for r in range(4))  # incarnations re-seeded, not bumped
    assert all(new.get(keys.host_key(r, 1)) == b"127.0.0.1" for r in range(4))  # where each is, for PeersLost
    diff = max_rel_diff(done.params(0), runner.reference(args))
    assert diff <= 1e-12, f"max rel diff {diff:.3e}"
