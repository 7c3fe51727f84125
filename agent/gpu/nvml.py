"""The NVML backend: driver events and health counters of the node's real GPUs (package nvidia-ml-py).

Events: per GPU one NVML event set registered for XID-critical errors, ECC errors and, where the
driver supports them, DRAM retirement, poison, GPU-unavailable and recovery-action events;
:meth:`NvmlBackend.wait_event` blocks in ``nvmlEventSetWait_v2`` (ctypes releases the GIL, so the
per-GPU threads really block in the driver). Health: volatile ECC totals, the state of each NVLink
link that was active when the backend opened, pending page retirement / row remapping, and the
driver's GPU recovery action field. Anything a GPU or driver does not support
(``NVML_ERROR_NOT_SUPPORTED``) is read as "not available" (None / not pending), never as a fault.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from agent.gpu.api import (
    RECOVERY_NONE,
    GpuBackend,
    GpuBackendUnavailable,
    GpuError,
    GpuEvent,
    GpuHealth,
    GpuLost,
    is_healthy,
)
from agent.gpu.xid import event_for_xid
from unicron.kernel import log as ulog
from unicron.kernel.types import ErrorKind

log = ulog.get(__name__)

T = TypeVar("T")


def _event_type(name: str) -> int:
    # Older nvidia-ml-py releases lack the newer event types; 0 registers nothing.
    return int(getattr(pynvml, name, 0))


EV_XID = _event_type("nvmlEventTypeXidCriticalError")
EV_SBE = _event_type("nvmlEventTypeSingleBitEccError")
EV_DBE = _event_type("nvmlEventTypeDoubleBitEccError")
EV_RETIREMENT = _event_type("nvmlEventTypeDramRetirementEvent")
EV_RETIREMENT_FAILURE = _event_type("nvmlEventTypeDramRetirementFailure")
EV_POISON_NONFATAL = _event_type("nvmlEventTypeNonFatalPoisonError")
EV_POISON_FATAL = _event_type("nvmlEventTypeFatalPoisonError")
EV_UNAVAILABLE = _event_type("nvmlEventTypeGpuUnavailableError")
EV_RECOVERY = _event_type("nvmlEventTypeGpuRecoveryAction")

WANTED_EVENTS = (
    EV_XID | EV_SBE | EV_DBE | EV_RETIREMENT | EV_RETIREMENT_FAILURE | EV_POISON_NONFATAL
    | EV_POISON_FATAL | EV_UNAVAILABLE | EV_RECOVERY
)
"""Event types registered per GPU (intersected with what the GPU supports)."""

FIELD_RECOVERY_ACTION: int | None = getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)

RECOVERY_ACTIONS: dict[int, str] = {
    0: RECOVERY_NONE,
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}
"""``nvmlGpuRecoveryAction_t`` values (NVML_GPU_RECOVERY_ACTION_*) -> names used in GpuHealth."""

_UNSUPPORTED = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
_UNAVAILABLE = (
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    pynvml.NVML_ERROR_NO_PERMISSION,
)


def recovery_action_name(code: int) -> str:
    """Name of an ``nvmlGpuRecoveryAction_t`` value; unknown values keep their number."""
    return RECOVERY_ACTIONS.get(code, f"unknown({code})")


#: the GPU is gone until a reset or reboot: no retry brings it back, so it is reported at once
_GONE = (pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED, pynvml.NVML_ERROR_GPU_NOT_FOUND)


def translate_error(exc: pynvml.NVMLError, what: str) -> GpuError:
    """An NVML error as this project's exception: a lost GPU (fallen off the bus, needing a reset, or
    no longer found) is :class:`GpuLost`; the rest may be transient (the monitor reports them when they
    persist)."""
    if exc.value in _GONE:
        return GpuLost(f"{what}: {exc}")
    return GpuError(f"{what}: {exc}")


def optional(what: str, fn: Callable[..., T], *args: Any) -> T | None:
    """``fn(*args)``, or None where the GPU/driver does not support it; other NVML errors are raised
    as :class:`GpuError`/:class:`GpuLost`."""
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        if exc.value in _UNSUPPORTED:
            return None
        raise translate_error(exc, what) from exc


def field_value_int(fv: Any) -> int | None:
    """The integer in an ``nvmlFieldValue_t``, or None when the driver returned an error for it."""
    if fv.nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    attr = {
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
    }.get(fv.valueType)
    if attr is None:
        return None
    return int(getattr(fv.value, attr))


def event_from_nvml(gpu: int, event_type: int, event_data: int, ts: float) -> GpuEvent | None:
    """Translate one NVML event; None for event types this agent does not act on."""
    ecc = ErrorKind.ECC_ERROR
    if event_type & EV_XID:
        return event_for_xid(gpu, int(event_data), ts)
    if event_type & EV_DBE:
        return GpuEvent(gpu, ecc, None, "double-bit (uncorrected) ECC error", ts)
    if event_type & EV_SBE:
        return GpuEvent(gpu, ecc, None, "single-bit (corrected) ECC error", ts, reportable=False)
    if event_type & EV_RETIREMENT:
        return GpuEvent(gpu, ecc, None, "DRAM page retirement / row remap pending (reset needed)", ts)
    if event_type & EV_RETIREMENT_FAILURE:
        return GpuEvent(gpu, ecc, None, "DRAM page retirement / row remap failed", ts)
    if event_type & (EV_POISON_FATAL | EV_POISON_NONFATAL):
        fatal = "fatal" if event_type & EV_POISON_FATAL else "contained"
        return GpuEvent(gpu, ecc, None, f"{fatal} memory poison error", ts)
    if event_type & EV_UNAVAILABLE:
        return GpuEvent(gpu, ErrorKind.GPU_DRIVER_ERROR, None, "GPU unavailable", ts)
    if event_type & EV_RECOVERY:
        action = recovery_action_name(int(event_data))
        return GpuEvent(
            gpu, ErrorKind.GPU_DRIVER_ERROR, None, f"driver requests recovery action {action}", ts,
            reportable=action != RECOVERY_NONE,
        )
    return None


class NvmlBackend(GpuBackend):
    """All GPUs NVML sees on this node. Raises :class:`GpuBackendUnavailable` without NVML/driver, and
    :class:`GpuError` when listing the GPUs fails otherwise."""

    name = "nvml"

    def __init__(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise GpuBackendUnavailable(f"NVML cannot start: {exc}") from exc
        self._closed = threading.Event()
        try:
            count = pynvml.nvmlDeviceGetCount()
            self._handles: list[Any | None] = []  # None: the GPU was lost already
            self._links: list[list[int]] = []
            self._event_sets: list[Any | None] = []
            self._gone: dict[int, str] = {}  # GPU -> why it could not be opened
            for gpu in range(count):
                self._open_gpu(gpu)
        except GpuError:  # a GPU's optional read failed (translated already)
            pynvml.nvmlShutdown()
            raise
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            if exc.value in _UNAVAILABLE:
                raise GpuBackendUnavailable(f"NVML cannot open the GPUs: {exc}") from exc
            raise translate_error(exc, "NVML setup") from exc

    def _open_gpu(self, gpu: int) -> None:
        """Open ``gpu``. One lost already (fallen off the bus, needing a reset, or not found: ``_GONE``)
        is kept without a handle: the agent starts, and the GPU's health polls raise GpuLost, which the
        monitor reports as it does for a GPU lost later. (Only GPU_IS_LOST was tolerated: one GPU
        needing a reset ended the whole node's agent before it registered.)"""
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
            links = self._active_links(gpu, handle)
            event_set = self._register_events(gpu, handle)  # last: nothing to free when the others fail
        except (pynvml.NVMLError, GpuLost) as exc:
            if isinstance(exc, pynvml.NVMLError) and exc.value not in _GONE:
                raise
            log.error("GPU lost already at agent start", gpu=gpu, error=str(exc))
            handle, links, event_set = None, [], None
            self._gone[gpu] = str(exc)
        self._handles.append(handle)
        self._links.append(links)
        self._event_sets.append(event_set)

    def _register_events(self, gpu: int, handle: Any) -> Any | None:
        supported = optional(f"GPU {gpu}: event types", pynvml.nvmlDeviceGetSupportedEventTypes, handle)
        mask = WANTED_EVENTS & (supported or 0)
        if not mask:
            log.warning("driver offers no error events; relying on health polls only", gpu=gpu)
            return None
        event_set = pynvml.nvmlEventSetCreate()
        try:
            pynvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
        except pynvml.NVMLError as exc:
            pynvml.nvmlEventSetFree(event_set)
            if exc.value not in _UNSUPPORTED:
                raise
            log.warning("cannot register error events; relying on health polls only", gpu=gpu, error=str(exc))
            return None
        return event_set

    def _active_links(self, gpu: int, handle: Any) -> list[int]:
        """Links active now: only these are watched, so a GPU that has NVLink hardware but no
        bridge (links never up) is not reported as faulty."""
        active: list[int] = []
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                state = pynvml.nvmlDeviceGetNvLinkState(handle, link)
            except pynvml.NVMLError as exc:
                if exc.value in (*_UNSUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                    continue  # no such link on this GPU
                raise
            if state == pynvml.NVML_FEATURE_ENABLED:
                active.append(link)
        log.info("watching NVLink links", gpu=gpu, links=active)
        return active

    def device_count(self) -> int:
        return len(self._handles)

    def wait_event(self, gpu: int, timeout_s: float) -> GpuEvent | None:
        event_set = self._event_sets[gpu]
        if event_set is None or self._closed.is_set():
            self._closed.wait(timeout_s)
            return None
        try:
            data = pynvml.nvmlEventSetWait_v2(event_set, max(1, int(timeout_s * 1000)))
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                return None
            raise translate_error(exc, f"GPU {gpu}: event wait") from exc
        return event_from_nvml(gpu, int(data.eventType), int(data.eventData), time.time())

    def health(self, gpu: int) -> GpuHealth:
        h = self._handles[gpu]
        if h is None:
            raise GpuLost(f"GPU {gpu}: lost since the agent started ({self._gone.get(gpu, 'no handle')})")
        ecc, volatile = pynvml.nvmlDeviceGetTotalEccErrors, pynvml.NVML_VOLATILE_ECC
        sbe = optional(f"GPU {gpu}: ECC", ecc, h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, volatile)
        dbe = optional(f"GPU {gpu}: ECC", ecc, h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, volatile)
        down = [
            link for link in self._links[gpu]
            if optional(f"GPU {gpu}: NVLink {link}", pynvml.nvmlDeviceGetNvLinkState, h, link)
            == pynvml.NVML_FEATURE_DISABLED
        ]
        pending = self._pending_retirement(gpu, h)
        action = self._recovery_action(gpu, h)
        return GpuHealth(gpu, is_healthy(dbe, down, pending, action), sbe, dbe, down, pending, action)

    def _pending_retirement(self, gpu: int, handle: Any) -> bool:
        # Pre-Ampere GPUs retire pages; Ampere and later remap rows. Either pending needs a reset.
        pages = optional(f"GPU {gpu}: retired pages", pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        rows = optional(f"GPU {gpu}: remapped rows", pynvml.nvmlDeviceGetRemappedRows, handle)
        return pages == pynvml.NVML_FEATURE_ENABLED or bool(rows and rows[2])

    def _recovery_action(self, gpu: int, handle: Any) -> str | None:
        if FIELD_RECOVERY_ACTION is None:
            return None
        fields = [FIELD_RECOVERY_ACTION]
        values = optional(f"GPU {gpu}: field values", pynvml.nvmlDeviceGetFieldValues, handle, fields)
        code = None if values is None else field_value_int(values[0])
        return None if code is None else recovery_action_name(code)

    def close(self) -> None:
        """Free the event sets and shut NVML down. Call after the monitor stopped (no thread may be
        blocked in ``nvmlEventSetWait`` on a set being freed)."""
        if self._closed.is_set():
            return
        self._closed.set()
        for event_set in self._event_sets:
            if event_set is not None:
                try:
                    pynvml.nvmlEventSetFree(event_set)
                except pynvml.NVMLError as exc:
                    log.warning("freeing an NVML event set failed", error=str(exc))
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.warning("nvmlShutdown failed", error=str(exc))


__all__ = [
    "FIELD_RECOVERY_ACTION",
    "RECOVERY_ACTIONS",
    "WANTED_EVENTS",
    "NvmlBackend",
    "event_from_nvml",
    "field_value_int",
    "optional",
    "recovery_action_name",
    "translate_error",
]
