"""A survivor's side of a lost host: cut this rank's connections to it as soon as its agent says so.

A node cut off the network (its link down, a partition) answers nothing: no reset, no close. A
gloo collective with its ranks, or a call to a store it hosted, then waits out its timeout
(``--collective-timeout``, 30 s here; torch's default is 10 min for NCCL and 30 min for gloo), long
after the coordinator declared the node lost and resized the task around it. Two agent messages name
such hosts, and both are acted on here, on the agent client's reader thread, because the training
thread is the one blocked:

* ``StoreMoved``: the store left its host: cut that host (the store's address was always known);
* ``PeersLost``: an in-place resize gave up ranks of lost nodes: cut their hosts, as this rank learned
  them when it entered its current epoch (``Membership.hosts``: every rank publishes
  ``host/<rank>/<incarnation>`` in the task's store when it starts and again when it re-seeds a moved
  store, :func:`unicron.runtime.store.publish_host`). Read then, not now: when the store's node and
  another node are lost together, the moved store never had the other node's ranks.

The blocked call then fails at once and the rank's recovery starts from that failure, as from a
dead peer's reset connection. The coordinator gives up whole nodes only (a rank's own fault is
restarted, not lost), so a lost rank's host runs no member of the task any more; this rank's own
host is never cut, nor loopback (:func:`unicron.runtime.sever.sever`). Only TCP connections are cut:
gloo's, and NCCL's socket transport; NCCL over InfiniBand or NVLink would need its communicator
aborted from here (``ncclCommAbort``), which is not built (no multi-GPU machine to test it on).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from unicron.kernel import log as ulog
from unicron.kernel import protocol
from unicron.runtime.sever import sever

log = ulog.get(__name__)

HostLost = protocol.StoreMoved | protocol.PeersLost


class HostLoss:
    """Tracks the task store's address (``StoreMoved`` updates it) and cuts the hosts the agent names.

    ``hosts``: where each member of this rank's current epoch runs (``Membership.hosts``)."""

    def __init__(self, rank: int, store_host: str, store_epoch: int, own_address: str,
                 hosts: Callable[[], Mapping[int, str]]) -> None:
        self.rank = rank
        self.own_address = own_address
        self._store_host = store_host
        self._store_epoch = store_epoch
        self._hosts = hosts

    def on_message(self, msg: HostLost) -> None:
        if isinstance(msg, protocol.StoreMoved):
            self._store_moved(msg)
        else:
            self._peers_lost(msg)

    def _store_moved(self, msg: protocol.StoreMoved) -> None:
        if msg.store_epoch <= self._store_epoch:
            return  # told twice (or a stale move): the host was cut the first time
        old, self._store_host, self._store_epoch = self._store_host, msg.host, msg.store_epoch
        if old and old != msg.host:
            self._cut(old, f"the store left it (store epoch {msg.store_epoch})")

    def _peers_lost(self, msg: protocol.PeersLost) -> None:
        hosts = self._hosts()
        lost = {hosts[r] for r in msg.lost if r in hosts and r != self.rank}
        for host in sorted(lost - {"", self.own_address}):
            self._cut(host, f"ranks {msg.lost} lost (membership epoch {msg.membership_epoch})")

    def _cut(self, host: str, why: str) -> None:
        cut = sever(host)
        log.info("cut the connections to a lost host", rank=self.rank, host=host, connections=cut, why=why)
