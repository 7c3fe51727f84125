"""Chaos suite: a seeded random schedule of every fault the harness knows, on the namespace cluster
(every node, coordinator and etcd member a host of its own; etcd 3 members; a leader and a standby
coordinator) with two tasks training, and invariants checked throughout.

Faults: rank SIGKILL, rank SIGSTOP, a raised exception of each severity (sev1 ECC, sev2 CUDA, sev3
connection reset), a simulated GPU XID, agent SIGKILL, node partition (its link down), coordinator
leader SIGKILL, coordinator leader partition, etcd member SIGKILL, whole-etcd outage. One at a time:
inject, wait for the incident it must become (kind and severity; none for the control-plane faults),
repair what an operator or systemd would (restart a killed daemon, undrain an isolated node, heal a
link, restart etcd), and wait until the cluster is healed: both tasks running at their GPUs (each
rank the statuses list a live process holding that identity), every node up, a leader, progress.
``heal_s``: fault -> healed, per kind; the fault's moment is the bench's own kill/stop stamp, or for
an injected raise or XID the incident's ``source_ts`` (the rank's raise, the simulated XID's stamp;
before 2026-11-28 it was read after the injection request returned, after the fault).

Invariants, checked every 0.2 s by a watcher thread and at the end (each breach one violation):

* no task lost or duplicated: both tasks in the decision state, never failed, each (task, rank) at
  most once in the nodes' statuses;
* no completed iteration lost beyond the in-flight one: a task's ranks resume from its committed
  step (the ranks are a torch-free stepper that commits its step to a file of its task: this checks
  that a relaunched rank gets its task's identity and state back, not the runtime's checkpoint
  restore, which tests/integration/test_recovery.py covers);
* every injected fault becomes an incident of the right severity (or a handled sev3), and the
  control-plane faults none (no false node loss); the cluster heals within ``heal_timeout_s``;
* never two live processes with one rank identity: every process on the machine is read from
  ``/proc`` (its environ's UNICRON_TASK, RANK), across namespaces (they share the PID namespace);
  an overlap longer than ``overlap_grace_s`` is a violation (a kill-then-launch overlaps never);
* no write from a deposed leader accepted: every ``action`` line a coordinator logs (logged only
  after its fenced write succeeded) falls while it was the latest coordinator elected.

    flock /tmp/unicron-heavy.lock .venv/bin/python bench/chaos.py [--quick] [--seed N] [--faults N]

Also the realistic false-alarm soak (``bench/soak.py``) runs first: ``false_alarms``. The last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import soak  # type: ignore[import-not-found,unused-ignore]  # bench/soak.py: the realistic false-alarm soak

from coordinator.statestore import read_state
from unicron.cli.main import main as cli
from unicron.cluster.etcd_server import EtcdCluster
from unicron.cluster.localcluster import LocalCluster
from unicron.cluster.netns import unavailable_reason
from unicron.kernel.inject import Injection, request
from unicron.kernel.procs import DEAD_STATES, proc_state
from unicron.kernel.types import ErrorKind, Incident, Severity

TASKS = ("alpha", "beta")
LEADER_TTL_S = 3

#: a torch-free rank: resumes from its task's committed step, reports one iteration per 0.1 s through
#: the agent socket (so raised injections, hangs and SIGSTOP work), and commits each step (rank 0)
STEPPER = (
    "import os, sys, time\n"
    "from unicron.kernel.client import AgentClient\n"
    "path = os.path.join(sys.argv[1], os.environ['UNICRON_TASK'])\n"
    "c = AgentClient.from_env().connect()\n"
    "c.install_excepthook()\n"
    "step = int(open(path).read()) if os.path.exists(path) else 0\n"
    "print('resumed', step, flush=True)\n"
    "while True:\n"
    "    with c.iteration(step): time.sleep(0.1)\n"
    "    step += 1\n"
    "    if os.environ['RANK'] == '0':\n"
    "        with open(path + '.tmp', 'w') as f: f.write(str(step))\n"
    "        os.replace(path + '.tmp', path)\n"
)


@dataclass
class Fault:
    kind: str
    ts: float
    node: str | None = None
    task: str | None = None
    rank: int | None = None
    expect: Callable[[Incident], bool] | None = None  # the incident it must become; None: none at all
    severity: Severity | None = None
    repair: Callable[[], None] | None = None  # what an operator or systemd does after it
    detail: str = ""
    #: the expected incident's ``source_ts`` is the fault's own stamp (the rank's raise, the simulated
    #: XID): heal_s starts there, not at ``ts`` (the agent's delivery, a fallback when none came)
    stamped: bool = False


@dataclass
class Tally:
    injected: Counter[str] = field(default_factory=Counter)
    heal_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    violations: list[str] = field(default_factory=list)
    overlaps: list[float] = field(default_factory=list)

    def violate(self, what: str) -> None:
        print(f"VIOLATION: {what}", file=sys.stderr, flush=True)
        self.violations.append(what)


START = time.monotonic()


def progress(msg: str) -> None:
    """With the UTC wall clock too: the daemons' logs are stamped with it, and a fault is matched to what
    they logged by it."""
    now = time.time()
    stamp = time.strftime("%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}"
    print(f"{time.monotonic() - START:7.1f}s {stamp} {msg}", file=sys.stderr, flush=True)


# --- /proc: who claims which rank identity -------------------------------------------------------


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie), read from /proc."""
    state = proc_state(pid)
    return state is not None and state not in DEAD_STATES


