"""Random event histories through the decision core and the executor, as the daemon drives them, with
the invariants checked after every event (a review's fuzzer, made a seeded test): no rank on a node out
of service, no node or GPU index over-committed, the executor's records equal to the core's placements,
every record surviving a JSON round trip, a stale input and a new leader deciding as nothing / the same.
"""

from __future__ import annotations

import json
import random

import pytest

from coordinator import decision as d
from coordinator.causes import classify
from coordinator.tasks import TaskSpec, parse_task_spec
from tests.coordinator.test_executor import Driven
from unicron.kernel.types import DetectionMethod as M
from unicron.kernel.types import ErrorKind as K
from unicron.kernel.types import Report, Severity

KINDS = [(M.EXCEPTION_PROPAGATION, K.CONNECTION_REFUSED_RESET), (M.PROCESS_SUPERVISION, K.EXITED_ABNORMALLY),
         (M.EXCEPTION_PROPAGATION, K.ECC_ERROR), (M.STATISTICAL_MONITORING, K.TASK_HANG),
         (M.NODE_HEALTH, K.LOST_CONNECTION), (M.PROCESS_SUPERVISION, K.FENCED), (M.EXCEPTION_PROPAGATION, K.CUDA_ERROR)]
NODES = ("n0", "n1", "n2", "n3")


def _spec(rng: random.Random, name: str) -> TaskSpec:
    tp = rng.choice([1, 1, 2])
    least = tp * rng.choice([1, 2, 4])
    fields: dict[str, object] = {"name": name, "command": ["python", "x.py"], "tp_size": tp,
                                 "recovery": rng.choice(["inprocess", "restart"]), "min_gpus": least}
    if rng.random() < 0.5:
        fields["max_gpus"] = least * rng.choice([1, 2, 4])
    return parse_task_spec(fields, None)


