"""Process-group epochs: who is in, agreed through the store, and the gloo/NCCL groups of each epoch.

An *epoch* is one agreed membership (a list of global ranks forming complete replicas) plus the process
groups built for it under a fresh store prefix ``e<epoch>/...``. Epoch 0 is every rank of the launch.
After a failure (or to admit joiners) the survivors move to the next epoch:

1. **Knowledge**: which members are dead, in order of speed: ``failed/<rank>`` counters written by the
   agent (:func:`mark_failed`, below, per incarnation), then heartbeat staleness. With
   no one dead after the heartbeat window, the membership stays the same (an in-place reattempt of a
   transient error). The agent's ``Regroup`` names the ranks a sev3 incident came from: they are
   alive (a sev3 is not fatal), so it is never taken as a death (it once was, without an
   incarnation: a survivor that reported a lost peer's broken connection was taken for dead by the
   others forever, which left rank 0 alone in an epoch and re-proposed the same admission endlessly).
2. **Agreement**: ``compare_set("epoch/<g+1>", "", proposal)``: the first proposal wins and every
   survivor adopts it, so all end with the same member list.
3. **Barrier**: members check in under ``epoch/<g+1>/ready/<rank>`` while watching for a member dying
   or a newer epoch appearing (then they move on to that one), and only then build their groups.
4. **Sweep**: once past the barrier nobody builds an older epoch's groups any more, so each member
   deletes the keys it wrote for older epochs (its ``ready`` key, its gloo rendezvous keys: ~8·W
   bytes each, a group's grow as W²), and the lowest member deletes those of the previous epoch's
   members left out of this one (dead or excluded). Before, every regroup left its W² bytes in the
   store for the job's life (~8.6 MB an epoch at W=1024). The ``epoch/<g>`` records stay: a joiner
   bisects over them (:meth:`Membership.latest`), and a moved store is re-seeded with them.

A rank asked to leave (``leave/<rank>``, an in-place shrink) is left out of the next proposal; it gets
:class:`Excluded` and exits. Any other rank left out of an agreed epoch (its replica lost a rank, or it
was presumed dead) gets :class:`Excluded` and rejoins later like a restarted process: it writes ``join/<rank>`` and waits for
an epoch that includes it. Survivors admit complete replicas of joiners at an iteration boundary, never
in a failure regroup mid-iteration (the joiner holds none of the iteration's reduced buckets).

**No complete replica survives** (every replica lost a rank: a TP group of one replica, or two
replicas losing complementary shards): the agreed epoch has no member, so nobody is left to admit
anyone; the same when every member of the newest epoch is known dead (the last ones died before they
admitted the joiners, or all at once: nobody wrote an empty epoch). The ranks asking to join (the excluded survivors and the restarted processes) then form the
next epoch themselves, reason ``restart``, as soon as their complete replicas include the proposer
(first proposal wins; those left out are admitted at a boundary as usual). Nobody in it holds state,
so all restore the newest checkpoint every rank holds, as a ``--resume`` launch does
(``Trainer._restore_everyone``), and the iteration in progress is redone. Without a checkpointer
the wait is pointless: :class:`NoCompleteReplica` ends it at once. A member of a ``restart`` epoch
that could not form (one died at its barrier) regroups from it as a member would.

**Failure marks** (``failed/<rank>``): the agent learns of a rank's death first (it is the parent) and
the survivors regroup faster when told at once than when they wait for a heartbeat to go stale. The
key, its incarnation rule (incarnation ``i`` is dead once ``failed >= i``, or once ``started/<rank>``
passed ``i``: a later process counted itself in, whose predecessor's mark a moved store may lack), the
writer (:func:`mark_failed`) and the reader (:meth:`Membership.dead`) are one protocol, so they live
here together. Writing to a store needs torch's TCPStore client, and importing torch inside the agent holds
the GIL long enough to starve its heartbeat thread (seen: a false node loss), so the agent
(:mod:`agent.marker`) keeps a small helper process, ``python -m unicron.runtime.membership --marker``:
one JSON line per request on stdin, ``{"host", "port", "rank"}``; one JSON line per answer on stdout
(:func:`mark_request`).

**A moved store.** The store is the sidecar of one node's agent; when that node is lost while a replica
survives, an in-place resize names another node, whose agent starts an empty store, and every agent
sends its ranks ``StoreMoved``. Each survivor re-seeds the new store with what it holds (:func:`reseed`):
its own ``started/<rank>`` and those of its epochs' members (raised, never lowered: several survivors
seed at once), ``failed/<rank>`` of the lost ranks up to their incarnation, its epoch records from the
last gap on (first writer wins), ``epoch/base`` (the start of that run, raised, never lowered: an
excluded rank re-seeds older epochs than a survivor's; every rank looks for the newest epoch from
there, and the epochs after it must be contiguous for it to be found), its ``leave/`` and
finally ``seeded``. A rank launched on a moved store waits for ``seeded`` before it counts itself in,
so its incarnation follows its rank's earlier ones. Epochs below ``epoch/base`` may be missing (or
an excluded rank's old ones): a rank reads the records of its own epochs from memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from unicron.kernel import log as ulog
from unicron.kernel.errors import PermanentError, UnicronError
from unicron.runtime import store as keys
from unicron.runtime.comm import CommGroup, RendezvousStore, broken_group, group_keys, new_group, solo_group
from unicron.runtime.epoch import EpochRecord
from unicron.runtime.heartbeat import StalenessJudge
from unicron.runtime.plan import Topology

log = ulog.get(__name__)

FINISHED_KEY = "finished"
SEEDED_KEY = "seeded"
"""Written by a survivor once it re-seeded a moved store (module docstring, "A moved store")."""
BASE_KEY = "epoch/base"
"""The start of the newest run of epochs a moved store was seeded with: the newest is looked for from
there (an epoch below it is no longer the newest)."""


class Excluded(Exception):
    """This rank is not a member of the agreed epoch; it must rejoin."""

    def __init__(self, epoch: int) -> None:
        super().__init__(f"not a member of epoch {epoch}")
        self.epoch = epoch


class JobFinished(Exception):
    """The job completed while this rank waited to join."""

    def __init__(self, iteration: int) -> None:
        super().__init__(f"the job finished at iteration {iteration}")
        self.iteration = iteration


class RegroupFailed(PermanentError):
    """No membership could be agreed and formed before the regroup deadline."""


class NoCompleteReplica(PermanentError):
    """Every replica lost a rank and nothing can restore one: no checkpointer is configured, or no rank
    holds a checkpoint. Fatal at once: waiting to be admitted would only run out the join timeout."""


RESTART_REASON = "restart"
"""Reason of an epoch the joiners formed themselves after one with no member (module docstring)."""


@dataclass
class Groups:
    """This rank's process groups in one epoch."""

    record: EpochRecord
    #: all members (the data-parallel group itself when tp == 1)
    world: CommGroup
    #: members with this rank's tensor-parallel rank
    dp: CommGroup
    #: this rank's replica
    tp: CommGroup
    dp_ranks: list[int] = field(default_factory=list)

    def release(self) -> list[CommGroup]:
        """Drop this epoch's groups, replacing them with the :func:`broken_group` placeholder; returns
        them, for the caller to destroy (:func:`unicron.runtime.reaper.destroy`).

        Peers blocked in a collective with us fail fast only once our sockets close, and gloo closes
        them in the group's destructor (``abort()`` alone leaves them open), so the caller must drop
        every other reference too.
        """
        released: list[CommGroup] = []
        for name in ("world", "dp", "tp"):
            g = getattr(self, name)
            setattr(self, name, broken_group())
            if g is solo_group() or g is broken_group() or any(g is r for r in released):
                continue
            try:
                g.abort()
            except Exception as exc:  # aborting a broken group may itself complain
                log.debug("aborting a process group failed", error=str(exc))
            released.append(g)
        return released


