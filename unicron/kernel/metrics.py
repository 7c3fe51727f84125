"""Serving a daemon's Prometheus metrics (``--metrics-port``) and what both daemons measure alike.

Each daemon defines its own metrics in its own module (``coordinator/metrics.py``,
``agent/metrics.py``) on a :class:`~prometheus_client.CollectorRegistry` of its own, never the
process-global default: tests run several daemons in one process, and each must export only its own.
Metric names are listed in ``docs/operations.md``; ``deploy/grafana/unicron.json`` charts them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from unicron.kernel import log as ulog
from unicron.kernel.errors import ConfigError, UnicronError

log = ulog.get(__name__)

#: seconds between two heartbeats of an agent (0.1 s nominal), sent (agent) or received (coordinator):
#: an agent short of CPU shows here before the coordinator's timeout (1 s) takes its node for lost
HEARTBEAT_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


@dataclass
class MetricsServer:
    """``GET /metrics`` on ``address``, served by its own thread."""

    server: WSGIServer
    thread: Thread
    address: str

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=2.0)


def serve(registry: CollectorRegistry, host: str, port: int, who: str) -> MetricsServer | None:
    """Serve ``registry`` on ``host:port``; None when ``port`` is 0 (metrics off)."""
    if port == 0:
        return None
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(
            f"{who}: metrics cannot listen on {host}:{port} ({exc.strerror}); change --metrics-host / "
            "--metrics-port (0 turns metrics off)"
        ) from exc
    bound = server.server_address[1]
    log.info("metrics serving", who=who, address=f"{host}:{bound}")
    return MetricsServer(server, thread, f"{host}:{bound}")


class EtcdMetrics:
    """etcd errors (by meaning: StoreUnavailable, StoreRejected, LeaseLost, StoreClosed) and the
    retries the daemon made because of them (by what was retried)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.errors = Counter("unicron_etcd_errors", "etcd calls that failed, by error class",
                              ["error"], registry=registry)
        self.retries = Counter("unicron_etcd_retries", "work retried because etcd was unavailable, by what",
                               ["what"], registry=registry)

    def error(self, exc: UnicronError) -> None:
        """A :class:`unicron.kernel.etcd.Store` ``on_error`` observer."""
        self.errors.labels(type(exc).__name__).inc()

    def retry(self, what: str) -> None:
        self.retries.labels(what).inc()


class TLSExpiry(Collector):
    """``unicron_tls_expiry_days``: days until the sooner of the daemon's TLS certificate's and its CA's
    end (``tls.ExpiryWatch.days_left``, read at scrape time); absent before the first read."""

    def __init__(self, days_left: Callable[[], float | None]) -> None:
        self.days_left = days_left

    def collect(self) -> Iterable[Metric]:
        days = self.days_left()
        if days is not None:
            yield GaugeMetricFamily("unicron_tls_expiry_days", "days until this daemon's TLS certificate or its "
                                    "CA expires, whichever is sooner (read every --tls-check-interval-s)",
                                    value=days)
