"""Resize soak: a seeded random schedule of faults and repairs against one in-place task of the real
training runtime (a small Megatron-core GPT, float64, gloo), on the namespace cluster (every node,
the coordinator and etcd a host of its own; 1 GPU per node, so the task runs one rank per node in
service), with the promises of in-place reconfiguration checked after every move and at the end.

Moves, one at a time, each waited out until the task trains again on every node in service:

* rank faults: SIGKILL, SIGSTOP (a hang), a hang whose process runs (a GPU hang: an injected sleep
  before its next iteration's compute, so its peers wait in the reduction), a raised sev2 (CUDA error)
  or sev3 (connection reset), a SIGKILL whose restart fails too (its relaunched process SIGKILLed
  before it rejoins: the node is isolated and the task shrinks off it);
* node faults (taken only while 2 nodes or more are in service): the node dies (its agent, spawner,
  store sidecar and ranks SIGKILLed; the node hosting the task's store whenever the pick falls on
  it), its link goes down (``ip link``), an XID 79 isolates it (its agent stays up), an operator
  drains it;
* repairs of a node out of service (its agent started again, its link healed, an undrain), taken
  at random so the task visits different data-parallel sizes, and whenever only one node is left.

Checked after each move (each breach one violation):

* the incident it must become, with Table 1's severity (a drain or a repair: no fault at all);
* survivors: every rank process not named by the move (the killed or stopped rank, the node's rank)
  is still the same process afterwards; nothing relaunched the task (no ``Assign`` of a new
  generation, no ``RestartTask``), and every rank still runs the first generation;
* healed within ``--heal-timeout-s``: one live rank per node in service, each past the step the
  task had reached at the move + 2;
* a grow (a repair that re-hosts rank ids) is confirmed by the coordinator no earlier than each of
  its joiners' first committed iteration, on the ranks' own clocks (before the coordinator required it,
  the survivors' steps confirmed grows whose joiners had not joined yet).

And throughout or at the end:

* from each rank identity's log (appended across its processes, one line per committed iteration
  with the process's pid and clock): no iteration redone (the indices strictly increase), never two
  processes committing as one rank at once (their spans do not overlap), and together the ranks
  cover 0..N without a gap. (Forked ranks keep the warm spawner's environment in ``/proc``, so the
  chaos bench's ``/proc`` scan cannot tell their identity; the ranks' own lines can.)
* exactness: the task is cancelled (every rank stops at one agreed commit and writes its
  parameters) and every rank's parameters are bit-identical to a failure-free run of the same N
  iterations on one rank (``--deterministic``: one canonical summation order for any data-parallel
  size): every shrink, grow, restart and reattempt on the way kept the gradient exact.

``heal_s`` per move kind is what the harness observed (move -> healed as defined above, polling
statuses), a soak figure, not a transition time: ``bench/transition.py`` times transitions from the
ranks' own clocks.

    flock /tmp/unicron-heavy.lock .venv/bin/python bench/resize_soak.py [--quick] [--seed N] [--moves N]
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from contextlib import redirect_stdout, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chaos import Tally as ChaosTally  # type: ignore[import-not-found,unused-ignore]
from chaos import alive, progress  # type: ignore[import-not-found,unused-ignore]
from transition import Done, IterLog  # type: ignore[import-not-found,unused-ignore]

from unicron.cli.main import main as cli
from unicron.cluster.launch import LocalJob
from unicron.cluster.localcluster import LocalCluster
from unicron.cluster.netns import unavailable_reason
from unicron.kernel.inject import Injection, request
from unicron.kernel.types import ErrorKind, Incident, Severity, StoreAddress
from unicron.runtime.compare import load_params, max_rel_diff

TASK = "soak"
#: 12 micro-batches per global batch: every data-parallel size from 1 to 4 divides the work, and
#: 4 canonical reduction blocks make the sum's order independent of it
BLOCKS = 4
ARGS = ["--iter-sleep", "0.1", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "64",
        "--dtype", "float64", "--global-batch-size", "24", "--micro-batch-size", "2", "--heartbeat-window", "3",
        "--blocks", str(BLOCKS), "--deterministic"]
#: the runtime's deterministic mode sums every micro-batch's contribution in one canonical order, so
#: the parameters are bit-identical for any history of data-parallel sizes (docs/runtime.md); without
#: it they drift apart by rounding, 2.6e-12 relative after 289 iterations in one run here
TOLERANCE = 0.0
#: whole-task relaunches: an in-place task must never need one
RELAUNCHES = ("Assign", "RestartTask")
RANK_FAULTS = ("rank_kill", "rank_stop", "rank_hang", "raise_sev2", "raise_sev3")
#: moves that may take a node out of service, like the node faults (``restart_dies`` isolates the node
#: of a restart that failed), so they need another node in service
NODE_FAULTS_ALSO = ("restart_dies",)
#: how long a hung rank sleeps: for good, as far as the soak goes
HANG_S = 3600.0
#: iterations after a regroup by which every hang monitor has a baseline (UNICRON_WARMUP_ITERATIONS 3
#: + IterationSettings.min_samples 5), with margin
STEADY_ITERATIONS = 10
#: moves taken in steady state, as a GPU hang mostly comes: there the hung rank's report and its peers'
#: race. Right after a move the warm-up bound finds the hung rank first (its last message is older
#: than its peers'), and the soak would not tell who the coordinator blames
STEADY_KINDS = ("rank_hang",)
NODE_FAULTS = ("node_kill", "partition", "xid", "drain")


@dataclass
class Move:
    kind: str
    ts: float
    #: rank processes the move may end (the rest must survive it)
    ending: set[int] = field(default_factory=set)
    node: str | None = None
    rank: int | None = None
    #: the incident it must become; None: no fault incident at all
    expect: Callable[[Incident], bool] | None = None
    severity: Severity | None = None


@dataclass
class Tally(ChaosTally):  # type: ignore[misc,unused-ignore]  # bench/chaos.py, imported by path
    """The chaos bench's tally (``injected`` counts the moves here) and what this soak adds."""

    dp_sizes: list[int] = field(default_factory=list)
    store_moves: int = 0
    survivors_checked: int = 0
    #: in-place grows whose confirmation was checked against their joiners' first committed iteration
    grows_checked: int = 0


