"""Reconfiguration in place end to end (issue 13 items 1 and 4): real etcd, a coordinator, three agents
and real ``unicron train`` ranks (float64). The node hosting the task's store (rank 0's) is killed (its agent,
store sidecar and ranks SIGKILLed): the task shrinks in place (``ResizeInPlace``, same generation), the
store moves to a surviving node, the survivors keep their processes, no completed iteration is redone,
and the parameters after the run equal a failure-free run's bit for bit (deterministic reduction: the
default mode's summation order follows the data-parallel split, and its rounding drift grows with the
iterations this machine happens to run before the test stops them). The node comes
back: the task grows back in place, the re-hosted rank crashes as it starts and is relaunched alone,
joins from a healthy replica, and still no survivor restarts; then the node is drained: its rank leaves at a boundary (the agent's ``Leave``)
and the rest go on; then the store's sidecar is SIGKILLed on a node that stays in service: the store
moves in place and nothing else changes; then a sev1 (XID 79) isolates a node whose agent stays up: its rank is killed
as a lost node's would be, and the last one trains on. The same shrink with TP=2 (a node other than the store's lost),
then a drain of the store's node: the store is handed over in place and that replica leaves.

The runs train until the test sets the task store's stop key (every rank stops at one agreed commit
and writes its outputs), so the test never waits for a fixed number of iterations.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from unicron.cli.main import main as cli
from unicron.cluster.launch import LocalJob
from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.inject import Injection, request
from unicron.kernel.types import StoreAddress
from unicron.runtime import store as keys
from unicron.runtime.compare import bitwise_equal, load_params, max_rel_diff
from unicron.runtime.heartbeat import STOP_KEY

#: the model and data, the same in the cluster's run and the failure-free reference
MODEL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "64",
         "--dtype", "float64", "--global-batch-size", "24", "--micro-batch-size", "4", "--heartbeat-window", "3",
         "--deterministic"]
#: the cluster's runs: a pause per iteration paces them against the moves
ARGS = ["--iter-sleep", "0.1", *MODEL]


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    gpus = int(getattr(request, "param", 1))
    env = {"UNICRON_STATUS_INTERVAL": "0.2"}  # in-place resize is the coordinator's default
    with LocalCluster(agents=3, gpus_per_agent=gpus, extra_env=env) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        try:
            yield c
        finally:
            os.environ.pop("UNICRON_ETCD", None)


def submit(c: LocalCluster, tmp: Path, out: Path, tp: int, crash: tuple[int, Path] | None = None) -> None:
    """``crash``: (rank, trigger file): a process of that rank started while the file exists removes it
    and exits 3 at once, before it runs anything (a crash at start)."""
    command = [sys.executable, "-m", "unicron.runtime.train", "--iterations", "0", "--tp", str(tp), *ARGS,
               "--out-dir", str(out)]
    if crash is not None:
        command = ["sh", "-c", f'if [ "$RANK" = {crash[0]} ] && rm "{crash[1]}" 2>/dev/null; then exit 3; fi; '
                   'exec "$@"', "sh", *command]
    spec = tmp / "job.json"
    spec.write_text(json.dumps({"name": "job", "command": command, "min_gpus": tp, "tp_size": tp}))
    assert cli(["submit", str(spec)]) == 0


def ranks(c: LocalCluster) -> dict[int, dict[str, Any]]:
    return c.running_ranks("job")


def stepping(c: LocalCluster, want: set[int], past: int, timeout: float = 90.0) -> dict[int, dict[str, Any]]:
    """The running ranks once exactly ``want`` run and every one of them reported a step > ``past``."""
    def ready() -> dict[int, dict[str, Any]] | None:
        now = ranks(c)
        ok = set(now) == want and all(isinstance(r.get("step"), int) and r["step"] > past for r in now.values())
        return now if ok else None

    found: dict[int, dict[str, Any]] = c.wait_for(ready, timeout, f"ranks {sorted(want)} past step {past}",
                                                  poll_s=0.1)
    return found


def kill_node(c: LocalCluster, node: str) -> None:
    """The node dies: its agent (with its spawner and store sidecar) and its ranks, all SIGKILLed."""
    victims = [int(r["pid"]) for r in ranks(c).values() if r["node"] == node]
    os.killpg(c.agents[node].pid, signal.SIGKILL)
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    c.agents[node].wait()


def actions_since(c: LocalCluster, t0: float) -> list[str]:
    return [str(r["action"]) for r in c.coordinator_log(t0) if r.get("event") == "action"]


def store_node(c: LocalCluster) -> str:
    """The node whose agent publishes the task's store address (``stores/job``)."""
    assert c.store is not None
    kv = c.store.get(c.keys.store("job"))
    assert kv is not None
    return StoreAddress.from_json(kv.value).node


