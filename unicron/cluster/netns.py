"""A multi-host network on one machine: one Linux network namespace per host on a private bridge.

Each :class:`Host` is a namespace with its own IP on a /24 behind a bridge in the root namespace
(a veth pair per host: one end on the bridge, the other moved into the namespace as ``eth0``).
Processes started with :meth:`Network.wrap` run inside a host's namespace (``ip netns exec``), so
an address or port chosen on the wrong host, or a ``127.0.0.1`` assumption, fails as it would on
real machines. :meth:`Network.partition` takes a host's link down (its processes keep running but
reach nobody, and nobody reaches them); :meth:`Network.heal` brings it back.

Needs root (CAP_NET_ADMIN) and iproute2's ``ip``; :func:`unavailable_reason` says why not.

Cleanup: every network records itself in a state file under :data:`STATE_DIR` with its owner's PID;
:meth:`Network.destroy` runs at exit, and each new network first removes the leftovers of owners
that died without cleaning up (a crashed or SIGKILLed test run), processes still inside them
included, so namespaces never pile up.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from unicron.kernel import log as ulog
from unicron.kernel.errors import ConfigError
from unicron.kernel.procs import pid_alive

log = ulog.get(__name__)

#: every namespace this module creates is named ``unicron-<owner pid>-<network id>-<host>``
NS_PREFIX = "unicron-"
#: one JSON file per live network (owner PID, bridge, namespaces), for the stale cleanup
STATE_DIR = Path(os.environ.get("UNICRON_NETNS_STATE_DIR", "/run/unicron-netns"))
#: the /24s handed out are 10.77.<x>.0/24, x chosen free under a lock (parallel runs never collide)
SUBNET_BASE = "10.77"


@functools.cache
def unavailable_reason() -> str | None:
    """Why namespace networks cannot be built here, or None when they can (probed once)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run the tests as root"
    probe = f"{NS_PREFIX}probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except ConfigError as exc:
        return f"cannot create a network namespace: {exc}"
    with contextlib.suppress(ConfigError):
        _ip("netns", "delete", probe)
    return None


def _ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise ConfigError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc.stdout


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


@dataclass(frozen=True)
class Host:
    name: str
    #: the namespace's name (``ip netns exec <ns> ...``)
    ns: str
    ip: str
    #: the root-namespace end of its veth pair (down = partitioned)
    link: str


class Network:
    """A bridge and its hosts. Create with :meth:`create`, add hosts, :meth:`destroy` when done."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex[:6]
        self.bridge = f"ucb{self.id}"
        self.hosts: dict[str, Host] = {}
        self.subnet: ipaddress.IPv4Network | None = None
        self._next = 10
        self._state = STATE_DIR / f"{self.id}.json"

    @property
    def gateway(self) -> str:
        """The bridge's address in the root namespace (where the test process reaches the hosts from)."""
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def create(self) -> Network:
        with _locked():
            cleanup_stale()
            self.subnet = _free_subnet()
            _ip("link", "add", self.bridge, "type", "bridge")
            self._save()  # from here on a crash leaves something to clean
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        atexit.register(self.destroy)
        log.info("netns network created", bridge=self.bridge, subnet=str(self.subnet))
        return self

    def add(self, name: str) -> Host:
        """A new host ``name`` with the next free address of the subnet."""
        assert self.subnet is not None, "create() first"
        if name in self.hosts:
            raise ConfigError(f"netns host {name!r} exists already")
        index = len(self.hosts)
        ip = str(self.subnet.network_address + self._next)
        self._next += 1
        host = Host(name, f"{NS_PREFIX}{os.getpid()}-{self.id}-{name}", ip, f"ucv{self.id}{index:03d}")
        peer = f"ucp{self.id}{index:03d}"
        self.hosts[name] = host
        _ip("netns", "add", host.ns)
        self._save()
        _ip("link", "add", host.link, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", host.ns)
        _ip("-n", host.ns, "link", "set", peer, "name", "eth0")
        _ip("-n", host.ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", host.ns, "link", "set", "eth0", "up")
        _ip("-n", host.ns, "link", "set", "lo", "up")
        _ip("link", "set", host.link, "master", self.bridge)
        _ip("link", "set", host.link, "up")
        return host

    def wrap(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].ns, *argv]

    def partition(self, host: str) -> None:
        """Cut ``host`` off the network: its processes run on, reaching nobody."""
        _ip("link", "set", self.hosts[host].link, "down")

    def heal(self, host: str) -> None:
        _ip("link", "set", self.hosts[host].link, "up")

    def destroy(self) -> None:
        _destroy(self.bridge, [h.ns for h in self.hosts.values()])
        self.hosts.clear()
        self._state.unlink(missing_ok=True)
        atexit.unregister(self.destroy)

    def _save(self) -> None:
        self._state.write_text(json.dumps({"pid": os.getpid(), "bridge": self.bridge,
                                           "namespaces": [h.ns for h in self.hosts.values()]}))


def _destroy(bridge: str, namespaces: Sequence[str]) -> None:
    # Deleting a namespace deletes its end of each veth pair, and with it the root-namespace end.
    for ns in namespaces:
        _delete_namespace(ns)
    _ip("link", "delete", bridge, check=False)


def _delete_namespace(ns: str) -> None:
    """Kill the processes still in ``ns``, then delete it: ``ip netns delete`` only drops the name, and a
    dead owner's daemons would run on in a namespace nobody reaches."""
    for pid in _ip("netns", "pids", ns, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "delete", ns, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    used = {ipaddress.IPv4Interface(w).network for line in _ip("-o", "-4", "addr", "show").splitlines()
            for w in line.split() if "/" in w and w[0].isdigit()}
    for x in range(256):
        net = ipaddress.IPv4Network(f"{SUBNET_BASE}.{x}.0/24")
        if net not in used:
            return net
    raise ConfigError(f"no free /24 left under {SUBNET_BASE}.0.0/16; remove stale bridges (ip link show type bridge)")


def cleanup_stale() -> int:
    """Remove the networks of owners that died without destroying them; returns how many."""
    removed = 0
    for path in STATE_DIR.glob("*.json"):
        try:
            state = json.loads(path.read_text())
            pid, bridge, namespaces = int(state["pid"]), str(state["bridge"]), list(state["namespaces"])
        except (OSError, ValueError, KeyError, TypeError):
            path.unlink(missing_ok=True)
            continue
        if pid_alive(pid):
            continue
        _destroy(bridge, namespaces)
        path.unlink(missing_ok=True)
        removed += 1
    # Namespaces whose state file was lost (a crash between `netns add` and the save).
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        parts = name.removeprefix(NS_PREFIX).split("-")
        if name.startswith(NS_PREFIX) and parts[0].isdigit() and not pid_alive(int(parts[0])):
            _delete_namespace(name)
    if removed:
        log.warning("removed stale netns networks", count=removed)
    return removed