@dataclass(frozen=True)
class CommSettings:
    """Timeouts of group formation and failure detection."""

    #: a collective that makes no progress for this long raises (gloo/NCCL timeout)
    collective_timeout_s: float = 30.0
    #: deadline for agreeing and forming a new epoch; longer than the collective timeout
    regroup_timeout_s: float = 90.0
    #: a peer whose heartbeat counter did not move for this long is presumed dead
    heartbeat_window_s: float = 5.0
    #: poll interval of the store while waiting
    poll_s: float = 0.005
    #: process-group backend: "gloo" (CPU or CUDA tensors) or "nccl" (CUDA tensors only)
    backend: str = "gloo"
    #: where the model and every collective's tensors live: "cpu" or "cuda:<LOCAL_RANK>"
    device: str = "cpu"


# --- failure marks ----------------------------------------------------------------------------


def failed_key(rank: int) -> str:
    """``failed/<rank>``: how many processes of ``rank`` are known dead (see the module's docstring)."""
    return f"failed/{rank}"


def mark_failed(host: str, port: int, rank: int, store: RendezvousStore | None = None) -> int:
    """Record that ``rank``'s newest process is gone; returns the failure count. ``failed`` is raised
    to ``started`` and never beyond: a process that died before it counted itself in (a crash at start)
    is no incarnation anyone knows, and a rank marked twice (an in-place shrink marks a lost node's
    ranks, whose own agent may have marked them first) is one death. Counting either would make the
    rank's next incarnation look dead at its start: it was never admitted (both ranks of a relaunch
    that crashed on a checkpoint lock, then restarted: rank 0 trained alone, rank 1 waited forever).

    The agent calls this the moment its child exits, so survivors regroup without waiting for a
    heartbeat to go stale. Pass ``store`` to reuse a connection.
    """
    s = store if store is not None else keys.connect(host, port, timeout_s=5.0)
    # compare-and-set, not read-then-add: two markers of one death at once counted it twice
    return raise_counter(s, failed_key(rank), keys.counter(s, keys.started_key(rank)))