class History(Driven):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.ids: list[str] = ["a0"]

    def event(self) -> d.Event:
        rng, st = self.rng, self.state
        t = self.ts(rng.choice([0.5, 1, 1, 5, 40, 130, 310]))
        nodes, tasks, roll = sorted(st.nodes), sorted(st.tasks), rng.random()
        if roll < 0.12 or not nodes:
            return d.NodeJoined(ts=t, node=rng.choice(NODES), gpus=rng.choice([8, 8, 4]))
        if roll < 0.2 or not tasks:
            return d.TaskSubmitted(ts=t, spec=_spec(rng, rng.choice("abc")))
        if roll < 0.25:
            node = rng.choice(nodes)
            operator: list[d.Event] = [d.NodeLost(ts=t, node=node, reason="x"), d.NodeDrained(ts=t, node=node),
                                       d.NodeUndrained(ts=t, node=node)]
            return rng.choice(operator)
        name = rng.choice(tasks)
        e = st.tasks[name]
        if roll < 0.28:
            user: list[d.Event] = [d.TaskFinished(ts=t, task=name), d.TaskCancelled(ts=t, task=name),
                                   d.TaskStopped(ts=t, task=name, step=3, reason="x"),
                                   d.TaskUpdated(ts=t, spec=_spec(rng, name))]
            return rng.choice(user)
        if roll < 0.55:
            method, kind = rng.choice(KINDS)
            node = rng.choice(sorted(e.placement) or nodes)
            report = Report(method=method, kind=kind, node=node, task=rng.choice([name, name, None]),
                            rank=rng.choice([*e.placement.get(node, [0]), None]), source_ts=t, agent_ts=t,
                            step=rng.choice([None, e.last_step, (e.last_step or 0) + rng.randint(0, 3)]))
            return d.IncidentRaised(ts=t, incident=classify(report, detected_ts=t, incident_id=f"i{len(self.events)}"),
                                    generation=rng.choice([e.generation, e.generation, e.generation - 1, None]),
                                    restart_epoch=rng.choice([None, e.restart_epoch, e.relaunch_epoch, e.restart_epoch - 1]))
        if roll < 0.78:
            o = e.outstanding
            action_id = o.action_id if o is not None and rng.random() < 0.85 else rng.choice(self.ids)
            where = rng.choice([None, *(o.waiting if o else []), *nodes])
            if rng.random() < 0.6:
                return d.ActionSucceeded(ts=t, action_id=action_id, node=where)
            return d.ActionFailed(ts=t, action_id=action_id, reason="r", node=where,
                                  cause=rng.choice([d.FailureCause.NODE, d.FailureCause.NODE, d.FailureCause.TASK]))
        if roll < 0.95:
            return d.ProgressMade(ts=t, task=name, step=(e.last_step or 0) + rng.choice([-2, 0, 1, 1, 2]),
                                  generation=rng.choice([e.generation, e.generation, e.generation - 1, None]),
                                  restart_epoch=rng.choice([None, e.restart_epoch]),
                                  joined=tuple(x for x in e.joiners if rng.random() < 0.7))
        return d.Tick(ts=t)

    def step(self) -> None:
        old = self.state
        before = old.to_dict()
        event = self.event()
        new, actions = self.core.handle(old, event)
        for item in (event, *actions):
            assert d.from_dict(json.loads(json.dumps(d.to_dict(item)))) == item, "codec round trip"
        if _stale(old, event):  # decides what a Tick at its time decides
            assert self.core.handle(old, d.Tick(ts=event.ts)) == (new, actions), f"stale {event} changed something"
        resumed = d.CoreState.from_dict(json.loads(json.dumps(before)))
        assert self.core.handle(resumed, event) == (new, actions), "a new leader decides differently"
        assert old.to_dict() == before, "the input state was modified"
        self.feed(event)
        assert self.state == new
        self.ids += [a.action_id for a in actions]
        self.check()

    def check(self) -> None:
        st = self.state
        assert d.CoreState.from_dict(json.loads(json.dumps(st.to_dict()))) == st, "state round trip"
        used: dict[str, int] = {}
        for name, e in st.tasks.items():
            if e.phase not in d.ACTIVE_PHASES or e.phase is d.TaskPhase.PENDING:
                assert not e.placement, f"{name} {e.phase} placed"
            if e.phase not in d.ACTIVE_PHASES:
                assert e.outstanding is None, f"{name} {e.phase} has an action out"
            if e.phase in (d.TaskPhase.REATTEMPTING, d.TaskPhase.RESTARTING, d.TaskPhase.RECONFIGURING):
                assert e.outstanding is not None, f"{name} {e.phase} waits for nothing"
            if e.outstanding is not None:
                assert e.outstanding.deadline > st.now, f"{name}: an action out past its deadline"
            ranks = e.all_ranks()
            assert len(set(ranks)) == len(ranks) and all(0 <= r < e.world_size for r in ranks), f"{name} {e.placement}"
            for node, on in e.placement.items():
                assert on and st.nodes[node].status is d.NodeState.UP, f"{name} placed on {node} {st.nodes[node]}"
                used[node] = used.get(node, 0) + len(on)
        assert all(n <= st.nodes[node].gpus for node, n in used.items()), f"over-committed: {used}"
        for node, records in self.executor.desired.items():
            gpus = [r.gpu for record in records.values() for r in record.ranks]
            count = st.nodes[node].gpus if node in st.nodes else 0
            assert len(set(gpus)) == len(gpus) and all(0 <= g < count for g in gpus), f"{node} ({count}): {gpus}"
            for name, record in records.items():
                want = st.tasks[name].placement.get(node, []) if name in st.tasks else []
                assert sorted(r.rank for r in record.ranks) == want, f"{node}/{name}: {record.ranks} != {want}"
                assert not want or record.generation == st.tasks[name].generation, f"{node}/{name} generation"
        for name, e in st.tasks.items():
            assert all(name in self.executor.desired.get(node, {}) for node in e.placement), f"no record of {name}"


def _stale(old: d.CoreState, event: d.Event) -> bool:
    """Whether ``event`` should change nothing: a result of no outstanding action, or an incident or
    step of an older generation (a sev1 is the node's, whatever the generation)."""
    if isinstance(event, d.ActionSucceeded | d.ActionFailed):
        return not any(e.outstanding and e.outstanding.action_id == event.action_id for e in old.tasks.values())
    if isinstance(event, d.IncidentRaised):
        entry, inc = old.tasks.get(event.incident.task or ""), event.incident
        return (entry is not None and event.generation is not None and event.generation < entry.generation
                and inc.severity is not None and inc.severity is not Severity.SEV1)
    if isinstance(event, d.ProgressMade):
        entry = old.tasks.get(event.task)
        return entry is not None and event.generation is not None and event.generation < entry.generation
    return False


@pytest.mark.parametrize("seed", range(10))
def test_random_histories_keep_the_core_and_the_executor_consistent(seed: int) -> None:
    history = History(seed)
    for _ in range(100):
        history.step()
