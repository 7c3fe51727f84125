"""Severity classification: paper Table 1 as one explicit table.

GPU health events found by the agent's GPU monitor (XID / ECC / NVLink) arrive as
``EXCEPTION_PROPAGATION`` reports of kind ECC_ERROR / NVLINK_ERROR / GPU_DRIVER_ERROR /
INVALID_DMA_MAPPING and are covered by the same rows. DEGRADATION (a slow but completed iteration)
is recorded only: severity ``None``, no recovery action.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from unicron.types import DetectionMethod, ErrorKind, Incident, Report, Severity

_M = DetectionMethod
_K = ErrorKind
_S = Severity

#: Paper Table 1, row by row.
TABLE1: Mapping[tuple[DetectionMethod, ErrorKind], Severity] = MappingProxyType(
    {
        (_M.NODE_HEALTH, _K.LOST_CONNECTION): _S.SEV1,
        (_M.PROCESS_SUPERVISION, _K.EXITED_ABNORMALLY): _S.SEV2,
        (_M.EXCEPTION_PROPAGATION, _K.CONNECTION_REFUSED_RESET): _S.SEV3,
        (_M.EXCEPTION_PROPAGATION, _K.ILLEGAL_MEMORY_ACCESS): _S.SEV2,
        (_M.EXCEPTION_PROPAGATION, _K.ECC_ERROR): _S.SEV1,
        (_M.EXCEPTION_PROPAGATION, _K.INVALID_DMA_MAPPING): _S.SEV1,
        (_M.EXCEPTION_PROPAGATION, _K.CUDA_ERROR): _S.SEV2,
        (_M.EXCEPTION_PROPAGATION, _K.NVLINK_ERROR): _S.SEV1,
        (_M.EXCEPTION_PROPAGATION, _K.GPU_DRIVER_ERROR): _S.SEV1,
        (_M.EXCEPTION_PROPAGATION, _K.OTHER_NETWORK_ERROR): _S.SEV3,
        (_M.EXCEPTION_PROPAGATION, _K.OTHER_SOFTWARE_ERROR): _S.SEV2,
        (_M.STATISTICAL_MONITORING, _K.NCCL_TIMEOUT): _S.SEV3,
        (_M.STATISTICAL_MONITORING, _K.LINK_FLAPPING): _S.SEV3,
        (_M.STATISTICAL_MONITORING, _K.TASK_HANG): _S.SEV2,
        (_M.STATISTICAL_MONITORING, _K.OTHER_SOFTWARE_ERROR): _S.SEV2,
    }
)

#: An unlisted (method, kind) pair is treated like the table's "other software errors" rows.
FALLBACK_SEVERITY = TABLE1[(_M.EXCEPTION_PROPAGATION, _K.OTHER_SOFTWARE_ERROR)]


def severity_of(method: DetectionMethod, kind: ErrorKind) -> Severity | None:
    """Table 1 lookup; ``None`` for DEGRADATION; never raises."""
    if kind is ErrorKind.DEGRADATION:
        return None
    found = TABLE1.get((method, kind))
    if found is not None:
        return found
    return TABLE1.get((method, ErrorKind.OTHER_SOFTWARE_ERROR), FALLBACK_SEVERITY)


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
