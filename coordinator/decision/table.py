"""Figure 7 per task as an explicit table: ``TRANSITIONS[(phase, trigger)] -> (next phase, response)``.

The engine (:mod:`coordinator.decision.engine`) turns events into triggers, looks them up here and
carries out the response; a (phase, trigger) pair not listed is ignored.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from coordinator.decision.state import TaskPhase
from unicron.kernel.types import Severity


class Trigger(enum.StrEnum):
    SEV3 = "sev3"  # a sev3 incident names one of the task's ranks / nodes
    # a sev3 from a survivor of an in-place resize, in the iteration that was in flight when it removed peers
    RESIZE_ECHO = "resize_echo"
    SEV2 = "sev2"
    PEER_DIED = "peer_died"  # during a restart: a rank's process died that the restart does not relaunch
    # a sev2 from a process of an Assign not yet confirmed (the launch failed there), or a process that
    # died during an in-place resize: no consequence of it, relaunched
    LAUNCH_FAULT = "launch_fault"
    # during a restart: a process the restart launched died (it is no consequence of the fault it recovers)
    RESTART_DIED = "restart_died"
    TASK_FAULT = "task_fault"  # a sev2 / sev3 incident on a task whose recovery is "restart" (all ranks)
    SEV1 = "sev1"  # a node the task has ranks on was isolated or lost
    ACTION_OK = "action_ok"  # the task's outstanding action was confirmed
    ACTION_FAILED = "action_failed"  # ... failed, or missed its deadline
    TASK_ERROR = "task_error"  # ... failed through the task's own fault (its command cannot run)
    PROGRESS = "progress"  # the task advanced under its current configuration: the recovery worked
    REATTEMPTS_SPENT = "reattempts_spent"  # a reattempt was due but the incident's reattempts are spent
    NO_PROGRESS = "no_progress"  # a restart was due but the restart budget is spent
    RESIZED = "resized"  # a reconfiguration gave the task a different placement (or a fresh one)
    # ... a different data-parallel size that keeps its layout and a complete replica: no rank stops
    RESIZED_IN_PLACE = "resized_in_place"
    # the task's store sidecar died on a node still in service: the same membership on a fresh store
    STORE_LOST = "store_lost"
    UNPLACED = "unplaced"  # a reconfiguration gave the task no GPUs
    FINISHED = "finished"
    # every rank stopped before the task's end, unasked, or a node's fence killed its ranks: the generation
    # cannot go on (a fenced node's peers were fenced too, or wait on its dead ranks and store)
    STOPPED = "stopped"
    CANCELLED = "cancelled"
    # the user replaced the task's spec with one its running ranks cannot take (command, env, layout)
    UPDATED = "updated"
    # the launch of an updated spec failed through the task's own fault (its new command cannot start),
    # or one of its processes failed, before that spec completed a step: the update failed, not the job
    UPDATE_FAILED = "update_failed"


class Response(enum.StrEnum):
    MERGE = "merge"  # nothing: the incident is a consequence of the recovery under way
    REATTEMPT = "reattempt"  # emit Reattempt
    RESTART = "restart"  # emit RestartRanks on the faulty node
    RESTART_ALL = "restart_all"  # emit RestartTask: every rank of the task, on every node, relaunched
    RECONFIGURE = "reconfigure"  # the node is isolated already: re-plan with this task forced to move
    ESCALATE = "escalate"  # failed restart -> sev1: isolate the restart's node, re-plan
    REASSIGN = "reassign"  # failed assignment: isolate the node it failed on (if known), re-plan
    ASSIGN = "assign"  # emit Assign with the new placement
    RESIZE = "resize"  # emit ResizeInPlace: survivors keep running, joiners join, leavers leave
    STOP = "stop"  # emit StopTask; the task waits for GPUs
    RECOVERED = "recovered"  # clear the outstanding action
    FAIL = "fail"  # emit StopTask + MarkTaskFailed + Alert; its GPUs go to the others
    RELAUNCH = "relaunch"  # nothing runs: re-plan with this task forced to a new generation (no in-place)
    RELEASE = "release"  # finished: its GPUs go to the others
    STOP_RELEASE = "stop_release"  # cancelled while holding GPUs: emit StopTask, GPUs go to the others
    WITHDRAW = "withdraw"  # cancelled while pending: nothing to stop
    # a new spec: re-plan with this task forced to a new generation (no in-place), which stops the
    # running ranks with an on-demand snapshot and launches the new command from it; no budget spent
    RELAUNCH_UPDATED = "relaunch_updated"
    # back to the spec the task ran with before the update, relaunched as a new generation from the
    # update's snapshot (which that spec's command restores), with an Alert; no budget spent
    ROLLBACK = "rollback"



_P = TaskPhase
_T = Trigger
_R = Response

#: Figure 7 per task. A (phase, trigger) pair not listed is ignored (e.g. anything in a final phase).
TRANSITIONS: Mapping[tuple[TaskPhase, Trigger], tuple[TaskPhase, Response]] = MappingProxyType(
    {
        # pending
        (_P.PENDING, _T.RESIZED): (_P.RECONFIGURING, _R.ASSIGN),  # ⑥ launched
        (_P.PENDING, _T.CANCELLED): (_P.CANCELLED, _R.WITHDRAW),
        # running
        (_P.RUNNING, _T.RESIZE_ECHO): (_P.RUNNING, _R.MERGE),  # part of the resize already done
        (_P.RUNNING, _T.SEV3): (_P.REATTEMPTING, _R.REATTEMPT),  # ①
        (_P.RUNNING, _T.SEV2): (_P.RESTARTING, _R.RESTART),  # ②
        (_P.RUNNING, _T.SEV1): (_P.RECONFIGURING, _R.RECONFIGURE),  # ③
        # recovery "restart": a stock job cannot take a relaunched peer back, so every rank goes
        (_P.RUNNING, _T.TASK_FAULT): (_P.RESTARTING, _R.RESTART_ALL),
        (_P.RUNNING, _T.REATTEMPTS_SPENT): (_P.RESTARTING, _R.RESTART),  # no reattempts allowed: sev2
        (_P.RUNNING, _T.NO_PROGRESS): (_P.FAILED, _R.FAIL),
        (_P.RUNNING, _T.RESIZED): (_P.RECONFIGURING, _R.ASSIGN),  # ④ join / ⑤ finish / ⑥ launch elsewhere
        (_P.RUNNING, _T.RESIZED_IN_PLACE): (_P.RECONFIGURING, _R.RESIZE),  # ③ / ④ / ⑤ without a restart
        (_P.RUNNING, _T.STORE_LOST): (_P.RECONFIGURING, _R.RESIZE),  # a fresh store, nothing else changes
        (_P.RUNNING, _T.UNPLACED): (_P.PENDING, _R.STOP),
        (_P.RUNNING, _T.FINISHED): (_P.FINISHED, _R.RELEASE),
        (_P.RUNNING, _T.STOPPED): (_P.RECONFIGURING, _R.RELAUNCH),
        (_P.RUNNING, _T.CANCELLED): (_P.CANCELLED, _R.STOP_RELEASE),
        (_P.RUNNING, _T.UPDATED): (_P.RECONFIGURING, _R.RELAUNCH_UPDATED),
        # the updated spec's ranks started (the Assign confirmed) and one failed before any step
        (_P.RUNNING, _T.UPDATE_FAILED): (_P.RECONFIGURING, _R.ROLLBACK),
        # reattempting
        (_P.REATTEMPTING, _T.RESIZE_ECHO): (_P.REATTEMPTING, _R.MERGE),  # part of the resize already done
        (_P.REATTEMPTING, _T.SEV3): (_P.REATTEMPTING, _R.MERGE),
        (_P.REATTEMPTING, _T.SEV2): (_P.RESTARTING, _R.RESTART),
        (_P.REATTEMPTING, _T.SEV1): (_P.RECONFIGURING, _R.RECONFIGURE),
        (_P.REATTEMPTING, _T.ACTION_OK): (_P.RUNNING, _R.RECOVERED),
        (_P.REATTEMPTING, _T.PROGRESS): (_P.RUNNING, _R.RECOVERED),
        (_P.REATTEMPTING, _T.ACTION_FAILED): (_P.REATTEMPTING, _R.REATTEMPT),  # again, while reattempts last
        (_P.REATTEMPTING, _T.REATTEMPTS_SPENT): (_P.RESTARTING, _R.RESTART),  # upgraded to sev2
        (_P.REATTEMPTING, _T.NO_PROGRESS): (_P.FAILED, _R.FAIL),
        (_P.REATTEMPTING, _T.TASK_ERROR): (_P.FAILED, _R.FAIL),  # no retry, no node isolated
        (_P.REATTEMPTING, _T.UPDATE_FAILED): (_P.RECONFIGURING, _R.ROLLBACK),  # the job goes on as before
        (_P.REATTEMPTING, _T.RESIZED): (_P.RECONFIGURING, _R.ASSIGN),
        (_P.REATTEMPTING, _T.RESIZED_IN_PLACE): (_P.RECONFIGURING, _R.RESIZE),
        (_P.REATTEMPTING, _T.STORE_LOST): (_P.RECONFIGURING, _R.RESIZE),
        (_P.REATTEMPTING, _T.UNPLACED): (_P.PENDING, _R.STOP),
        (_P.REATTEMPTING, _T.FINISHED): (_P.FINISHED, _R.RELEASE),
        (_P.REATTEMPTING, _T.STOPPED): (_P.RECONFIGURING, _R.RELAUNCH),
        (_P.REATTEMPTING, _T.CANCELLED): (_P.CANCELLED, _R.STOP_RELEASE),
        (_P.REATTEMPTING, _T.UPDATED): (_P.RECONFIGURING, _R.RELAUNCH_UPDATED),
        # restarting
        (_P.RESTARTING, _T.RESIZE_ECHO): (_P.RESTARTING, _R.MERGE),  # part of the resize already done
        (_P.RESTARTING, _T.SEV3): (_P.RESTARTING, _R.MERGE),
        (_P.RESTARTING, _T.SEV2): (_P.RESTARTING, _R.MERGE),
        # A dead process is no consequence a restart absorbs: widen the restart to relaunch it too
        # (issue #19 item 1: merged, the other node's rank 0 was never relaunched and the task hung).
        (_P.RESTARTING, _T.PEER_DIED): (_P.RESTARTING, _R.RESTART),
        # every rank is relaunched already: the peers' crashes are the first failure's consequence
        (_P.RESTARTING, _T.TASK_FAULT): (_P.RESTARTING, _R.MERGE),
        # the restart failed, as at its deadline but without waiting for it: merged, a restarted task
        # whose other ranks went on making steps confirmed it with this rank dead and never relaunched it
        (_P.RESTARTING, _T.RESTART_DIED): (_P.RECONFIGURING, _R.ESCALATE),
        (_P.RESTARTING, _T.NO_PROGRESS): (_P.FAILED, _R.FAIL),
        (_P.RESTARTING, _T.SEV1): (_P.RECONFIGURING, _R.RECONFIGURE),
        (_P.RESTARTING, _T.ACTION_OK): (_P.RUNNING, _R.RECOVERED),
        (_P.RESTARTING, _T.PROGRESS): (_P.RUNNING, _R.RECOVERED),
        (_P.RESTARTING, _T.ACTION_FAILED): (_P.RECONFIGURING, _R.ESCALATE),  # upgraded to sev1
        (_P.RESTARTING, _T.TASK_ERROR): (_P.FAILED, _R.FAIL),  # no retry, no node isolated
        (_P.RESTARTING, _T.UPDATE_FAILED): (_P.RECONFIGURING, _R.ROLLBACK),  # the job goes on as before
        (_P.RESTARTING, _T.RESIZED): (_P.RECONFIGURING, _R.ASSIGN),
        (_P.RESTARTING, _T.UNPLACED): (_P.PENDING, _R.STOP),
        (_P.RESTARTING, _T.FINISHED): (_P.FINISHED, _R.RELEASE),
        (_P.RESTARTING, _T.STOPPED): (_P.RECONFIGURING, _R.RELAUNCH),
        (_P.RESTARTING, _T.CANCELLED): (_P.CANCELLED, _R.STOP_RELEASE),
        (_P.RESTARTING, _T.UPDATED): (_P.RECONFIGURING, _R.RELAUNCH_UPDATED),
        # reconfiguring
        (_P.RECONFIGURING, _T.RESIZE_ECHO): (_P.RECONFIGURING, _R.MERGE),  # part of the resize already done
        (_P.RECONFIGURING, _T.SEV3): (_P.RECONFIGURING, _R.MERGE),
        (_P.RECONFIGURING, _T.SEV2): (_P.RECONFIGURING, _R.MERGE),
        # merged, it waited out the Assign's deadline (300 s) with the rank dead; a resize's was confirmed
        # by the survivors' steps and its rank never relaunched
        (_P.RECONFIGURING, _T.LAUNCH_FAULT): (_P.RESTARTING, _R.RESTART),
        (_P.RECONFIGURING, _T.TASK_FAULT): (_P.RECONFIGURING, _R.MERGE),
        (_P.RECONFIGURING, _T.SEV1): (_P.RECONFIGURING, _R.RECONFIGURE),
        (_P.RECONFIGURING, _T.ACTION_OK): (_P.RUNNING, _R.RECOVERED),
        (_P.RECONFIGURING, _T.PROGRESS): (_P.RUNNING, _R.RECOVERED),
        (_P.RECONFIGURING, _T.ACTION_FAILED): (_P.RECONFIGURING, _R.REASSIGN),
        (_P.RECONFIGURING, _T.NO_PROGRESS): (_P.FAILED, _R.FAIL),
        (_P.RECONFIGURING, _T.TASK_ERROR): (_P.FAILED, _R.FAIL),  # no retry, no node isolated
        (_P.RECONFIGURING, _T.UPDATE_FAILED): (_P.RECONFIGURING, _R.ROLLBACK),  # the job goes on as before
        (_P.RECONFIGURING, _T.RESIZED): (_P.RECONFIGURING, _R.ASSIGN),
        # only while no Assign is out (the engine checks): its ranks may not run yet
        (_P.RECONFIGURING, _T.RESIZED_IN_PLACE): (_P.RECONFIGURING, _R.RESIZE),
        (_P.RECONFIGURING, _T.STORE_LOST): (_P.RECONFIGURING, _R.RESIZE),  # as above: no Assign out
        (_P.RECONFIGURING, _T.UNPLACED): (_P.PENDING, _R.STOP),
        (_P.RECONFIGURING, _T.FINISHED): (_P.FINISHED, _R.RELEASE),
        (_P.RECONFIGURING, _T.STOPPED): (_P.RECONFIGURING, _R.RELAUNCH),
        (_P.RECONFIGURING, _T.CANCELLED): (_P.CANCELLED, _R.STOP_RELEASE),
        (_P.RECONFIGURING, _T.UPDATED): (_P.RECONFIGURING, _R.RELAUNCH_UPDATED),
    }
)

#: A response that spends a budget, and the trigger that replaces it once the budget is spent
#: (looked up again from the same phase).
BUDGETED: Mapping[Response, Trigger] = MappingProxyType(
    {
        _R.REATTEMPT: _T.REATTEMPTS_SPENT,
        _R.RESTART: _T.NO_PROGRESS,
        _R.RESTART_ALL: _T.NO_PROGRESS,
        _R.ESCALATE: _T.NO_PROGRESS,
        _R.REASSIGN: _T.NO_PROGRESS,
        _R.RELAUNCH: _T.NO_PROGRESS,
    }
)

SEVERITY_TRIGGER: Mapping[Severity, Trigger] = MappingProxyType(
    {Severity.SEV1: _T.SEV1, Severity.SEV2: _T.SEV2, Severity.SEV3: _T.SEV3}
)
