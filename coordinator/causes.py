"""Cause detection: what the coordinator observes in etcd, turned into the decision core's events.

Pure functions, no I/O and no clock: the daemon parses a watch event into a typed record and asks
this module which :data:`coordinator.decision.Event` values it means, given the core's current
state. Each rule here is one arrow of the contract in ``docs/decision.md``:

* a report                               -> an incident (:func:`incident`, severity by paper Table 1,
                                            :mod:`unicron.kernel.severity`) -> ``IncidentRaised``;
                                            a hang that echoes an in-place recovery, handled
                                            (:func:`regroup_echo`); a log-read rank's hang while
                                            another node's rank saves, handled (:func:`held_by_phase`);
                                            a hang, the rank the others wait for where the
                                            statuses show one, a save past its bound included
                                            (:func:`hang_culprit`)
* ``status/<node>`` steps                -> ``ProgressMade``                    (:func:`progress`)
* ``results/<node>``                     -> ``ActionSucceeded`` / ``ActionFailed`` (:func:`outcomes`)
* every rank of a task exited 0          -> ``TaskFinished``, or ``TaskStopped`` when a rank said it
                                            stopped before its end               (:func:`ended`)
* a node's lease gone, its link silent   -> ``NodeLost``                        (:func:`lease_gone`);
  a node of the state a new leader finds unregistered, still so after a grace (:func:`unregistered`)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from coordinator import decision as d
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.protocol import PHASE_CHECKPOINT, PHASE_COLLECTIVE, PHASE_EVAL, PHASE_REGROUP, PHASES
from unicron.kernel.severity import severity_of
from unicron.kernel.types import (
    AssignmentResult,
    DetectionMethod,
    ErrorKind,
    Incident,
    NodeStatus,
    RankStatus,
    Report,
    TaskResult,
)

#: (task, generation) -> the highest step already turned into a ProgressMade
Seen = Mapping[tuple[str, int], int]


def incident_id(report: Report) -> str:
    """One incident per report: a report seen twice (replayed after an etcd outage) is one incident."""
    return f"r-{report.report_id}"


def incident(report: Report, detected_ts: float) -> Incident:
    return classify(report, detected_ts=detected_ts, incident_id=incident_id(report))


def classify(report: Report, detected_ts: float, incident_id: str) -> Incident:
    """Turn an agent's report into an incident; ``detected_ts`` is when the coordinator saw it.

    The severity is paper Table 1's (:func:`unicron.kernel.severity.severity_of`, never raises). GPU
    health events found by the agent's GPU monitor (XID / ECC / NVLink) arrive as
    ``EXCEPTION_PROPAGATION`` reports of kind ECC_ERROR / NVLINK_ERROR / GPU_DRIVER_ERROR /
    INVALID_DMA_MAPPING and hit the sev1 rows. DEGRADATION (a slow but completed iteration) is
    recorded only: severity ``None``, no recovery action.
    """
    return Incident(
        incident_id=incident_id,
        severity=severity_of(report.method, report.kind),
        method=report.method,
        kind=report.kind,
        node=report.node,
        message=report.message,
        task=report.task,
        gpu=report.gpu,
        rank=report.rank,
        step=report.step,
        source_ts=report.source_ts,
        detected_ts=detected_ts,
        report_id=report.report_id,
        handled=report.handled,
        detection_s=detected_ts - report.source_ts,
    )


@dataclasses.dataclass(frozen=True)
class InPlaceRecovery:
    """The latest report of a task's rank that recovered in place (``Report.handled``)."""

    ts: float
    """When its fault was observed (the latest such report's ``source_ts``)."""
    step: int | None
    """The highest iteration such a report named (None: none named one)."""

    def after(self, report: Report) -> InPlaceRecovery:
        """This record, moved on by another handled report of the task."""
        steps = [s for s in (self.step, report.step) if s is not None]
        return InPlaceRecovery(max(self.ts, report.source_ts), max(steps) if steps else None)