class Soak:
    def __init__(self, c: LocalCluster, rng: random.Random, heal_timeout_s: float) -> None:
        self.c, self.rng, self.heal_timeout_s = c, rng, heal_timeout_s
        self.tally = Tally()
        #: node -> how it left service ("killed", "partitioned", "isolated", "drained")
        self.out: dict[str, str] = {}
        self.generation: int | None = None
        self.iterations = IterLog(c.run_dir, TASK)

    # --- reading the cluster -----------------------------------------------------------------

    def live(self) -> dict[int, dict[str, Any]]:
        """The task's ranks the statuses call running whose process is alive (not a zombie): a status
        is a snapshot, and a cut-off node's cannot have caught up with its ranks' deaths."""
        return {r: info for r, info in self.c.running_ranks(TASK).items() if alive(int(info["pid"]))}

    def in_service(self) -> list[str]:
        return [n for n in self.c.node_names() if n not in self.out]

    def healed(self, past: int) -> dict[int, dict[str, Any]] | None:
        now = self.live()
        world = len(self.in_service())
        if len(now) != world or {str(r["node"]) for r in now.values()} != set(self.in_service()):
            return None
        if not all(isinstance(r.get("step"), int) and r["step"] > past for r in now.values()):
            return None
        return now

    def store_node(self) -> str | None:
        assert self.c.store is not None
        kv = self.c.store.get(self.c.keys.store(TASK))
        return StoreAddress.from_json(kv.value).node if kv is not None else None

    # --- moves -------------------------------------------------------------------------------

    def pick(self) -> tuple[int, dict[str, Any]]:
        ranks = self.live()
        r = self.rng.choice(sorted(ranks))
        return r, ranks[r]

    def m_rank_kill(self) -> Move:
        r, info = self.pick()
        os.kill(int(info["pid"]), signal.SIGKILL)
        return Move("rank_kill", time.time(), {int(info["pid"])}, str(info["node"]), r, severity=Severity.SEV2,
                    expect=lambda i: i.kind is ErrorKind.EXITED_ABNORMALLY and i.rank == r)

    def m_restart_dies(self) -> Move:
        """A rank is SIGKILLed, and so is the process its restart launches, as soon as its node's status
        shows it (before it rejoins): the restart failed (``restart_died``), its node is isolated (sev1)
        and the task shrinks in place off it, the survivors untouched (the escalation relaunched the
        whole task before ``bd51333``). Where the relaunch completed an iteration first, the second
        kill is an ordinary restart: counted apart, as ``restart_dies_late``."""
        r, info = self.pick()
        node, first = str(info["node"]), int(info["pid"])
        hosts_store = self.store_node() == node
        t = time.time()
        os.kill(first, signal.SIGKILL)

        def relaunched(not_pid: int) -> dict[str, Any] | None:
            now = self.c.running_ranks(TASK).get(r)
            return now if now is not None and int(now["pid"]) != not_pid else None

        second: dict[str, Any] = self.c.wait_for(lambda: relaunched(first), 30.0, f"rank {r}'s relaunch",
                                                 poll_s=0.02)
        late = bool(second.get("advanced"))
        with suppress(ProcessLookupError):
            os.kill(int(second["pid"]), signal.SIGKILL)
        outcome = self.c.wait_for(lambda: ("isolated" if self.c.node_state(node) == "isolated" else
                                           "late" if relaunched(int(second["pid"])) is not None else None),
                                  60.0, f"{node} isolated or rank {r} relaunched again", poll_s=0.1)
        if outcome == "isolated" and not late:
            self.out[node] = "isolated"
            self.tally.store_moves += hosts_store
            kind = "restart_dies"
        else:
            kind = "restart_dies_late"
        return Move(kind, t, {first, int(second["pid"])}, node, r, severity=Severity.SEV2,
                    expect=lambda i: i.kind is ErrorKind.EXITED_ABNORMALLY and i.rank == r)

    def m_rank_stop(self) -> Move:
        r, info = self.pick()
        os.kill(int(info["pid"]), signal.SIGSTOP)
        return Move("rank_stop", time.time(), {int(info["pid"])}, str(info["node"]), r, severity=Severity.SEV2,
                    expect=lambda i: i.kind is ErrorKind.TASK_HANG)

    def m_rank_hang(self) -> Move:
        """Only the hung rank may end: restarting a peer that waits for it is a violation, and its
        peers' hang reports must name it (``coordinator.causes.hang_culprit``). Taken in steady state
        (``STEADY_KINDS``)."""
        r, info, ts = self._inject({"fault": "slow", "delay_s": HANG_S, "iterations": 1})
        return Move("rank_hang", ts, {int(info["pid"])}, str(info["node"]), r, severity=Severity.SEV2,
                    expect=lambda i: i.kind is ErrorKind.TASK_HANG and i.rank == r)

    def _inject(self, fault: dict[str, object]) -> tuple[int, dict[str, Any], float]:
        """Inject ``fault`` into a random rank through its agent: (rank, its status, when it was done)."""
        r, info = self.pick()
        assert self.c.store is not None
        ans = request(self.c.store, self.c.keys, str(info["node"]),
                      Injection.from_dict({**fault, "task": TASK, "rank": r}), timeout_s=20.0)
        return r, info, float(ans.executed_ts or time.time())

    def _raise(self, name: str, kind: ErrorKind, sev: Severity, ending: bool) -> Move:
        r, info, ts = self._inject({"fault": "raise", "kind": kind.value})
        return Move(name, ts, {int(info["pid"])} if ending else set(), str(info["node"]), r, severity=sev,
                    expect=lambda i: i.kind is kind and i.rank == r)

    def m_raise_sev2(self) -> Move:
        return self._raise("raise_sev2", ErrorKind.CUDA_ERROR, Severity.SEV2, ending=True)

    def m_raise_sev3(self) -> Move:
        return self._raise("raise_sev3", ErrorKind.CONNECTION_REFUSED_RESET, Severity.SEV3, ending=False)

    def _node(self) -> tuple[str, set[int]]:
        node = self.rng.choice(self.in_service())
        return node, {int(r["pid"]) for r in self.live().values() if r["node"] == node}

    def _note_store(self, node: str) -> None:
        if self.store_node() == node:
            self.tally.store_moves += 1

    def _take_out(self, kind: str, how: str, act: Callable[[str, set[int]], None],
                  error: ErrorKind | None) -> Move:
        """Take a node in service out (``act`` on it and its rank processes): a sev1 ``error`` on it
        is the incident it must become (None: no fault at all)."""
        node, pids = self._node()
        self._note_store(node)
        act(node, pids)
        self.out[node] = how
        if error is None:
            return Move(kind, time.time(), pids, node)
        return Move(kind, time.time(), pids, node, severity=Severity.SEV1,
                    expect=lambda i: i.kind is error and i.node == node)

    def m_node_kill(self) -> Move:
        def kill(node: str, pids: set[int]) -> None:
            os.killpg(self.c.agents[node].pid, signal.SIGKILL)
            for pid in pids:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return self._take_out("node_kill", "killed", kill, ErrorKind.LOST_CONNECTION)

    def m_partition(self) -> Move:
        return self._take_out("partition", "partitioned", lambda node, _: self.c.partition(node),
                              ErrorKind.LOST_CONNECTION)

    def m_xid(self) -> Move:
        def xid(node: str, _: set[int]) -> None:
            assert self.c.store is not None
            request(self.c.store, self.c.keys, node, Injection.from_dict({"fault": "xid", "code": 79, "gpu": 0}),
                    timeout_s=20.0)
        return self._take_out("xid", "isolated", xid, ErrorKind.GPU_DRIVER_ERROR)

    def m_drain(self) -> Move:
        def drain(node: str, _: set[int]) -> None:
            with redirect_stdout(io.StringIO()):
                assert cli(["drain", node]) == 0
        return self._take_out("drain", "drained", drain, None)

    def m_repair(self) -> Move:
        node = self.rng.choice(sorted(self.out))
        how = self.out[node]
        t = time.time()
        if how == "killed":
            self.c.agents[node].wait()
            self.c.start_agent(node)
        elif how == "partitioned":
            self.c.heal(node)
        if how in ("killed", "partitioned"):
            self.c.wait_registered(node)
        # a lost node rejoins by itself; an isolated or drained one stays out until an operator returns it
        state = self.c.wait_for(lambda: (s := self.c.node_state(node)) in ("up", "isolated", "drained") and s,
                                30.0, f"{node} registered", poll_s=0.1)
        if state != "up":
            with redirect_stdout(io.StringIO()):
                assert cli(["undrain", node]) == 0
        del self.out[node]
        return Move(f"repair_{how}", t, set(), node)

    # --- one move ----------------------------------------------------------------------------

    def next_kind(self, round_: list[str]) -> str:
        if len(self.in_service()) <= 1 or (self.out and self.rng.random() < 0.4):
            return "repair"
        if not round_:
            kinds = [*RANK_FAULTS, *NODE_FAULTS, *NODE_FAULTS_ALSO]
            if self.c.net is None:
                kinds.remove("partition")
            round_.extend(self.rng.sample(kinds, len(kinds)))
        return round_.pop()

    def wait_steady(self) -> None:
        """Until every hang monitor is past its warm-up (every regroup resets them)."""
        steady = max(int(r.get("step") or 0) for r in self.live().values()) + STEADY_ITERATIONS
        self.c.wait_for(lambda: self.healed(steady), self.heal_timeout_s, "the monitors past their warm-up",
                        poll_s=0.1)

    def move(self, kind: str) -> None:
        if kind in STEADY_KINDS:
            self.wait_steady()
        before = self.live()
        past = max(int(r.get("step") or 0) for r in before.values())
        m = getattr(self, f"m_{kind}")()
        n = sum(self.tally.injected.values()) + 1
        self.tally.injected[m.kind] += 1
        progress(f"move {n}: {m.kind} {m.node or ''} {'' if m.rank is None else f'rank {m.rank}'} "
                 f"(in service {len(self.in_service())})")
        self.check_incident(m)
        try:
            after: dict[int, dict[str, Any]] = self.c.wait_for(lambda: self.healed(past + 2), self.heal_timeout_s,
                                                               "the task to heal", poll_s=0.1)
        except TimeoutError:
            raise RuntimeError(f"{m.kind} on {m.node}: not healed within {self.heal_timeout_s} s; "
                               f"live ranks {sorted(self.live())}, out {self.out}") from None
        self.tally.heal_s[m.kind].append(time.time() - m.ts)
        progress(f"  healed in {self.tally.heal_s[m.kind][-1]:.2f} s at dp {len(after)}")
        self.tally.dp_sizes.append(len(after))
        self.check_survivors(m, before, after)
        self.check_grow(m, before, after)

    def check_incident(self, m: Move) -> None:
        if m.expect is None:
            return
        try:
            inc = self.c.wait_incident(lambda i: i.task in (None, TASK) and m.expect is not None and m.expect(i),
                                       timeout_s=30.0, after=m.ts - 1.0)
        except TimeoutError:
            self.tally.violate(f"{m.kind} on {m.node} rank {m.rank}: no incident")
            return
        if inc.severity is not m.severity and not (inc.severity is Severity.SEV3 and inc.handled):
            self.tally.violate(f"{m.kind}: incident {inc.kind.value} is {inc.severity}, expected {m.severity}")

    def check_survivors(self, m: Move, before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]]) -> None:
        kept = {int(r["pid"]) for r in before.values()} - m.ending
        now = {int(r["pid"]) for r in after.values()}
        self.tally.survivors_checked += len(kept)
        if not kept <= now:
            self.tally.violate(f"{m.kind} on {m.node}: survivors restarted: {sorted(kept - now)}")
        gens = {int(r["generation"]) for r in after.values()}
        self.generation = self.generation if self.generation is not None else min(gens)
        if gens != {self.generation}:
            self.tally.violate(f"{m.kind}: generations {sorted(gens)}, the task started at {self.generation}")
        acts = self.c.actions(m.ts - 1.0)
        relaunches = [a for a in acts if str(a.get("action")) in RELAUNCHES]
        if relaunches:
            self.tally.violate(f"{m.kind}: the task was relaunched: {relaunches}")
        if m.kind == "drain" or m.kind.startswith("repair"):
            # no fault: only the resize (a drained store node's hand-over breaks the iteration in
            # flight: the ranks' sev3 reports of it are its echo, and a hang reported while they
            # regroup is marked handled; neither makes an action)
            faults = [i for i in self.c.incidents() if i.detected_ts >= m.ts and i.severity in (Severity.SEV1,
                      Severity.SEV2) and i.node == m.node and not i.handled]
            others = [a for a in acts if a["ts"] >= m.ts and str(a.get("action")) != "ResizeInPlace"]
            if faults or others:
                self.tally.violate(f"{m.kind} on {m.node}: incidents {[i.kind.value for i in faults]}, "
                                   f"actions {[a.get('action') for a in others]}")

    def check_grow(self, m: Move, before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]]) -> None:
        """A grow is confirmed no earlier than its joiners' first committed iteration, on the ranks' own
        clocks (their ``iteration N done`` lines): the survivors step on without the joiners until they
        are admitted, so their steps prove nothing about it."""
        joiners = {r: int(after[r]["pid"]) for r in set(after) - set(before)}
        resized = next((float(a["ts"]) for a in self.c.actions(m.ts) if a.get("action") == "ResizeInPlace"), None)
        if not joiners or resized is None:
            return

        def first_done() -> float | None:
            """When the last joiner committed its first iteration (a joiner's status may show a step it
            began, not one it committed)."""
            firsts: dict[int, float] = {}
            for d in self.iterations.after(m.ts):
                if joiners.get(d.rank) == d.pid:
                    firsts[d.rank] = min(d.ts, firsts.get(d.rank, d.ts))
            return max(firsts.values()) if set(firsts) == set(joiners) else None

        try:
            at = self.c.wait_for(lambda: confirmed_after(self.c, resized), 10.0, "the grow confirmed", poll_s=0.1)
            first = self.c.wait_for(first_done, 10.0, "a joiner's committed iteration", poll_s=0.1)
        except TimeoutError as exc:
            self.tally.violate(f"{m.kind} on {m.node}: {exc}")
            return
        self.tally.grows_checked += 1
        if at < first:
            self.tally.violate(f"{m.kind} on {m.node}: the grow was confirmed at {at:.3f}, before joiners "
                               f"{sorted(joiners)} committed an iteration ({first:.3f})")



