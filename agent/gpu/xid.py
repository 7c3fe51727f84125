"""XID code -> Table 1 error status.

XIDs are the NVIDIA driver's error reports (``NVRM: Xid ...`` in the kernel log, and the
``nvmlEventTypeXidCriticalError`` event in NVML). The table below follows NVIDIA's "Xid Errors"
documentation and its Xid catalog (docs.nvidia.com/deploy/xid-errors); the kind chosen for each
code follows the catalog's immediate action: "restart the application" -> a sev2 kind
(CUDA error, illegal memory access), "reset the GPU / reboot / drain" -> a sev1 kind
(ECC, NVLink, GPU driver error).

Two sets are explicit:

* :data:`INFORMATIONAL` - XIDs that do not indicate a new failure on their own (a corrected error, a
  clean-up after another error that was already reported, an engine training never uses). They are
  logged, not reported.
* everything not in :data:`XIDS` - unknown codes are treated as a GPU driver error (sev1) with the
  code in the message: an unclassified hardware report is safer handled as a node fault than ignored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from agent.gpu.api import GpuEvent
from unicron.kernel.types import ErrorKind


@dataclass(frozen=True)
class XidInfo:
    """What one XID code means to Unicron."""

    kind: ErrorKind
    """Table 1 status reported for this XID."""
    description: str
    """NVIDIA's short description of the code."""
    informational: bool = False
    """True: log only, no report (see :data:`INFORMATIONAL`)."""


_CUDA = ErrorKind.CUDA_ERROR
_IMA = ErrorKind.ILLEGAL_MEMORY_ACCESS
_ECC = ErrorKind.ECC_ERROR
_NVL = ErrorKind.NVLINK_ERROR
_DRV = ErrorKind.GPU_DRIVER_ERROR

XIDS: dict[int, XidInfo] = {
    # Application-level faults: the catalog's immediate action is "restart the application" (sev2).
    8: XidInfo(_CUDA, "GPU stopped processing (channel idle timeout)"),
    13: XidInfo(_CUDA, "graphics engine exception"),
    31: XidInfo(_IMA, "GPU memory page fault"),
    43: XidInfo(_CUDA, "GPU stopped processing (channel reset verification)"),
    69: XidInfo(_CUDA, "graphics engine class error"),
    109: XidInfo(_CUDA, "context switch timeout"),
    # Memory faults (sev1: the node's GPU memory is suspect until reset / drained).
    48: XidInfo(_ECC, "double-bit (uncorrectable) ECC error"),
    63: XidInfo(_ECC, "ECC page retirement or row remapping recording event (reset needed)"),
    64: XidInfo(_ECC, "ECC page retirement or row remapper recording failure"),
    94: XidInfo(_ECC, "contained ECC error"),
    95: XidInfo(_ECC, "uncontained ECC error"),
    140: XidInfo(_ECC, "unrecovered ECC error"),
    # Interconnect faults (sev1).
    74: XidInfo(_NVL, "NVLink error"),
    144: XidInfo(_NVL, "NVLink SAW error"),
    145: XidInfo(_NVL, "NVLink RLW error"),
    146: XidInfo(_NVL, "NVLink TLW error"),
    147: XidInfo(_NVL, "NVLink TREX error"),
    148: XidInfo(_NVL, "NVLink NVLPW control error"),
    149: XidInfo(_NVL, "NVLink NETIR error"),
    150: XidInfo(_NVL, "NVLink MSE error"),
    # Driver, firmware and bus faults (sev1).
    32: XidInfo(_DRV, "invalid or corrupted push buffer stream"),
    38: XidInfo(_DRV, "driver firmware error"),
    44: XidInfo(_DRV, "graphics engine fault during context switch"),
    57: XidInfo(_DRV, "error programming video memory interface"),
    58: XidInfo(_DRV, "unstable video memory interface detected"),
    61: XidInfo(_DRV, "internal micro-controller breakpoint/warning"),
    62: XidInfo(_DRV, "internal micro-controller halt"),
    79: XidInfo(_DRV, "GPU has fallen off the bus"),
    119: XidInfo(_DRV, "GSP RPC timeout"),
    120: XidInfo(_DRV, "GSP error"),
    122: XidInfo(_DRV, "SPI PMU RPC read failure"),
    123: XidInfo(_DRV, "SPI PMU RPC write failure"),
    124: XidInfo(_DRV, "SPI PMU RPC erase failure"),
    125: XidInfo(_DRV, "InfoROM filesystem failure"),
    143: XidInfo(_DRV, "GPU initialization failure"),
    154: XidInfo(_DRV, "GPU recovery action changed"),
    # Informational: logged, not reported.
    # 45 follows the kill of an application after another error (which is reported on its own).
    45: XidInfo(_CUDA, "preemptive cleanup, due to previous errors", informational=True),
    # Corrected errors: the hardware already fixed the data.
    92: XidInfo(_ECC, "high single-bit ECC error rate (corrected)", informational=True),
    121: XidInfo(_NVL, "C2C link corrected error", informational=True),
    # Display and video engines: a training job does not use them.
    56: XidInfo(_DRV, "display engine error", informational=True),
    68: XidInfo(_DRV, "NVDEC0 exception", informational=True),
    73: XidInfo(_DRV, "NVENC2 error", informational=True),
    81: XidInfo(_DRV, "VGA subsystem error", informational=True),
}

INFORMATIONAL: frozenset[int] = frozenset(code for code, info in XIDS.items() if info.informational)
"""XIDs that are logged but never reported."""


def classify(code: int) -> XidInfo:
    """The meaning of XID ``code``; an unknown code is a (reportable) GPU driver error."""
    info = XIDS.get(code)
    if info is None:
        return XidInfo(_DRV, f"unknown XID {code}")
    return info


def event_for_xid(gpu: int, code: int, ts: float | None = None, detail: str = "") -> GpuEvent:
    """The :class:`GpuEvent` a backend emits for XID ``code`` on ``gpu``."""
    info = classify(code)
    message = f"XID {code}: {info.description}" + (f" ({detail})" if detail else "")
    return GpuEvent(
        gpu=gpu,
        kind=info.kind,
        xid=code,
        message=message,
        ts=time.time() if ts is None else ts,
        reportable=not info.informational,
    )