def regroup_echo(report: Report, last: InPlaceRecovery | None, grace_s: float,
                 statuses: Mapping[str, NodeStatus]) -> bool:
    """Whether a hang report is the echo of a rank's in-place recovery: the peers sat in the broken
    iteration's collective while the ranks regrouped, and their detectors may fire meanwhile. Only a
    hang within ``grace_s`` of the recovery, in the iteration it broke or the next: a hang of a later
    iteration is a new fault (the detectors reset at the regroup), which before this step condition
    waited out ``hang_repeat_s`` (60 s) whenever it came within the grace (resize soak, ``rank_hang``).
    Never while a rank of the task is stopped (a SIGSTOP, a debugger: the reporter, or the culprit
    :func:`hang_culprit` names): no regroup explains a frozen process, and dismissed as an echo it
    held the task at a fraction of its ranks until ``hang_repeat_s`` reported it again."""
    if report.kind is not ErrorKind.TASK_HANG or report.task is None or last is None:
        return False
    if report.source_ts - last.ts > grace_s:
        return False
    if any(r.state == "stopped" for _, r in _task_ranks(report, statuses)):
        return False
    return report.step is None or last.step is None or report.step <= last.step + 1


#: phases outside the iterations a rank may spend minutes in (a save, an evaluation), up to its
#: agent's UNICRON_PHASE_HANG_S
_LONG = (PHASE_CHECKPOINT, PHASE_EVAL)


def held_by_phase(report: Report, statuses: Mapping[str, NodeStatus]) -> str | None:
    """Why a hang report is a wait for another rank's checkpoint or evaluation, or None.

    Only for a rank that reports no phases (a job read from its log): Megatron prints its checkpoint
    lines on rank 0 and its progress on the last rank, so when they run on different nodes the last
    rank's monitor never hears of the save and judges the wait for it as a hang. Only until the
    saving rank's ``phase_deadline`` (its agent's bound on those phases, which its status carries;
    none: a status from before the bound, held as it was): rank 0, which only prints the save, has no
    monitor of its own to judge it, and a save blocked for good (a hung filesystem) held every hang
    of the task, so the job sat idle until a human noticed. A rank that reports its phases is left to
    :func:`hang_culprit`, which names a rank stuck in them."""
    if report.kind is not ErrorKind.TASK_HANG or report.task is None or report.handled:
        return None
    ranks = _task_ranks(report, statuses)
    reporter = next((r for node, r in ranks if _is_reporter(report, node, r)), None)
    if reporter is None or reporter.phase is not None:
        return None
    busy = sorted((r.rank, node, r.phase) for node, r in ranks
                  if r.state == "running" and r.phase in _LONG and not _is_reporter(report, node, r)
                  and (r.phase_deadline is None or report.source_ts < r.phase_deadline))
    if not busy:
        return None
    rank, node, phase = busy[0]
    return f"waits for rank {rank}'s {phase} on {node}"


def hang_culprit(report: Report, statuses: Mapping[str, NodeStatus]) -> Report:
    """The report of a hang, pointed at the rank that causes it where the agents' statuses show one.

    A rank that hangs holds every peer in its next collective, so every agent finds its ranks hung at
    about the same time, and the first report is often a healthy peer's: restarting that peer leaves
    the task waiting for the hung rank. So a hang reported for a rank that waits goes to the rank it
    waits for, as the agents last saw them: a stopped process (a SIGSTOP, a debugger) first; else,
    when the reporter's rank waits in the iteration's collective (``PHASE_COLLECTIVE``), a running
    rank of the task still inside the iteration outside it, at or before the reporter's step (a GPU
    hang, a stuck loader). If several, the lowest stopped rank, or the rank furthest behind (then the
    lowest), except that ranks of one node tying for furthest behind (TP partners: see below) name the
    node, not a rank, also in the report of one of them. A hang of a rank that reports no phases goes
    to a rank in a checkpoint or evaluation past its agent's bound (``phase_deadline``): the save that
    :func:`held_by_phase` no longer excuses. Anything else is the report as it came.

    It trusts statuses at most one status interval old to show where a rank is: for iterations shorter
    than the status interval the pick may be a rank that has since joined the collective."""
    if report.kind is not ErrorKind.TASK_HANG or report.task is None or report.handled:
        return report
    ranks = _task_ranks(report, statuses)
    found = (_stopped_rank(report, ranks) or _overdue_phase_rank(report, ranks)
             or _rank_outside_collective(report, ranks))
    if found is None:
        return report
    node, culprit, why = found
    if isinstance(culprit, list):  # several on one node: the incident names the node, all its ranks restart
        names = " and ".join(str(r.rank) for r in culprit)
        return dataclasses.replace(
            report, node=node, rank=None, gpu=None, restart_epoch=max(r.restart_epoch for r in culprit),
            message=f"{report.message} (reported on {report.node} for rank {report.rank}; ranks {names}' "
                    f"processes {why})")
    return dataclasses.replace(
        report, node=node, rank=culprit.rank, gpu=None, restart_epoch=culprit.restart_epoch,
        message=f"{report.message} (reported on {report.node} for rank {report.rank}; rank {culprit.rank}'s "
                f"process {why})")


