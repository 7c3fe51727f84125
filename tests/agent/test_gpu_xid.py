"""The XID table: the mappings the design relies on, the informational set, unknown codes."""

from __future__ import annotations

import pytest

from agent.gpu import xid
from unicron.kernel.types import ErrorKind

# Mappings fixed by the design (issue 2): the kind decides the severity the coordinator applies.
EXPECTED = {
    79: ErrorKind.GPU_DRIVER_ERROR,
    48: ErrorKind.ECC_ERROR,
    63: ErrorKind.ECC_ERROR,
    64: ErrorKind.ECC_ERROR,
    94: ErrorKind.ECC_ERROR,
    95: ErrorKind.ECC_ERROR,
    74: ErrorKind.NVLINK_ERROR,
    31: ErrorKind.ILLEGAL_MEMORY_ACCESS,
    13: ErrorKind.CUDA_ERROR,
    43: ErrorKind.CUDA_ERROR,
    119: ErrorKind.GPU_DRIVER_ERROR,
    120: ErrorKind.GPU_DRIVER_ERROR,
    61: ErrorKind.GPU_DRIVER_ERROR,
    62: ErrorKind.GPU_DRIVER_ERROR,
}


@pytest.mark.parametrize(("code", "kind"), sorted(EXPECTED.items()))
def test_design_mappings(code: int, kind: ErrorKind) -> None:
    event = xid.event_for_xid(3, code, ts=12.5)
    assert (event.gpu, event.kind, event.xid, event.ts, event.reportable) == (3, kind, code, 12.5, True)
    assert f"XID {code}" in event.message


def test_preemptive_cleanup_is_informational() -> None:
    assert 45 in xid.INFORMATIONAL
    assert not xid.event_for_xid(0, 45).reportable


def test_informational_set_is_exactly_the_flagged_entries() -> None:
    flagged = {code for code, info in xid.XIDS.items() if info.informational}
    assert flagged == set(xid.INFORMATIONAL)
    assert not set(EXPECTED) & xid.INFORMATIONAL


def test_unknown_xid_is_a_reportable_driver_error_naming_the_code() -> None:
    code = 9999
    assert code not in xid.XIDS
    event = xid.event_for_xid(1, code, detail="pid=42")
    assert event.kind is ErrorKind.GPU_DRIVER_ERROR
    assert event.reportable
    assert "9999" in event.message and "pid=42" in event.message
