"""A whole Unicron cluster on this machine: a throwaway etcd, a coordinator and N agents, each a
real process. Used by the integration tests, the local demo and the benchmarks.

Two network modes. Loopback (the default): every process on 127.0.0.1. Namespaces (``netns=True``,
root only): every node, coordinator and etcd member is a host of its own (a network namespace with
its own IP on a bridge, :mod:`unicron.cluster.netns`), so addresses chosen on the wrong host show,
and :meth:`LocalCluster.partition` cuts a host off the network.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from coordinator.statestore import read_state
from unicron.cluster.etcd_server import EtcdCluster, EtcdServer
from unicron.cluster.netns import Network
from unicron.kernel import etcdauth, parentdeath, tls
from unicron.kernel.errors import ConfigError, StartFailed, TemporaryError
from unicron.kernel.etcd import Store
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.net import free_port
from unicron.kernel.types import Incident, NodeAssignment, RankSpec, TaskAssignment

#: A rank without torch for harness tests: reports an iteration every 0.1 s through the agent's
#: socket; its steps are wall-clock tenths, so they keep growing across restarts.
STEPPER = [sys.executable, "-c",
           "import time\n"
           "from unicron.kernel.client import AgentClient\n"
           "c = AgentClient.from_env().connect()\n"
           "while True:\n"
           "    with c.iteration(int(time.time() * 10)): time.sleep(0.1)\n"]


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class LocalCluster:
    def __init__(
        self,
        agents: int = 3,
        gpus_per_agent: int = 2,
        prefix: str = "/unicron",
        run_dir: str | None = None,
        extra_env: dict[str, str] | None = None,
        quiet: bool = True,
        metrics: bool = False,
        tls: bool = False,
        netns: bool = False,
        etcd_members: int = 1,
        coordinators: int = 1,
        prefork: Sequence[str] | None = None,
    ) -> None:
        """With ``tls``, the secure variant (docs/operations.md): a cluster CA and certificates in
        ``<run_dir>/certs``, etcd with TLS, ``--client-cert-auth`` and per-role auth, and every
        daemon on mutual TLS (``UNICRON_TLS_DIR``); the harness itself acts as the coordinator.
        ``netns``: each process on a host (network namespace) of its own; ``etcd_members``: etcd
        as a cluster of that many members; ``coordinators``: one leader and the rest running standbys.
        ``prefork``: the modules the agents' warm spawners import (default: the agent's, training and
        workload; ``[]``: no spawner). Three spawners importing Megatron-core at start cost ~30 s of
        CPU on a 2-core machine: a cluster whose ranks never run it should say what they run."""
        self.n_agents = agents
        self.gpus_per_agent = gpus_per_agent
        self.n_coordinators = coordinators
        self.keys = Keyspace(prefix)
        self.run_dir = run_dir or tempfile.mkdtemp(prefix="unicron-run-")
        self.net = Network().create() if netns else None
        if self.net is not None:  # every host up front: the certificates name their addresses
            for host in (*(f"etcd{i}" for i in range(etcd_members)), *(f"coord{i}" for i in range(coordinators)),
                         *self.node_names()):
                self.net.add(host)
        self.tls_dir = self._issue_certs(etcd_members) if tls else ""
        self.etcd: EtcdServer | EtcdCluster = self._make_etcd(etcd_members)
        self.store: Store | None = None
        #: the first coordinator started (the leader, until a test kills it); see :meth:`leader_pid`
        self.coordinator: subprocess.Popen[bytes] | None = None
        #: every coordinator process by index (its host in netns mode is ``coord<index>``)
        self.coordinators: dict[int, subprocess.Popen[bytes]] = {}
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        #: every daemon process started -> its log file
        self._logs: dict[subprocess.Popen[bytes], Path] = {}
        #: the SIGTERM handler :meth:`__enter__` replaced, put back by :meth:`__exit__`
        self._sigterm_before: Callable[[int, FrameType | None], Any] | int | None = None
        self.extra_env = ({} if prefork is None else {"UNICRON_PREFORK": ",".join(prefork) or ","}) \
            | (extra_env or {})
        self.quiet = quiet
        self._revision = 0
        #: with ``metrics``: "coordinator" and each node -> the port its /metrics is served on
        self.metrics_ports: dict[str, int] = {}
        self.metrics = metrics
        #: temporary errors (an etcd read timing out, say) that :meth:`wait_for` took for "not yet"
        self.temporary_errors = 0

    # --- lifecycle ---------------------------------------------------------------------------

    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(self.n_agents)]

    def _issue_certs(self, etcd_members: int) -> str:
        """The cluster CA and every holder's certificate, each naming the addresses its holder serves
        on (loopback always; in netns mode its hosts' IPs: all coordinators share one certificate,
        and so do all etcd members)."""
        directory = Path(self.run_dir) / "certs"
        tls.init_ca(directory)
        coords = [self.host_ip(f"coord{i}") for i in range(self.n_coordinators)]
        members = [self.host_ip(f"etcd{i}") for i in range(etcd_members)]
        holders = [(tls.Role.COORDINATOR, "coordinator", coords), (tls.Role.OPERATOR, "operator", []),
                   (tls.Role.ETCD, EtcdServer.SERVER_CERT, members), (tls.Role.ETCD, etcdauth.ROOT, [])]
        for role, name, hosts in [*holders, *((tls.Role.NODE, n, [self.host_ip(n)]) for n in self.node_names())]:
            tls.issue(directory, role, name, hosts)
        return str(directory)

    def tls_config(self, name: str) -> tls.TLSConfig | None:
        """The certificate ``name`` of this cluster (None without ``tls``)."""
        return tls.TLSConfig.from_dir(self.tls_dir, name) if self.tls_dir else None

    def _secure_etcd(self) -> None:
        admin = self.tls_config(etcdauth.ROOT)
        assert admin is not None
        peers = [tls.Peer(tls.Role.COORDINATOR, "coordinator"), tls.Peer(tls.Role.OPERATOR, "operator"),
                 *(tls.Peer(tls.Role.NODE, n) for n in self.node_names())]
        # auth is the cluster's: set up through any one member
        etcdauth.setup(self.etcd.endpoint.split(",")[0], admin, self.keys, peers)

    def _make_etcd(self, members: int) -> EtcdServer | EtcdCluster:
        # The members' logs go with the run's: a member's data dir goes at cleanup, and so would a log
        # there (named by a failed start's error, or read for a stall or an election seen in the run).
        tls_dir, log_dir = self.tls_dir or None, self.run_dir
        if self.net is None:
            return EtcdServer(tls_dir=tls_dir, log_dir=log_dir) if members == 1 else \
                EtcdCluster(members, tls_dir=tls_dir, log_dir=log_dir)
        hosts = [self.net.hosts[f"etcd{i}"] for i in range(members)]
        if members == 1:
            return EtcdServer(host=hosts[0].ip, ports=(2379, 2380), launcher=self.net.wrap("etcd0", []),
                              tls_dir=tls_dir, log_dir=log_dir)
        return EtcdCluster(members, [(h.ip, self.net.wrap(h.name, [])) for h in hosts], tls_dir=tls_dir,
                           log_dir=log_dir)

    def host_ip(self, host: str) -> str:
        """The address of ``host`` (a node, ``coord<i>`` or ``etcd<i>``): its namespace's IP, or loopback."""
        if self.net is None:
            return "127.0.0.1"
        if host not in self.net.hosts:
            self.net.add(host)
        return self.net.hosts[host].ip

    def partition(self, host: str) -> None:
        """Cut ``host`` off the network (netns mode): its processes run on but reach nobody."""
        if self.net is None:
            raise ConfigError("partition() needs LocalCluster(netns=True)")
        self.net.partition(host)

    def heal(self, host: str) -> None:
        if self.net is None:
            raise ConfigError("heal() needs LocalCluster(netns=True)")
        self.net.heal(host)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "UNICRON_ETCD": self.etcd.endpoint, "UNICRON_PREFIX": self.keys.prefix, "UNICRON_RUN_DIR": self.run_dir,
            "PYTHONUNBUFFERED": "1",
        })
        if self.tls_dir:
            env[tls.ENV_DIR] = self.tls_dir
        env.update(self.extra_env)
        return env

    def _spawn(self, argv: list[str], log_name: str, host: str) -> subprocess.Popen[bytes]:
        log_path = Path(self.run_dir) / f"{log_name}.log"
        env = self._env()
        cmd = [sys.executable, *argv]
        if self.net is not None:
            # Everything the daemon serves is reachable from other hosts, never on loopback only. The
            # coordinator listens on every interface and advertises its default: its route to etcd.
            env.update({"UNICRON_METRICS_HOST": self.host_ip(host), "UNICRON_COORDINATOR_HOST": "0.0.0.0"})
            cmd = self.net.wrap(host, cmd)
        with open(log_path, "ab") as out:
            # dies with this process (with its ranks, which die with it): a SIGKILLed owner left the
            # daemons running for good (``ip netns exec`` execs the daemon, which keeps the signal)
            proc = parentdeath.popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._logs[proc] = log_path
        return proc

    def start(self, timeout_s: float = 60.0) -> LocalCluster:
        self.etcd.start()
        if self.tls_dir:
            self._secure_etcd()
        # with TLS the harness reads and writes as the coordinator (its tests write assignments)
        self.store = Store(self.etcd.endpoint, tls_config=self.tls_config("coordinator"))
        self.start_coordinator()
        for i in range(1, self.n_coordinators):
            self.start_coordinator(i, wait=False)
        for node in self.node_names():
            self.start_agent(node)
        daemons = [*self.coordinators.values(), *self.agents.values()]
        self.wait_for(lambda: len(self.registered_nodes()) == self.n_agents, timeout_s, "agents to register",
                      procs=daemons)
        # Registered in etcd is not yet joined in the coordinator's decision: a task submitted in
        # between is measured against part of the cluster (and refused as larger than it).
        self.wait_for(lambda: all(self.node_state(n) == "up" for n in self.node_names()), timeout_s,
                      "the coordinator to count every node", procs=daemons)
        return self

    def running_ranks(self, task: str) -> dict[int, dict[str, Any]]:
        """The task's running ranks by rank number, from every node's status, each with its node. A
        rank listed by two nodes (a node cut off from etcd cannot yet have rewritten its status after
        its ranks were killed and relaunched elsewhere) is taken from the newer launch: the chaos bench
        otherwise aimed faults at processes that no longer existed."""
        out: dict[int, dict[str, Any]] = {}
        for n in self.node_names():
            for r in (self.agent_status(n) or {}).get("ranks", []):
                if r.get("task") != task or r.get("state") != "running":
                    continue
                seen = out.get(int(r["rank"]))
                if seen is None or _launch(r) >= _launch(seen):
                    out[int(r["rank"])] = r | {"node": n}
        return out

    def coordinator_log(self, since: float = 0.0, index: int = 0) -> list[dict[str, Any]]:
        """Coordinator ``index``'s JSON log lines stamped at or after ``since`` (epoch seconds), each
        with its stamp as ``ts`` (epoch seconds, the coordinator's own clock)."""
        return self._daemon_log("coordinator.log" if index == 0 else f"coordinator{index}.log", since)

    def agent_log(self, node: str, since: float = 0.0) -> list[dict[str, Any]]:
        """Agent ``node``'s JSON log lines stamped at or after ``since``, as :meth:`coordinator_log`."""
        return self._daemon_log(f"agent-{node}.log", since)

    def _daemon_log(self, name: str, since: float) -> list[dict[str, Any]]:
        out = []
        for line in Path(self.run_dir, name).read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not (isinstance(rec, dict) and "timestamp" in rec):
                continue
            rec["ts"] = datetime.datetime.fromisoformat(str(rec["timestamp"]).replace("Z", "+00:00")).timestamp()
            if rec["ts"] >= since:
                out.append(rec)
        return out

    def actions(self, since: float = 0.0, index: int = 0) -> list[dict[str, Any]]:
        """The actions coordinator ``index`` took at or after ``since`` (its ``action`` log records, in
        order: ``action``, ``task``/``node`` where they apply, ``ts``)."""
        return [r for r in self.coordinator_log(since, index) if r.get("event") == "action"]

    def node_state(self, node: str) -> str | None:
        """The node's state in the coordinator's decision record (up, drained, isolated, lost)."""
        assert self.store is not None
        state, _, _ = read_state(self.store, self.keys)
        entry = state.nodes.get(node) if state is not None else None
        return entry.status.value if entry is not None else None

    def _metrics_args(self, who: str) -> list[str]:
        if not self.metrics:
            return []
        if who not in self.metrics_ports:  # a restarted daemon keeps its port
            self.metrics_ports[who] = free_port()
        return ["--metrics-port", str(self.metrics_ports[who])]

    def metrics_url(self, who: str) -> str:
        return f"http://{self.host_ip('coord0' if who == 'coordinator' else who)}:{self.metrics_ports[who]}/metrics"

    def start_coordinator(self, index: int = 0, wait: bool = True) -> None:
        """Start coordinator ``index`` (its log: ``coordinator.log`` for 0, ``coordinator<index>.log``);
        ``wait``: until some coordinator leads."""
        who = "coordinator" if index == 0 else f"coordinator{index}"
        proc = self._spawn(["-m", "coordinator.main", *self._metrics_args(who)], who, f"coord{index}")
        self.coordinators[index] = proc
        if index == 0:
            self.coordinator = proc
        if wait:
            self.wait_for(lambda: self.store is not None and self.store.get(self.keys.leader()) is not None, 30.0,
                          "the coordinator to lead", procs=[proc])

    def leader_pid(self) -> int | None:
        """The PID in the leader key (the coordinator that leads now), None while nobody does."""
        assert self.store is not None
        kv = self.store.get(self.keys.leader())
        return int(json.loads(kv.value)["pid"]) if kv is not None else None

    def leader_index(self) -> int:
        """The index of the coordinator that leads now (see :meth:`start_coordinator`)."""
        pid = self.leader_pid()
        return next(i for i, p in self.coordinators.items() if p.pid == pid)

    def elected_at(self, index: int, after: float) -> float | None:
        """When coordinator ``index`` logged its election at or after ``after`` (its own clock)."""
        return next((r["ts"] for r in self.coordinator_log(after, index) if r.get("event") == "elected leader"),
                    None)

    def restart_coordinator(self, index: int) -> None:
        """Reap coordinator ``index`` (killed by the caller) and start it again as a standby."""
        self.coordinators[index].wait()
        self.start_coordinator(index, wait=False)

    def start_agent(self, node: str) -> None:
        self.agents[node] = self._spawn(
            ["-m", "agent.main", "--node", node, "--gpu-backend", "simulated", "--gpus", str(self.gpus_per_agent),
             # in netns mode the agent finds its address itself (its route to etcd)
             *([] if self.net is not None else ["--advertise-host", "127.0.0.1"]), *self._metrics_args(node)],
            f"agent-{node}", node,
        )

    def stop(self) -> None:
        procs = [p for p in (*self.agents.values(), *self.coordinators.values()) if p is not None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if self.store is not None:
            self.store.close()
        self.etcd.cleanup()
        if self.net is not None:
            self.net.destroy()

    def __enter__(self) -> LocalCluster:
        # The cluster's processes run in their own sessions: a SIGTERM to this process must unwind
        # through __exit__ (which stops them), not kill it with them orphaned.
        if threading.current_thread() is threading.main_thread():
            self._sigterm_before = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            return self.start()
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self._sigterm_before is not None:  # None: not ours to restore (set outside Python, or kept)
                signal.signal(signal.SIGTERM, self._sigterm_before)
                self._sigterm_before = None

    # --- observation -------------------------------------------------------------------------

    def wait_for(self, pred: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.02,
                 procs: Sequence[subprocess.Popen[bytes]] = ()) -> Any:
        """``pred()``'s first truthy value within ``timeout_s``. A temporary error counts as "not yet":
        reads time out while etcd stalls (a 3-member cluster electing, say), and chaos seed 57 ended
        before its first fault on one such timeout. One of ``procs`` (daemons being started) exiting
        is :class:`StartFailed` at once, naming it and its log: it was waited out, a timeout."""
        deadline = time.monotonic() + timeout_s
        last: TemporaryError | None = None
        while time.monotonic() < deadline:
            for p in procs:
                if p.poll() is not None:
                    log_path = self._logs[p]
                    raise StartFailed(f"{log_path.stem} (pid {p.pid}) exited with {p.returncode} while waiting "
                                      f"for {what}; see {log_path}")
            try:
                value = pred()
            except TemporaryError as exc:
                last, value = exc, None
                self.temporary_errors += 1
            if value:
                return value
            time.sleep(poll_s)
        cause = f" (last error: {last})" if last is not None else ""
        raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}{cause}; logs in {self.run_dir}")

    def registered_nodes(self) -> list[str]:
        assert self.store is not None
        kvs, _ = self.store.get_prefix(self.keys.nodes())
        return [self.keys.tail(kv.key, self.keys.nodes()) for kv in kvs]

    def wait_registered(self, node: str, timeout_s: float = 30.0) -> None:
        """Wait until ``node``'s *current* agent process registered (not a dead one's lingering key)
        and had time to open its link to the coordinator."""
        assert self.store is not None
        pid = self.agents[node].pid

        def registered() -> bool:
            kv = self.store.get(self.keys.node(node))  # type: ignore[union-attr]
            return kv is not None and json.loads(kv.value).get("agent_pid") == pid

        self.wait_for(registered, timeout_s, f"{node}'s agent (pid {pid}) to register")
        time.sleep(0.3)  # the agent opens its coordinator link right after registering

    def incidents(self) -> list[Incident]:
        assert self.store is not None
        kvs, _ = self.store.get_prefix(self.keys.incidents())
        out = [Incident.from_json(kv.value) for kv in kvs]
        return sorted(out, key=lambda i: i.detected_ts)

    def wait_incident(self, pred: Callable[[Incident], bool], timeout_s: float = 30.0,
                      after: float = 0.0) -> Incident:
        def find() -> Incident | None:
            return next((i for i in self.incidents() if i.detected_ts >= after and pred(i)), None)

        result: Incident = self.wait_for(find, timeout_s, "an incident")
        return result

    def agent_status(self, node: str) -> dict[str, Any] | None:
        assert self.store is not None
        kv = self.store.get(self.keys.status(node))
        return json.loads(kv.value) if kv else None

    # --- direct assignment (tests that drive agents without the decision core) ----------------

    def assign_task(self, task: str, argv: list[str], nodes: list[str], ranks_per_node: int,
                    env: dict[str, str] | None = None, generation: int = 1) -> None:
        """Write assignments running ``argv`` on ``ranks_per_node`` ranks of each of ``nodes``; the
        first node's agent hosts the task's store sidecar (and publishes its address)."""
        assert self.store is not None
        world = len(nodes) * ranks_per_node
        for i, node in enumerate(nodes):
            ranks = [RankSpec(rank=i * ranks_per_node + j, local_rank=j, gpu=j) for j in range(ranks_per_node)]
            ta = TaskAssignment(task=task, generation=generation, argv=argv,
                                env={**(env or {}), "UNICRON_EXTERNAL_STORE": "1"}, world_size=world,
                                ranks=ranks, store_node=nodes[0], group_rank=i, group_world_size=len(nodes))
            self._revision += 1
            na = NodeAssignment(node=node, revision=self._revision, tasks=[ta])
            self.store.put(self.keys.assignment(node), na.to_json())


def _launch(rank: Mapping[str, Any]) -> tuple[int, int]:
    """A rank status's launch: (generation, restart epoch); a newer one supersedes an older."""
    return int(rank.get("generation") or 0), int(rank.get("restart_epoch") or 0)
