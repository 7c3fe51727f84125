"""What a GPU backend reports and the interface the per-GPU monitoring threads use.

A backend is either NVML (real GPUs) or simulated (tests, benchmarks, GPU-less nodes). The monitor
(:mod:`agent.gpu.monitor`) runs one thread per GPU that blocks in :meth:`GpuBackend.wait_event` and
polls :meth:`GpuBackend.health` between waits; the backend itself keeps no threads.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field

from unicron.kernel.errors import PermanentError, TemporaryError
from unicron.kernel.types import ErrorKind

RECOVERY_NONE = "none"
"""``GpuHealth.recovery_action`` when the driver asks for nothing."""


@dataclass(frozen=True)
class GpuEvent:
    """A fault the driver announced for one GPU (an XID, an ECC error, a recovery request, ...)."""

    gpu: int
    """Index of the GPU on this node (NVML / CUDA_VISIBLE_DEVICES order)."""
    kind: ErrorKind
    """Table 1 status the event maps to."""
    xid: int | None
    """The XID code when the event is an XID, else None."""
    message: str
    """Human-readable description, including the XID and its meaning when there is one."""
    ts: float = field(default_factory=time.time)
    """Wall-clock time the event was observed (the source timestamp of the resulting Report)."""
    reportable: bool = True
    """False for informational events (a corrected single-bit ECC error, an XID that only follows
    another failure): the monitor logs them and does not call ``on_event``."""


@dataclass(frozen=True)
class GpuHealth:
    """One health poll of one GPU. Counters are None where the GPU or driver does not support them."""

    gpu: int
    """Index of the GPU on this node."""
    ok: bool
    """True when nothing below indicates a fault (see :func:`is_healthy`)."""
    ecc_sbe: int | None
    """Volatile (since driver load) corrected ECC error count."""
    ecc_dbe: int | None
    """Volatile (since driver load) uncorrected ECC error count."""
    nvlink_down: list[int]
    """NVLink links that were active when monitoring began and are inactive now."""
    retired_pages_pending: bool
    """A page retirement or row remap is pending and needs a GPU reset to take effect."""
    recovery_action: str | None
    """The driver's requested recovery action ("none", "gpu_reset", "node_reboot", ...);
    None where the driver does not expose it."""
    ts: float = field(default_factory=time.time)
    """Wall-clock time of the poll."""

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form for ``NodeStatus.gpu_health``."""
        return {
            "gpu": self.gpu,
            "ok": self.ok,
            "ecc_sbe": self.ecc_sbe,
            "ecc_dbe": self.ecc_dbe,
            "nvlink_down": list(self.nvlink_down),
            "retired_pages_pending": self.retired_pages_pending,
            "recovery_action": self.recovery_action,
            "ts": self.ts,
        }


def is_healthy(
    ecc_dbe: int | None, nvlink_down: list[int], retired_pages_pending: bool, recovery_action: str | None
) -> bool:
    """The single definition of a healthy GPU, shared by both backends. Corrected (single-bit) ECC
    errors do not count: the hardware fixed them."""
    return (
        not ecc_dbe
        and not nvlink_down
        and not retired_pages_pending
        and recovery_action in (None, RECOVERY_NONE)
    )


class GpuError(TemporaryError):
    """A backend call failed; the monitor logs it and retries with backoff."""


class GpuLost(GpuError):
    """The GPU no longer answers (NVML_ERROR_GPU_IS_LOST: it fell off the bus). The monitor reports
    it once as a GPU driver error and keeps retrying in case it comes back after a reset."""


class GpuBackendUnavailable(PermanentError):
    """The requested backend cannot run on this node (no NVML library, no driver)."""


class GpuBackend(abc.ABC):
    """One node's GPUs. Methods may be called concurrently from different GPUs' threads."""

    name: str
    """Backend name for ``NodeInfo.gpu_backend``: "nvml" or "simulated"."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of GPUs on the node."""

    @abc.abstractmethod
    def wait_event(self, gpu: int, timeout_s: float) -> GpuEvent | None:
        """Block until ``gpu`` has an event or ``timeout_s`` passes (then None). Returns None at once
        after :meth:`close`. May also return None early (a non-error event the driver woke us for)."""

    @abc.abstractmethod
    def health(self, gpu: int) -> GpuHealth:
        """Poll ``gpu``'s health counters. Raises :class:`GpuError` (or :class:`GpuLost`)."""

    def interrupt(self) -> None:  # noqa: B027 - optional hook, a no-op where the wait cannot be woken
        """Wake threads blocked in :meth:`wait_event` where the backend can (speeds up stop)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the backend; blocked and later waits return None."""