def rank_processes() -> dict[tuple[str, int], list[int]]:
    """(task, rank) -> live PIDs whose environment names them (zombies left out), read from /proc."""
    out: dict[tuple[str, int], list[int]] = defaultdict(list)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            env = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue
        if b"UNICRON_TASK=" not in env or not alive(int(entry.name)):
            continue
        fields = dict(kv.split(b"=", 1) for kv in env.split(b"\0") if b"=" in kv)
        task, rank = fields.get(b"UNICRON_TASK"), fields.get(b"RANK")
        # the agent's own helpers (store sidecar, marker) carry the task but no RANK
        if task and rank is not None and task.decode() in TASKS:
            out[(task.decode(), int(rank))].append(int(entry.name))
    return out


class Chaos:
    def __init__(self, c: LocalCluster, rng: random.Random, steps_dir: Path, heal_timeout_s: float) -> None:
        self.c = c
        self.rng = rng
        self.steps_dir = steps_dir
        self.heal_timeout_s = heal_timeout_s
        self.tally = Tally()
        self.partitioned: set[str] = set()
        self._stop = threading.Event()
        self._overlap_since: dict[tuple[str, int], float] = {}
        self._high: dict[str, int] = {}  # task -> highest committed step seen
        self.overlap_grace_s = 1.0
        self._reported: set[tuple[str, int]] = set()
        #: most rank identities one /proc scan found (shows the scan sees the ranks at all)
        self.identities_seen_max = 0

    # --- reading the cluster -----------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        assert self.c.store is not None
        state, _, _ = read_state(self.c.store, self.c.keys)  # the state is split over several keys
        return dict(state.to_dict()) if state is not None else {}

    def tasks(self) -> dict[str, Any]:
        buf = io.StringIO()
        with redirect_stdout(buf):
            if cli(["tasks", "--json"]) != 0:
                return {}
        return {t["name"]: t for t in json.loads(buf.getvalue())}

    def running(self, task: str) -> dict[int, dict[str, Any]]:
        """The task's ranks that the nodes' statuses call running and that are live processes holding
        that identity now. A status is a snapshot: a node cut off from etcd (a partition) cannot yet
        have rewritten it after its ranks died, and seed 41 aimed a kill at such a rank (the pid was
        gone) and took the cluster for healed while that node's new ranks had not started."""
        live = rank_processes()
        return {r: info for r, info in self.c.running_ranks(task).items()
                if int(info["pid"]) in live.get((task, r), [])}

    def committed(self, task: str) -> int:
        with contextlib.suppress(OSError, ValueError):
            return int((self.steps_dir / task).read_text())
        return 0

    def healed(self) -> bool:
        if self.c.leader_pid() is None:
            return False
        if any(self.c.node_state(n) != "up" for n in self.c.node_names()):
            return False
        tasks = self.tasks()
        for t in TASKS:
            info = tasks.get(t)
            if info is None or info["phase"] != "running" or len(self.running(t)) != info["gpus"]:
                return False
        return True

    # --- invariants --------------------------------------------------------------------------

    def watch(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.check_once()
            except Exception as exc:  # etcd down: the statuses cannot be read now; /proc still can
                if "etcd" not in type(exc).__name__.lower() and "Store" not in type(exc).__name__:
                    progress(f"watch: {type(exc).__name__}: {exc}")
                with contextlib.suppress(Exception):
                    self.check_identities()

    def check_once(self) -> None:
        self.check_identities()
        for t in TASKS:
            step = self.committed(t)
            high = self._high.get(t, 0)
            if step < high - 1:
                self.tally.violate(f"task {t}: committed step went back from {high} to {step}")
            self._high[t] = max(high, step)

    def check_identities(self) -> None:
        now = time.monotonic()
        live = rank_processes()
        self.identities_seen_max = max(self.identities_seen_max, len(live))
        for ident, pids in live.items():
            if len(pids) > 1:
                since = self._overlap_since.setdefault(ident, now)
                if now - since > self.overlap_grace_s and ident not in self._reported:
                    self._reported.add(ident)
                    self.tally.violate(f"rank {ident} held by {len(pids)} live processes {pids} for "
                                       f"{now - since:.1f} s (partitioned: {sorted(self.partitioned)})")
            elif ident in self._overlap_since:
                self.tally.overlaps.append(now - self._overlap_since.pop(ident))
                self._reported.discard(ident)
        for ident in set(self._overlap_since) - set(live):
            self.tally.overlaps.append(now - self._overlap_since.pop(ident))
            self._reported.discard(ident)

    def check_tasks(self) -> int:
        """Tasks lost: missing from the decision state or failed (a violation each)."""
        lost = 0
        tasks = self.state().get("tasks", {})
        for t in TASKS:
            phase = tasks.get(t, {}).get("phase")
            if phase not in ("running", "restarting", "reattempting", "reconfiguring", "pending"):
                lost += 1
                self.tally.violate(f"task {t} lost: phase {phase}")
        for t in TASKS:
            ranks = [r["rank"] for n in self.c.node_names() for r in (self.c.agent_status(n) or {}).get("ranks", [])
                     if r.get("task") == t and r.get("state") == "running"]
            dup = [r for r, k in Counter(ranks).items() if k > 1]
            if dup:
                self.tally.violate(f"task {t}: ranks {dup} running on two nodes")
        return lost

    def check_fencing(self) -> None:
        """Every coordinator's 'action' lines fall while it was the latest coordinator elected."""
        elections: list[tuple[float, int]] = []
        actions: list[tuple[float, int, str]] = []
        for i in self.c.coordinators:
            for r in self.c.coordinator_log(0.0, i):
                if r.get("event") == "elected leader":
                    elections.append((r["ts"], i))
                elif r.get("event") == "action":
                    actions.append((r["ts"], i, str(r.get("action"))))
        elections.sort()
        for ts, i, what in actions:
            before = [who for t, who in elections if t <= ts]
            if not before or before[-1] != i:
                self.tally.violate(f"coordinator {i} acted ({what}) at {ts:.3f} while "
                                   f"{before[-1] if before else 'nobody'} led")

    # --- faults ------------------------------------------------------------------------------

    def pick_rank(self) -> tuple[str, int, dict[str, Any]]:
        t = self.rng.choice(TASKS)
        ranks = self.running(t)
        r = self.rng.choice(sorted(ranks))
        return t, r, ranks[r]

    def signal_rank(self, sig: signal.Signals) -> tuple[str, int, dict[str, Any]]:
        """Send ``sig`` to a live rank; one that exits between the pick and the signal is picked again."""
        for _ in range(5):
            t, r, info = self.pick_rank()
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(info["pid"]), sig)
                return t, r, info
            time.sleep(0.2)
        raise RuntimeError(f"no live rank took {sig.name} in 5 picks")

    def f_rank_kill(self) -> Fault:
        t, r, info = self.signal_rank(signal.SIGKILL)
        return Fault("rank_sigkill", time.time(), info["node"], t, r, severity=Severity.SEV2,
                     expect=lambda i: i.kind is ErrorKind.EXITED_ABNORMALLY and i.task == t and i.rank == r)

    def f_rank_stop(self) -> Fault:
        t, r, info = self.signal_rank(signal.SIGSTOP)
        return Fault("rank_sigstop", time.time(), info["node"], t, r, severity=Severity.SEV2,
                     expect=lambda i: i.kind is ErrorKind.TASK_HANG and i.task == t)

    def _raise(self, name: str, kind: ErrorKind, sev: Severity) -> Fault:
        t, r, info = self.pick_rank()
        assert self.c.store is not None
        node = str(info["node"])
        ans = request(self.c.store, self.c.keys, node, Injection.from_dict({"fault": "raise", "kind": kind.value,
                                                                            "task": t, "rank": r}), timeout_s=20.0)
        repair = (lambda: self.undrain(node)) if sev is Severity.SEV1 else None
        return Fault(name, float(ans.executed_ts or time.time()), node, t, r, severity=sev, repair=repair,
                     expect=lambda i: i.kind is kind and i.task == t and i.rank == r, stamped=True)

    def f_raise_sev1(self) -> Fault:
        return self._raise("raise_sev1_ecc", ErrorKind.ECC_ERROR, Severity.SEV1)

    def f_raise_sev2(self) -> Fault:
        return self._raise("raise_sev2_cuda", ErrorKind.CUDA_ERROR, Severity.SEV2)

    def f_raise_sev3(self) -> Fault:
        return self._raise("raise_sev3_conn_reset", ErrorKind.CONNECTION_REFUSED_RESET, Severity.SEV3)

    def f_xid(self) -> Fault:
        info = self.pick_rank()[2]
        node, gpu = str(info["node"]), int(info.get("gpu", 0))
        assert self.c.store is not None
        ans = request(self.c.store, self.c.keys, node, Injection.from_dict({"fault": "xid", "code": 79, "gpu": gpu}),
                      timeout_s=20.0)  # right after an etcd outage the agent's watch is still resuming
        return Fault("xid", float(ans.executed_ts or time.time()), node, severity=Severity.SEV1,
                     repair=lambda: self.undrain(node),
                     expect=lambda i: i.kind is ErrorKind.GPU_DRIVER_ERROR and i.node == node, stamped=True)

    def busy_node(self) -> str:
        return str(self.pick_rank()[2]["node"])

    def f_agent_kill(self) -> Fault:
        node = self.busy_node()
        os.kill(self.c.agents[node].pid, signal.SIGKILL)

        def repair() -> None:
            self.c.agents[node].wait()
            self.c.start_agent(node)
            self.rejoin(node)
        return Fault("agent_sigkill", time.time(), node, severity=Severity.SEV1, repair=repair,
                     expect=lambda i: i.kind is ErrorKind.LOST_CONNECTION and i.node == node)

    def f_partition(self) -> Fault:
        node = self.busy_node()
        self.c.partition(node)
        self.partitioned.add(node)
        t = time.time()

        def repair() -> None:
            time.sleep(max(0.0, t + 2.0 - time.time()))  # cut off for 2 s at least
            self.c.heal(node)
            self.partitioned.discard(node)
            self.rejoin(node)
        return Fault("node_partition", t, node, severity=Severity.SEV1, repair=repair,
                     expect=lambda i: i.kind is ErrorKind.LOST_CONNECTION and i.node == node)

    def f_leader_kill(self) -> Fault:
        old = self.c.leader_index()
        os.kill(self.c.coordinators[old].pid, signal.SIGKILL)
        return Fault("leader_sigkill", time.time(), f"coord{old}", repair=lambda: self.c.restart_coordinator(old))

    def f_leader_partition(self) -> Fault:
        old = self.c.leader_index()
        host = f"coord{old}"
        self.c.partition(host)
        t = time.time()

        def repair() -> None:
            self.c.wait_for(lambda: self.c.leader_pid() not in (None, self.c.coordinators[old].pid),
                            LEADER_TTL_S + 10.0, "the standby to lead")
            time.sleep(max(0.0, t + LEADER_TTL_S + 2.0 - time.time()))
            self.c.heal(host)
            self.c.coordinators[old].wait(timeout=30.0)  # it is fenced and exits
            self.c.restart_coordinator(old)
        return Fault("leader_partition", t, host, repair=repair)

    def f_etcd_member_kill(self) -> Fault:
        assert isinstance(self.c.etcd, EtcdCluster)
        m = self.rng.choice(self.c.etcd.members)
        m.kill()

        def repair() -> None:
            time.sleep(1.0)
            m.launch()
            m.wait_ready(30.0)
        return Fault("etcd_member_sigkill", time.time(), m.name, repair=repair)

    def f_etcd_outage(self, outage_s: float) -> Fault:
        assert isinstance(self.c.etcd, EtcdCluster)
        self.c.etcd.kill()
        t = time.time()

        def repair() -> None:
            time.sleep(max(0.0, t + outage_s - time.time()))
            self.c.etcd.start()
        return Fault("etcd_outage", t, repair=repair)

    def rejoin(self, node: str) -> None:
        """A node whose link was lost is isolated (sev1) or lost (lease expired): once its agent is
        registered again, an operator undrains it if it is isolated (a lost node rejoins by itself)."""
        self.c.wait_registered(node)
        state = self.c.wait_for(lambda: (s := self.c.node_state(node)) in ("up", "isolated") and s, 20.0,
                                f"{node} back (up or isolated)", poll_s=0.1)
        if state == "isolated":
            self.undrain(node)

    def undrain(self, node: str) -> None:
        self.c.wait_for(lambda: self.c.node_state(node) == "isolated", 20.0, f"{node} isolated")
        time.sleep(0.5)
        with redirect_stdout(io.StringIO()):
            assert cli(["undrain", node]) == 0

    # --- one round -------------------------------------------------------------------------

    def inject(self, kind: str, outage_s: float) -> None:
        before = time.time()
        fault = self.f_etcd_outage(outage_s) if kind == "etcd_outage" else getattr(self, f"f_{kind}")()
        self.tally.injected[fault.kind] += 1
        progress(f"fault {sum(self.tally.injected.values())}: {fault.kind} {fault.node or ''} "
                 f"{fault.task or ''} {'' if fault.rank is None else fault.rank}")
        healing_from = fault.ts
        if fault.expect is not None:
            try:
                inc = self.c.wait_incident(fault.expect, timeout_s=20.0, after=before - 0.5)
                if fault.stamped:
                    healing_from = inc.source_ts
                if inc.severity is not fault.severity and not (inc.severity is Severity.SEV3 and inc.handled):
                    self.tally.violate(f"{fault.kind}: incident {inc.kind.value} is {inc.severity}, "
                                       f"expected {fault.severity}")
            except TimeoutError:
                self.tally.violate(f"{fault.kind} on {fault.node} {fault.task} {fault.rank}: no incident")
        if fault.repair is not None:
            fault.repair()
        try:
            self.c.wait_for(self.healed, self.heal_timeout_s, "the cluster to heal", poll_s=0.2)
            self.tally.heal_s[fault.kind].append(time.time() - healing_from)
            progress(f"  healed in {self.tally.heal_s[fault.kind][-1]:.2f} s")
        except TimeoutError:
            self.tally.violate(f"{fault.kind}: not healed within {self.heal_timeout_s} s: {self.tasks()}")
            self.c.wait_for(self.healed, 120.0, "the cluster to heal at last", poll_s=0.5)
        if fault.expect is None:  # a control-plane fault: no node may have been taken for lost
            false = [i for i in self.c.incidents() if i.detected_ts >= before
                     and i.kind is ErrorKind.LOST_CONNECTION]
            for i in false:
                self.tally.violate(f"{fault.kind}: false node loss {i.node} ({i.message})")
        # progress after healing: every task's committed step moves
        steps = {t: self.committed(t) for t in TASKS}
        self.c.wait_for(lambda: all(self.committed(t) > steps[t] for t in TASKS), 20.0, "progress", poll_s=0.1)