def stop_training(c: LocalCluster) -> None:
    """Every rank stops at one agreed commit and writes its outputs (the runtime's stop key)."""
    assert c.store is not None
    kv = c.store.get(c.keys.store("job"))
    assert kv is not None
    addr = StoreAddress.from_json(kv.value)
    keys.connect(addr.host, addr.port).set(STOP_KEY, "1")
    c.wait_for(lambda: not ranks(c), 60.0, "every rank to stop", poll_s=0.1)


def result(out: Path, rank: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / f"rank{rank}.json").read_text())
    return data


def reference(tmp: Path, iterations: int, tp: int, blocks: int) -> Path:
    """A failure-free run of the same iterations on one replica, with the same reduction blocks."""
    # without the cluster run's pause per iteration: it paces the moves, not the numbers
    job = LocalJob(tp, ["--iterations", str(iterations), "--tp", str(tp), *MODEL, "--blocks", str(blocks)],
                   str(tmp / "reference"))
    with job:
        codes = job.wait(120.0)
    assert all(code == 0 for code in codes.values()), job.logs()
    return Path(job.params_path(0))


def check_exact(out: Path, tmp: Path, tp: int, blocks: int, rank: int = 0) -> list[int]:
    """``rank`` (one that ran throughout) ran every iteration once, and its parameters equal the
    failure-free run's bit for bit; returns the data-parallel size of each iteration."""
    done = result(out, rank)
    its = [e["data"] for e in done["events"] if e["kind"] == "iteration"]
    assert [e["it"] for e in its] == list(range(done["iterations"])), "an iteration was redone or skipped"
    got = load_params(str(out / f"rank{rank}.pt"))
    want = load_params(str(reference(tmp, done["iterations"], tp, blocks)))
    assert bitwise_equal(got, want), f"parameters differ: max rel diff {max_rel_diff(got, want):.3e}"
    return [int(e["dp"]) for e in its]


