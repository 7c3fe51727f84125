"""Per-incident costs (paper Eq. 1: C_recovery = C_detection + C_transition + C_sub-healthy).

Detection and transition are *times* during which a task delivers no WAF; the sub-healthy cost is not
a constant but what the simulation integrates: the WAF a reduced or re-planned cluster forgoes until
it is whole again. Every constant is a field of :class:`CostSettings` (one place), overridable on the
command line (``--cost FIELD=VALUE``) and printed with the results.

Unicron's defaults are our own benchmark figures (bench/RESULTS.md, sections "detection",
"transition", "ckpt"), scaled to the simulated models by one rule:

* a time that does not depend on the model (detecting a lost node, a dead process, an exception;
  launching processes) is used as measured - paper §7.2 finds detection times the same across
  tasks and cluster sizes, except statistical monitoring, which is in units of D_iter;
* a time that is one iteration's work (finishing the failed iteration in a reattempt or a restart,
  recomputing lost iterations) is converted to iterations of the benchmark's workload (D_iter =
  ``bench_iteration_s``) and multiplied by the simulated task's D_iter (from the throughput model);
* restoring training state is the task's state per model-parallel rank divided by the measured
  restore bandwidth from a peer's memory (bench/ckpt).

The baselines' constants come from the paper (cited per field; docs/simulator.md lists them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from unicron.kernel.errors import ConfigError
from unicron.kernel.types import DetectionMethod, ErrorKind

#: Which detection method sees a failure of each kind (paper Table 1).
METHOD: dict[str, DetectionMethod] = {
    ErrorKind.LOST_CONNECTION.value: DetectionMethod.NODE_HEALTH,
    ErrorKind.EXITED_ABNORMALLY.value: DetectionMethod.PROCESS_SUPERVISION,
    ErrorKind.NCCL_TIMEOUT.value: DetectionMethod.STATISTICAL_MONITORING,
    ErrorKind.LINK_FLAPPING.value: DetectionMethod.STATISTICAL_MONITORING,
    ErrorKind.TASK_HANG.value: DetectionMethod.STATISTICAL_MONITORING,
}


def method_of(kind: str) -> DetectionMethod:
    return METHOD.get(kind, DetectionMethod.EXCEPTION_PROPAGATION)


@dataclass(frozen=True)
class CostSettings:
    """Every constant of the cost model. Seconds unless the name says otherwise."""

    # -- Unicron, from bench/RESULTS.md --------------------------------------------------------------
    unicron_detect_node_s: float = 0.92
    """Lost node -> incident: heartbeat timeout, bench/detection node_silenced p50 0.92 s (paper Table 2: 5.6 s)."""
    unicron_detect_process_s: float = 0.038
    """Dead rank -> incident: bench/detection rank_killed p50 (paper: 1.8 s)."""
    unicron_detect_exception_s: float = 0.012
    """Exception/XID -> incident: bench/detection exception p50 (paper: 0.3 s)."""
    unicron_detect_stall_iterations: float = 2.73
    """Hang/NCCL timeout -> incident, in D_iter: bench/detection stall p50 (paper: 3 D_iter)."""
    bench_iteration_s: float = 0.22
    """D_iter of the workload bench/transition measured on (~0.2-0.25 s per iteration)."""
    unicron_reattempt_s: float = 0.103
    """sev3 reattempt in place, bench/transition median; scaled by D_iter / bench_iteration_s."""
    unicron_restart_s: float = 0.171
    """sev2 restart of the failed ranks, bench/transition median; scaled by D_iter / bench_iteration_s."""
    unicron_reconfigure_fixed_s: float = 5.0
    """Fixed part of a reconfiguration (plan, stop, launch the ranks): bench/transition reconfigure
    median 8.36 s minus its 15 recomputed iterations of 0.22 s."""
    unicron_restore_gbps: float = 0.91
    """State restore bandwidth per rank from a peer's memory: bench/ckpt 1.099 GB in 1.207 s."""
    unicron_lost_iterations: float = 0.5
    """Iterations recomputed after a fault forces a reconfiguration: 0.5 with the in-memory snapshot
    every iteration (bench/ckpt, 0.8 % blocking); bench/transition's torch-save every 20 gives ~10."""
    # -- Megatron (paper Figure 2, Table 2, §7.3) -----------------------------------------------------
    megatron_detect_node_s: float = 5.7
    """A lost node, without Unicron: paper Table 2 case 1 (5.7 s)."""
    megatron_timeout_s: float = 1800.0
    """Every other failure, without Unicron: D_timeout, the NCCL timeout (paper Table 2, Figure 2: up to 30 min)."""
    megatron_restart_s: float = 1380.0
    """Resubmission (9 min) + environment and CUDA setup (14 min): paper Figure 2."""
    megatron_recompute_s: float = 900.0
    """Progress since the last persisted checkpoint: 15 min on average at a 30 min interval (paper §7.3 note 2)."""
    # -- Oobleck, Varuna, Bamboo ---------------------------------------------------------------------
    oobleck_throughput: float = 0.324
    """Throughput relative to Megatron. The paper gives Figure 3(a) only as a plot; this is its
    trace-a result (Unicron 1.2x Megatron, 3.7x Oobleck: 1.2/3.7) - a fitted input, not a measurement."""
    varuna_throughput: float = 0.25
    """As above: 1.2 / 4.8 (paper §7.5)."""
    bamboo_throughput: float = 0.261
    """As above: 1.2 / 4.6 (paper §7.5)."""
    oobleck_transition_s: float = 300.0
    """Oobleck's reconfiguration without a checkpoint reload (paper §7.3: shorter than Megatron's,
    longer than Unicron's; Figure 9 is a plot only, so this is an assumption)."""
    bamboo_transition_s: float = 300.0
    """Bamboo's recovery through redundant computation (paper §7.3; same assumption as Oobleck's)."""
    varuna_restart_s: float = 1380.0
    """Varuna restarts from its last checkpoint like Megatron (paper §7.3): Megatron's restart time."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"cost.{f.name}: expected a finite number >= 0, got {value!r}")
        for name in ("bench_iteration_s", "unicron_restore_gbps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"cost.{name}: must be > 0")

    def with_overrides(self, items: list[str]) -> CostSettings:
        """Apply ``FIELD=VALUE`` strings (the ``--cost`` flag)."""
        known = {f.name for f in fields(self)}
        changes: dict[str, float] = {}
        for item in items:
            name, sep, raw = item.partition("=")
            if not sep or name not in known:
                raise ConfigError(f"--cost {item!r}: expected FIELD=VALUE with FIELD one of {sorted(known)}")
            try:
                changes[name] = float(raw)
            except ValueError:
                raise ConfigError(f"--cost {name}: {raw!r} is not a number") from None
        return replace(self, **changes)

    def to_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}

    # -- Unicron's costs for one task ------------------------------------------------------------------

    def unicron_detect_s(self, kind: str, iteration_s: float) -> float:
        method = method_of(kind)
        if method is DetectionMethod.NODE_HEALTH:
            return self.unicron_detect_node_s
        if method is DetectionMethod.PROCESS_SUPERVISION:
            return self.unicron_detect_process_s
        if method is DetectionMethod.STATISTICAL_MONITORING:
            return self.unicron_detect_stall_iterations * iteration_s
        return self.unicron_detect_exception_s

    def unicron_in_place_s(self, restart: bool, iteration_s: float) -> float:
        """A reattempt (sev3) or a restart of the failed ranks (sev2), scaled to this task's D_iter."""
        measured = self.unicron_restart_s if restart else self.unicron_reattempt_s
        return measured / self.bench_iteration_s * iteration_s

    def unicron_reconfigure_s(self, rank_state_bytes: float, iteration_s: float, faulted: bool) -> float:
        """A new placement: launch, restore each rank's state, recompute the lost iterations if faulted."""
        lost = self.unicron_lost_iterations * iteration_s if faulted else 0.0
        return self.unicron_reconfigure_fixed_s + rank_state_bytes / (self.unicron_restore_gbps * 1e9) + lost