_Culprit = tuple[str, RankStatus | list[RankStatus], str]
"""(node, the rank's status, or those of several ranks of that node any of which it may be, why)"""

#: phases inside an iteration but outside its collective: a rank there for a hang's length holds the others
_BEHIND = tuple(p for p in PHASES if p not in (PHASE_COLLECTIVE, PHASE_REGROUP))


def _task_ranks(report: Report, statuses: Mapping[str, NodeStatus]) -> list[tuple[str, RankStatus]]:
    """(node, status) of every rank of the report's task and generation, as the agents last saw them."""
    return [(node, r) for node, st in statuses.items() for r in st.ranks
            if r.task == report.task and (report.generation is None or r.generation == report.generation)]


def _is_reporter(report: Report, node: str, r: RankStatus) -> bool:
    return (node, r.rank) == (report.node, report.rank)


def _stopped_rank(report: Report, ranks: list[tuple[str, RankStatus]]) -> _Culprit | None:
    stopped = [(node, r) for node, r in ranks if r.state == "stopped"]
    if not stopped or any(_is_reporter(report, node, r) for node, r in stopped):
        return None
    node, r = min(stopped, key=lambda nr: (nr[1].rank, nr[0]))
    return node, r, "is stopped"


def _overdue_phase_rank(report: Report, ranks: list[tuple[str, RankStatus]]) -> _Culprit | None:
    """For a rank without phases (a job read from its log), the lowest running rank of the task in a
    checkpoint or evaluation past its ``phase_deadline``: the save it waits for that :func:`held_by_phase`
    no longer excuses (restarting the waiting last rank left rank 0 in its blocked save)."""
    reporter = next((r for node, r in ranks if _is_reporter(report, node, r)), None)
    if reporter is None or reporter.phase is not None:
        return None
    overdue = [(node, r) for node, r in ranks if r.state == "running" and r.phase in _LONG
               and r.phase_deadline is not None and report.source_ts >= r.phase_deadline
               and not _is_reporter(report, node, r)]
    if not overdue:
        return None
    node, r = min(overdue, key=lambda nr: (nr[1].rank, nr[0]))
    return node, r, f"has been in {r.phase} past its agent's bound (UNICRON_PHASE_HANG_S)"


def _rank_outside_collective(report: Report, ranks: list[tuple[str, RankStatus]]) -> _Culprit | None:
    reporter = next(((node, r) for node, r in ranks if _is_reporter(report, node, r)), None)
    if reporter is None or reporter[1].phase not in (PHASE_COLLECTIVE, *_BEHIND):
        return None
    behind = [(node, r) for node, r in ranks if r.state == "running" and r.phase in _BEHIND
              and (report.step is None or r.step is None or r.step <= report.step)]
    if reporter[1].phase == PHASE_COLLECTIVE:
        if not behind:
            return None
        node, r = min(behind, key=lambda nr: (_step(nr[1]), nr[1].rank, nr[0]))
    else:
        node, r = reporter  # its own hang: only a tie (below) changes whom it names
    # With TP > 1 the hung rank's partners wait inside the model's own collectives, which report no phase:
    # they look as far behind as it does, and their own reports as much its. They share its node (Megatron
    # keeps TP groups in one), so the node's ranks restart rather than a guess among them, which
    # restarted a healthy partner and let the restart deadline isolate the node.
    tied = sorted((t for n, t in behind if n == node and _step(t) == _step(r)), key=lambda t: t.rank)
    if len(tied) > 1:
        phases = ", ".join(sorted({str(t.phase) for t in tied}))
        return node, tied, f"have not joined the collective (phase {phases}, step {r.step})"
    if r is reporter[1]:
        return None
    return node, r, f"has not joined the collective (phase {r.phase}, step {r.step})"


