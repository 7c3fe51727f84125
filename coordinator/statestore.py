"""The decision state in etcd, written as what changed (issue 16 item 4).

The state was one JSON value written whole with every decision: 120 kB and ~8 ms of serialising at
1,000 nodes x 8 GPUs, for a decision that changed one node. Now ``state`` holds only the core's clock
and counter, each node entry is ``state/nodes/<node>`` and each task entry ``state/tasks/<task>``; a
decision writes the entries that differ from the last state *written* (not the last adopted: a quiet
tick or progress is adopted without a write, and its changes go out with the next write). A state
written whole by an older coordinator still loads (its entries are in the ``state`` value), and the
first write after loading it writes every entry.

Entries are read one by one: an entry this coordinator cannot read (damaged, or of a version whose
meaning it does not know) costs its own node or task, not the whole state. The reader once raised for
any of them, and a new leader then started afresh and stopped every task. Fields a newer coordinator
added to a task entry, its spec or its model are left out with a warning (as protobuf readers skip
unknown fields): during a rolling upgrade or a rollback the older leader keeps the task as it knows it.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, fields, replace
from typing import Any

from coordinator import decision as d
from coordinator.tasks import MODEL_FIELDS, SPEC_FIELDS
from unicron.kernel import jsontext
from unicron.kernel import log as ulog
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.etcd import Store
from unicron.kernel.keyspace import Keyspace

log = ulog.get(__name__)

_TASK_FIELDS = frozenset(f.name for f in fields(d.TaskEntry))


def _changed(old: dict[str, Any] | None, new: dict[str, Any]) -> list[str]:
    if old is None:
        return sorted(new)
    return sorted(k for k, e in new.items() if (o := old.get(k)) is not e and o != e)


def steps_only(old: d.CoreState, new: d.CoreState) -> bool:
    """Whether ``new`` differs from ``old`` only in the clock (and the GPU-hours run until it) and
    tasks' last steps (and the last report of a step rate that goes on measuring from the same first
    one): what a successor re-observes (the clock, the statuses' steps), so a decision that changed
    nothing else need not be written. Progress that also reset a restart budget or confirmed a suspicion must be: left unwritten,
    a new leader loaded the old restart count and suspect, and failed a healthy task or put back a node
    that should have stayed isolated. Entries are copied on write: one not touched is the same object."""
    if new.nodes.keys() != old.nodes.keys() or new.tasks.keys() != old.tasks.keys():
        return False
    if (new.retired_generation != old.retired_generation or new.failures != old.failures
            or new.idle_alerted != old.idle_alerted):
        return False
    if any((o := old.nodes[n]) is not e and o != e for n, e in new.nodes.items()):
        return False
    return all((was := old.tasks[t]) is e or replace(
        was, last_step=e.last_step, rate=e.rate if e.rate is not None and e.rate.same_window(was.rate) else was.rate,
    ) == e for t, e in new.tasks.items())


def state_writes(keys: Keyspace, written: d.CoreState | None, new: d.CoreState,
                 stored: Collection[str] = ()) -> tuple[dict[str, str], list[str]]:
    """The puts and deletes that turn the stored state ``written`` into ``new``. ``written`` None: what
    etcd holds is unknown (a new leader, or a state it could not read): every entry is written, and
    the entry keys ``stored`` there that ``new`` lacks are deleted (an unreadable one left behind made
    every later leader start afresh again)."""
    nodes = _changed(written.nodes if written else None, new.nodes)
    tasks = _changed(written.tasks if written else None, new.tasks)
    # the existing codec, on a state holding only the changed entries
    part = replace(new, nodes={n: new.nodes[n] for n in nodes},
                    tasks={t: new.tasks[t] for t in tasks}).to_dict()
    entries_n: dict[str, Any] = part.pop("nodes")  # type: ignore[assignment]
    entries_t: dict[str, Any] = part.pop("tasks")  # type: ignore[assignment]
    puts = {keys.state(): json.dumps({**part, "nodes": {}, "tasks": {}})}
    puts.update({keys.state_node(n): json.dumps(v) for n, v in entries_n.items()})
    puts.update({keys.state_task(t): json.dumps(v) for t, v in entries_t.items()})
    deletes: list[str] = []
    if written is not None:
        deletes += [keys.state_node(n) for n in sorted(set(written.nodes) - set(new.nodes))]
        deletes += [keys.state_task(t) for t in sorted(set(written.tasks) - set(new.tasks))]
    else:
        kept = {keys.state_node(n) for n in new.nodes} | {keys.state_task(t) for t in new.tasks}
        deletes += sorted(set(stored) - kept)
    return puts, deletes


def stored_entries(store: Store, keys: Keyspace) -> list[str]:
    """The keys of every state entry etcd holds, readable or not."""
    return [kv.key for prefix in (keys.state_nodes(), keys.state_tasks()) for kv in store.get_prefix(prefix)[0]]


@dataclass(frozen=True)
class Unreadable:
    """A stored state entry that could not be read: left out of the state."""

    key: str
    error: str
    value: str


def _known_fields(entry: object) -> tuple[object, list[str]]:
    """A task entry without the fields this version does not know (its own, its spec's, its model's),
    and their names."""
    if not isinstance(entry, dict):
        return entry, []
    out = {k: v for k, v in entry.items() if k in _TASK_FIELDS}
    dropped = sorted(set(entry) - _TASK_FIELDS)
    spec = out.get("spec")
    if isinstance(spec, dict):
        out["spec"] = {k: v for k, v in spec.items() if k in SPEC_FIELDS}
        dropped += [f"spec.{k}" for k in sorted(set(spec) - SPEC_FIELDS)]
        model = spec.get("model")
        if isinstance(model, dict):
            out["spec"]["model"] = {k: v for k, v in model.items() if k in MODEL_FIELDS}
            dropped += [f"spec.model.{k}" for k in sorted(set(model) - MODEL_FIELDS)]
    return out, dropped


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def read_state(store: Store, keys: Keyspace) -> tuple[d.CoreState | None, bool, list[Unreadable]]:
    """The stored state (None if there is none), whether it was in the split form, and the entries
    left out of it because they could not be read. Raises InvalidRecord when the state's own record
    (clock and counter) cannot be read."""
    kv = store.get(keys.state())
    if kv is None:
        return None, False, []
    try:
        top = jsontext.parse(kv.value, "decision state")
    except InvalidRecord as exc:
        raise InvalidRecord(f"{exc}; delete the state key to start afresh") from exc
    if not isinstance(top, dict):
        raise InvalidRecord("decision state: expected an object; delete the state key to start afresh")
    inline = {kind: top.get(kind) or {} for kind in ("nodes", "tasks")}
    state = d.CoreState.from_dict({**top, "nodes": {}, "tasks": {}})
    unreadable: list[Unreadable] = []
    for kind, prefix in (("nodes", keys.state_nodes()), ("tasks", keys.state_tasks())):
        if not isinstance(inline[kind], dict):
            raise InvalidRecord(f"decision state: {kind}: expected an object; delete the state key to start afresh")
        # name -> (key, stored text): the entries written whole by an older coordinator, then split ones
        raw: dict[str, tuple[str, str]] = {name: (keys.state(), json.dumps(e)) for name, e in inline[kind].items()}
        raw.update({keys.tail(e.key, prefix): (e.key, _text(e.value)) for e in store.get_prefix(prefix)[0]})
        for name, (key, text) in sorted(raw.items()):
            try:
                entry = jsontext.parse(text, key)
                if kind == "tasks":
                    entry, dropped = _known_fields(entry)
                    if dropped:
                        log.warning("state entry has fields this version does not know; left out", key=key,
                                    fields=dropped)
                one = d.CoreState.from_dict({"now": state.now, "counter": state.counter, "nodes": {}, "tasks": {},
                                             kind: {name: entry}})
            except (InvalidRecord, ValueError) as exc:
                unreadable.append(Unreadable(key, str(exc), text))
                continue
            getattr(state, kind).update(getattr(one, kind))
    _stand_in_for_placed_nodes(state)
    whole = bool(inline["nodes"]) or bool(inline["tasks"])
    return state, not whole, unreadable


def _stand_in_for_placed_nodes(state: d.CoreState) -> None:
    """An entry for every node a task is placed on that has none (its entry was unreadable): the core
    takes a node it has no entry for as one that never joined, so that node's loss before it
    re-registers would be ignored and the task left running on a dead host. In service (an active
    task's placement names only nodes in service) with as many GPUs as its ranks use; its registration corrects
    the count, and an operator's drain read from its lost entry is not restored."""
    used: dict[str, int] = {}
    for entry in state.tasks.values():
        if entry.phase not in d.ACTIVE_PHASES:
            continue
        for node, ranks in entry.placement.items():  # not ``relaunching``: it may name a lost node
            used[node] = used.get(node, 0) + len(ranks)
    for node, gpus in sorted(used.items()):
        if node not in state.nodes:
            log.warning("a task is placed on a node whose state entry is missing; assuming it in service",
                        node=node, gpus=gpus)
            state.nodes[node] = d.NodeEntry(max(gpus, 1), reason="state entry unreadable")
