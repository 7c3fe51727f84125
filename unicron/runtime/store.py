"""The task's rendezvous store: a TCPStore sidecar that outlives any rank, the keys ranks share, and
the failure marker that writes ``failed/<rank>`` for the agent.

Rank 0 may die, so no rank hosts the store: the agent (or a test launcher) runs
``python -m unicron.runtime.store --host H --port P`` next to the task and every rank connects as a
client. One sidecar serves one launch of one task (the agent starts a fresh one per assignment
generation), so keys need no task prefix.

The failure marker, ``python -m unicron.runtime.store --marker``: the agent learns of a rank's death
first (it is the parent) and the survivors regroup faster when told at once than when they wait for a
heartbeat to go stale. Writing to a store needs torch's TCPStore client, and importing torch inside the
agent holds the GIL long enough to starve its heartbeat thread (seen: a false node loss), so the agent
(:mod:`agent.marker`) keeps this small process: one JSON line per request on stdin,
``{"host", "port", "rank"}``; one JSON line per answer on stdout (:func:`mark_request`). Writer
(:func:`mark_failed`), key and reader (:mod:`unicron.runtime.membership` counts ``failed/<rank>``
against incarnations) are this one protocol, so they live here together.

Keys (all small ASCII values):

* ``started/<rank>``: counter, +1 each time a process for ``rank`` starts; its value is that
  process's *incarnation* (1 = first start, >1 = a restart that must rejoin).
* ``failed/<rank>``: counter, +1 by :func:`mark_failed` whenever someone knows a process of ``rank``
  died. Incarnation ``i`` is dead once ``failed >= i``.
* ``hb/<rank>``: counter a rank's heartbeat thread bumps every ~50 ms.
* ``join/<rank>``: the incarnation of a live process of ``rank`` asking to (re)join.
* ``epoch/latest`` and ``epoch/<g>``: the agreed membership of each process-group epoch
  (see :mod:`unicron.runtime.membership`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, TextIO

from unicron.kernel.errors import ConfigError, TemporaryError, UnicronError
from unicron.runtime.comm import RendezvousStore, TCPStore

DEFAULT_TIMEOUT_S = 30.0


def started_key(rank: int) -> str:
    return f"started/{rank}"


def leave_key(rank: int) -> str:
    """``leave/<rank>``: the incarnation of ``rank`` that was asked to leave (an in-place shrink)."""
    return f"leave/{rank}"


def failed_key(rank: int) -> str:
    return f"failed/{rank}"


def hb_key(rank: int) -> str:
    return f"hb/{rank}"


def join_key(rank: int) -> str:
    return f"join/{rank}"


def _check_addr(host: str, port: int) -> None:
    if not host:
        raise ConfigError("store host is empty; set MASTER_ADDR (or --host)")
    if not 0 < port < 65536:
        raise ConfigError(f"store port {port} is out of range 1..65535; set MASTER_PORT (or --port)")


def connect(host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> TCPStore:
    """A client connection to the sidecar; raises TemporaryError if it cannot be reached in time."""
    _check_addr(host, port)
    try:
        return TCPStore(
            host, port, None, False, datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
    except (RuntimeError, OSError) as exc:
        raise TemporaryError(f"cannot reach the task store at {host}:{port}: {exc}") from exc


def serve_store(host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> TCPStore:
    """Host the task's store at host:port (returns once listening; serves while the object lives)."""
    _check_addr(host, port)
    try:
        # TCPStore's server listens on every interface whatever host it is given; handing it a
        # socket already bound to host:port makes it listen on exactly that address.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1024)
        except OSError:
            sock.close()
            raise
        return TCPStore(
            host, port, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
            master_listen_fd=sock.detach(),  # the store owns the descriptor from here on
        )
    except (RuntimeError, OSError) as exc:
        raise TemporaryError(f"cannot serve the task store on {host}:{port}: {exc}") from exc


def counter(store: RendezvousStore, key: str) -> int:
    """Read a counter key without blocking (a missing key reads 0)."""
    return int(store.add(key, 0))


def mark_failed(host: str, port: int, rank: int, store: RendezvousStore | None = None) -> int:
    """Record that the current process of ``rank`` died; returns the new failure count.

    The agent calls this the moment its child exits, so survivors regroup without waiting for a
    heartbeat to go stale. Pass ``store`` to reuse a connection.
    """
    s = store if store is not None else connect(host, port, timeout_s=5.0)
    return int(s.add(failed_key(rank), 1))


def mark_current_failed(host: str, port: int, rank: int, store: RendezvousStore | None = None) -> int:
    """Record that ``rank``'s newest process is gone, whoever else already said so: ``failed`` is
    raised to ``started`` and never beyond (an in-place shrink marks the ranks of a lost node, whose
    own agent may or may not have marked them first; counting twice would make the rank's next
    incarnation look dead at its start)."""
    s = store if store is not None else connect(host, port, timeout_s=5.0)
    behind = counter(s, started_key(rank)) - counter(s, failed_key(rank))
    return int(s.add(failed_key(rank), max(behind, 0)))


def mark_request(line: str, stores: dict[tuple[str, int], RendezvousStore]) -> dict[str, Any]:
    """One failure-marker request (a JSON line ``{"host", "port", "rank"}``, optionally ``"current": true``
    for :func:`mark_current_failed`) -> its answer; never raises.

    ``stores`` keeps one connection per store across requests; a failed one is dropped and reopened
    next time.
    """
    try:
        req = json.loads(line)
        host, port, rank = str(req["host"]), int(req["port"]), int(req["rank"])
        current = bool(req.get("current", False))
    except (ValueError, KeyError, TypeError) as exc:
        return {"ok": False, "error": f"bad request {line.strip()[:80]!r}: {exc}"}
    try:
        store = stores.get((host, port))
        if store is None:
            store = stores[(host, port)] = connect(host, port, timeout_s=5.0)
        mark = mark_current_failed if current else mark_failed
        count = mark(host, port, rank, store=store)
        return {"ok": True, "rank": rank, "failures": count}
    except (UnicronError, RuntimeError, OSError) as exc:
        stores.pop((host, port), None)  # reconnect next time
        return {"ok": False, "rank": rank, "error": str(exc)}


def serve_marks(requests: Iterable[str], answers: TextIO) -> None:
    """The failure marker's loop: a ready line, then one answer line per request line."""
    stores: dict[tuple[str, int], RendezvousStore] = {}
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in requests:
        if line.strip():
            print(json.dumps(mark_request(line, stores)), file=answers, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m unicron.runtime.store",
        description="Host a task's TCPStore until killed, or (--marker) mark ranks failed in stores for the agent.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, help="TCP port to listen on")
    parser.add_argument("--marker", action="store_true",
                        help="be the agent's failure marker: JSON requests on stdin, answers on stdout")
    args = parser.parse_args(argv)
    if args.marker:
        serve_marks(sys.stdin, sys.stdout)
        return 0
    if args.port is None:
        parser.error("--port is required (unless --marker)")
    try:
        server = serve_store(args.host, args.port)
    except (ConfigError, TemporaryError) as exc:
        print(f"unicron store: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"unicron store listening on {args.host}:{args.port}", flush=True)
    while not stop.wait(1.0):
        pass
    del server
    time.sleep(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
