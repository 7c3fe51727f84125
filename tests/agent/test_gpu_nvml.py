"""The NVML backend: what can run without a GPU (error handling, event and field decoding against
pynvml's real exception classes and ctypes structures), and a real-GPU test marked ``gpu``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.gpu import GpuError, GpuEvent, GpuLost, SimulatedBackend, nvml, open_backend
from agent.gpu.monitor import GpuMonitor
from unicron.kernel.errors import ConfigError
from unicron.kernel.types import ErrorKind


def _nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


HAVE_NVML = _nvml_works()
no_nvml = pytest.mark.skipif(HAVE_NVML, reason="NVML works here; the fallback path is not taken")


@no_nvml
def test_auto_falls_back_to_simulated_with_a_logged_reason(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="agent.gpu.factory"):
        backend = open_backend("auto", simulated_gpus=2)
    assert isinstance(backend, SimulatedBackend)
    assert backend.device_count() == 2 and backend.name == "simulated"
    assert "NVML cannot start" in caplog.text
    backend.close()


@no_nvml
def test_explicit_nvml_without_a_driver_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"UNICRON_GPU_BACKEND nvml: NVML cannot start.*--gpu-backend simulated"):
        open_backend("nvml")


AGENT_WITH_NVML = """
import sys, pynvml
def fail(*_):
    raise pynvml.NVMLError({code})
pynvml.{call} = fail
from agent.main import main
sys.exit(main(["--node", "n1", "--etcd", "127.0.0.1:1", "--advertise-host", "127.0.0.1", "--gpu-backend", "{kind}",
               "--run-dir", {run!r}, "--prefork", "", "--replica-budget-mb", "0"]))
"""


@pytest.mark.parametrize(("kind", "call", "code", "reason"), [
    ("nvml", "nvmlInit", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML cannot start: NVML Shared Library Not Found"),
    ("nvml", "nvmlInit", pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "NVML cannot start: RM has detected"),
    ("auto", "nvmlDeviceGetCount", pynvml.NVML_ERROR_UNKNOWN, "NVML setup: Unknown Error"),
], ids=["library-missing", "driver-mismatch", "count-fails"])
def test_an_nvml_that_cannot_start_ends_the_agent_with_one_line(tmp_path: Path, kind: str, call: str, code: int,
                                                                 reason: str) -> None:
    """GpuBackendUnavailable (or a GpuError listing the GPUs) came out of Agent.__init__ as a traceback,
    in a loop under systemd; now it is a ConfigError: one line saying what to check, exit 2."""
    if kind == "auto" and not HAVE_NVML:  # nvmlInit must succeed for the count to be asked
        script = AGENT_WITH_NVML.replace("pynvml.{call} = fail", "pynvml.nvmlInit = pynvml.nvmlShutdown = "
                                         "lambda: None\npynvml.{call} = fail")
    else:
        script = AGENT_WITH_NVML
    proc = subprocess.run([sys.executable, "-c", script.format(code=code, call=call, kind=kind, run=str(tmp_path))],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("{")]  # JSON log lines aside
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(f"unicron-agent: --gpu-backend / UNICRON_GPU_BACKEND {kind}: "), \
        proc.stderr
    assert reason in lines[0]


def test_unknown_backend_kind_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="auto"):
        open_backend("cuda")


@no_nvml
def test_an_nvml_call_that_fails_becomes_a_gpu_error() -> None:
    # A real NVML call without an initialised library fails with NVML_ERROR_UNINITIALIZED.
    with pytest.raises(GpuError, match="device count"):
        nvml.optional("device count", pynvml.nvmlDeviceGetCount)


def test_not_supported_reads_as_absent() -> None:
    def unsupported() -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    assert nvml.optional("ecc", unsupported) is None


def test_lost_gpu_is_distinguished() -> None:
    lost = nvml.translate_error(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST), "GPU 2: ECC")
    other = nvml.translate_error(pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN), "GPU 2: ECC")
    assert isinstance(lost, GpuLost) and "GPU 2: ECC" in str(lost)
    assert type(other) is GpuError


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_RESET_REQUIRED, pynvml.NVML_ERROR_GPU_NOT_FOUND])
def test_a_gpu_that_needs_a_reset_or_is_gone_is_lost(code: int) -> None:
    """Retrying cannot bring these back: they were transient errors, never reported."""
    assert isinstance(nvml.translate_error(pynvml.NVMLError(code), "GPU 1: ECC"), GpuLost)


def _nvml_error(code: int) -> Callable[..., Any]:
    def fail(*_: object) -> Any:
        raise pynvml.NVMLError(code)

    return fail


@pytest.mark.parametrize("lost", [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED,
                                  pynvml.NVML_ERROR_GPU_NOT_FOUND], ids=["lost", "reset-required", "not-found"])
@pytest.mark.parametrize("lost_in", ["nvmlDeviceGetHandleByIndex", "nvmlDeviceGetSupportedEventTypes"])
def test_a_gpu_lost_before_the_agent_starts_is_reported_not_fatal(monkeypatch: pytest.MonkeyPatch,
                                                                  lost_in: str, lost: int) -> None:
    """One GPU lost already (NVML_ERROR_GPU_IS_LOST while opening it) made the backend raise GpuLost,
    which open_backend let out: the agent crash-looped under systemd. The backend now opens; that GPU's
    health polls raise GpuLost, which the GPU monitor reports as for a GPU lost later. The same for a
    GPU needing a reset or no longer found (only GPU_IS_LOST was tolerated: one GPU answering
    RESET_REQUIRED took the whole node's agent down before it registered)."""
    for name, fn in {"nvmlInit": lambda: None, "nvmlShutdown": lambda: None, "nvmlDeviceGetCount": lambda: 2,
                     "nvmlDeviceGetHandleByIndex": lambda i: f"handle{i}",
                     "nvmlDeviceGetSupportedEventTypes": lambda h: 0,
                     "nvmlDeviceGetTotalEccErrors": lambda *_: 0}.items():
        monkeypatch.setattr(pynvml, name, fn)
    for name in ("nvmlDeviceGetNvLinkState", "nvmlDeviceGetRetiredPagesPendingStatus",
                 "nvmlDeviceGetRemappedRows", "nvmlDeviceGetFieldValues"):
        monkeypatch.setattr(pynvml, name, _nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED))
    real = getattr(pynvml, lost_in)
    monkeypatch.setattr(pynvml, lost_in, lambda h: _nvml_error(lost)() if h in (1, "handle1") else real(h))
    backend = open_backend("auto")
    try:
        assert backend.device_count() == 2
        assert backend.health(0).ok
        with pytest.raises(GpuLost, match="GPU 1"):
            backend.health(1)
        assert backend.wait_event(1, 0.01) is None
        events: list[GpuEvent] = []
        monitor = GpuMonitor(backend, on_event=events.append, on_health=lambda h: None, health_interval_s=0.05)
        monitor.start()
        try:  # reported once, as a GPU driver error (sev1): the node is taken out of service
            deadline = time.monotonic() + 10
            while not events and time.monotonic() < deadline:
                time.sleep(0.02)
            assert [(e.gpu, e.kind) for e in events] == [(1, ErrorKind.GPU_DRIVER_ERROR)]
        finally:
            monitor.stop()
    finally:
        backend.close()


