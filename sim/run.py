"""Run several systems on one trace and workload (the entry point the CLI and the benchmark use)."""

from __future__ import annotations

from collections.abc import Sequence

from sim.baselines import PROFILES, BaselineSim
from sim.costs import CostSettings
from sim.engine import Result
from sim.trace import Trace
from sim.unicron import UnicronSim, initial_placement
from sim.workload import Workload
from unicron.kernel.errors import InvalidRecord

SYSTEMS = ("unicron", *PROFILES)


def parse_systems(text: str) -> list[str]:
    if text == "all":
        return list(SYSTEMS)
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SYSTEMS]
    if bad or not names:
        raise InvalidRecord(f"--systems: unknown {bad or text!r}; use 'all' or a list of {', '.join(SYSTEMS)}")
    return names


def simulate(
    trace: Trace,
    workload: Workload,
    systems: Sequence[str] = SYSTEMS,
    costs: CostSettings | None = None,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Result]:
    """Every system in ``systems`` on the same trace and workload; baselines start from Unicron's plan."""
    costs = costs or CostSettings()
    if trace.n_nodes != workload.n_nodes or trace.gpus_per_node != workload.gpus_per_node:
        raise InvalidRecord(
            f"trace: {trace.n_nodes} nodes x {trace.gpus_per_node} GPUs, but the workload's cluster is "
            f"{workload.n_nodes} x {workload.gpus_per_node}")
    start = UnicronSim(workload, trace, costs, seed)
    initial = initial_placement(start)
    out: dict[str, Result] = {}
    for name in systems:
        if name == "unicron":
            out[name] = UnicronSim(workload, trace, costs, seed, progress).run()
        else:
            out[name] = BaselineSim(PROFILES[name], initial, workload, trace, costs, seed, progress).run()
    return out