KINDS = ["rank_kill", "rank_stop", "raise_sev1", "raise_sev2", "raise_sev3", "xid", "agent_kill", "partition",
         "leader_kill", "leader_partition", "etcd_member_kill", "etcd_outage"]


def submit(c: LocalCluster, steps_dir: Path, spec_dir: Path) -> None:
    for t in TASKS:
        spec = spec_dir / f"{t}.json"
        spec.write_text(json.dumps({"name": t, "command": [sys.executable, "-c", STEPPER, str(steps_dir)],
                                    "min_gpus": 2}))
        with redirect_stdout(io.StringIO()):
            assert cli(["submit", str(spec)]) == 0


def play(inject: Callable[[str, float], None], tally: Tally, rng: random.Random, faults: int, t_end: float,
         outage_s: float, stop_file: str | None) -> None:
    """Inject rounds of every kind in a seeded order (each kind once per round) until ``faults`` are
    in, the monotonic deadline ``t_end`` passes or ``stop_file`` exists.

    Whatever stops a round ends the schedule as one violation, and returns: the end checks and the
    JSON line must still come. Not only a cluster that never healed (TimeoutError): two full runs
    ended in a traceback and no figures because an injection its agent never executed raised
    TemporaryError from ``inject.request``, and a harness bug must not hide the run either (its
    traceback is printed for triage, and it counts as a violation, so it cannot pass unseen)."""
    schedule: list[str] = []
    try:
        while (sum(tally.injected.values()) < faults and time.monotonic() < t_end
               and not (stop_file and os.path.exists(stop_file))):
            if not schedule:
                schedule = rng.sample(KINDS, len(KINDS))
            inject(schedule.pop(), outage_s)
    except Exception as exc:
        traceback.print_exc()
        tally.violate(f"schedule ended: {type(exc).__name__}: {exc}")
        progress(f"schedule ended early: {type(exc).__name__}: {exc}")


