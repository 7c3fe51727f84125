"""GPU types as data: the numbers the throughput model needs, nothing else.

Peak FLOP/s are dense BF16 tensor-core figures from the vendors' datasheets. Bandwidths are per
direction. ``internode_bw`` is what one whole node can push to the network (all NICs together); the
A800 entry matches the paper's platform (§7.1: four 200 Gbps NICs per 8-GPU node).
"""

from __future__ import annotations

from dataclasses import dataclass

from unicron.kernel.errors import InvalidRecord

GIB = 1 << 30


@dataclass(frozen=True)
class GpuType:
    """One accelerator model and the interconnect it usually comes with."""

    name: str
    """Canonical name, e.g. ``"A800-80GB"``."""
    peak_flops: float
    """Dense BF16 tensor-core peak, FLOP/s per GPU."""
    memory_bytes: float
    """Device memory per GPU, bytes."""
    hbm_bw: float
    """Device-memory bandwidth, bytes/s per GPU (optimizer step is memory bound)."""
    nvlink_bw: float
    """NVLink/NVSwitch bandwidth, bytes/s per GPU per direction (tensor-parallel collectives)."""
    internode_bw: float
    """Network bandwidth of one node, bytes/s per direction, shared by the node's GPUs."""


GPU_TYPES: dict[str, GpuType] = {
    g.name: g
    for g in (
        GpuType("A100-80GB", 312e12, 80 * GIB, 2.039e12, 300e9, 200e9),
        GpuType("A800-80GB", 312e12, 80 * GIB, 2.039e12, 200e9, 100e9),
        GpuType("H100-80GB", 989e12, 80 * GIB, 3.35e12, 450e9, 400e9),
        GpuType("H200-141GB", 989e12, 141e9, 4.8e12, 450e9, 400e9),
    )
}

_ALIASES = {name.split("-")[0].lower(): name for name in GPU_TYPES} | {n.lower(): n for n in GPU_TYPES}


def gpu_type(name: str) -> GpuType:
    """Look a GPU type up by canonical name or short alias (``"a800"``, ``"H100"``), case-insensitively."""
    canonical = _ALIASES.get(name.strip().lower())
    if canonical is None:
        raise InvalidRecord(f"cluster.gpu_type: unknown GPU type {name!r}; known: {', '.join(GPU_TYPES)}")
    return GPU_TYPES[canonical]
