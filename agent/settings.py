"""Agent settings: every field is a flag with an environment fallback (see unicron.kernel.config)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from unicron.kernel import patterns, tls
from unicron.kernel.config import setting
from unicron.kernel.errors import ConfigError
from unicron.kernel.etcd import parse_endpoints
from unicron.kernel.net import check_host

UNIX_PATH_MAX = 107
"""Bytes of a Unix socket's path (Linux's sun_path is 108 with the terminating NUL)."""
PID_DIGITS = 7
"""Digits of the largest pid (Linux's PID_MAX_LIMIT, 4194304): the spawner binds ``<node>.pf.<pid>`` first."""


@dataclass(frozen=True)
class AgentSettings:
    node: str = setting(socket.gethostname(), "UNICRON_NODE", "this node's name in the cluster")
    """Unique per node; used as the etcd key segment, so [A-Za-z0-9_.-] only."""
    advertise_host: str = setting("", "UNICRON_ADVERTISE_HOST",
                                  "address other nodes reach this agent at (default: this host's address on its route to etcd)")
    """Task store sidecars this agent hosts listen on it; registered as ``NodeInfo.host``."""
    etcd: str = setting("127.0.0.1:2379", "UNICRON_ETCD", "etcd endpoints, host:port[,host:port...]")
    """etcd endpoints."""
    prefix: str = setting("/unicron", "UNICRON_PREFIX", "etcd key prefix of this Unicron cluster")
    """Must match the coordinator's."""
    gpu_backend: str = setting("auto", "UNICRON_GPU_BACKEND", "GPU backend: auto, nvml or simulated")
    """auto uses NVML when the driver library loads, else a simulated GPU backend."""
    gpus: int = setting(2, "UNICRON_SIMULATED_GPUS", "number of GPUs of the simulated backend", least=0)
    """Ignored with NVML, which reports the real count."""
    lease_ttl_s: int = setting(3, "UNICRON_LEASE_TTL", "TTL (s) of the node's etcd lease", least=1)
    """The node's records vanish this long after the agent stops refreshing (the slow node-loss path)."""
    heartbeat_s: float = setting(0.1, "UNICRON_HEARTBEAT", "seconds between heartbeats to the coordinator", above=0)
    """Keep well under the coordinator's --heartbeat-timeout-s."""
    status_interval_s: float = setting(1.0, "UNICRON_STATUS_INTERVAL", "seconds between node status writes", above=0)
    """How fresh ``unicron nodes`` is."""
    health_interval_s: float = setting(1.0, "UNICRON_HEALTH_INTERVAL", "seconds between GPU health polls", above=0)
    """XID/ECC events arrive at once regardless; this is for counters and NVLink state."""
    run_dir: str = setting("/tmp/unicron", "UNICRON_RUN_DIR", "directory for the ranks' Unix socket and logs")
    """Created if missing. Also holds ``<node>.groups/``, the records of the ranks' process groups that
    the agent's next start kills if it died without clean-up (:mod:`agent.rankgroups`). Its sockets' paths (``<node>.sock``, ``<node>.pf.<pid>``) must fit a Unix
    socket's 107 bytes: a longer one is refused at start."""
    rank_log_max_mb: int = setting(256, "UNICRON_RANK_LOG_MAX_MB",
                                   "size (MiB) past which a rank's log is rotated to <log>.1 (0: never)", least=0)
    """Checked at every status write, for the tasks on the node (an ended task's logs are written no
    more). The run dir is memory under systemd (/run): a rank's log grows for the job's weeks, so two
    files of at most this size per rank are what it keeps."""
    ended_task_logs_kept: int = setting(8, "UNICRON_ENDED_TASK_LOGS_KEPT",
                                        "ended tasks whose log directories (logs/<task>) the run dir keeps", least=0)
    """An operator reads a finished or failed job's rank logs there for a while; past this many, the
    directories of the tasks that left the node first are removed (when a task leaves, and at the
    agent's start). The run dir is memory under systemd (/run): kept for good, the logs of every job
    the node ever ran filled it. A task still assigned here keeps its logs whatever this is."""
    hang_factor: float = setting(3.0, "UNICRON_HANG_FACTOR", "an iteration longer than this x the mean is a hang")
    """The paper's 3x D_iter."""
    warmup_iterations: int = setting(5, "UNICRON_WARMUP_ITERATIONS", "iterations before hang detection starts", least=0)
    """The first iterations (compilation, allocator warm-up) are slow and do not set the baseline."""
    warmup_hang_s: float = setting(1800.0, "UNICRON_WARMUP_HANG_S",
                                   "seconds a rank without a baseline yet (just launched, warming up) may report nothing")
    """Past it the rank is hung (sev2): the iteration rules need a baseline first. 0: off."""
    phase_hang_s: float = setting(3600.0, "UNICRON_PHASE_HANG_S",
                                  "seconds a rank in a checkpoint or evaluation may report nothing (0: unbounded)",
                                  least=0.0)
    """Past it the rank is hung (sev2): a save blocked for good (a hung NFS/Lustre mount, a dead
    object-store endpoint) left the job idle on all its GPUs until a human noticed. An hour: a full save
    of a trillion-parameter model with its optimizer state (~14 TB) takes ~25 minutes at 10 GB/s, an
    evaluation minutes. Also shown in the node's status (``RankStatus.phase_deadline``), past which the
    coordinator no longer takes another rank's hang for a wait on this one's save."""
    replica_budget_mb: int = setting(1024, "UNICRON_REPLICA_BUDGET_MB", "memory for peers' checkpoint replicas", least=0)
    """0 disables the replica server."""
    replica_host: str = setting("", "UNICRON_REPLICA_HOST",
                                "address the checkpoint replica server listens on (default: the advertise host)")
    """Ranks on the other nodes push their snapshots to it: it must be on the cluster network (the
    loopback default it had was unreachable from any other host)."""
    prefork: str = setting("unicron.runtime.train,unicron.runtime.workload", "UNICRON_PREFORK",
                           "modules a warm spawner imports once to fork ranks from (comma-separated; empty: off)")
    """Ranks started as ``<agent's python> -m MODULE`` for these modules are forked, already imported
    (milliseconds instead of seconds for torch + Megatron); costs one idle process holding the imports."""
    prefork_wait_s: float = setting(30.0, "UNICRON_PREFORK_WAIT_S",
                                    "seconds after the spawner started that a rank waits for its imports", least=0.0)
    """A rank assigned while the spawner still imports is forked once it is ready, not started cold beside it;
    past this bound (a stuck import) ranks start as new processes. 0: never wait."""
    progress_regex: str = setting("", "UNICRON_PROGRESS_REGEX",
                                  "regex of an uninstrumented job's progress lines, with a (?P<iteration>...) group "
                                  "and optionally (?P<elapsed_ms>...) or (?P<elapsed_s>...); a task's env overrides it")
    """Megatron-LM's ``iteration N/ M | ... elapsed time per iteration (ms): X`` lines are always parsed."""
    stop_grace_s: float = setting(10.0, "UNICRON_STOP_GRACE", "seconds a stopped rank gets between SIGTERM and SIGKILL", least=0)
    """A training rank uses it to reach the iteration boundary, save an on-demand snapshot and exit 0
    (unicron/runtime/preempt.py): give it an iteration plus a snapshot's save. Every stop of a running
    task (cancel, preemption, a relaunching reconfigure) waits at most this long per rank."""
    fence_s: float = setting(4.0, "UNICRON_FENCE", "seconds without a word from etcd or the coordinator (since the later of the two) after which the agent kills its ranks (0: never)", least=0)
    """A partition breaks the link 2 s after the cut (its TCP_USER_TIMEOUT); the coordinator has
    declared the node lost and relaunched its ranks elsewhere by about 2.5 s, so the old ranks die
    about 4 s after that instead of running on as duplicates for the whole partition. Either contact
    alone prevents it (agent/fence.py). At least the lease TTL. Too short a fence kills ranks nobody
    replaced when etcd is out while the coordinator fails over (they relaunch when contact returns)."""
    etcd_timeout_s: float = setting(2.0, "UNICRON_ETCD_TIMEOUT", "timeout (s) of one etcd call", above=0)
    """Calls that exceed it count as etcd being unavailable and are retried."""
    metrics_port: int = setting(0, "UNICRON_METRICS_PORT", "TCP port serving Prometheus metrics at /metrics (0: off)", least=0, most=65535)
    """Scraped by Prometheus; the metric names are in docs/operations.md."""
    metrics_host: str = setting("127.0.0.1", "UNICRON_METRICS_HOST", "address the metrics endpoint listens on")
    """Loopback by default: the endpoint is unauthenticated; set the cluster network's address to scrape it."""
    tls_dir: str = setting("", "UNICRON_TLS_DIR", "directory with ca.crt and NODE.crt/.key (this node's certificate): mutual TLS on etcd, the link and the replica server (empty: plaintext)")
    """Made by ``unicron certs issue --role node NODE``; the certificate's name must be this node's."""
    tls_check_interval_s: float = setting(6 * 3600.0, "UNICRON_TLS_CHECK_INTERVAL", "seconds between two checks of the TLS certificate's and CA's end while running (a warning at most once a day within 30 days of it)", above=0)
    """A daemon runs for weeks: checked only at start, a certificate that came within the window meanwhile
    was never warned of before every handshake of the cluster failed at once (``tls.ExpiryWatch``)."""
    log_level: str = setting("INFO", "UNICRON_LOG_LEVEL", "log level")
    """Logs are JSON lines on stderr."""

    @property
    def socket_path(self) -> str:
        """The Unix socket the node's ranks report to."""
        return os.path.join(self.run_dir, f"{self.node}.sock")

    @property
    def rank_groups_dir(self) -> str:
        """Where the ranks' process groups are recorded while they live (:mod:`agent.rankgroups`)."""
        return os.path.join(self.run_dir, f"{self.node}.groups")

    @property
    def prefork_path(self) -> str:
        """The warm spawner's Unix socket."""
        return os.path.join(self.run_dir, f"{self.node}.pf")

    def validate(self) -> None:
        if not self.node or any(not (c.isalnum() or c in "-_.") for c in self.node):
            raise ConfigError(f"--node / UNICRON_NODE: bad node name {self.node!r}; use letters, digits, - _ .")
        # checked here: the agent binds its sockets only once registered, and a bind that fails then
        # leaves a node the coordinator takes for lost
        sockets = {self.socket_path: len(os.fsencode(self.socket_path))}
        if any(m.strip() for m in self.prefork.split(",")):
            sockets[f"{self.prefork_path}.PID"] = len(os.fsencode(self.prefork_path)) + 1 + PID_DIGITS
        for path, size in sockets.items():
            if size > UNIX_PATH_MAX:
                raise ConfigError(f"--run-dir / UNICRON_RUN_DIR {self.run_dir!r}: the agent's socket {path!r} would be "
                                  f"{size} bytes, over the {UNIX_PATH_MAX} a Unix socket's path may have; "
                                  "use a shorter run directory")
        parse_endpoints(self.etcd)
        for host, flag in ((self.advertise_host, "--advertise-host / UNICRON_ADVERTISE_HOST"),
                           (self.replica_host, "--replica-host / UNICRON_REPLICA_HOST")):
            if host:
                check_host(host, flag)
        if 0 < self.fence_s < self.lease_ttl_s:
            raise ConfigError(f"--fence-s / UNICRON_FENCE: {self.fence_s} is below the lease TTL ({self.lease_ttl_s} s): "
                              "the node could kill its ranks before etcd let its lease go; use 0 (never) or more")
        if self.gpu_backend not in ("auto", "nvml", "simulated"):
            raise ConfigError("--gpu-backend / UNICRON_GPU_BACKEND must be auto, nvml or simulated")
        if self.progress_regex:
            try:
                patterns.compile_job_regex(patterns.ENV_PROGRESS_REGEX, self.progress_regex)
            except ConfigError as exc:  # its message names the variable; an operator may have typed the flag
                raise ConfigError(f"--progress-regex / {exc}") from exc
        if self.tls_dir:
            tls.load(self.tls_dir, self.node, tls.Role.NODE)
