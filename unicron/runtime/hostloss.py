"""A survivor's side of a lost host: cut this rank's connections to it as soon as its agent says so.

A node cut off the network (its link down, a partition) answers nothing: no reset, no close. A
gloo collective with its ranks, or a call to a store it hosted, then waits out its timeout
(``--collective-timeout``, 30 s here; torch's default is 10 min for NCCL and 30 min for gloo), long
after the coordinator declared the node lost and resized the task around it. Two agent messages name
such hosts, and both are acted on here, on the agent client's reader thread, because the training
thread is the one blocked:

* ``StoreMoved``: the store left its host: cut that host (the store's address was always known);
* ``PeersLost``: an in-place resize gave up ranks of lost nodes: cut their hosts, read from the task's
  store (``host/<rank>/<incarnation>``, which every rank publishes when it starts and again when it
  re-seeds a moved store, :func:`unicron.runtime.store.publish_host`).

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
from unicron.kernel.errors import TemporaryError
from unicron.runtime import store as keys
from unicron.runtime.sever import sever

log = ulog.get(__name__)

#: how long the reader thread waits for the task's store when it looks up lost ranks' hosts: the store
#: answers in milliseconds, and a store that does not is itself lost (``StoreMoved`` cuts its host)
READ_TIMEOUT_S = 5.0

HostLost = protocol.StoreMoved | protocol.PeersLost


class HostLoss:
    """Tracks the task store's address (``StoreMoved`` updates it) and cuts the hosts the agent names.

    ``incarnations``: the members of this rank's current epoch, with their incarnations (the lost
    processes' host keys are per incarnation)."""

    def __init__(self, rank: int, store_host: str, store_port: int, store_epoch: int, own_address: str,
                 incarnations: Callable[[], Mapping[int, int]]) -> None:
        self.rank = rank
        self.own_address = own_address
        self._store = (store_host, store_port)
        self._store_epoch = store_epoch
        self._incarnations = incarnations

    def on_message(self, msg: HostLost) -> None:
        if isinstance(msg, protocol.StoreMoved):
            self._store_moved(msg)
        else:
            self._peers_lost(msg)

    def _store_moved(self, msg: protocol.StoreMoved) -> None:
        if msg.store_epoch <= self._store_epoch:
            return  # told twice (or a stale move): the host was cut the first time
        old, self._store, self._store_epoch = self._store[0], (msg.host, msg.port), msg.store_epoch
        if old and old != msg.host:
            self._cut(old, f"the store left it (store epoch {msg.store_epoch})")

    def _peers_lost(self, msg: protocol.PeersLost) -> None:
        incarnations = self._incarnations()
        wanted = [keys.host_key(r, incarnations[r]) for r in msg.lost if r in incarnations and r != self.rank]
        if not wanted:
            return
        try:
            store = keys.connect(*self._store, timeout_s=READ_TIMEOUT_S)
            hosts = {store.get(k).decode() for k in wanted if store.check([k])}
        except (TemporaryError, *keys.STORE_ERRORS) as exc:
            log.warning("cannot read the lost ranks' hosts: their collectives will time out", rank=self.rank,
                        lost=msg.lost, error=str(exc).splitlines()[0])
            return
        for host in sorted(hosts - {"", self.own_address}):
            self._cut(host, f"ranks {msg.lost} lost (membership epoch {msg.membership_epoch})")

    def _cut(self, host: str, why: str) -> None:
        cut = sever(host)
        log.info("cut the connections to a lost host", rank=self.rank, host=host, connections=cut, why=why)
