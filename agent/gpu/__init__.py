"""Node health monitoring of the agent: one monitoring thread per GPU (paper §3.1, §4.1)."""

from agent.gpu.api import GpuBackend, GpuBackendUnavailable, GpuError, GpuEvent, GpuHealth, GpuLost
from agent.gpu.factory import BACKEND_KINDS, open_backend
from agent.gpu.monitor import GpuMonitor
from agent.gpu.simulated import SimulatedBackend

__all__ = [
    "BACKEND_KINDS",
    "GpuBackend",
    "GpuBackendUnavailable",
    "GpuError",
    "GpuEvent",
    "GpuHealth",
    "GpuLost",
    "GpuMonitor",
    "SimulatedBackend",
    "open_backend",
]