def run(seed: int, faults: int, budget_s: float, agents: int, outage_s: float,
        heal_timeout_s: float = 45.0, stop_file: str | None = None) -> dict[str, Any]:
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"chaos: the namespace cluster is unavailable: {reason}")
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="unicron-chaos-"))
    steps_dir = work / "steps"
    steps_dir.mkdir()
    c = LocalCluster(agents=agents, gpus_per_agent=2, netns=True, etcd_members=3, coordinators=2,
                     extra_env={"UNICRON_LEADER_TTL": str(LEADER_TTL_S), "UNICRON_WARMUP_ITERATIONS": "3",
                                # a rank stopped before it has a baseline (right after a launch) is
                                # found after this long; the default (30 min) is for real jobs
                                "UNICRON_WARMUP_HANG_S": "10",
                                "UNICRON_PREFORK": ""})
    with c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        chaos = Chaos(c, rng, steps_dir, heal_timeout_s)
        submit(c, steps_dir, work)
        c.wait_for(chaos.healed, 90.0, "both tasks to run")
        progress(f"cluster up, both tasks running; logs in {c.run_dir}")
        watcher = threading.Thread(target=chaos.watch, daemon=True)
        watcher.start()
        try:
            play(chaos.inject, chaos.tally, rng, faults, time.monotonic() + budget_s, outage_s, stop_file)
        finally:
            chaos._stop.set()
            watcher.join()
        chaos.check_identities()
        tasks_lost = chaos.check_tasks()
        chaos.check_fencing()
        os.environ.pop("UNICRON_ETCD", None)
    tally = chaos.tally
    heal = {k: {"n": len(v), "p50_s": round(statistics.median(v), 2), "max_s": round(max(v), 2)}
            for k, v in sorted(tally.heal_s.items())}
    return {
        "seed": seed, "faults_injected": sum(tally.injected.values()), "per_kind": dict(sorted(tally.injected.items())),
        "invariant_violations": len(tally.violations), "violations": tally.violations[:20], "tasks_lost": tasks_lost,
        "heal": heal, "rank_identity_overlaps": len(tally.overlaps),
        "rank_identity_overlap_max_s": round(max(tally.overlaps), 2) if tally.overlaps else 0.0,
        "rank_identities_seen_max": chaos.identities_seen_max,
        "committed_steps": {t: chaos.committed(t) for t in TASKS},
        # reads in the harness's own waits that failed and were asked again (etcd faults, stalls)
        "wait_temporary_errors": c.temporary_errors,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description="chaos suite on the namespace cluster")
    ap.add_argument("--quick", action="store_true", help="a short schedule (under a minute)")
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--faults", type=int, default=None, help="faults to inject (default 200; quick: 6)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop injecting after this long")
    ap.add_argument("--stop-file", default="/tmp/unicron-chaos.stop",
                    help="end the schedule early once this file exists (the end checks and the JSON line still come)")
    args = ap.parse_args()
    faults = args.faults or (6 if args.quick else 200)
    budget = args.budget_s or (20.0 if args.quick else 20 * 60.0)
    t0 = time.monotonic()
    soaked = soak.soak([args.seed], 2 if args.quick else 8, 3000 if args.quick else 20000, soak.IterationSettings())
    progress(f"soak: {soaked}")
    out = run(args.seed, faults, budget, agents=3 if args.quick else 4, outage_s=3.0 if args.quick else 8.0,
              stop_file=args.stop_file)
    out |= {"false_alarms": soaked["false_alarms"], "soak": soaked, "wall_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