def _step(r: RankStatus) -> int:
    return r.step if r.step is not None else -1


def raised(inc: Incident, generation: int | None, restart_epoch: int | None = None) -> d.IncidentRaised | None:
    """The core event for an incident; None when the runtime already handled it in place."""
    if inc.handled:
        return None
    return d.IncidentRaised(ts=inc.detected_ts, incident=inc, generation=generation, restart_epoch=restart_epoch)


def _pending_restart(entry: d.TaskEntry) -> int | None:
    """The restart epoch whose processes alone can show that the task recovered, if a restart is pending."""
    o = entry.outstanding
    return entry.restart_epoch if o is not None and o.kind is d.ActionKind.RESTART else None


def _pending_joiners(entry: d.TaskEntry) -> set[int]:
    """The joiners an in-place grow under way still waits for: during its resize, or during a restart
    that superseded it (a joiner that died at its start is relaunched; the others still have to join)."""
    o = entry.outstanding
    waiting = o is not None and o.kind in (d.ActionKind.RESIZE, d.ActionKind.RESTART)
    return set(entry.joiners) if waiting else set()


def progress(status: NodeStatus, state: d.CoreState, seen: Seen, ts: float) -> list[d.ProgressMade]:
    """New steps completed by a task's ranks at its current generation (and, while a restart is
    pending, by processes that restart launched: a survivor's or the dead process's step says nothing
    about it). Such a process that has completed an iteration proves the restart whatever its step:
    a job that resumed from its checkpoint redoes steps the coordinator saw before the failure, and
    waiting for it to pass them would let the restart's deadline expire on a healthy node. Likewise,
    while an in-place grow is pending, its joiners' processes that completed an iteration are named
    (``joined``): the survivors' steps, which go on without them, do not prove it. Only ranks placed on
    the status's node count: a node speaks for its own ranks (another node's status could otherwise
    confirm a restart, reset a restart budget or confirm a suspicion for a task it does not host)."""
    best: dict[str, int] = {}
    proven: set[str] = set()  # tasks with a process of the pending restart that completed an iteration
    joined: dict[str, list[int]] = {}
    for r in status.ranks:
        entry = state.tasks.get(r.task)
        if entry is None or r.step is None or r.generation != entry.generation:
            continue
        if r.rank not in entry.ranks_on(status.node):
            continue
        # a joiner launched before a restart that superseded its grow still proves its own joining
        if (r.advanced and entry.joiners and r.membership_epoch >= entry.joining_since
                and r.rank in _pending_joiners(entry)):
            joined.setdefault(r.task, []).append(r.rank)
            best[r.task] = max(r.step, best.get(r.task, -1))
        epoch = _pending_restart(entry)
        if epoch is not None and r.restart_epoch < epoch:
            continue
        best[r.task] = max(r.step, best.get(r.task, -1))
        if epoch is not None and r.advanced:
            proven.add(r.task)
    out = []
    for task, step in sorted(best.items()):
        entry = state.tasks[task]
        ranks = tuple(sorted(joined.get(task, ())))
        if task in proven:
            out.append(d.ProgressMade(ts=ts, task=task, step=step, generation=entry.generation,
                                      restart_epoch=entry.restart_epoch, joined=ranks))
        elif ranks or step > seen.get((task, entry.generation), -1):
            out.append(d.ProgressMade(ts=ts, task=task, step=step, generation=entry.generation, joined=ranks))
    return out


