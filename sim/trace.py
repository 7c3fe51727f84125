"""Failure traces: one JSON object per line, read and written here, and the seeded generators.

A record is one failure: ``{"time_s", "node", "gpu", "severity", "kind", "repair_s"}``. ``severity``
is 1, 2 or 3 (paper Table 1); ``kind`` an :class:`~unicron.kernel.types.ErrorKind` value; ``repair_s``
how long a sev1 node stays out of service (0 for sev2/sev3, which take no GPU away, paper §7.5).

Generators (all seeded, numpy's PCG64): :func:`poisson` (failures per GPU at a rate),
:func:`trace_a` (8 weeks, 10 sev1 + 33 others, sev1 repair uniform in 1-7 days) and :func:`trace_b`
(7 days, 26 sev1 + 80 others; repairs 20x faster, so the pool stays stable as the paper says).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from unicron.kernel import jsontext
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.types import FAULT_KINDS, ErrorKind

DAY_S = 86_400.0
WEEK_S = 7 * DAY_S

#: Kinds drawn for each severity (paper Table 1 rows of that severity); sev1 is a lost node half the time.
KINDS: dict[int, tuple[ErrorKind, ...]] = {
    1: (ErrorKind.LOST_CONNECTION, ErrorKind.LOST_CONNECTION, ErrorKind.ECC_ERROR, ErrorKind.NVLINK_ERROR),
    2: (ErrorKind.EXITED_ABNORMALLY, ErrorKind.CUDA_ERROR, ErrorKind.ILLEGAL_MEMORY_ACCESS, ErrorKind.TASK_HANG),
    3: (ErrorKind.NCCL_TIMEOUT, ErrorKind.LINK_FLAPPING, ErrorKind.CONNECTION_REFUSED_RESET),
}


@dataclass(frozen=True, order=True)
class Failure:
    """One failure of a trace."""

    time_s: float
    """Seconds from the start of the simulation."""
    node: str
    """The node it happens on."""
    gpu: int
    """The GPU index on that node (which task's ranks it hits)."""
    severity: int
    """1 (node out of service), 2 (process restart), 3 (transient)."""
    kind: str
    """An ErrorKind value: decides the detection method."""
    repair_s: float = 0.0
    """sev1: seconds until the node is back in service; 0 otherwise."""

    def to_dict(self) -> dict[str, object]:
        return {"time_s": self.time_s, "node": self.node, "gpu": self.gpu, "severity": self.severity,
                "kind": self.kind, "repair_s": self.repair_s}

    @staticmethod
    def from_dict(data: object, where: str = "trace") -> Failure:
        if not isinstance(data, dict):
            raise InvalidRecord(f"{where}: expected a JSON object, got {type(data).__name__}")
        known = {"time_s", "node", "gpu", "severity", "kind", "repair_s"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRecord(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
        for name in ("time_s", "node", "gpu", "severity", "kind"):
            if name not in data:
                raise InvalidRecord(f"{where}.{name}: missing")
        time_s, repair_s = data["time_s"], data.get("repair_s", 0.0)
        for name, value in (("time_s", time_s), ("repair_s", repair_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise InvalidRecord(f"{where}.{name}: expected a number of seconds >= 0, got {value!r}")
        node, gpu, severity, kind = data["node"], data["gpu"], data["severity"], data["kind"]
        if not isinstance(node, str) or not node:
            raise InvalidRecord(f"{where}.node: expected a node name, got {node!r}")
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise InvalidRecord(f"{where}.gpu: expected a GPU index >= 0, got {gpu!r}")
        if severity not in (1, 2, 3) or isinstance(severity, bool):
            raise InvalidRecord(f"{where}.severity: expected 1, 2 or 3, got {severity!r}")
        if kind not in {k.value for k in FAULT_KINDS}:
            raise InvalidRecord(f"{where}.kind: {kind!r} is not a failure kind; known: {sorted(k.value for k in FAULT_KINDS)}")
        return Failure(float(time_s), node, gpu, int(severity), str(kind), float(repair_s))


@dataclass(frozen=True)
class Trace:
    """A failure trace over a cluster of ``n_nodes`` nodes named ``node000``..., ``duration_s`` long."""

    name: str
    duration_s: float
    n_nodes: int
    gpus_per_node: int
    failures: tuple[Failure, ...]

    def count(self, severity: int) -> int:
        return sum(1 for f in self.failures if f.severity == severity)


def node_name(i: int) -> str:
    return f"node{i:03d}" if i < 1000 else f"node{i}"


def write(trace: Trace, path: Path) -> None:
    """One header line (``{"trace": name, "duration_s", "n_nodes", "gpus_per_node"}``), then a line per failure."""
    with path.open("w") as out:
        header = {"trace": trace.name, "duration_s": trace.duration_s, "n_nodes": trace.n_nodes,
                  "gpus_per_node": trace.gpus_per_node}
        out.write(json.dumps(header) + "\n")
        for f in trace.failures:
            out.write(json.dumps(f.to_dict()) + "\n")


def read(path: Path, n_nodes: int | None = None, gpus_per_node: int = 8) -> Trace:
    """Read a trace file. Without a header line the duration is the last failure's time (plus its repair)
    and the cluster size ``n_nodes`` (or the highest node index seen + 1)."""
    try:
        lines = jsontext.decode(path.read_bytes(), f"trace {path}").splitlines()
    except OSError as exc:
        raise InvalidRecord(f"trace: cannot read {path}: {exc.strerror}") from exc
    header: dict[str, object] = {}
    header_where = f"trace {path.name}"
    failures: list[tuple[Failure, str]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"trace {path.name} line {number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRecord(f"{where}: not JSON ({exc.msg})") from None
        if isinstance(data, dict) and "trace" in data:
            header, header_where = data, where
            continue
        failures.append((Failure.from_dict(data, where), where))
    duration = header.get("duration_s")
    if duration is None:
        duration = max((f.time_s + f.repair_s for f, _ in failures), default=0.0)
    if isinstance(duration, bool) or not isinstance(duration, int | float) or not 0 < duration < math.inf:
        raise InvalidRecord(f"trace {path.name}: a duration of {duration!r} s covers nothing to simulate; give "
                            'failures, or a header line {"trace": NAME, "duration_s": SECONDS} with SECONDS > 0')
    nodes = header.get("n_nodes", n_nodes)
    if nodes is None:
        nodes = 1 + max((int("".join(c for c in f.node if c.isdigit()) or 0) for f, _ in failures), default=0)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise InvalidRecord(f"{header_where}.n_nodes: expected the cluster's number of nodes, a positive integer; got {nodes!r}")
    gpn = header.get("gpus_per_node", gpus_per_node)
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
        raise InvalidRecord(f"{header_where}.gpus_per_node: expected the GPUs of a node, a positive integer; got {gpn!r}")
    # the simulation would pass over a failure outside the cluster or the period without a word and
    # still count it: a mistyped trace has to fail here instead
    names = {node_name(i) for i in range(nodes)}
    for f, where in failures:
        if f.node not in names:
            raise InvalidRecord(f"{where}.node: {f.node!r} is not one of the trace's {nodes} nodes "
                                f"({node_name(0)}..{node_name(nodes - 1)}); name one of them, or give the "
                                "cluster's size in the header's n_nodes")
        if f.gpu >= gpn:
            raise InvalidRecord(f"{where}.gpu: {f.gpu} is not below the {gpn} GPUs per node; give an index "
                                "below it, or the GPUs per node in the header's gpus_per_node")
        if "duration_s" in header and f.time_s >= duration:
            raise InvalidRecord(f"{where}.time_s: {f.time_s:g} is not before the trace's end "
                                f"(duration_s {duration:g}); fix the time or the header's duration_s")
    name = header.get("trace", path.stem)
    return Trace(str(name), float(duration), nodes, gpn, tuple(sorted(f for f, _ in failures)))


def _draw(
    rng: np.random.Generator,
    times: Sequence[float],
    severities: Sequence[int],
    n_nodes: int,
    gpus_per_node: int,
    repair_range_s: tuple[float, float],
) -> list[Failure]:
    """Assign nodes, GPUs, kinds and repairs to failure times; a node out of service does not fail again."""
    down_until = [0.0] * n_nodes
    out = []
    for t, sev in sorted(zip(times, severities, strict=True)):
        up = [i for i in range(n_nodes) if down_until[i] <= t]
        if not up:
            continue
        node = int(up[int(rng.integers(len(up)))])
        kinds = KINDS[sev]
        kind = kinds[int(rng.integers(len(kinds)))]
        repair = float(rng.uniform(*repair_range_s)) if sev == 1 else 0.0
        if sev == 1:
            down_until[node] = t + repair
        out.append(Failure(round(float(t), 3), node_name(node), int(rng.integers(gpus_per_node)), sev,
                           kind.value, round(repair, 3)))
    return out


def fixed_counts(
    name: str,
    seed: int,
    duration_s: float,
    sev1: int,
    other: int,
    repair_range_s: tuple[float, float],
    n_nodes: int = 16,
    gpus_per_node: int = 8,
) -> Trace:
    """``sev1`` + ``other`` failures at uniform times (a Poisson process conditioned on its count);
    the others are sev2 or sev3 with equal chance."""
    rng = np.random.default_rng(seed)
    times = list(rng.uniform(0.0, duration_s, sev1 + other))
    severities = [1] * sev1 + [int(s) for s in rng.integers(2, 4, other)]
    failures = _draw(rng, times, severities, n_nodes, gpus_per_node, repair_range_s)
    return Trace(name, duration_s, n_nodes, gpus_per_node, tuple(failures))


def trace_a(seed: int = 0, n_nodes: int = 16, gpus_per_node: int = 8) -> Trace:
    """Paper §7.5 trace-a: 8 weeks, 10 sev1 + 33 others, sev1 repair uniform in [1, 7] days."""
    return fixed_counts("trace-a", seed, 8 * WEEK_S, 10, 33, (DAY_S, 7 * DAY_S), n_nodes, gpus_per_node)


TRACE_B_REPAIR_SCALE = 20.0
"""trace-b repairs are 20x faster than trace-a's (paper: failures 20x as frequent, nodes rejoin at a
similar rate so the pool stays stable)."""


def trace_b(seed: int = 0, n_nodes: int = 16, gpus_per_node: int = 8) -> Trace:
    """Paper §7.5 trace-b: 7 days, 26 sev1 + 80 others, sev1 repair uniform in [1, 7] days / 20."""
    repair = (DAY_S / TRACE_B_REPAIR_SCALE, 7 * DAY_S / TRACE_B_REPAIR_SCALE)
    return fixed_counts("trace-b", seed, WEEK_S, 26, 80, repair, n_nodes, gpus_per_node)


#: trace-a's rate per GPU: 43 failures on 128 GPUs in 8 weeks.
TRACE_A_RATE_PER_GPU_HOUR = 43 / (128 * 8 * 7 * 24)
TRACE_A_SEV1_FRACTION = 10 / 43


def poisson(
    seed: int,
    n_nodes: int,
    duration_s: float,
    rate_per_gpu_hour: float = TRACE_A_RATE_PER_GPU_HOUR,
    sev1_fraction: float = TRACE_A_SEV1_FRACTION,
    repair_range_s: tuple[float, float] = (DAY_S, 7 * DAY_S),
    gpus_per_node: int = 8,
    name: str = "poisson",
) -> Trace:
    """Failures as a Poisson process per GPU at ``rate_per_gpu_hour``; each is sev1 with
    ``sev1_fraction``, otherwise sev2 or sev3 with equal chance."""
    if not (rate_per_gpu_hour >= 0 and math.isfinite(rate_per_gpu_hour)):
        raise InvalidRecord(f"trace.rate_per_gpu_hour: expected a number >= 0, got {rate_per_gpu_hour!r}")
    if not 0 <= sev1_fraction <= 1:
        raise InvalidRecord(f"trace.sev1_fraction: expected a number in [0, 1], got {sev1_fraction!r}")
    rng = np.random.default_rng(seed)
    expected = rate_per_gpu_hour * n_nodes * gpus_per_node * duration_s / 3600.0
    count = int(rng.poisson(expected))
    times = list(rng.uniform(0.0, duration_s, count))
    severities = [1 if rng.random() < sev1_fraction else int(rng.integers(2, 4)) for _ in range(count)]
    failures = _draw(rng, times, severities, n_nodes, gpus_per_node, repair_range_s)
    return Trace(name, duration_s, n_nodes, gpus_per_node, tuple(failures))


def named(name: str, seed: int) -> Trace:
    """``trace-a`` or ``trace-b`` by name."""
    if name == "trace-a":
        return trace_a(seed)
    if name == "trace-b":
        return trace_b(seed)
    raise InvalidRecord(f"--trace: {name!r} is not trace-a, trace-b or an existing file")

