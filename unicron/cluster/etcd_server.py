"""Start throwaway etcd servers on free loopback ports (tests, the local demo, benchmarks).

Uses the ``etcd`` binary from Debian's ``etcd-server`` package. The server keeps its ports and
data directory across :meth:`EtcdServer.restart`, so "etcd restarted while running" can be tested.
:class:`EtcdCluster` runs several members as one real etcd cluster (``--initial-cluster``), each
optionally inside a network namespace of its own (:mod:`unicron.cluster.netns`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from unicron.kernel import log as ulog
from unicron.kernel import parentdeath, tls
from unicron.kernel.errors import ConfigError, StartFailed, StoreRejected
from unicron.kernel.net import free_port

#: an error in etcd 3.4's default log format ("DATE TIME C | pkg: msg", C critical, E error); later
#: versions log JSON lines with a "level"
_CAPNSLOG_ERROR = re.compile(r"^\S+ \S+ [CE] \| (.*)$")


def etcd_binary() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if path is None:
        raise ConfigError("etcd binary not found: install Debian's etcd-server (apt-get install etcd-server)")
    return path


log = ulog.get(__name__)

#: tries at binding freshly chosen ports (free_port races other processes' connections)
PORT_ATTEMPTS = 3


def _port_taken(error: str) -> bool:
    return "address already in use" in error or "another etcd answers" in error


class EtcdServer:
    """With ``tls_dir`` (made by ``unicron certs``) the server speaks TLS to clients and takes only
    clients with a certificate of that CA (``--client-cert-auth``); it serves with ``DIR/etcd.crt``.
    etcd's own user/role auth on top is set up by :mod:`unicron.kernel.etcdauth`."""

    #: the certificate the server serves with (and probes its own readiness with) in ``tls_dir``
    SERVER_CERT = "etcd"

    def __init__(self, data_dir: str | None = None, host: str = "127.0.0.1", tls_dir: str | None = None, *,
                 name: str = "unicron", ports: tuple[int, int] | None = None,
                 launcher: Sequence[str] = (), log_dir: str | Path | None = None) -> None:
        """``ports``: (client, peer), default free ones on ``host``; ``launcher``: an argv prefix the
        etcd command runs under (``ip netns exec NS``: ``host`` is then an address of that namespace);
        ``log_dir``: where etcd's output goes, as ``etcd-<name>.log`` (default: ``etcd.log`` in the data
        dir, which :meth:`cleanup` removes)."""
        self.host = host
        self.tls_config = tls.TLSConfig.from_dir(tls_dir, self.SERVER_CERT) if tls_dir else None
        self.name = name
        self.client_port, self.peer_port = ports or (free_port(host), free_port(host))
        #: the ports chosen here (None: the caller's): only these may be replaced when taken
        self._chosen = None if ports is not None else (self.client_port, self.peer_port)
        self._started_once = False
        self.launcher = list(launcher)
        #: ``name=peer-url,...`` of every member (set by :class:`EtcdCluster`; default: this one alone)
        self.initial_cluster = f"{name}={self.peer_url}"
        #: shared by the members of one cluster (a member refuses peers of another token)
        self.cluster_token = f"unicron-{uuid.uuid4().hex[:8]}"
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="unicron-etcd-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(log_dir) / f"etcd-{name}.log" if log_dir is not None else Path(self.data_dir) / "etcd.log"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"{'https' if self.tls_config else 'http'}://{self.host}:{self.peer_port}"

    def start(self, timeout_s: float = 15.0) -> EtcdServer:
        for attempt in range(PORT_ATTEMPTS):
            self.launch()
            try:
                self.wait_ready(timeout_s)
            except StartFailed as exc:
                self.stop()  # one that never became ready must not run on
                if not self._may_move_ports() or attempt == PORT_ATTEMPTS - 1 or not _port_taken(str(exc)):
                    raise
                # free_port() raced: an outgoing connection took the port as its ephemeral source port
                # (a fresh clone's run, two test workers: "bind: address already in use"); a server
                # nobody has reached yet may take other ones
                log.info("etcd ports taken before it bound them; trying others", ports=(self.client_port,
                                                                                         self.peer_port))
                self.client_port, self.peer_port = self._chosen = free_port(self.host), free_port(self.host)
                self.initial_cluster = f"{self.name}={self.peer_url}"
                shutil.rmtree(Path(self.data_dir) / "data", ignore_errors=True)
            except BaseException:
                self.stop()
                raise
            else:
                self._started_once = True
                return self
        raise AssertionError("unreachable: the last attempt raises")

    def _may_move_ports(self) -> bool:
        """Only a lone server whose ports were chosen here and that never ran (no client knows them)."""
        return (self._chosen == (self.client_port, self.peer_port) and not self._started_once
                and self.initial_cluster == f"{self.name}={self.peer_url}")

    def launch(self) -> None:
        """Start the process without waiting (a cluster member is ready only once a quorum runs)."""
        client_url = f"{'https' if self.tls_config else 'http'}://{self.host}:{self.client_port}"
        argv = [
            *self.launcher, etcd_binary(), "--name", self.name, "--data-dir", str(Path(self.data_dir) / "data"),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster, "--initial-cluster-token", self.cluster_token,
            # Short election/heartbeat timings: local members, and lease expiry checks should not
            # lag behind the short TTLs the tests use.
            "--heartbeat-interval", "50", "--election-timeout", "500",
        ]
        if self.tls_config is not None:
            cert, key, ca = str(self.tls_config.cert), str(self.tls_config.key), str(self.tls_config.ca)
            # etcd grants by the certificate's CN: without the CA's revocation list a revoked certificate
            # came back to life when its name was issued again (etcd reads the list at each handshake)
            crl = str(tls.ensure_crl(Path(ca).parent))
            argv += ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth",
                     "--client-crl-file", crl,
                     # members talk to each other with the same certificate, and take only the CA's
                     "--peer-cert-file", cert, "--peer-key-file", key, "--peer-trusted-ca-file", ca,
                     "--peer-client-cert-auth", "--peer-crl-file", crl]
        with open(self.log_path, "ab") as log:
            # in its own session (a signal to the owner's group is not etcd's), yet it dies with its owner:
            # a SIGKILLed test run left etcd running, and its data dir, for good
            self.proc = parentdeath.popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 15.0) -> None:
        """Until this server answers on its client port; :class:`StartFailed` (with the last error it
        logged) if it exits first, does not answer within ``timeout_s``, or another etcd answers there."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise self._start_failed(f"etcd exited with {self.proc.returncode}")
            ours = self._probe()
            if ours:
                return
            if ours is not None:
                raise self._start_failed(f"another etcd answers on {self.endpoint}, not this one (its port was "
                                         "taken after it was chosen)")
            time.sleep(0.05)
        raise self._start_failed(f"etcd did not become ready in {timeout_s}s")

    def _probe(self) -> bool | None:
        """None while nothing answers on the client port; else whether the etcd answering is this one
        (a member with our peer URL): free_port() races other runs, and another etcd that took the port
        would answer while ours, unable to bind, exits."""
        from unicron.kernel.etcd import Store

        with contextlib.suppress(OSError), socket.create_connection((self.host, self.client_port), 0.2):
            store = Store(self.endpoint, timeout_s=1.0, tls_config=self.tls_config)
            try:
                # etcd answered even if its auth (enabled before a restart) refuses this user
                with contextlib.suppress(StoreRejected):
                    store.put("/unicron-ready", "1")
                return any(self.peer_url in m.peer_urls for m in store.client.members)
            except Exception:  # not serving yet
                return None
            finally:
                store.close()
        return None

    def _start_failed(self, what: str) -> StartFailed:
        return StartFailed(f"{what}{self._last_error()}; see {self.log_path}")

    def _last_error(self) -> str:
        """``": <what>"`` of the last error etcd logged, or "" if none."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            if (m := _CAPNSLOG_ERROR.match(line)) is not None:
                return f": {m.group(1)}"
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict) and rec.get("level") in ("error", "fatal", "panic"):
                    return "".join(f": {rec[k]}" for k in ("msg", "error") if rec.get(k))
        return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL (a crash, not a shutdown); :meth:`start` brings the member back with its data."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        try:
            return self.start()
        except BaseException:
            self.cleanup()  # no __exit__ follows a failed __enter__: the data dir would stay
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class EtcdCluster:
    """``members`` etcd servers forming one cluster. ``hosts`` (one per member) are
    ``(address, launcher)`` pairs, e.g. a namespace's IP and ``ip netns exec NS``; default: loopback
    ports. With ``tls_dir``, clients and peers on TLS (each member serves ``DIR/etcd.crt``, whose SANs
    must cover every member's address). The same interface as :class:`EtcdServer` where the tests and
    the harness use it."""

    def __init__(self, members: int = 3, hosts: Sequence[tuple[str, Sequence[str]]] = (),
                 tls_dir: str | None = None, log_dir: str | Path | None = None) -> None:
        """``log_dir``: as :class:`EtcdServer`'s, for every member."""
        if members < 1:
            raise ConfigError(f"etcd cluster: members must be >= 1, got {members}")
        if hosts and len(hosts) != members:
            raise ConfigError(f"etcd cluster: {members} members but {len(hosts)} hosts")
        self.members = [
            EtcdServer(name=f"m{i}", host=hosts[i][0], ports=(2379, 2380), launcher=hosts[i][1], tls_dir=tls_dir,
                       log_dir=log_dir)
            if hosts else EtcdServer(name=f"m{i}", tls_dir=tls_dir, log_dir=log_dir)
            for i in range(members)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        token = self.members[0].cluster_token
        for m in self.members:
            m.initial_cluster, m.cluster_token = initial, token

    @property
    def endpoint(self) -> str:
        """Every member's client address, ``host:port,...`` (what the daemons' --etcd takes)."""
        return ",".join(m.endpoint for m in self.members)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        try:
            for m in self.members:
                m.launch()
            for m in self.members:
                m.wait_ready(timeout_s)
        except BaseException:
            self.stop()  # the members launched before the failure must not run on
            raise
        return self

    def leader(self) -> EtcdServer:
        """The member that leads the raft group now (asked of the members themselves)."""
        from unicron.kernel.etcd import Store

        for m in self.members:
            if m.proc is None:
                continue
            store = Store(m.endpoint, timeout_s=1.0, tls_config=m.tls_config)
            try:
                leader = store.client.status().leader
                for other in self.members:
                    if leader is not None and other.proc is not None and other.name == leader.name:
                        return other
            except Exception:  # this member is down or between elections: ask the next
                continue
            finally:
                store.close()
        raise RuntimeError("no etcd member knows a leader")

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def restart(self) -> None:
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL every member (the whole cluster crashes); :meth:`start` brings it back."""
        for m in self.members:
            m.kill()

    def pause(self) -> None:
        for m in self.members:
            m.pause()

    def resume(self) -> None:
        for m in self.members:
            m.resume()

    def cleanup(self) -> None:
        for m in self.members:
            m.cleanup()

    def __enter__(self) -> EtcdCluster:
        try:
            return self.start()
        except BaseException:
            self.cleanup()  # no __exit__ follows a failed __enter__: the data dirs would stay
            raise

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

