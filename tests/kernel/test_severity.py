"""Paper Table 1 (unicron.kernel.severity), row by row, and its fallbacks."""

from __future__ import annotations

import pytest

from unicron.kernel.severity import FALLBACK_SEVERITY, TABLE1, method_of, severity_of
from unicron.kernel.types import DetectionMethod, ErrorKind, Severity

M = DetectionMethod
K = ErrorKind
S = Severity

# Transcribed from the paper's Table 1, independently of the module's table (tests/coordinator/test_causes.py
# imports it to check the coordinator's classification row by row).
PAPER_TABLE1 = [
    (M.NODE_HEALTH, K.LOST_CONNECTION, S.SEV1),
    (M.PROCESS_SUPERVISION, K.EXITED_ABNORMALLY, S.SEV2),
    (M.EXCEPTION_PROPAGATION, K.CONNECTION_REFUSED_RESET, S.SEV3),
    (M.EXCEPTION_PROPAGATION, K.ILLEGAL_MEMORY_ACCESS, S.SEV2),
    (M.EXCEPTION_PROPAGATION, K.ECC_ERROR, S.SEV1),
    (M.EXCEPTION_PROPAGATION, K.INVALID_DMA_MAPPING, S.SEV1),
    (M.EXCEPTION_PROPAGATION, K.CUDA_ERROR, S.SEV2),
    (M.EXCEPTION_PROPAGATION, K.NVLINK_ERROR, S.SEV1),
    (M.EXCEPTION_PROPAGATION, K.GPU_DRIVER_ERROR, S.SEV1),
    (M.EXCEPTION_PROPAGATION, K.OTHER_NETWORK_ERROR, S.SEV3),
    (M.EXCEPTION_PROPAGATION, K.OTHER_SOFTWARE_ERROR, S.SEV2),
    (M.STATISTICAL_MONITORING, K.NCCL_TIMEOUT, S.SEV3),
    (M.STATISTICAL_MONITORING, K.LINK_FLAPPING, S.SEV3),
    (M.STATISTICAL_MONITORING, K.TASK_HANG, S.SEV2),
    (M.STATISTICAL_MONITORING, K.OTHER_SOFTWARE_ERROR, S.SEV2),
]


def test_table_has_exactly_the_papers_rows() -> None:
    assert dict(TABLE1) == {(m, k): s for m, k, s in PAPER_TABLE1}


@pytest.mark.parametrize("kind", [K.ECC_ERROR, K.NVLINK_ERROR, K.GPU_DRIVER_ERROR, K.INVALID_DMA_MAPPING])
def test_gpu_monitor_events_are_node_level(kind: ErrorKind) -> None:
    # the agent's GPU monitor (XID / ECC / NVLink) reports through exception propagation
    assert severity_of(M.EXCEPTION_PROPAGATION, kind) is S.SEV1


@pytest.mark.parametrize("method", list(M))
def test_degradation_is_recorded_only(method: DetectionMethod) -> None:
    assert severity_of(method, K.DEGRADATION) is None


def test_unlisted_pairs_fall_back_to_other_software_errors_and_never_raise() -> None:
    listed = {(m, k) for m, k, _ in PAPER_TABLE1}
    for method in M:
        for kind in K:
            if (method, kind) in listed or kind is K.DEGRADATION:
                continue
            assert severity_of(method, kind) is FALLBACK_SEVERITY is S.SEV2, (method, kind)


@pytest.mark.parametrize("kind", [K.NCCL_TIMEOUT, K.LINK_FLAPPING])
@pytest.mark.parametrize("observed", [M.EXCEPTION_PROPAGATION, M.STATISTICAL_MONITORING])
def test_nccl_timeouts_and_link_flapping_are_sev3_however_they_arrive(kind: ErrorKind, observed: DetectionMethod) -> None:
    # Before: a stderr line or an exception report carried EXCEPTION_PROPAGATION and fell back to sev2.
    assert severity_of(observed, kind) is (S.SEV3 if observed is M.STATISTICAL_MONITORING else S.SEV2)
    assert method_of(observed, kind) is M.STATISTICAL_MONITORING
    assert severity_of(method_of(observed, kind), kind) is S.SEV3


@pytest.mark.parametrize("kind", [k for k in K if k not in (K.NCCL_TIMEOUT, K.LINK_FLAPPING, K.TASK_HANG)])
def test_other_kinds_keep_the_method_they_were_observed_by(kind: ErrorKind) -> None:
    for method in M:
        assert method_of(method, kind) is method
