"""``unicron nodes``, ``unicron status`` and ``unicron incidents``: read the cluster's state from etcd.

They answer while no coordinator runs. ``nodes`` also asks the coordinator, briefly, for what only it
knows (whether a node is isolated or lost, and why) and says so on stderr when it cannot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from typing import Any

from unicron.cli.common import (
    add_cluster_flags,
    at_least,
    emit,
    one_line,
    open_store,
    read_json_prefix,
    tls_config,
)
from unicron.cli.tasks import ApiClient, api_flag, leader_api
from unicron.kernel.config import finite_float
from unicron.kernel.errors import PermanentError, UnicronError
from unicron.kernel.etcd import Store
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.proto import coordinator_pb2 as pb

NODE_COLUMNS = ("node", "state", "gpus", "backend", "unhealthy_gpus", "ranks", "agent_pid", "status_age_s",
                "reason")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("nodes", help="list the cluster's nodes, their state (up/drained/isolated/lost) and health")
    add_cluster_flags(p)
    p.add_argument("--api", default=os.environ.get("UNICRON_API") or None, metavar="HOST:PORT",
                   help="coordinator API address (env: UNICRON_API; default: from the leader key in etcd)")
    p.add_argument("--timeout", type=at_least(finite_float, 0.0, above=True), default=2.0, metavar="SECONDS",
                   help="how long to wait for the coordinator's view before showing etcd's alone (default 2)")
    p.set_defaults(func=cmd_nodes)
    p = sub.add_parser("status", help="show what each node runs (optionally one task)")
    add_cluster_flags(p)
    p.add_argument("task", nargs="?", help="only this task")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("incidents", help="list recorded incidents, newest last")
    add_cluster_flags(p)
    p.add_argument("--limit", type=at_least(int, 0), default=50, help="show at most this many (default 50; 0: all kept)")
    p.set_defaults(func=cmd_incidents)


def _epoch(value: Any) -> float | None:
    """A record's Unix timestamp; None (unknown) for one no clock writes. Any node may write its own
    status, and a huge integer there was an OverflowError traceback in float or datetime arithmetic."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        datetime.fromtimestamp(value, UTC)  # datetime's range: years 1 to 9999
    except (OverflowError, OSError, ValueError):  # ValueError: NaN
        return None
    return float(value)


def _when(value: Any, now: float | None = None) -> str:
    """A record's time (UTC) as the table shows it: the date only when it is not today's, so that on a
    run of weeks yesterday's incident does not read as one from an hour ago."""
    ts = _epoch(value)
    if ts is None:
        return ""
    when, today = datetime.fromtimestamp(ts, UTC), datetime.fromtimestamp(time.time() if now is None else now, UTC)
    return when.strftime("%H:%M:%S.%f" if when.date() == today.date() else "%Y-%m-%dT%H:%M:%S.%f")[:-3]


def coordinator_nodes(args: argparse.Namespace, store: Store, keys: Keyspace) -> dict[str, dict[str, Any]]:
    """The coordinator's view of each node (state, reason, gpus), by name. Raises UnicronError."""
    api = api_flag(args)
    resolve = (lambda: api) if api is not None else (lambda: leader_api(store, keys))
    reply = ApiClient(resolve, args.timeout, follow=False, tls_config=tls_config(args)).call(
        "ListNodes", pb.ListNodesRequest())
    nodes = (json.loads(n) for n in reply.node_json)
    return {str(n["node"]): n for n in nodes if isinstance(n, dict) and "node" in n}


