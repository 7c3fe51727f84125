"""How long agents take to write to etcd again after an etcd outage (issue #19 item 5). Not a test:
run it by hand, under the heavy-test lock:

    flock /tmp/unicron-heavy.lock .venv/bin/python tests/agent/measure_etcd_reconnect.py [OUTAGE_S] [ROUNDS]

Real etcd (SIGKILLed, restarted on the same data dir and ports after OUTAGE_S), a coordinator and two
agents writing ``status/<node>`` every 0.2 s. The clock starts when etcd answers a fresh client again
and stops, per agent, at the first ``status/<node>`` write etcd holds from after that moment (its
mod revision is above the revision read at ready). Prints one JSON line.
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
import time

from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.etcd import Store


def one_outage(c: LocalCluster, outage_s: float) -> list[float]:
    assert c.etcd.proc is not None
    c.etcd.proc.send_signal(signal.SIGKILL)
    c.etcd.proc.wait()
    c.etcd.proc = None
    time.sleep(outage_s)
    c.etcd.start()  # returns when a fresh client's put succeeded
    ready = time.monotonic()
    probe = Store(c.etcd.endpoint)
    try:
        base = probe.revision()
        delays: dict[str, float] = {}
        while len(delays) < len(c.node_names()) and time.monotonic() - ready < 120:
            for node in c.node_names():
                kv = probe.get(c.keys.status(node))
                if node not in delays and kv is not None and kv.mod_revision > base:
                    delays[node] = time.monotonic() - ready
            time.sleep(0.01)
    finally:
        probe.close()
    return sorted(delays.values())


def main() -> None:
    outage_s = float(sys.argv[1]) if len(sys.argv) > 1 else 15.0
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    with LocalCluster(agents=2, gpus_per_agent=1, extra_env={"UNICRON_STATUS_INTERVAL": "0.2"}) as c:
        samples: list[float] = []
        for _ in range(rounds):
            samples += one_outage(c, outage_s)
            time.sleep(3.0)  # let every daemon settle before the next outage
        print(json.dumps({"outage_s": outage_s, "agent_rewrite_s": [round(s, 3) for s in samples],
                          "median_s": round(statistics.median(samples), 3), "max_s": round(max(samples), 3)}))


if __name__ == "__main__":
    main()
