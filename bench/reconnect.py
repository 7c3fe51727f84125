"""How soon agents write to etcd again after an etcd outage (issue #19 item 5), against the same
agents with gRPC's default reconnect backoff, in the same run.

Real etcd (SIGKILLed, restarted on the same data dir and ports after the outage), a coordinator and
two agents writing ``status/<node>`` every 0.2 s, started the way production starts them (the
coordinator's settings, the agents' daemons). The clock starts when etcd answers a fresh client again
(``EtcdServer.start`` returns after a put succeeded) and stops, per agent, at the first
``status/<node>`` write etcd holds from after that moment (mod revision above the revision read at
ready); an agent with no such write within ``GIVE_UP_S`` counts as never reconnected (``inf``: the
max, and so the target, fail; ``*_missed`` counts them). One sample per agent per outage:
``samples`` = ``agents`` x ``rounds``. Baseline: ``UNICRON_ETCD_GRPC_DEFAULT_BACKOFF=1`` in the agents' environment, which keeps
gRPC's own reconnect backoff (1 s growing x1.6 per failure to 120 s): what the agents had when the
issue measured 10-18 s.

    .venv/bin/python bench/reconnect.py [--quick]

Target: ``reconnect_max_s`` <= 2.0 (the agents' retry interval is 0.5 s; status is written every
0.2 s). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.etcd import GRPC_DEFAULT_BACKOFF_ENV, Store

TARGET_MAX_S = 2.0
GIVE_UP_S = 120.0
AGENTS = 2


def one_outage(c: LocalCluster, outage_s: float) -> list[float]:
    c.etcd.kill()
    time.sleep(outage_s)
    c.etcd.start()
    ready = time.monotonic()
    probe = Store(c.etcd.endpoint)
    try:
        base = probe.revision()
        delays: dict[str, float] = {}
        while len(delays) < len(c.node_names()) and time.monotonic() - ready < GIVE_UP_S:
            for node in c.node_names():
                kv = probe.get(c.keys.status(node))
                if node not in delays and kv is not None and kv.mod_revision > base:
                    delays[node] = time.monotonic() - ready
            time.sleep(0.01)
    finally:
        probe.close()
    # an agent that never wrote again stays in the figures (as never reconnected), not out of them
    return sorted(delays.get(node, math.inf) for node in c.node_names())


def measure(outage_s: float, rounds: int, default_backoff: bool) -> list[float]:
    env = {"UNICRON_STATUS_INTERVAL": "0.2"}
    if default_backoff:
        env[GRPC_DEFAULT_BACKOFF_ENV] = "1"
    samples: list[float] = []
    with LocalCluster(agents=AGENTS, gpus_per_agent=1, extra_env=env) as c:
        for i in range(rounds):
            got = one_outage(c, outage_s)
            print(f"{'baseline' if default_backoff else 'unicron'} outage {i}: {got}", file=sys.stderr, flush=True)
            samples += got
            time.sleep(3.0)  # every daemon settles before the next outage
    return samples


def seconds(x: float) -> float | None:
    """A delay for the JSON line: a missed reconnection (inf) is null, which strict JSON can carry."""
    return round(x, 3) if math.isfinite(x) else None


def summary(samples: list[float]) -> dict[str, float | None]:
    return {"p50_s": seconds(statistics.median(samples)), "max_s": seconds(max(samples)),
            "min_s": seconds(min(samples)), "missed": sum(1 for x in samples if math.isinf(x))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one 8 s outage per variant (full: three of 15 s)")
    args = ap.parse_args()
    outage_s, rounds = (8.0, 1) if args.quick else (15.0, 5)  # 5 outages each in a full run
    t0 = time.monotonic()
    ours = measure(outage_s, rounds, default_backoff=False)
    base = measure(outage_s, rounds, default_backoff=True)
    s, b = summary(ours), summary(base)
    print(json.dumps({
        "quick": args.quick, "outage_s": outage_s, "agents": AGENTS, "rounds": rounds, "samples": len(ours),
        "reconnect_p50_s": s["p50_s"], "reconnect_max_s": s["max_s"], "reconnect_missed": s["missed"],
        "reconnect_all_s": [seconds(x) for x in ours],
        "baseline_p50_s": b["p50_s"], "baseline_max_s": b["max_s"], "baseline_missed": b["missed"],
        "baseline_all_s": [seconds(x) for x in base],
        "target_met": max(ours) <= TARGET_MAX_S, "wall_s": round(time.monotonic() - t0, 1),
    }))


if __name__ == "__main__":
    main()