# --- the end ---------------------------------------------------------------------------------


def confirmed_after(c: LocalCluster, since: float) -> float | None:
    """When the coordinator next confirmed a recovery of the task (a ``--progress--> running`` edge)."""
    return next((float(r["ts"]) for r in c.coordinator_log(since)
                 if r.get("event") == "transition" and "--progress--> running" in str(r.get("edge"))), None)


def iteration_order(log: IterLog) -> list[str]:
    """Breaches in what each rank identity's log (appended across its processes) shows: an iteration
    redone (its indices must strictly increase), two processes committing as one rank at once (their
    first-to-last commit spans overlap), or an iteration no rank committed."""
    bad: list[str] = []
    by_rank: dict[int, list[Done]] = defaultdict(list)
    for d in log.poll():
        by_rank[d.rank].append(d)
    for rank, done in sorted(by_rank.items()):
        back = [(a.it, b.it) for a, b in itertools.pairwise(done) if b.it <= a.it]
        if back:
            bad.append(f"rank {rank} committed iteration {back[0][1]} after {back[0][0]}")
        spans: dict[int, tuple[float, float]] = {}
        for d in done:
            first, last = spans.get(d.pid, (d.ts, d.ts))
            spans[d.pid] = (min(first, d.ts), max(last, d.ts))
        ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
        for (p, (_, end)), (q, (start, _)) in itertools.pairwise(ordered):
            if start <= end:
                bad.append(f"rank {rank}: processes {p} and {q} both committed iterations in {start:.3f}-{end:.3f}")
    seen = {d.it for done in by_rank.values() for d in done}
    missing = sorted(set(range(max(seen, default=-1) + 1)) - seen)
    if missing:
        bad.append(f"iterations {missing[:10]} committed by no rank")
    return bad