def raise_counter(store: RendezvousStore, key: str, value: int) -> int:
    """Raise counter ``key`` to at least ``value``, never lower it (survivors re-seed one store at once,
    two markers may mark one death at once); returns the counter's value then."""
    while True:
        current = keys.counter(store, key)
        if current >= value:
            return current
        now = int(store.compare_set(key, str(current), str(value)))
        if now >= value:
            return now


def _newest_run(records: list[EpochRecord]) -> list[EpochRecord]:
    """The records, sorted by epoch, from the last gap on: an epoch abandoned at its barrier is held by
    nobody, and a joiner finds the newest epoch by doubling and bisecting over contiguous ones (from
    ``epoch/base``; across a gap it settled on the older side and was never admitted)."""
    start = len(records) - 1
    while start > 0 and records[start - 1].epoch == records[start].epoch - 1:
        start -= 1
    return records[max(start, 0):]


def reseed(store: RendezvousStore, rank: int, incarnation: int, records: Iterable[EpochRecord],
           lost: Iterable[int], leaving: bool, address: str = "") -> None:
    """Seed a moved (empty) store with what this rank holds (module docstring, "A moved store");
    ``address``: where this rank's node is reached (``host/<rank>/<incarnation>``; "": it does not know)."""
    raise_counter(store, keys.started_key(rank), incarnation)
    store.set(keys.host_key(rank, incarnation), address)
    held = sorted(records, key=lambda rec: rec.epoch)
    for rec in held:
        for r, inc in sorted(rec.incarnations.items()):
            raise_counter(store, keys.started_key(r), inc)
    held = _newest_run(held)
    for rec in held:
        store.compare_set(f"epoch/{rec.epoch}", "", rec.encode())
    if held:
        newest = held[-1]
        for r in lost:
            if r in newest.incarnations and r != rank:
                raise_counter(store, failed_key(r), newest.incarnations[r])
        # The newest run's start, not the first re-seeder's: an excluded rank holds older epochs
        raise_counter(store, BASE_KEY, held[0].epoch)
    if leaving:
        store.set(keys.leave_key(rank), str(incarnation))
    if held:  # a joiner that holds no epoch has nothing others need: it does not open the store to them
        store.set(SEEDED_KEY, "1")


