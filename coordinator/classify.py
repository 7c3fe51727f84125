"""Severity classification of reports into incidents, by paper Table 1 (``unicron.kernel.severity``).

GPU health events found by the agent's GPU monitor (XID / ECC / NVLink) arrive as
``EXCEPTION_PROPAGATION`` reports of kind ECC_ERROR / NVLINK_ERROR / GPU_DRIVER_ERROR /
INVALID_DMA_MAPPING and are covered by the same rows. DEGRADATION (a slow but completed iteration)
is recorded only: severity ``None``, no recovery action.
"""

from __future__ import annotations

from unicron.kernel.severity import FALLBACK_SEVERITY, TABLE1, severity_of
from unicron.kernel.types import Incident, Report

__all__ = ["FALLBACK_SEVERITY", "TABLE1", "classify", "severity_of"]

def classify(report: Report, detected_ts: float, incident_id: str) -> Incident:
    """Turn an agent's report into an incident; ``detected_ts`` is when the coordinator saw it."""
    return Incident(
        incident_id=incident_id,
        severity=severity_of(report.method, report.kind),
        method=report.method,
        kind=report.kind,
        node=report.node,
        message=report.message,
        task=report.task,
        gpu=report.gpu,
        rank=report.rank,
        step=report.step,
        source_ts=report.source_ts,
        detected_ts=detected_ts,
        report_id=report.report_id,
        handled=report.handled,
    )
