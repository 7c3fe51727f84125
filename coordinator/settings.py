"""Coordinator settings: every field is a flag with an environment fallback (see unicron.kernel.config)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.decision.state import SEV2_FAULTS_KEPT
from unicron.kernel.config import setting
from unicron.kernel.errors import ConfigError
from unicron.kernel.net import WILDCARDS, check_host, route_address


@dataclass(frozen=True)
class CoordinatorSettings:
    etcd: str = setting("127.0.0.1:2379", "UNICRON_ETCD", "etcd endpoints, host:port[,host:port...]")
    """etcd endpoints the coordinator uses for all state."""
    prefix: str = setting("/unicron", "UNICRON_PREFIX", "etcd key prefix of this Unicron cluster")
    """Key prefix; several clusters can share one etcd under different prefixes."""
    listen_host: str = setting("127.0.0.1", "UNICRON_COORDINATOR_HOST", "address the agent link and API listen on")
    """Interface for the agent link and the gRPC API."""
    advertise_host: str = setting("", "UNICRON_COORDINATOR_ADVERTISE_HOST", "address agents and clients dial the link and API at (default: --listen-host, or for a wildcard listen host this host's address on its route to etcd)")
    """Goes into the leader key. A wildcard listen address (0.0.0.0) is no address to dial; the
    route to etcd is the network the agents share with this host."""
    link_port: int = setting(0, "UNICRON_LINK_PORT", "TCP port of the agent link (0: any free port)", least=0, most=65535)
    """Agents find the actual address in the leader key."""
    api_port: int = setting(0, "UNICRON_API_PORT", "TCP port of the gRPC API (0: any free port)", least=0, most=65535)
    """The CLI finds the actual address in the leader key."""
    heartbeat_timeout_s: float = setting(1.0, "UNICRON_HEARTBEAT_TIMEOUT", "seconds without an agent heartbeat before its node is lost", above=0)
    """Must exceed several agent heartbeat intervals; the paper's Table 2 took 5.6 s for this case."""
    leader_ttl_s: int = setting(3, "UNICRON_LEADER_TTL", "TTL (s) of the leadership lease", least=2)
    """A stopped leader is replaced this long after it stopped refreshing."""
    etcd_timeout_s: float = setting(2.0, "UNICRON_ETCD_TIMEOUT", "timeout (s) of one etcd call", above=0)
    """Calls that exceed it count as etcd being unavailable and are retried."""
    reattempt_deadline_s: float = setting(30.0, "UNICRON_REATTEMPT_DEADLINE", "seconds a sev3 reattempt may take before it counts as failed", above=0)
    """Figure 7: a failed reattempt escalates to a sev2 restart."""
    restart_deadline_s: float = setting(120.0, "UNICRON_RESTART_DEADLINE", "seconds a sev2 restart may take before it counts as failed", above=0)
    """Figure 7: a failed restart escalates to sev1 (isolate and reconfigure)."""
    flap_faults: int = setting(3, "UNICRON_FLAP_FAULTS", "sev2 faults of one node within --flap-window-s that make it flapping: the one reaching this count isolates the node instead of restarting its ranks again (0: never)", least=0, most=SEV2_FAULTS_KEPT)
    """See DecisionSettings.flap_faults."""
    flap_window_s: float = setting(3600.0, "UNICRON_FLAP_WINDOW", "seconds within which --flap-faults sev2 faults of one node make it flapping", above=0)
    """See DecisionSettings.flap_window_s."""
    in_place_resize: bool = setting(True, "UNICRON_IN_PLACE_RESIZE", "resize a task in place (survivors keep running) when a new allocation keeps its layout; 0 makes every move a new generation")
    """See DecisionSettings.in_place_resize."""
    spare_stores: bool = setting(True, "UNICRON_SPARE_STORES", "with in-place resize, each task's successor store node keeps a spare store sidecar listening; 0: a moved store starts from nothing")
    """The store moves when its node is lost; a sidecar starting then imports torch (1 s here) while
    every survivor waits. The spare is one idle process per in-place task, on one node."""
    registration_grace_s: float = setting(10.0, "UNICRON_REGISTRATION_GRACE", "seconds a new leader waits for a node of the decision state that is not registered (nor on the link) before the node counts as lost, and at least gives an outstanding action before its deadline expires", above=0)
    """A live agent keeps its registration through a leader change, and re-registers within a second or
    two of an etcd outage that expired it; a node found missing at the takeover died meanwhile."""
    ended_tasks_kept: int = setting(1000, "UNICRON_ENDED_TASKS_KEPT", "finished, failed and cancelled tasks kept in the task set (unicron tasks); the one that ended first is retired past it", least=0)
    """See DecisionSettings.ended_tasks_kept."""
    regroup_grace_s: float = setting(10.0, "UNICRON_REGROUP_GRACE", "seconds after a rank's in-place recovery during which the task's hang reports are its consequence", least=0)
    """Peers wait in a collective while the ranks regroup; their hang detectors may fire meanwhile."""
    gpu_type: str = setting("A800", "UNICRON_GPU_TYPE", "accelerator type for the planner's throughput model")
    """One of plans.hardware's types (A100, A800, H100, H200); the cluster is assumed homogeneous."""
    metrics_port: int = setting(0, "UNICRON_METRICS_PORT", "TCP port serving Prometheus metrics at /metrics (0: off)", least=0, most=65535)
    """Scraped by Prometheus; the metric names are in docs/operations.md."""
    metrics_host: str = setting("127.0.0.1", "UNICRON_METRICS_HOST", "address the metrics endpoint listens on")
    """Loopback by default: the endpoint is unauthenticated; set the cluster network's address to scrape it."""
    alert_webhook: str = setting("", "UNICRON_ALERT_WEBHOOK", "URL the decision core's alerts are POSTed to as JSON (empty: log only)")
    """Node isolated or lost, task failed, GPUs left idle: one POST each, retried, never blocking decisions."""
    alert_webhook_timeout_s: float = setting(2.0, "UNICRON_ALERT_WEBHOOK_TIMEOUT", "timeout (s) of one webhook POST", above=0)
    """A POST that times out is retried (3 times, backoff from 0.5 s), then counted as failed."""
    tls_dir: str = setting("", "UNICRON_TLS_DIR", "directory with ca.crt and this coordinator's TLS_NAME.crt/.key: mutual TLS on etcd, the agent link and the API (empty: plaintext)")
    """Made by ``unicron certs``; with it only cluster-CA certificates get in, and the API's mutating calls take an operator's."""
    tls_name: str = setting("coordinator", "UNICRON_TLS_NAME", "name of this coordinator's certificate in --tls-dir")
    """Its certificate's role must be ``coordinator``; its SANs must cover --listen-host."""
    tls_check_interval_s: float = setting(6 * 3600.0, "UNICRON_TLS_CHECK_INTERVAL", "seconds between two checks of the TLS certificate's and CA's end while running (a warning at most once a day within 30 days of it)", above=0)
    """A daemon runs for weeks: checked only at start, a certificate that came within the window meanwhile
    was never warned of before every handshake of the cluster failed at once (``tls.ExpiryWatch``)."""
    etcd_history_s: float = setting(60.0, "UNICRON_ETCD_HISTORY", "seconds of etcd history the leader keeps: it compacts older revisions (0: never; then etcd must compact itself)", least=0)
    """Without compaction etcd fills its backend quota and refuses every write (see coordinator.compaction)."""
    log_level: str = setting("INFO", "UNICRON_LOG_LEVEL", "log level")
    """Logs are JSON lines on stderr."""

    def validate(self) -> None:
        from plans.api import gpu_type
        from unicron.kernel.etcd import parse_endpoints

        parse_endpoints(self.etcd)
        try:
            gpu_type(self.gpu_type)
        except Exception as exc:
            raise ConfigError(f"--gpu-type / UNICRON_GPU_TYPE: {exc}") from exc
        for host, flag in ((self.listen_host, "--listen-host / UNICRON_COORDINATOR_HOST"),
                           (self.advertise_host, "--advertise-host / UNICRON_COORDINATOR_ADVERTISE_HOST")):
            if host:
                check_host(host, flag)
        if self.advertise_host in WILDCARDS[1:]:
            raise ConfigError("--advertise-host / UNICRON_COORDINATOR_ADVERTISE_HOST must be an address peers can "
                              f"dial, not the wildcard {self.advertise_host}; leave it empty for the default")
        if self.tls_dir:
            from unicron.kernel import tls

            tls.load(self.tls_dir, self.tls_name, tls.Role.COORDINATOR)
        if self.alert_webhook and not self.alert_webhook.startswith(("http://", "https://")):
            raise ConfigError("--alert-webhook / UNICRON_ALERT_WEBHOOK must be an http:// or https:// URL")


def advertise_host(settings: CoordinatorSettings) -> str:
    """The address the coordinator advertises in the leader key (see ``advertise_host``)."""
    if settings.advertise_host:
        return settings.advertise_host
    if settings.listen_host not in WILDCARDS:
        return settings.listen_host
    from unicron.kernel.etcd import parse_endpoints

    host, port = parse_endpoints(settings.etcd)[0]
    try:
        return route_address(host, port)
    except OSError as exc:
        raise ConfigError(f"--listen-host {settings.listen_host!r} is a wildcard and this host has no route to etcd "
                          f"({host}:{port}: {exc}) to pick an address from: set --advertise-host / "
                          "UNICRON_COORDINATOR_ADVERTISE_HOST") from exc
