"""The agent's fence (agent/fence.py): when it kills a node's ranks, and when it must not."""

from __future__ import annotations

import threading

import pytest

from agent.daemon import Agent, fenced_placement
from agent.fence import Contact, Fence, cut_off_for
from unicron.kernel import protocol
from unicron.kernel.errors import StoreUnavailable
from unicron.kernel.types import ErrorKind, RankSpec, TaskAssignment


def test_a_fenced_placement_is_not_launched_again_but_a_later_membership_of_it_is() -> None:
    """An in-place task keeps its generation: once resized around the lost node and placed on it again
    (a higher membership epoch), its ranks join the running ones. The returned node had refused them
    (bench/resize_soak.py: the task one rank short for good)."""
    def placed(generation: int, membership_epoch: int, task: str = "t") -> TaskAssignment:
        return TaskAssignment(task=task, generation=generation, argv=["python", "train.py"], env={}, world_size=4,
                              ranks=[RankSpec(rank=3, local_rank=0, gpu=0)], store_node="n0",
                              membership_epoch=membership_epoch)

    fenced = {"t": (2, 5)}
    assert fenced_placement(placed(2, 5), fenced)  # as it ran when the fence killed it
    assert fenced_placement(placed(1, 9), fenced)  # an older generation
    assert not fenced_placement(placed(2, 6), fenced)  # re-placed here after the resize around the node
    assert not fenced_placement(placed(3, 0), fenced)  # relaunched as a new generation
    assert not fenced_placement(placed(1, 0, task="other"), fenced)  # never fenced


def test_the_cut_off_counts_from_the_later_contact() -> None:
    assert cut_off_for(Contact(lease_renewed_at=0.0, link_down_since=1.0), now=10.0) == 9.0
    assert cut_off_for(Contact(lease_renewed_at=0.0, link_down_since=None), now=10.0) == 0.0  # etcd outage
    assert cut_off_for(Contact(lease_renewed_at=9.9, link_down_since=1.0), now=10.0) == pytest.approx(0.1)
    assert cut_off_for(Contact(lease_renewed_at=None, link_down_since=1.0), now=10.0) == 0.0  # never registered


def test_the_end_of_a_whole_etcd_outage_does_not_fence() -> None:
    """Chaos seed 83: etcd down 8 s with the link up; as etcd came back the deposed leader's link broke,
    0.3 s before the agent's next lease renewal. Counting from the lease alone (9.5 s) fenced the node."""
    w = World()
    f = w.fence()
    w.contact = Contact(lease_renewed_at=0.0, link_down_since=9.2)
    f.check(9.5)
    f.check(9.75)
    w.contact = Contact(lease_renewed_at=10.0, link_down_since=9.2)  # the renewal that came next
    f.check(10.0)
    assert w.kills == [] and not f.fenced.is_set()


class World:
    """The contact the fence reads, and what it did."""

    def __init__(self) -> None:
        self.contact = Contact(lease_renewed_at=0.0, link_down_since=None)
        self.kills: list[float] = []
        self.restores = 0
        self.restore_fails = 0

    def restored(self) -> None:
        if self.restore_fails:
            self.restore_fails -= 1
            raise StoreUnavailable("etcd read timed out")
        self.restores += 1

    def fence(self) -> Fence:
        return Fence(6.0, lambda: self.contact, self.kills.append, self.restored, threading.Event())


def test_cut_off_past_fence_s_on_two_checks_in_a_row_kills_once_and_restores_when_contact_returns() -> None:
    w = World()
    f = w.fence()
    w.contact = Contact(lease_renewed_at=0.0, link_down_since=0.0)  # the link broke with the last renewal
    f.check(5.0)
    f.check(6.2)  # past 6 s once: not yet
    assert w.kills == [] and not f.fenced.is_set()
    f.check(6.4)
    assert w.kills == [6.4] and f.fenced.is_set()
    f.check(9.0)
    assert w.kills == [6.4]  # killed once
    w.contact = Contact(lease_renewed_at=20.0, link_down_since=0.0)  # re-registered: etcd answers again
    w.restore_fails = 1
    f.check(20.1)
    assert f.fenced.is_set() and w.restores == 0  # the assignment could not be read: retried
    f.check(20.4)
    assert not f.fenced.is_set() and w.restores == 1


def test_a_late_check_judges_nothing() -> None:
    """A starved agent's threads are all late: its own silence is not the cluster's."""
    w = World()
    f = w.fence()
    w.contact = Contact(lease_renewed_at=0.0, link_down_since=0.0)
    f.check(7.0, late=True)
    f.check(7.2)
    assert w.kills == []  # one on-time check past fence_s, the late one did not count
    f.check(7.4)
    assert w.kills == [7.4]


def test_the_link_up_or_a_renewed_lease_never_fences() -> None:
    w = World()
    f = w.fence()
    w.contact = Contact(lease_renewed_at=0.0, link_down_since=None)  # a whole-etcd outage
    for t in range(7, 60):
        f.check(float(t))
    w.contact = Contact(lease_renewed_at=59.0, link_down_since=1.0)  # a coordinator failover
    for t in range(60, 65):
        f.check(float(t))
    assert w.kills == [] and not f.fenced.is_set()


def test_fence_s_zero_never_starts_the_thread() -> None:
    w = World()
    f = Fence(0.0, lambda: w.contact, w.kills.append, w.restored, threading.Event()).start()
    assert not f._thread.is_alive()


@pytest.mark.parametrize(("claimed", "kind"), [
    ("cuda_error", ErrorKind.CUDA_ERROR),
    ("fenced", ErrorKind.OTHER_SOFTWARE_ERROR),  # the agent's own finding: a rank's claim is not taken
    ("degradation", ErrorKind.OTHER_SOFTWARE_ERROR),
    ("no_such_kind", ErrorKind.OTHER_SOFTWARE_ERROR),
])
def test_a_rank_cannot_report_its_agents_own_findings(claimed: str, kind: ErrorKind) -> None:
    msg = protocol.ExceptionReport(message="boom", traceback="", kind=claimed, fatal=True, step=1, ts=0.0)
    assert Agent._exception_kind(msg) is kind
