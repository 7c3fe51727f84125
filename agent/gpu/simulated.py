"""A GPU backend whose faults a test harness triggers (tests, benchmarks, GPU-less nodes).

Events are delivered through a condition variable: a thread blocked in :meth:`wait_event` wakes the
moment :meth:`inject_xid` / :meth:`inject_ecc` is called, so the simulated path has the latency of
a real NVML event wait (no polling). Health reflects injected state until :meth:`repair`.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from agent.gpu.api import RECOVERY_NONE, GpuBackend, GpuError, GpuEvent, GpuHealth, GpuLost, is_healthy
from agent.gpu.xid import event_for_xid
from unicron.kernel.errors import ConfigError
from unicron.kernel.types import ErrorKind


@dataclass
class _GpuState:
    cond: threading.Condition
    events: deque[GpuEvent] = field(default_factory=deque)
    wakeups: int = 0
    ecc_sbe: int = 0
    ecc_dbe: int = 0
    nvlink_down: set[int] = field(default_factory=set)
    retired_pages_pending: bool = False
    recovery_action: str = RECOVERY_NONE
    lost: bool = False
    health_errors: int = 0


class SimulatedBackend(GpuBackend):
    """``gpus`` simulated GPUs, healthy until a fault is injected."""

    name = "simulated"

    def __init__(self, gpus: int) -> None:
        if gpus < 0:
            raise ConfigError(f"simulated_gpus must be >= 0, got {gpus}")
        self._lock = threading.Lock()
        self._gpus = [_GpuState(threading.Condition(self._lock)) for _ in range(gpus)]
        self._closed = False

    def device_count(self) -> int:
        return len(self._gpus)

    def _state(self, gpu: int) -> _GpuState:
        if not 0 <= gpu < len(self._gpus):
            raise ConfigError(f"gpu index {gpu} out of range: {len(self._gpus)} simulated GPU(s)")
        return self._gpus[gpu]

    # --- backend interface -----------------------------------------------------------------------

    def wait_event(self, gpu: int, timeout_s: float) -> GpuEvent | None:
        st = self._state(gpu)
        with st.cond:
            seen = st.wakeups
            st.cond.wait_for(lambda: bool(st.events) or self._closed or st.wakeups != seen, timeout_s)
            if self._closed or not st.events:
                return None
            return st.events.popleft()

    def health(self, gpu: int) -> GpuHealth:
        st = self._state(gpu)
        with self._lock:
            if st.lost:
                raise GpuLost(f"GPU {gpu} is lost (simulated)")
            if st.health_errors > 0:
                st.health_errors -= 1
                raise GpuError(f"GPU {gpu}: health query failed (simulated)")
            down = sorted(st.nvlink_down)
            return GpuHealth(
                gpu=gpu,
                ok=is_healthy(st.ecc_dbe, down, st.retired_pages_pending, st.recovery_action),
                ecc_sbe=st.ecc_sbe,
                ecc_dbe=st.ecc_dbe,
                nvlink_down=down,
                retired_pages_pending=st.retired_pages_pending,
                recovery_action=st.recovery_action,
            )

    def interrupt(self) -> None:
        with self._lock:
            for st in self._gpus:
                st.wakeups += 1
                st.cond.notify_all()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for st in self._gpus:
                st.cond.notify_all()

    # --- fault injection -------------------------------------------------------------------------

    def _push(self, st: _GpuState, event: GpuEvent) -> None:
        st.events.append(event)
        st.cond.notify_all()

    def inject_xid(self, gpu: int, code: int, detail: str = "") -> GpuEvent:
        """The driver reports XID ``code`` on ``gpu`` (as NVML's XID-critical event would)."""
        st = self._state(gpu)
        event = event_for_xid(gpu, code, detail=detail)
        with self._lock:
            self._push(st, event)
        return event

    def inject_ecc(self, gpu: int, double_bit: bool = True) -> GpuEvent:
        """An ECC error on ``gpu``: double-bit (uncorrected, a fault) or single-bit (corrected, logged)."""
        st = self._state(gpu)
        what = "double-bit (uncorrected)" if double_bit else "single-bit (corrected)"
        event = GpuEvent(gpu, ErrorKind.ECC_ERROR, None, f"{what} ECC error", reportable=double_bit)
        with self._lock:
            if double_bit:
                st.ecc_dbe += 1
            else:
                st.ecc_sbe += 1
            self._push(st, event)
        return event

    def set_nvlink_down(self, gpu: int, link: int, down: bool = True) -> None:
        """NVLink ``link`` of ``gpu`` goes down (or back up with ``down=False``); seen by health polls."""
        st = self._state(gpu)
        with self._lock:
            if down:
                st.nvlink_down.add(link)
            else:
                st.nvlink_down.discard(link)

    def set_retired_pages_pending(self, gpu: int, pending: bool = True) -> None:
        """A page retirement / row remap is pending on ``gpu`` (seen by health polls)."""
        st = self._state(gpu)
        with self._lock:
            st.retired_pages_pending = pending

    def set_recovery_action(self, gpu: int, action: str) -> None:
        """The driver asks for ``action`` ("gpu_reset", "node_reboot", ... or "none") on ``gpu``."""
        st = self._state(gpu)
        with self._lock:
            st.recovery_action = action

    def set_lost(self, gpu: int, lost: bool = True) -> None:
        """``gpu`` stops answering health queries (fell off the bus) until ``lost=False``."""
        st = self._state(gpu)
        with self._lock:
            st.lost = lost

    def fail_health(self, gpu: int, times: int = 1) -> None:
        """The next ``times`` health queries of ``gpu`` fail with a transient :class:`GpuError`."""
        st = self._state(gpu)
        with self._lock:
            st.health_errors += times

    def repair(self, gpu: int) -> None:
        """``gpu`` was reset: counters and injected faults cleared, pending events dropped."""
        st = self._state(gpu)
        with self._lock:
            st.events.clear()
            st.ecc_sbe = st.ecc_dbe = 0
            st.nvlink_down.clear()
            st.retired_pages_pending = st.lost = False
            st.recovery_action = RECOVERY_NONE
            st.health_errors = 0
