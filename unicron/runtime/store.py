"""The task's rendezvous store: a TCPStore sidecar that outlives any rank, and the keys ranks share.

Rank 0 may die, so no rank hosts the store: the agent (or a test launcher) runs
``python -m unicron.runtime.store --host H --port P`` next to the task and every rank connects as a
client. One sidecar serves one launch of one task (the agent starts a fresh one per assignment
generation), so keys need no task prefix. Its node may be lost too: then an in-place resize moves the
store to another node and the survivors re-seed it (:mod:`unicron.runtime.membership`, "A moved store").

Keys (all small ASCII values):

* ``started/<rank>``: counter, +1 each time a process for ``rank`` starts; its value is that
  process's *incarnation* (1 = first start, >1 = a restart that must rejoin).
* ``failed/<rank>``: counter, +1 whenever someone knows a process of ``rank`` died; incarnation
  ``i`` is dead once ``failed >= i``. Key, writer (the agent's failure marker) and reader are one
  protocol and live in :mod:`unicron.runtime.membership`.
* ``hb/<rank>``: counter a rank's heartbeat thread bumps every ~50 ms.
* ``join/<rank>``: the incarnation of a live process of ``rank`` asking to (re)join.
* ``host/<rank>/<incarnation>``: the address that process's node is reached at (its route's source
  address to the store; "" where it has none), read by every member at each epoch's barrier
  (``Membership.hosts``) for when its node is lost (``PeersLost``, :mod:`unicron.runtime.hostloss`).
  Per incarnation: a rank id re-hosted elsewhere publishes its new host without covering the lost one's.
* ``epoch/latest`` and ``epoch/<g>``: the agreed membership of each process-group epoch
  (see :mod:`unicron.runtime.membership`).
"""

from __future__ import annotations

import argparse
import datetime
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

from unicron.kernel.errors import ConfigError, TemporaryError
from unicron.kernel.net import route_address
from unicron.runtime.comm import RendezvousStore, TCPStore

DEFAULT_TIMEOUT_S = 30.0
STORE_ERRORS = (dist.DistNetworkError, dist.DistStoreError)
"""What a store call raises when the sidecar is gone (its connection closed) or does not answer."""


def started_key(rank: int) -> str:
    return f"started/{rank}"


def leave_key(rank: int) -> str:
    """``leave/<rank>``: the incarnation of ``rank`` that was asked to leave (an in-place shrink)."""
    return f"leave/{rank}"


def hb_key(rank: int) -> str:
    return f"hb/{rank}"


def join_key(rank: int) -> str:
    return f"join/{rank}"


def host_key(rank: int, incarnation: int) -> str:
    return f"host/{rank}/{incarnation}"


def publish_host(store: RendezvousStore, rank: int, incarnation: int, store_host: str, store_port: int) -> str:
    """Publish the address this process's node is reached at (``host/<rank>/<incarnation>``); returns it,
    or "" where this host has no route to the store's address (then nobody can cut it: peers wait for
    their collective timeout instead). Published either way: every member has the key, so the members'
    hosts are read in one call (``Membership.hosts``)."""
    try:
        address = route_address(store_host, store_port)
    except OSError:
        address = ""
    store.set(host_key(rank, incarnation), address)
    return address


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m unicron.runtime.store",
        description="Host a task's TCPStore until killed.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    args = parser.parse_args(argv)
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