def stop_and_compare(c: LocalCluster, out: Path, work: Path, tally: Tally) -> dict[str, Any]:
    """Cancel the task (its ranks stop at one agreed commit and write their parameters), and compare
    every rank's parameters to a failure-free run. (The runtime's own stop key would do the same, but
    to the coordinator ranks stopping unasked are a preemption, and it relaunches the task.)"""
    running = {r: int(info["pid"]) for r, info in c.running_ranks(TASK).items()}
    t0 = time.time()
    with redirect_stdout(io.StringIO()):
        assert cli(["cancel", TASK]) == 0
    c.wait_for(lambda: not any(alive(pid) for pid in running.values()), 120.0, "every rank to exit", poll_s=0.2)
    # written at this stop (a rank that left earlier wrote its own, older outputs under the same name)
    results = {r: json.loads((out / f"rank{r}.json").read_text()) for r in running
               if (out / f"rank{r}.json").exists() and (out / f"rank{r}.json").stat().st_mtime >= t0}
    if set(results) != set(running):
        tally.violate(f"ranks {sorted(set(running) - set(results))} of {sorted(running)} wrote no outputs at the stop")
    if not results:
        return {"ranks_compared": 0}
    iterations = {int(r["iterations"]) for r in results.values()}
    if len(iterations) != 1:
        tally.violate(f"the ranks stopped after different iteration counts: {sorted(iterations)}")
    n = max(iterations)
    job = LocalJob(1, ["--iterations", str(n), *ARGS], str(work / "reference"))
    with job:
        codes = job.wait(300.0)
    if any(code != 0 for code in codes.values()):
        tally.violate(f"the reference run failed: {codes}")
        return {"ranks_compared": 0, "iterations": n}
    ref = load_params(job.params_path(0))
    diffs = {r: max_rel_diff(load_params(str(out / f"rank{r}.pt")), ref) for r in sorted(results)}
    for r, d in diffs.items():
        if d > TOLERANCE:
            tally.violate(f"rank {r}: parameters differ from the failure-free run by {d:.3e} > {TOLERANCE}")
    return {"ranks_compared": len(diffs), "iterations": n, "max_rel_diff": max(diffs.values())}