def test_xid_event_decodes_through_the_xid_table() -> None:
    event = nvml.event_from_nvml(1, nvml.EV_XID, 79, ts=5.0)
    assert event is not None
    assert (event.gpu, event.kind, event.xid, event.reportable) == (1, ErrorKind.GPU_DRIVER_ERROR, 79, True)


def test_ecc_events_only_uncorrected_is_reportable() -> None:
    dbe = nvml.event_from_nvml(0, nvml.EV_DBE, 0, ts=1.0)
    sbe = nvml.event_from_nvml(0, nvml.EV_SBE, 0, ts=1.0)
    assert dbe is not None and sbe is not None
    assert dbe.kind is sbe.kind is ErrorKind.ECC_ERROR
    assert dbe.reportable and not sbe.reportable


def test_recovery_action_event() -> None:
    none = nvml.event_from_nvml(0, nvml.EV_RECOVERY, pynvml.NVML_GPU_RECOVERY_ACTION_NONE, ts=1.0)
    reboot = nvml.event_from_nvml(0, nvml.EV_RECOVERY, pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT, ts=1.0)
    assert none is not None and not none.reportable
    assert reboot is not None and reboot.reportable and "node_reboot" in reboot.message


def test_events_the_agent_does_not_act_on_are_dropped() -> None:
    assert nvml.event_from_nvml(0, pynvml.nvmlEventTypePState, 0, ts=1.0) is None


def test_field_value_decoding() -> None:
    fv = pynvml.c_nvmlFieldValue_t()
    fv.nvmlReturn = pynvml.NVML_SUCCESS
    fv.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    fv.value.uiVal = pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    assert nvml.field_value_int(fv) == 1
    assert nvml.recovery_action_name(1) == "gpu_reset"
    fv.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
    assert nvml.field_value_int(fv) is None


def test_unknown_recovery_action_keeps_its_number() -> None:
    assert nvml.recovery_action_name(99) == "unknown(99)"


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_NVML, reason="needs NVML and a GPU")
def test_real_gpus_answer_health_and_event_waits() -> None:
    backend = nvml.NvmlBackend()
    try:
        assert backend.device_count() >= 1
        health = backend.health(0)
        assert health.gpu == 0
        assert health.ok == (not health.ecc_dbe and not health.nvlink_down
                             and not health.retired_pages_pending
                             and health.recovery_action in (None, "none"))
        event = backend.wait_event(0, 0.05)  # a healthy GPU: normally a timeout
        assert event is None or event.gpu == 0
    finally:
        backend.close()
