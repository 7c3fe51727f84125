"""Start throwaway etcd servers on free loopback ports (tests, the local demo, benchmarks).

Uses the ``etcd`` binary from Debian's ``etcd-server`` package. The server keeps its ports and
data directory across :meth:`EtcdServer.restart`, so "etcd restarted while running" can be tested.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from unicron.kernel import tls
from unicron.kernel.errors import ConfigError, StoreRejected
from unicron.kernel.net import free_port


def etcd_binary() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if path is None:
        raise ConfigError("etcd binary not found: install Debian's etcd-server (apt-get install etcd-server)")
    return path


class EtcdServer:
    """With ``tls_dir`` (made by ``unicron certs``) the server speaks TLS to clients and takes only
    clients with a certificate of that CA (``--client-cert-auth``); it serves with ``DIR/etcd.crt``.
    etcd's own user/role auth on top is set up by :mod:`unicron.kernel.etcdauth`."""

    #: the certificate the server serves with (and probes its own readiness with) in ``tls_dir``
    SERVER_CERT = "etcd"

    def __init__(self, data_dir: str | None = None, host: str = "127.0.0.1", tls_dir: str | None = None) -> None:
        self.host = host
        self.tls_config = tls.TLSConfig.from_dir(tls_dir, self.SERVER_CERT) if tls_dir else None
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="unicron-etcd-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(self.data_dir) / "etcd.log"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def start(self, timeout_s: float = 15.0) -> EtcdServer:
        client_url = f"{'https' if self.tls_config else 'http'}://{self.host}:{self.client_port}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        argv = [
            etcd_binary(), "--name", "unicron", "--data-dir", str(Path(self.data_dir) / "data"),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"unicron={peer_url}",
            # Short election/heartbeat timings: a single local member, and lease expiry checks
            # should not lag behind the short TTLs the tests use.
            "--heartbeat-interval", "50", "--election-timeout", "500",
        ]
        if self.tls_config is not None:
            argv += ["--cert-file", str(self.tls_config.cert), "--key-file", str(self.tls_config.key),
                     "--trusted-ca-file", str(self.tls_config.ca), "--client-cert-auth"]
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.client_port), 0.2):
                from unicron.kernel.etcd import Store

                store = Store(self.endpoint, timeout_s=1.0, tls_config=self.tls_config)
                try:
                    store.put("/unicron-ready", "1")
                    return
                except StoreRejected:
                    return  # etcd answered: its auth (enabled before a restart) refused this user
                except Exception:
                    pass
                finally:
                    store.close()
            time.sleep(0.05)
        raise RuntimeError(f"etcd did not become ready in {timeout_s}s; see {self.log_path}")

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
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