def await_seeded(store: RendezvousStore, timeout_s: float, poll_s: float = 0.02) -> bool:
    """Wait until a survivor re-seeded a moved store; False if none did within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not store.check([SEEDED_KEY]):
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


Poll = Callable[[], None]
"""Called while a regroup waits, to read the agent's instructions (a Leave or Stop arriving then)."""


class Membership:
    """Epoch agreement and group construction for one rank."""

    def __init__(
        self,
        store: RendezvousStore,
        rank: int,
        topo: Topology,
        incarnation: int,
        settings: CommSettings,
        poll: Poll | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.topo = topo
        self.incarnation = incarnation
        self.settings = settings
        self.judge = StalenessJudge(store, settings.heartbeat_window_s)
        #: seconds spent in the phases of the last regroup (for logs and benchmarks)
        self.timing: dict[str, float] = {}
        self._poll = poll or (lambda: None)
        #: where each member of the epoch last entered runs (``host/<rank>/<incarnation>``; "": unknown),
        #: read once at its barrier: a survivor told that ranks were lost cuts their hosts from here,
        #: without a store call (the store may have been lost with them; :mod:`unicron.runtime.hostloss`)
        self.hosts: Mapping[int, str] = {}
        #: store keys this rank wrote for epochs it has not swept yet: epoch -> keys (module docstring, "Sweep")
        self._written: dict[int, list[str]] = {}

    def use(self, store: RendezvousStore) -> None:
        """Go on with a moved store (its heartbeat counters start anew: so does their judge)."""
        self.store = store
        self.judge = StalenessJudge(store, self.settings.heartbeat_window_s)

    # --- records ---------------------------------------------------------------------------------

    def _read(self, epoch: int) -> EpochRecord | None:
        key = f"epoch/{epoch}"
        if not self.store.check([key]):
            return None
        return EpochRecord.decode(self.store.get(key))

    def _propose(self, rec: EpochRecord) -> EpochRecord:
        won = self.store.compare_set(f"epoch/{rec.epoch}", "", rec.encode())
        return EpochRecord.decode(won)

    def latest(self, after: int) -> EpochRecord | None:
        """The newest agreed epoch after ``after``, if any.

        Epochs are contiguous (each is proposed as its base + 1), so the newest is found by doubling
        the step past ``after`` and then bisecting: O(log n) store reads, where a scan one by one from
        0 (a joiner knows no epoch) made a grow wait for tens of thousands of reads. On a moved store
        the search starts at ``epoch/base`` at the earliest: epochs below it need not be contiguous
        with the newest.
        """
        after = max(after, self._base() - 1)
        if not self._exists(after + 1):
            return None
        lo, step = after + 1, 1  # lo exists
        while self._exists(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step  # hi does not exist
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._exists(mid) else (lo, mid)
        return self._read(lo)

    def _exists(self, epoch: int) -> bool:
        return self.store.check([f"epoch/{epoch}"])

    def _base(self) -> int:
        """``epoch/base``: the oldest epoch of a moved store's newest run (0 on the first store)."""
        return keys.counter(self.store, BASE_KEY)

    def _newer_exists(self, epoch: int) -> bool:
        """Whether an epoch after ``epoch`` was agreed: the next one, or a moved store's base past it (an
        excluded rank that re-seeded first found its own old epoch and waited at its barrier)."""
        return self._exists(epoch + 1) or self._base() > epoch

    # --- knowledge -------------------------------------------------------------------------------

    def dead(self, rec: EpochRecord, ranks: Iterable[int]) -> set[int]:
        """Members of ``rec`` among ``ranks`` known or presumed dead right now."""
        others = [r for r in ranks if r != self.rank]
        out = {r for r in others if self._gone(r, rec.incarnations.get(r, 1))}
        out |= self.judge.stale(r for r in others if r not in out)
        self._poll()
        return out

    def _gone(self, rank: int, incarnation: int) -> bool:
        """Whether process ``incarnation`` of ``rank`` is known dead: marked failed, or a later process
        of its rank counted itself in (a relaunch just before the store moved: its mark was lost with
        the old store, and its rank was not among the lost ones a re-seed marks)."""
        return (keys.counter(self.store, failed_key(rank)) >= incarnation
                or keys.counter(self.store, keys.started_key(rank)) > incarnation)

    def leaving(self, rec: EpochRecord) -> set[int]:
        """Members of ``rec`` whose incarnation there was asked to leave (``leave/<rank>``)."""
        asked = [r for r in rec.members if self.store.check([keys.leave_key(r)])]
        return {r for r in asked if _int(self.store.get(keys.leave_key(r))) == rec.incarnations.get(r, 1)}

    def leave(self) -> None:
        """Ask to be left out of the next epoch (the agent's Leave); the others agree it at a commit."""
        self.store.set(keys.leave_key(self.rank), str(self.incarnation))

    def joiners(self, members: Iterable[int]) -> dict[int, int]:
        """Ranks outside ``members`` asking to join, as complete live replicas: rank -> incarnation."""
        inside = set(members)
        asking: dict[int, int] = {}
        for r in range(self.topo.world_size):
            if r not in inside and (inc := asking_to_join(self.store, r)) is not None:
                asking[r] = inc
        stale = self.judge.stale(asking)
        complete = self.topo.full_replica_members(r for r in asking if r not in stale)
        return {r: asking[r] for r in complete}

    def _asked_to_leave(self, rank: int, incarnation: int) -> bool:
        return asked_to_leave(self.store, rank, incarnation)

    def has_joiners(self, members: Iterable[int]) -> bool:
        """Cheap check used at every iteration boundary while some ranks are out."""
        inside = set(members)
        outside = [keys.join_key(r) for r in range(self.topo.world_size) if r not in inside]
        return bool(outside) and any(self.store.check([k]) for k in outside) and bool(self.joiners(inside))

    # --- epochs ----------------------------------------------------------------------------------

    def start(self) -> Groups:
        """Epoch 0 on a first start: every rank of the launch, all at incarnation 1."""
        everyone = tuple(range(self.topo.world_size))
        rec = self._propose(EpochRecord(0, everyone, dict.fromkeys(everyone, 1), "start"))
        try:
            return self._enter(rec, deadline=time.monotonic() + self.settings.regroup_timeout_s)
        except _MovedOn as moved:  # a rank died before epoch 0 formed
            return self.regroup(moved.record, "start", assume_same=True, admit=True)

    def regroup(self, current: EpochRecord, reason: str, assume_same: bool = False, admit: bool = False) -> Groups:
        """Move to the next agreed epoch after ``current``.

        ``assume_same``: propose at once without waiting for failure knowledge (this rank knows the
        error was its own and transient, or the regroup is only to admit joiners). ``admit``: this
        rank's proposal takes in the joiners waiting. Only where no member has part of an iteration
        done (at start, at an iteration boundary): admitted mid-iteration, a joiner reduced from bucket
        0 against the others' bucket k (a wrong gradient, or gloo aborting on the size mismatch).
        """
        deadline = time.monotonic() + self.settings.regroup_timeout_s
        base = current
        t0 = time.monotonic()
        self.timing = {}
        while time.monotonic() < deadline:
            nxt = self.latest(base.epoch)
            if nxt is None:
                dead = self._wait_knowledge(base, deadline, assume_same)
                self.timing["knowledge_s"] = time.monotonic() - t0
                if dead is None:
                    continue  # someone else proposed: adopt theirs
                nxt = self._proposal(base, dead, reason, admit)
            self.timing["agreed_s"] = time.monotonic() - t0
            try:
                return self._enter(nxt, deadline)
            except _MovedOn as moved:
                base = moved.record
                assume_same = True  # the dead are known; whoever proposes next removes them
        raise RegroupFailed(f"rank {self.rank}: no epoch after {current.epoch} formed within "
                            f"{self.settings.regroup_timeout_s:.0f}s")

    def join(self, timeout_s: float, restorable: bool = True) -> Groups | None:
        """As a restarted or excluded process: ask to join and wait for an epoch that includes us.
        None once this process is asked to leave (its ``leave/<rank>``, written when the poll reads the
        agent's Leave): nobody would admit it. A leaver whose store moved regrouped there after the
        others and found itself excluded before it read the Leave; it waited to be admitted until the
        agent's leave timeout (60 s) killed it.

        When the newest epoch has no member, the joiners form the next one (module docstring, "No
        complete replica survives"); ``restorable``: whether its members could restore a checkpoint,
        else :class:`NoCompleteReplica` is raised at once."""
        self.store.set(keys.join_key(self.rank), str(self.incarnation))
        deadline = time.monotonic() + timeout_s
        seen = -1
        newest: EpochRecord | None = None
        while time.monotonic() < deadline:
            if self.store.check([FINISHED_KEY]):
                raise JobFinished(_int(self.store.get(FINISHED_KEY)))
            self._poll()
            if self._asked_to_leave(self.rank, self.incarnation):
                return None
            rec = self.latest(seen)
            if rec is not None:
                seen, newest = rec.epoch, rec
            elif newest is not None and self._all_gone(newest):
                if not restorable:
                    raise NoCompleteReplica(
                        f"epoch {newest.epoch}: no complete replica survived (every replica lost a rank) and "
                        "no checkpointer is configured (--ckpt) to restore one; relaunch the job")
                rec = self._restart(newest)
                if rec is not None:
                    seen, newest = rec.epoch, rec
            if rec is not None and self.rank in rec.members and rec.incarnations.get(self.rank) == self.incarnation:
                try:
                    return self._enter(rec, time.monotonic() + self.settings.regroup_timeout_s)
                except _MovedOn as moved:
                    abandoned = moved.record
                if abandoned.reason != RESTART_REASON:
                    continue  # its members (holding state) agree the next epoch and admit us again
                try:  # every member of a restart epoch is a joiner: nobody else would form the next
                    return self.regroup(abandoned, RESTART_REASON, assume_same=True, admit=True)
                except Excluded:
                    continue
            time.sleep(self.settings.poll_s * 4)
        raise RegroupFailed(f"rank {self.rank}: not admitted to the job within {timeout_s:.0f}s")

    def _all_gone(self, rec: EpochRecord) -> bool:
        """Whether no member of ``rec`` is left to admit anyone: it has none, or every one is known dead
        (the last members died before they admitted the joiners). Stops at the first live member."""
        return all(self._gone(r, rec.incarnations.get(r, 1)) for r in rec.members)

    def _restart(self, empty: EpochRecord) -> EpochRecord | None:
        """After an epoch with no member: propose the joiners' complete replicas as the next epoch, once
        they include this rank; the agreed record (another joiner's may win), or None (not yet)."""
        asking = self.joiners(())
        if self.rank not in asking:
            return None
        return self._propose(EpochRecord(empty.epoch + 1, tuple(sorted(asking)), asking, RESTART_REASON))

    def _proposal(self, base: EpochRecord, dead: set[int], reason: str, admit: bool) -> EpochRecord:
        leaving = self.leaving(base)
        alive = [r for r in base.members if r not in dead and r not in leaving]
        members = self.topo.full_replica_members(alive)
        incs = {r: base.incarnations[r] for r in members}
        if admit:
            incs.update(self.joiners(members))
        everyone = tuple(sorted(incs))
        rec = EpochRecord(base.epoch + 1, everyone, incs, reason)
        return self._propose(rec)

    def _wait_knowledge(self, base: EpochRecord, deadline: float, assume_same: bool) -> set[int] | None:
        """Dead members of ``base`` once known; None when another rank's proposal already exists."""
        t0 = time.monotonic()
        while time.monotonic() < deadline:
            if self._newer_exists(base.epoch):
                return None
            dead = self.dead(base, base.members)
            if dead or assume_same:
                return dead
            if time.monotonic() - t0 > self.settings.heartbeat_window_s:
                return set()  # everyone is alive: a transient error, regroup as we were
            time.sleep(self.settings.poll_s)
        raise RegroupFailed(f"rank {self.rank}: no failure knowledge after epoch {base.epoch}")

    def _enter(self, rec: EpochRecord, deadline: float) -> Groups:
        if self.rank not in rec.members:
            raise Excluded(rec.epoch)
        t0 = time.monotonic()
        self._barrier(rec, deadline)
        t1 = time.monotonic()
        self.hosts = self._hosts_of(rec)
        groups = self._build(rec)
        self.timing.update(barrier_s=t1 - t0, build_s=time.monotonic() - t1)
        self._sweep(rec)
        return groups

    def _sweep(self, rec: EpochRecord) -> None:
        """Past ``rec``'s barrier: delete the keys of older epochs (module docstring, "Sweep")."""
        stale = [k for e in sorted(self._written) if e < rec.epoch for k in self._written.pop(e)]
        if self.rank == min(rec.members) and rec.epoch > 0 and (prev := self._read(rec.epoch - 1)) is not None:
            for r in prev.members:
                if r not in rec.members:
                    stale += self._keys_of(prev, r)
        for key in stale:
            self.store.delete_key(key)

    def _keys_of(self, rec: EpochRecord, rank: int) -> list[str]:
        """The keys member ``rank`` of ``rec`` writes to enter it: its ready key and rendezvous keys."""
        out = [_ready_key(rec.epoch, rank)]
        for name, ranks in self._group_specs(rec, rank):
            if len(ranks) > 1:  # a one-rank gloo group is the solo placeholder: no rendezvous
                out += group_keys(self.settings.backend, name, ranks.index(rank))
        return out

    def _hosts_of(self, rec: EpochRecord) -> dict[int, str]:
        """The members' hosts, in one store call where each published one (a member always does
        before its barrier, :func:`unicron.runtime.store.publish_host`), else key by key."""
        wanted = {r: keys.host_key(r, rec.incarnations[r]) for r in rec.members}
        if self.store.check(list(wanted.values())):
            return {r: v.decode() for r, v in zip(wanted, self.store.multi_get(list(wanted.values())), strict=True)}
        return {r: self.store.get(k).decode() for r, k in wanted.items() if self.store.check([k])}

    def _barrier(self, rec: EpochRecord, deadline: float) -> None:
        # all this rank will write for the epoch, noted first: an abandoned epoch's are swept too
        self._written[rec.epoch] = self._keys_of(rec, self.rank)
        self.store.set(_ready_key(rec.epoch, self.rank), str(self.incarnation))
        want = [_ready_key(rec.epoch, r) for r in rec.members]
        while time.monotonic() < deadline:
            if self.store.check(want):
                return
            if self._newer_exists(rec.epoch):
                raise _MovedOn(rec)
            if self.dead(rec, self._absent(rec)):
                raise _MovedOn(rec)
            time.sleep(self.settings.poll_s)
        raise RegroupFailed(f"rank {self.rank}: members {self._absent(rec)} of epoch {rec.epoch} did not arrive "
                            f"within {self.settings.regroup_timeout_s:.0f}s and were not marked dead")

    def _absent(self, rec: EpochRecord) -> list[int]:
        """Members of ``rec`` not (yet) at its barrier."""
        return [r for r in rec.members if not self.store.check([_ready_key(rec.epoch, r)])]

    def _group(self, name: str, ranks: list[int]) -> CommGroup:
        if len(ranks) == 1 and self.settings.backend == "gloo":
            return solo_group()
        return new_group(
            self.settings.backend, self.store, name, ranks.index(self.rank), len(ranks),
            self.settings.collective_timeout_s,
        )

    def _group_specs(self, rec: EpochRecord, rank: int) -> list[tuple[str, list[int]]]:
        """(store prefix, global ranks) of the groups ``rank`` builds in ``rec``: world, dp, tp (one
        group, the data-parallel one, when tp == 1)."""
        g, members = rec.epoch, list(rec.members)
        dp_ranks = self.topo.dp_peers(members, rank)
        if self.topo.tp == 1:
            return [(f"e{g}/dp", members)]
        replica = self.topo.replica_of(rank)
        return [(f"e{g}/world", members), (f"e{g}/dp{self.topo.tp_rank(rank)}", dp_ranks),
                (f"e{g}/tp{replica}", self.topo.ranks_of(replica))]

    def _build(self, rec: EpochRecord) -> Groups:
        dp_ranks = self.topo.dp_peers(list(rec.members), self.rank)
        try:
            built = [self._group(name, ranks) for name, ranks in self._group_specs(rec, self.rank)]
        except RuntimeError as exc:
            log.warning("building the groups failed", rank=self.rank, epoch=rec.epoch, error=str(exc))
            raise _MovedOn(rec) from exc
        if self.topo.tp == 1:
            return Groups(rec, built[0], built[0], solo_group(), dp_ranks)
        world, dp, tp = built
        return Groups(rec, world, dp, tp, dp_ranks)


def _ready_key(epoch: int, rank: int) -> str:
    return f"epoch/{epoch}/ready/{rank}"


def asked_to_leave(store: RendezvousStore, rank: int, incarnation: int) -> bool:
    """A rank that joined (its ``join/<rank>`` stays) and was then asked to leave is no joiner: taking
    it back in re-formed the same epoch at every commit (one epoch an iteration, issue 13)."""
    key = keys.leave_key(rank)
    return store.check([key]) and _int(store.get(key)) == incarnation


def asking_to_join(store: RendezvousStore, rank: int) -> int | None:
    """The incarnation of ``rank`` that asks to join: its ``join/<rank>`` names the rank's newest process,
    which has not died and was not asked to leave. None otherwise: a key left by a process that joined
    and died since (nothing deletes it) asks nothing."""
    if not store.check([keys.join_key(rank)]):
        return None
    inc = _int(store.get(keys.join_key(rank)))
    if inc != keys.counter(store, keys.started_key(rank)) or keys.counter(store, failed_key(rank)) >= inc:
        return None
    return None if asked_to_leave(store, rank, inc) else inc


def _int(raw: bytes) -> int:
    try:
        return int(raw)
    except ValueError:
        return 0  # the iteration is only reported; a malformed value must not fail the exit


class _MovedOn(Exception):
    """Epoch ``record`` cannot be formed (a member died or a newer epoch exists)."""

    def __init__(self, record: EpochRecord) -> None:
        super().__init__(f"epoch {record.epoch} abandoned")
        self.record = record


def mark_request(line: str, stores: dict[tuple[str, int], RendezvousStore]) -> dict[str, Any]:
    """One failure-marker request (a JSON line ``{"host", "port", "rank"}``) -> its answer; never raises.

    ``stores`` keeps one connection per store across requests; a failed one is dropped and reopened
    next time.
    """
    try:
        req = json.loads(line)
        host, port, rank = str(req["host"]), int(req["port"]), int(req["rank"])
    except (ValueError, KeyError, TypeError, OverflowError) as exc:  # OverflowError: int() of JSON's Infinity
        return {"ok": False, "error": f"bad request {line.strip()[:80]!r}: {exc}"}
    try:
        store = stores.get((host, port))
        if store is None:
            store = stores[(host, port)] = keys.connect(host, port, timeout_s=5.0)
        count = mark_failed(host, port, rank, store=store)
        return {"ok": True, "rank": rank, "failures": count}
    except (UnicronError, RuntimeError, OSError) as exc:
        stores.pop((host, port), None)  # reconnect next time
        return {"ok": False, "rank": rank, "error": str(exc)}


def serve_marks(requests: Iterable[str], answers: TextIO) -> None:
    """The failure marker's loop: a ready line, then one answer line per request line."""
    stores: dict[tuple[str, int], RendezvousStore] = {}
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in requests:
        if line.strip():
            print(json.dumps(mark_request(line, stores)), file=answers, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m unicron.runtime.membership",
        description="The agent's failure marker: mark ranks failed in their tasks' stores.",
    )
    parser.add_argument("--marker", action="store_true", required=True,
                        help="JSON requests {host, port, rank} on stdin, one answer line each on stdout")
    parser.parse_args(argv)
    serve_marks(sys.stdin, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
