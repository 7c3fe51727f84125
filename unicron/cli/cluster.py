"""``unicron nodes``, ``unicron status`` and ``unicron incidents``: read the cluster's state from etcd."""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime
from typing import Any

from unicron.cli.common import add_cluster_flags, emit, open_store, read_json_prefix


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("nodes", help="list the cluster's nodes and their health")
    add_cluster_flags(p)
    p.set_defaults(func=cmd_nodes)
    p = sub.add_parser("status", help="show what each node runs (optionally one task)")
    add_cluster_flags(p)
    p.add_argument("task", nargs="?", help="only this task")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("incidents", help="list recorded incidents, newest last")
    add_cluster_flags(p)
    p.add_argument("--limit", type=int, default=50, help="show at most this many (default 50)")
    p.set_defaults(func=cmd_incidents)


def _when(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return ""
    return datetime.fromtimestamp(ts, UTC).strftime("%H:%M:%S.%f")[:-3]


def cmd_nodes(args: argparse.Namespace) -> int:
    store, keys = open_store(args)
    statuses = {k.rsplit("/", 1)[-1]: v for k, v in read_json_prefix(store, keys.statuses())}
    drained = {k.rsplit("/", 1)[-1] for k, _ in read_json_prefix(store, keys.drains())}
    rows = []
    for key, info in read_json_prefix(store, keys.nodes()):
        node = key.rsplit("/", 1)[-1]
        st = statuses.get(node, {})
        health = st.get("gpu_health") or []
        bad = [h.get("gpu") for h in health if isinstance(h, dict) and not h.get("ok", True)]
        rows.append({
            "node": node, "gpus": info.get("gpus"), "backend": info.get("gpu_backend"),
            "agent_pid": info.get("agent_pid"), "state": "drained" if node in drained else "up",
            "unhealthy_gpus": ",".join(map(str, bad)) or "-",
            "ranks": len(st.get("ranks") or []),
            "status_age_s": round(time.time() - st["ts"], 1) if isinstance(st.get("ts"), int | float) else None,
        })
    store.close()
    return emit(args, rows, ["node", "state", "gpus", "backend", "unhealthy_gpus", "ranks", "agent_pid", "status_age_s"])


def cmd_status(args: argparse.Namespace) -> int:
    store, keys = open_store(args)
    rows = []
    for _, st in read_json_prefix(store, keys.statuses()):
        for r in st.get("ranks") or []:
            if args.task and r.get("task") != args.task:
                continue
            rows.append({"node": st.get("node"), "task": r.get("task"), "rank": r.get("rank"),
                         "pid": r.get("pid"), "state": r.get("state"), "step": r.get("step"),
                         "generation": st.get("generation")})
    store.close()
    rows.sort(key=lambda r: (str(r["task"]), r["rank"] if isinstance(r["rank"], int) else -1))
    return emit(args, rows, ["task", "rank", "node", "pid", "state", "step", "generation"])


def cmd_incidents(args: argparse.Namespace) -> int:
    store, keys = open_store(args)
    items = [v for _, v in read_json_prefix(store, keys.incidents()) if isinstance(v, dict)]
    store.close()
    items.sort(key=lambda i: i.get("detected_ts") or 0)
    items = items[-args.limit:] if args.limit > 0 else items
    if args.json:
        return emit(args, items, [])
    rows = [{
        "detected": _when(i.get("detected_ts")), "severity": (f"sev{i['severity']}" if i.get("severity") else "info") + (" handled" if i.get("handled") else ""),
        "kind": i.get("kind"), "node": i.get("node"), "task": i.get("task"), "rank": i.get("rank"),
        "gpu": i.get("gpu"),
        "latency_ms": round(1000 * (i["detected_ts"] - i["source_ts"]), 1)
        if isinstance(i.get("detected_ts"), int | float) and isinstance(i.get("source_ts"), int | float) else None,
        "message": str(i.get("message", ""))[:60],
    } for i in items]
    return emit(args, rows, ["detected", "severity", "kind", "node", "task", "rank", "gpu", "latency_ms", "message"])
