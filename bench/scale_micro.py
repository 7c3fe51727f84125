"""Per-operation costs behind bench/scale.py's figures, at 1,000 nodes x 8 GPUs, with no etcd (so it
runs without the shared lock): a node status read (full, and the coordinator's StatusReader), the
executor draft copy per decision (deep copy vs two-level copy), the decision state written whole vs
as what changed. Written to run against any checkout (``PYTHONPATH=<checkout>``; the parts a checkout
lacks are left out), so the same script measures before and after the fixes. Best of a few repetitions
(the machine is shared). ``--quick`` is accepted (it is already quick). One JSON line.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

from agent.gpu.simulated import SimulatedBackend
from coordinator import decision as d
from coordinator.decision.state import NodeEntry, NodeState, TaskEntry, TaskPhase
from coordinator.tasks import parse_task_spec
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.types import NodeStatus, RankSpec, RankStatus, TaskAssignment

N = 1000
GPUS = 8


def best_s(fn: Callable[[], object], reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def status_raw(step: int) -> bytes:
    gpus = SimulatedBackend(GPUS)
    return NodeStatus(node="h", ts=time.time(), generation=3, task="wide", gpu_health=[gpus.health(g).to_dict() for g in range(GPUS)],
                      ranks=[RankStatus(task="wide", generation=3, rank=GPUS + j, pid=0, state="running", step=step,
                                        restart_epoch=0) for j in range(GPUS)]).to_json().encode()


def status_reads(out: dict[str, Any]) -> None:
    raws = [status_raw(k) for k in range(200)]
    out["status_full_read_us"] = round(1e6 * best_s(lambda: [NodeStatus.from_json(r) for r in raws]) / len(raws), 1)
    try:
        from coordinator.statuses import StatusReader
    except ImportError:
        return
    reader = StatusReader()
    reader.read("h", raws[0])
    out["status_reader_us"] = round(1e6 * best_s(lambda: [reader.read("h", r) for r in raws]) / len(raws), 1)


def draft_copies(out: dict[str, Any]) -> None:
    desired = {f"n{i:04d}": {"wide": TaskAssignment(
        task="wide", generation=3, argv=["python", "-m", "unicron.runtime.train"], env={"UNICRON_EXTERNAL_STORE": "1"},
        world_size=N * GPUS, ranks=[RankSpec(rank=i * GPUS + j, local_rank=j, gpu=j) for j in range(GPUS)],
        store_node="n0000", group_rank=i, group_world_size=N)} for i in range(N)}
    out["draft_deepcopy_ms"] = round(1e3 * best_s(lambda: copy.deepcopy(desired), 3), 2)
    out["draft_twolevel_ms"] = round(1e3 * best_s(lambda: {n: dict(t) for n, t in desired.items()}, 3), 3)


def state_write(out: dict[str, Any]) -> None:
    spec = parse_task_spec({"name": "wide", "command": ["python", "x.py"], "min_gpus": 1}, None)
    st = d.CoreState(now=1.0, counter=1)
    for i in range(N):
        st.nodes[f"n{i:04d}"] = NodeEntry(GPUS)
    st.tasks["wide"] = TaskEntry(spec=spec, phase=TaskPhase.RUNNING, generation=3,
                                 placement={f"n{i:04d}": list(range(i * GPUS, (i + 1) * GPUS)) for i in range(N)})
    out["state_whole_bytes"] = len(json.dumps(st.to_dict()))
    out["state_whole_ms"] = round(1e3 * best_s(lambda: json.dumps(st.to_dict())), 2)
    try:
        from coordinator.statestore import state_writes
    except ImportError:
        return
    new = dataclasses.replace(st, now=2.0, nodes=dict(st.nodes))
    new.nodes["n0007"] = NodeEntry(GPUS, NodeState.LOST, "agent connection closed")
    puts, _ = state_writes(Keyspace(), st, new)
    out["state_one_node_change_bytes"] = sum(len(v) for v in puts.values())
    out["state_one_node_change_ms"] = round(1e3 * best_s(lambda: state_writes(Keyspace(), st, new)), 3)


def main() -> None:
    out: dict[str, Any] = {"bench": "scale_micro", "nodes": N, "gpus_per_node": GPUS}
    status_reads(out)
    draft_copies(out)
    state_write(out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
