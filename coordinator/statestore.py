"""The decision state in etcd, written as what changed (issue 16 item 4).

The state was one JSON value written whole with every decision: 120 kB and ~8 ms of serialising at
1,000 nodes x 8 GPUs, for a decision that changed one node. Now ``state`` holds only the core's clock
and counter, each node entry is ``state/nodes/<node>`` and each task entry ``state/tasks/<task>``; a
decision writes the entries that differ from the last state *written* (not the last adopted: a quiet
tick or progress is adopted without a write, and its changes go out with the next write). A state
written whole by an older coordinator still loads (its entries are in the ``state`` value), and the
first write after loading it writes every entry.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from coordinator import decision as d
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.etcd import Store
from unicron.kernel.keyspace import Keyspace


def _changed(old: dict[str, Any] | None, new: dict[str, Any]) -> list[str]:
    if old is None:
        return sorted(new)
    return sorted(k for k, e in new.items() if (o := old.get(k)) is not e and o != e)


def state_writes(keys: Keyspace, written: d.CoreState | None, new: d.CoreState,
                 stored: Collection[str] = ()) -> tuple[dict[str, str], list[str]]:
    """The puts and deletes that turn the stored state ``written`` into ``new``. ``written`` None: what
    etcd holds is unknown (a new leader, or a state it could not read): every entry is written, and
    the entry keys ``stored`` there that ``new`` lacks are deleted (an unreadable one left behind made
    every later leader start afresh again)."""
    nodes = _changed(written.nodes if written else None, new.nodes)
    tasks = _changed(written.tasks if written else None, new.tasks)
    # the existing codec, on a state holding only the changed entries
    part = d.CoreState(now=new.now, counter=new.counter, nodes={n: new.nodes[n] for n in nodes},
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


def read_state(store: Store, keys: Keyspace) -> tuple[d.CoreState | None, bool]:
    """The stored state (None if there is none) and whether it was in the split form. Raises
    InvalidRecord when it cannot be read."""
    kv = store.get(keys.state())
    if kv is None:
        return None, False
    try:
        data = json.loads(kv.value)
        if not isinstance(data, dict):
            raise InvalidRecord("decision state: expected an object; delete the state key to start afresh")
        whole = bool(data.get("nodes")) or bool(data.get("tasks"))
        nodes, _ = store.get_prefix(keys.state_nodes())
        tasks, _ = store.get_prefix(keys.state_tasks())
        data["nodes"] = {**data.get("nodes", {}), **{keys.tail(kv.key, keys.state_nodes()): json.loads(kv.value)
                                                       for kv in nodes}}
        data["tasks"] = {**data.get("tasks", {}), **{keys.tail(kv.key, keys.state_tasks()): json.loads(kv.value)
                                                       for kv in tasks}}
    except (ValueError, AttributeError, TypeError) as exc:
        raise InvalidRecord(f"decision state: {exc}") from exc
    return d.CoreState.from_dict(data), not whole