def test_node_lost_shrinks_in_place_its_return_grows_back_a_drain_a_store_lost_and_an_isolation_shrink(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """One cluster for the three moves (each test's cluster start and reference run cost ~30 s)."""
    c, out = cluster, tmp_path / "out"
    trigger = tmp_path / "crash-rank-0"
    submit(c, tmp_path, out, tp=1, crash=(0, trigger))
    first = stepping(c, {0, 1, 2}, 2, timeout=120.0)
    gen = {r["generation"] for r in first.values()}
    victim = first[0]["node"]
    assert store_node(c) == victim  # the store's node is lost with its sidecar: the store moves
    t0 = time.time()
    kill_node(c, victim)
    survivors = {r: first[r]["pid"] for r in (1, 2)}
    shrunk = stepping(c, {1, 2}, max(r["step"] for r in first.values()) + 2)
    shrink_s = time.time() - t0
    assert {r: shrunk[r]["pid"] for r in survivors} == survivors, "a survivor was restarted"
    assert {r["generation"] for r in shrunk.values()} == gen
    acts = actions_since(c, t0)
    assert "ResizeInPlace" in acts and "Assign" not in acts, acts
    assert store_node(c) == first[1]["node"]  # the lowest survivor's node hosts the moved store
    moves = [r for r in c.agent_log(first[1]["node"], t0) if r.get("event") == "store moved"]
    assert [r.get("spare") for r in moves] == [True], moves  # the sidecar kept ready there, no start

    t1 = time.time()
    c.start_agent(victim)  # repaired; a node lost by a sev1 stays isolated until an operator returns it
    c.wait_registered(victim)
    # back in service (④): rank 0 is re-hosted there as a joiner, which crashes as it starts: it is
    # relaunched alone (before, its death was merged into the grow, the survivors' steps confirmed it,
    # and rank 0 stayed dead with its GPU held)
    trigger.touch()
    assert cli(["undrain", victim]) == 0
    grown = stepping(c, {0, 1, 2}, max(r["step"] for r in shrunk.values()) + 2)
    assert not trigger.exists()  # it did crash
    acts = actions_since(c, t1)
    assert "ResizeInPlace" in acts and "RestartRanks" in acts[acts.index("ResizeInPlace"):], acts
    # confirmed by the relaunched joiner's progress (while a restart is pending, only the statuses of
    # processes it launched count: the survivors' steps cannot)
    confirmed(c, t1, "restarting", "completed")
    grow_s = time.time() - t1
    assert {r: grown[r]["pid"] for r in survivors} == survivors, "a survivor was restarted"
    assert grown[0]["node"] == victim and grown[0]["pid"] != first[0]["pid"]
    assert {r["generation"] for r in grown.values()} == gen
    assert "Assign" not in actions_since(c, t0)

    drained = drain_leaves(c, grown, survivors, leaver=0)
    store_lost = store_sidecar_dies(c, stepping(c, {1, 2}, 0))
    isolated = isolation_kills(c, {1: survivors[1]}, faulty=2)  # the store's node now: it moves back

    stop_training(c)
    dps = check_exact(out, tmp_path, tp=1, blocks=3, rank=1)
    # 3, 2 (lost), 3 (grown), 2 (drained), 1 (isolated)
    assert dps[0] == 3 and dps[-1] == 1 and 3 in dps[dps.index(2):] and 2 in dps[dps.index(3, 1):], dps
    assert result(out, 0)["incarnation"] == 2  # the joiner took its state from a replica
    assert result(out, 0)["mode"] == "left"  # ... and left when its node was drained
    # killed with its node's isolation: no work-conserving stop, so no outputs of its own
    assert not (out / "rank2.json").exists(), result(out, 2)
    print(f"shrink (kill -> survivors 2 steps on) {shrink_s:.1f} s; grow (agent start -> joiner steps) "
          f"{grow_s:.1f} s; store sidecar lost {store_lost:.1f} s; drain {drained:.1f} s; isolation "
          f"{isolated:.1f} s; dp per iteration {dps}")


def confirmed(c: LocalCluster, since: float, phase: str, by: str) -> None:
    """Waits for the coordinator's ``phase --progress--> running`` transition whose reason has ``by``."""
    c.wait_for(lambda: any(f"{phase} --progress--> running" in str(r.get("edge")) and by in str(r.get("edge"))
                           for r in c.coordinator_log(since) if r.get("event") == "transition"),
               10.0, f"{phase} confirmed {by}")


def store_sidecar_dies(c: LocalCluster, before: dict[int, dict[str, Any]]) -> float:
    """The store's sidecar is SIGKILLed on a node that stays in service: a fresh store on the spare's
    node, re-seeded by the running ranks, and nothing else: no rank restarts, no node is isolated.
    (Before, the ranks' waits for a new store read as hangs and their stderr as network faults:
    reattempts, a restart onto the dead store, then the healthy node isolated.)"""
    assert c.store is not None
    node = store_node(c)
    kv = c.store.get(c.keys.store("job"))
    assert kv is not None
    port = StoreAddress.from_json(kv.value).port
    pid = next(int(r["pid"]) for r in c.agent_log(node)
               if r.get("event") == "store sidecar listening" and r.get("port") == port)
    t0 = time.time()
    os.kill(pid, signal.SIGKILL)
    after = stepping(c, set(before), max(r["step"] for r in before.values()) + 2)
    assert {r: after[r]["pid"] for r in before} == {r: before[r]["pid"] for r in before}, "a rank was restarted"
    assert actions_since(c, t0) == ["ResizeInPlace"]
    assert store_node(c) != node  # the spare's node hosts the fresh store
    return time.time() - t0


def drain_leaves(c: LocalCluster, before: dict[int, dict[str, Any]], survivors: dict[int, Any],
                 leaver: int = 2) -> float:
    """The agent's side of a shrink whose node stays in service: ``leaver`` gets ``Leave``, finishes its
    iteration and exits 0 (no failure reported, nothing marked); the others never stop."""
    t0 = time.time()
    assert cli(["drain", str(before[leaver]["node"])]) == 0
    shrunk = stepping(c, set(before) - {leaver}, max(r["step"] for r in before.values()) + 2)
    assert {r: shrunk[r]["pid"] for r in survivors} == survivors, "a survivor was restarted"
    acts = actions_since(c, t0)
    assert "ResizeInPlace" in acts and "Assign" not in acts, acts
    faults = [i for i in c.incidents() if i.detected_ts >= t0 - 1 and i.severity is not None]
    assert not faults, f"a rank leaving is no fault: {faults}"
    return time.time() - t0


def isolation_kills(c: LocalCluster, survivors: dict[int, Any], faulty: int) -> float:
    """An XID 79 under ``faulty`` on a node whose agent stays up: the node is isolated and its rank
    goes as a lost node's would, SIGKILLed. It must not stop politely: a SIGTERMed rank's
    work-conserving stop rides the gradient all-reduce, so every rank would stop at the next boundary
    and the task, resized around the node, would be taken as finished."""
    assert c.store is not None
    before = stepping(c, {*survivors, faulty}, 0)  # fresh steps: the survivors must go on past them
    node = str(before[faulty]["node"])
    t0 = time.time()
    answer = request(c.store, c.keys, node, Injection.from_dict({"fault": "xid", "code": 79, "gpu": 0}))
    assert answer.ok, answer.detail
    shrunk = stepping(c, set(before) - {faulty}, max(r["step"] for r in before.values()) + 2)
    assert {r: shrunk[r]["pid"] for r in survivors} == survivors, "a survivor was restarted"
    acts = actions_since(c, t0)
    assert "IsolateNode" in acts and "ResizeInPlace" in acts and "Assign" not in acts, acts
    assert c.node_state(node) == "isolated"
    return time.time() - t0


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_a_tp2_task_loses_a_node_in_place(cluster: LocalCluster, tmp_path: Path) -> None:
    c, out = cluster, tmp_path / "out"
    submit(c, tmp_path, out, tp=2)
    first = stepping(c, set(range(6)), 2, timeout=120.0)
    victim = first[4]["node"]
    assert {first[4]["node"], first[5]["node"]} == {victim} != {first[0]["node"]}
    t0 = time.time()
    kill_node(c, victim)
    survivors = {r: first[r]["pid"] for r in range(4)}
    shrunk = stepping(c, set(range(4)), max(r["step"] for r in first.values()) + 2)
    assert {r: shrunk[r]["pid"] for r in survivors} == survivors, "a survivor was restarted"
    acts = actions_since(c, t0)
    assert "ResizeInPlace" in acts and "Assign" not in acts, acts
    # the store's node is drained: it hands the store over (in place; it was a new generation) and its
    # replica leaves
    hosting = store_node(c)
    assert hosting == first[0]["node"] != shrunk[2]["node"]
    t1 = time.time()
    assert cli(["drain", hosting]) == 0
    kept = {r: survivors[r] for r in (2, 3)}
    drained = stepping(c, {2, 3}, max(r["step"] for r in shrunk.values()) + 2)
    assert {r: drained[r]["pid"] for r in kept} == kept, "a survivor was restarted"
    assert "Assign" not in actions_since(c, t1)
    assert store_node(c) == shrunk[2]["node"]
    assert [r.get("event") for r in c.agent_log(hosting, t1) if r.get("event") == "store handed over"]
    stop_training(c)
    dps = check_exact(out, tmp_path, tp=2, blocks=3, rank=2)
    assert dps[0] == 3 and 2 in dps and dps[-1] == 1, dps

