"""Choosing the GPU backend at agent start-up."""

from __future__ import annotations

from agent.gpu.api import GpuBackend, GpuBackendUnavailable, GpuError
from agent.gpu.simulated import SimulatedBackend
from unicron.kernel import log as ulog
from unicron.kernel.errors import ConfigError

log = ulog.get(__name__)

BACKEND_KINDS = ("auto", "nvml", "simulated")


def open_backend(kind: str = "auto", simulated_gpus: int = 0) -> GpuBackend:
    """Open the node's GPU backend.

    ``kind``: "nvml" (real GPUs), "simulated" (``simulated_gpus`` fault-injectable GPUs), or "auto":
    NVML where it starts, else simulated, with the reason logged (a GPU-less test machine runs the
    same agent code). Raises :class:`ConfigError` (one line, exit 2 at the agent's start, not a
    traceback) when NVML is needed and cannot start (``nvml`` on a node without the library or with a
    mismatched driver) or fails while opening the GPUs.
    """
    if kind not in BACKEND_KINDS:
        raise ConfigError(f"gpu backend: must be one of {BACKEND_KINDS}, got {kind!r}")
    if kind == "simulated":
        return SimulatedBackend(simulated_gpus)
    from agent.gpu.nvml import NvmlBackend  # deferred: pynvml is only needed here

    try:
        return NvmlBackend()
    except GpuBackendUnavailable as exc:
        if kind == "nvml":
            raise ConfigError(f"--gpu-backend / UNICRON_GPU_BACKEND nvml: {exc}; install the NVIDIA driver (its "
                              "libnvidia-ml, of the loaded kernel module's version: check nvidia-smi), or use "
                              "--gpu-backend simulated on a node without GPUs") from exc
        log.warning("GPU backend unavailable; using simulated GPUs instead", error=str(exc), gpus=simulated_gpus)
        return SimulatedBackend(simulated_gpus)
    except GpuError as exc:  # NVML started but listing the GPUs failed: not a node to fake GPUs on
        raise ConfigError(f"--gpu-backend / UNICRON_GPU_BACKEND {kind}: {exc}; check the driver (nvidia-smi)") from exc
