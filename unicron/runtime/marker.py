"""``python -m unicron.runtime.marker``: writes "rank R died" into tasks' rendezvous stores for the agent.

The agent learns of a rank's death first (it is the parent) and the survivors regroup faster when
told at once than when they wait for a heartbeat to go stale. Writing to the store needs torch's
TCPStore client, and importing torch inside the agent holds the GIL long enough to starve its
heartbeat thread (seen: a false node loss). So the agent keeps this small process instead: one JSON
line per request on stdin, ``{"host", "port", "rank"}``; one JSON line per answer on stdout.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from unicron.kernel.errors import UnicronError
from unicron.runtime.store import connect, mark_failed


def handle(line: str, stores: dict[tuple[str, int], Any]) -> dict[str, Any]:
    try:
        req = json.loads(line)
        host, port, rank = str(req["host"]), int(req["port"]), int(req["rank"])
    except (ValueError, KeyError, TypeError) as exc:
        return {"ok": False, "error": f"bad request {line.strip()[:80]!r}: {exc}"}
    try:
        store = stores.get((host, port))
        if store is None:
            store = stores[(host, port)] = connect(host, port, timeout_s=5.0)
        count = mark_failed(host, port, rank, store=store)
        return {"ok": True, "rank": rank, "failures": count}
    except (UnicronError, RuntimeError, OSError) as exc:
        stores.pop((host, port), None)  # reconnect next time
        return {"ok": False, "rank": rank, "error": str(exc)}


def main() -> int:
    stores: dict[tuple[str, int], Any] = {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(handle(line, stores)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
