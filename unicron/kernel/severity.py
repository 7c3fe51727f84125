"""Paper Table 1 — detection method x error status -> severity — as one explicit table.

Shared by the coordinator (which classifies every report with it) and the training runtime (which
handles sev3 faults in place), so it lives here rather than in either.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from unicron.kernel.types import DetectionMethod, ErrorKind, Severity

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


#: Kinds that Table 1 lists under statistical monitoring only: NCCL timeouts, link flapping, hangs.
TIMEOUT_KINDS: frozenset[ErrorKind] = frozenset(
    k for (m, k) in TABLE1 if m is _M.STATISTICAL_MONITORING and k is not _K.OTHER_SOFTWARE_ERROR
)


def method_of(observed: DetectionMethod, kind: ErrorKind) -> DetectionMethod:
    """The detection method a report of ``kind`` carries, given how the agent ``observed`` it.

    Table 1 files NCCL timeouts and link flapping under statistical monitoring (sev3): they are
    timeouts, found by a watchdog timer (NCCL's, or the link's), and only *arrive* as a line in a
    rank's stderr, an exception report, or a kernel log line. Read that way they must keep the
    table's severity; under "exception propagation" they would fall back to sev2 (a restart where the
    paper reattempts in place). Every other kind keeps the method it was observed by.
    """
    return _M.STATISTICAL_MONITORING if kind in TIMEOUT_KINDS else observed