def _applied(tr: TaskResult | None, entry: d.TaskEntry, kind: d.ActionKind) -> bool:
    """Whether the agent's result is about the task's outstanding action (same coordinates)."""
    if tr is None or tr.generation != entry.generation:
        return False
    if kind is d.ActionKind.RESTART:
        return tr.restart_epoch >= entry.restart_epoch
    if kind is d.ActionKind.REATTEMPT:
        return tr.regroup_epoch >= entry.regroup_epoch
    if kind is d.ActionKind.RESIZE:
        return tr.membership_epoch >= entry.membership_epoch
    return True


def _running(tr: TaskResult | None, ranks: Collection[int]) -> bool:
    return tr is not None and all(tr.ranks.get(str(r)) == "running" for r in ranks)


def outcomes(
    result: AssignmentResult, latest: Mapping[str, AssignmentResult], state: d.CoreState, ts: float
) -> list[d.ActionSucceeded | d.ActionFailed]:
    """The action outcomes one node's reconcile result shows.

    A failed reconcile fails the outstanding action of each task of the node that it left without its
    ranks running at the action's coordinates. Where the agent says the task's command could not be
    executed (``TaskResult.cannot_start``), the failure is the task's (``FailureCause.TASK``: it fails
    at once with the reason, no node blamed); otherwise the failure names the node only when the
    action is for it (``Outstanding.node``), and the core's restart budget ends a task that cannot run
    anywhere, without isolating healthy nodes. An assignment succeeds once every node of
    its placement runs its ranks at the new generation (``latest``: each node's newest result,
    ``result`` included). Restarts and reattempts are confirmed by progress, not here: a relaunched
    process that runs is not yet a recovered task.
    """
    out: list[d.ActionSucceeded | d.ActionFailed] = []
    for name, entry in sorted(state.tasks.items()):
        o = entry.outstanding
        if o is None or entry.phase not in d.ACTIVE_PHASES or result.node not in entry.placement:
            continue
        tr = result.tasks.get(name)
        here = entry.ranks_on(result.node)
        if not result.ok and _applied(tr, entry, o.kind) and not _running(tr, here):
            # A command the OS refused to execute is the task's fault; anything else may be the node's.
            cause = d.FailureCause.TASK if tr is not None and tr.cannot_start else d.FailureCause.NODE
            # the node is named only when the action is for it: a survivor's failed reconcile during a
            # grow, or one node's during a whole-task restart, blamed the node the action named
            out.append(d.ActionFailed(ts=ts, action_id=o.action_id, cause=cause,
                                      node=result.node if result.node == o.node else None,
                                      reason=f"node {result.node}: {result.detail}"))
            continue
        if o.kind is not d.ActionKind.ASSIGN:
            continue
        if all(
            (r := latest.get(node)) is not None
            and _applied(t := r.tasks.get(name), entry, o.kind)
            and _running(t, ranks)
            for node, ranks in entry.placement.items()
        ):
            out.append(d.ActionSucceeded(ts=ts, action_id=o.action_id))
    return out


def ended(statuses: Mapping[str, NodeStatus], state: d.CoreState,
          ts: float, changed: str | None = None) -> list[d.TaskFinished | d.TaskStopped]:
    """Tasks every rank of which exited with returncode 0, on its own, at the current generation:
    finished, unless a rank said it stopped before its end (a SIGTERM nobody in Unicron sent: the
    ranks stopped work-conservingly, and the task is to go on from their snapshot).

    ``changed``: the node whose status just arrived; only its tasks can have ended with it, and its own
    ranks are looked at first. Scanning every node of every task for each of the 1,000 statuses a
    second was 45 % of the coordinator's loop at 1,000 nodes."""
    out: list[d.TaskFinished | d.TaskStopped] = []
    for name, entry in sorted(state.tasks.items()):
        if entry.phase not in d.ACTIVE_PHASES or not entry.placement:
            continue
        if changed is not None and changed not in entry.placement:
            continue
        exits = _all_exits_ok(statuses, name, entry, first=changed)
        if exits is None:
            continue
        stops = sorted((r.stopped_at, r.rank) for r in exits if r.stopped_at is not None)
        if not stops:
            out.append(d.TaskFinished(ts=ts, task=name))
            continue
        step, rank = stops[0]
        out.append(d.TaskStopped(ts=ts, task=name, step=step,
                                 reason=f"rank {rank} stopped at iteration {step} on a SIGTERM Unicron did not send"))
    return out