def run(seed: int, moves: int, agents: int, heal_timeout_s: float) -> dict[str, Any]:
    reason = unavailable_reason()
    netns = reason is None
    if not netns:
        progress(f"no namespaces ({reason}): loopback cluster, no partitions")
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="unicron-resize-soak-"))
    out = work / "out"
    # a rank stopped before its hang detector has a baseline (right after a launch or a relaunch) is
    # found after UNICRON_WARMUP_HANG_S; the default (30 min) is for real jobs (as in bench/chaos.py)
    env = {"UNICRON_STATUS_INTERVAL": "0.2", "UNICRON_WARMUP_ITERATIONS": "3", "UNICRON_WARMUP_HANG_S": "10"}
    started = time.monotonic()
    with LocalCluster(agents=agents, gpus_per_agent=1, netns=netns, extra_env=env) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        soak = Soak(c, rng, heal_timeout_s)
        spec = work / "job.json"
        command = [sys.executable, "-m", "unicron.runtime.train", "--iterations", "0", *ARGS, "--log-iterations",
                   "--out-dir", str(out)]
        # the ranks' own log lines (recovery steps, store moves) in their agents' logs, for triage
        spec.write_text(json.dumps({"name": TASK, "command": command, "min_gpus": 1,
                                    "env": {"UNICRON_LOG_LEVEL": "INFO"}}))
        with redirect_stdout(io.StringIO()):
            assert cli(["submit", str(spec)]) == 0
        c.wait_for(lambda: soak.healed(2), 240.0, f"the task on {agents} ranks", poll_s=0.2)
        progress(f"task training on {agents} ranks; logs in {c.run_dir}")
        round_: list[str] = []
        completed = True
        try:
            while sum(soak.tally.injected.values()) < moves:
                soak.move(soak.next_kind(round_))
            while soak.out:  # every node back before the end: the stop needs no node out of service
                soak.move("repair")
        except Exception as exc:  # the end checks and the JSON line must still come
            traceback.print_exc()
            soak.tally.violate(f"schedule ended: {type(exc).__name__}: {exc}")
            completed = False
        exact = stop_and_compare(c, out, work, soak.tally) if completed else {}
        order = iteration_order(soak.iterations)  # read on from where the grow checks left off
        for what in order:
            soak.tally.violate(what)
        os.environ.pop("UNICRON_ETCD", None)
    t = soak.tally
    heal = {k: {"n": len(v), "p50_s": round(statistics.median(v), 2), "min_s": round(min(v), 2),
                "max_s": round(max(v), 2)} for k, v in sorted(t.heal_s.items())}
    return {"seed": seed, "netns": netns, "agents": agents, "moves": sum(t.injected.values()),
            "per_kind": dict(sorted(t.injected.items())), "invariant_violations": len(t.violations),
            "violations": t.violations[:20], "store_moves": t.store_moves,
            "survivor_processes_checked": t.survivors_checked, "grows_checked": t.grows_checked,
            "dp_sizes_visited": sorted(set(t.dp_sizes)),
            "exact": exact, "heal": heal, "wall_s": round(time.monotonic() - started, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description="in-place resize soak on the namespace cluster")
    ap.add_argument("--quick", action="store_true", help="a short schedule on 3 nodes")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--moves", type=int, default=None, help="moves (faults and repairs; default 40, quick 4)")
    ap.add_argument("--heal-timeout-s", type=float, default=120.0)
    args = ap.parse_args()
    moves = args.moves or (4 if args.quick else 40)
    print(json.dumps(run(args.seed, moves, 3 if args.quick else 4, args.heal_timeout_s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
