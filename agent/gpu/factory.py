"""Choosing the GPU backend at agent start-up."""

from __future__ import annotations

from agent.gpu.api import GpuBackend, GpuBackendUnavailable
from agent.gpu.simulated import SimulatedBackend
from unicron.kernel import log as ulog
from unicron.kernel.errors import ConfigError

log = ulog.get(__name__)

BACKEND_KINDS = ("auto", "nvml", "simulated")


def open_backend(kind: str = "auto", simulated_gpus: int = 0) -> GpuBackend:
    """Open the node's GPU backend.

    ``kind``: "nvml" (real GPUs; raises :class:`GpuBackendUnavailable` without NVML), "simulated"
    (``simulated_gpus`` fault-injectable GPUs), or "auto": NVML where it starts, else simulated,
    with the reason logged (a GPU-less test machine runs the same agent code).
    """
    if kind not in BACKEND_KINDS:
        raise ConfigError(f"gpu backend: must be one of {BACKEND_KINDS}, got {kind!r}")
    if kind == "simulated":
        return SimulatedBackend(simulated_gpus)
    from agent.gpu.nvml import NvmlBackend  # deferred: pynvml is only needed here

    if kind == "nvml":
        return NvmlBackend()
    try:
        return NvmlBackend()
    except GpuBackendUnavailable as exc:
        log.warning("GPU backend unavailable; using simulated GPUs instead", error=str(exc), gpus=simulated_gpus)
        return SimulatedBackend(simulated_gpus)