def _all_exits_ok(statuses: Mapping[str, NodeStatus], task: str, entry: d.TaskEntry,
                  first: str | None) -> list[RankStatus] | None:
    """Every rank of the task's placement if all exited 0 unasked, else None; node ``first`` is looked
    at first and the scan stops at the first node that says no."""
    out: list[RankStatus] = []
    for node in sorted(entry.placement, key=lambda n: n != first):
        here = _exits_ok(statuses.get(node), task, entry.generation, entry.placement[node])
        if here is None:
            return None
        out += here
    return out


def _exits_ok(status: NodeStatus | None, task: str, generation: int,
              ranks: Collection[int]) -> list[RankStatus] | None:
    """The node's ``ranks`` of the task's generation if every one exited 0 unasked, else None."""
    if status is None or not ranks:
        return None
    by_rank = {r.rank: r for r in status.ranks if r.task == task and r.generation == generation}
    out = [r for rank in ranks if (r := by_rank.get(rank)) is not None
           and r.state == "exited" and r.returncode == 0 and not r.requested]
    return out if len(out) == len(ranks) else None


LEASE_EXPIRED = "agent lease expired"
NEVER_REGISTERED = "agent not registered since this coordinator took the lead"


def speaks_for(key_node: str, record_node: str, what: str) -> None:
    """A record under a node's key (``reports/<node>/``, ``results/<node>``, ``status/<node>``) is about
    that node. etcd's auth lets a node write only its own keys; the node named inside is the writer's
    word, so one node could otherwise report faults of another (and have it isolated), answer its
    actions or speak for its ranks. Raises
    InvalidRecord when they differ."""
    if record_node != key_node:
        raise InvalidRecord(f"a {what} under node {key_node!r}'s key names node {record_node!r}: "
                            "a node speaks only for itself")


def lease_gone(node: str, link_alive: bool, already_lost: bool, ts: float,
               reason: str = LEASE_EXPIRED) -> d.NodeLost | None:
    """A node's registration vanished. Not a loss while its heartbeat link still runs: after an etcd
    outage every agent's lease may expire before the agent reconnects, while the node is fine."""
    if link_alive or already_lost:
        return None
    return d.NodeLost(ts=ts, node=node, reason=reason)


def unregistered(state: d.CoreState, registered: Collection[str]) -> list[str]:
    """Nodes the state has in service that have no registration. A new leader's watch starts after what
    it reads: a node whose lease expired in between (its host died with the old leader's, a rack's
    power) sends no delete it could see, and its tasks would stay placed on it. A drained or isolated
    node is out of service already, and may well be down on purpose."""
    return sorted(n for n, e in state.nodes.items() if e.status is d.NodeState.UP and n not in registered)


def node_lost_report(node: str, reason: str, ts: float) -> Report:
    """The coordinator's own report of a node it lost (link silent or closed, or lease gone): a sev1
    ``lost_connection`` by Table 1, recorded as an incident like any agent's report."""
    return Report(method=DetectionMethod.NODE_HEALTH, kind=ErrorKind.LOST_CONNECTION, node=node,
                  message=reason, source_ts=ts, agent_ts=ts)


def rejoin(node: str, gpus: int, state: d.CoreState, ts: float) -> d.NodeJoined | None:
    """An agent registered. An isolated node stays out of service until an operator undrains it:
    a reconnect (after an etcd restart, say) is no repair."""
    entry = state.nodes.get(node)
    if entry is not None and entry.status is d.NodeState.ISOLATED:
        return None
    return d.NodeJoined(ts=ts, node=node, gpus=gpus)