def cmd_nodes(args: argparse.Namespace) -> int:
    """Registrations and health from etcd, merged with the coordinator's state and reason per node.

    A node can be isolated while its agent is registered and healthy, and lost while the coordinator
    still counts it, so neither view alone says what the scheduler does with a node.
    """
    api_flag(args)  # a malformed --api is the user's error, not a coordinator that did not answer
    store, keys = open_store(args)
    try:
        statuses = {k.rsplit("/", 1)[-1]: v for k, v in read_json_prefix(store, keys.statuses())}
        drained = {k.rsplit("/", 1)[-1] for k, _ in read_json_prefix(store, keys.drains())}
        registered = {k.rsplit("/", 1)[-1]: v for k, v in read_json_prefix(store, keys.nodes())}
        try:
            seen: dict[str, dict[str, Any]] | None = coordinator_nodes(args, store, keys)
        except UnicronError as exc:
            print(f"unicron nodes: the coordinator did not answer, so STATE shows only registrations and "
                  f"drains, not isolation or loss ({one_line(str(exc))})", file=sys.stderr)
            seen = None
    finally:
        store.close()
    rows = []
    for node in sorted(set(registered) | set(seen or {})):
        info, st, coord = registered.get(node, {}), statuses.get(node, {}), (seen or {}).get(node)
        if coord is not None:
            state, reason = str(coord.get("state", "unknown")), str(coord.get("reason") or "")
        else:
            # not (yet) seen by the coordinator, or no coordinator to ask
            state, reason = ("drained" if node in drained else "unknown"), ""
        bad = [h.get("gpu") for h in _entries(st.get("gpu_health")) if not h.get("ok", True)]
        rows.append({
            "node": node, "state": state, "reason": reason, "registered": node in registered,
            "gpus": info.get("gpus", coord.get("gpus") if coord else None), "backend": info.get("gpu_backend"),
            "agent_pid": info.get("agent_pid"), "unhealthy_gpus": ",".join(map(str, bad)) or "-",
            "ranks": len(_entries(st.get("ranks"))),
            "status_age_s": round(time.time() - ts, 1) if (ts := _epoch(st.get("ts"))) is not None else None,
        })
    return emit(args, rows, NODE_COLUMNS)


def cmd_status(args: argparse.Namespace) -> int:
    store, keys = open_store(args)
    try:
        statuses = read_json_prefix(store, keys.statuses())
        # a mistyped or retired task name read as a task with no ranks, exit 0: a script polling it never knew
        known = not args.task or store.get(keys.task(args.task)) is not None
    finally:
        store.close()
    rows = []
    for _, st in statuses:
        for r in _entries(st.get("ranks")):
            if args.task and r.get("task") != args.task:
                continue
            rows.append({"node": st.get("node"), "task": r.get("task"), "rank": r.get("rank"),
                         "pid": r.get("pid"), "state": r.get("state"), "step": r.get("step"),
                         # the rank's own: a node runs ranks of several tasks and generations
                         "generation": r.get("generation")})
    rows.sort(key=lambda r: (str(r["task"]), r["rank"] if isinstance(r["rank"], int) else -1))
    if not rows and not known:
        raise PermanentError(f"no task named {args.task!r} in etcd, and no ranks of it (a cancelled or retired "
                             "task has no record; see 'unicron tasks')")
    return emit(args, rows, ["task", "rank", "node", "pid", "state", "step", "generation"])


def cmd_incidents(args: argparse.Namespace) -> int:
    store, keys = open_store(args)
    try:
        items = [v for _, v in read_json_prefix(store, keys.incidents())]
    finally:
        store.close()
    items.sort(key=lambda i: _epoch(i.get("detected_ts")) or 0.0)
    items = items[-args.limit:] if args.limit > 0 else items
    if args.json:
        return emit(args, items, [])
    rows = [{
        "detected": _when(i.get("detected_ts")), "severity": (f"sev{i['severity']}" if i.get("severity") else "info") + (" handled" if i.get("handled") else ""),
        "kind": i.get("kind"), "node": i.get("node"), "task": i.get("task"), "rank": i.get("rank"),
        "gpu": i.get("gpu"),
        "latency_ms": round(1000 * (detected - source), 1)
        if (detected := _epoch(i.get("detected_ts"))) is not None and (source := _epoch(i.get("source_ts"))) is not None
        else None,
        "action": i.get("action") or "-",
        "transition_s": _seconds(i.get("transition_s")), "sub_healthy_s": _seconds(i.get("sub_healthy_s")),
        "message": str(i.get("message", ""))[:60],
    } for i in items]
    return emit(args, rows, ["detected", "severity", "kind", "node", "task", "rank", "gpu", "latency_ms", "action",
                             "transition_s", "sub_healthy_s", "message"])


def _entries(value: Any) -> list[dict[str, Any]]:
    """The objects in a record's list field; anything else (a damaged or foreign record) as no entries."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _seconds(value: Any) -> float | str:
    """A recovery-cost term: "-" while unknown (recovery still going on, or none needed)."""
    return round(value, 2) if isinstance(value, int | float) else "-"
