"""Error text -> Table 1 status: specific patterns win, unknown text is 'other software error'."""

from __future__ import annotations

import pytest

from unicron.kernel.patterns import classify_text, match
from unicron.kernel.types import ErrorKind as K


@pytest.mark.parametrize(("text", "kind"), [
    ("RuntimeError: CUDA error: an illegal memory access was encountered", K.ILLEGAL_MEMORY_ACCESS),
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered", K.ECC_ERROR),
    ("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.", K.GPU_DRIVER_ERROR),
    ("NCCL WARN NET/IB : Got completion with error 12, NVLink error", K.NVLINK_ERROR),
    ("[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)", K.NCCL_TIMEOUT),
    ("RuntimeError: CUDA error: device-side assert triggered", K.CUDA_ERROR),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:123",
     K.CONNECTION_REFUSED_RESET),
    ("ConnectionRefusedError: [Errno 111] Connection refused", K.CONNECTION_REFUSED_RESET),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1275, ncclSystemError",
     K.OTHER_NETWORK_ERROR),
    ("mlx5_core 0000:5e:00.0: Port module event: module 0, Cable plugged; link down", K.LINK_FLAPPING),
])
def test_known_error_text(text: str, kind: K) -> None:
    assert match(text) is kind
    assert classify_text(text) is kind


@pytest.mark.parametrize("text", ["", "KeyError: 'loss'", "\xff\xfe garbage \x00", "x" * 100_000])
def test_unknown_text_is_other_software_error_and_never_raises(text: str) -> None:
    assert match(text) is None
    assert classify_text(text) is K.OTHER_SOFTWARE_ERROR


# As torch's ProcessGroupNCCL watchdog and the kernel/NIC drivers print them.
NCCL_TIMEOUTS = [
    "[rank3]:[E801 07:19:37.123456789 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=1841, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) "
    "ran for 600042 milliseconds before timing out.",
    "[rank0]:[E801 07:19:38.000 ProcessGroupNCCL.cpp:1664] [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group "
    "watchdog thread terminated with exception: [Rank 0] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=5, OpType=BROADCAST, NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800095 milliseconds",
    "torch.distributed.DistBackendError: NCCL communicator was aborted on rank 1. Original reason for failure "
    "was: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLGATHER)",
]
LINK_FLAPS = [
    "mlx5_core 0000:5e:00.0 ib0: Link down",
    "NCCL WARN NET/IB : ib0:1 Got async event : port state change",
    "ixgbe 0000:03:00.0 eth2: NIC Link is Down",
    "bnxt_en 0000:3b:00.0 ens1f0: link flap detected",
]


@pytest.mark.parametrize("text", NCCL_TIMEOUTS)
def test_nccl_watchdog_timeouts(text: str) -> None:
    assert match(text) is K.NCCL_TIMEOUT


@pytest.mark.parametrize("text", LINK_FLAPS)
def test_link_flapping(text: str) -> None:
    assert match(text) is K.LINK_FLAPPING


# A healthy rank's informational logging on stderr (a pre-flight check, Python's logging): each was
# matched as a hardware fault (sev1: the node isolated) or an NCCL timeout before the patterns named
# the fault rather than the subsystem (review reproduction with a real agent).
BENIGN = [
    "INFO preflight: GPU 0 H100 80GB: ECC enabled, volatile uncorrected ECC errors: 0",
    "INFO preflight: GPU 0: 18 NVLink links active, bandwidth test passed",
    "WARNING preflight: gpu driver 535.104 is older than the recommended 550",
    "INFO trainer: NCCL timeout set to 1800 s",
    "NVLink errors: 0",
    "INFO gpu0: 0 uncorrected ECC errors",
    "INFO gpu0: no ECC errors found",
    "INFO 18 NVLink links active, 0 errors",
]


@pytest.mark.parametrize("text", BENIGN)
def test_informational_lines_name_no_fault(text: str) -> None:
    assert match(text) is None


@pytest.mark.parametrize(("text", "kind"), [
    ("Xid 48: Double Bit ECC Error on GPU 3", K.ECC_ERROR),
    ("GPU 2: ECC errors detected, page retirement pending", K.ECC_ERROR),
    ("NVRM: GPU at PCI:0000:3b:00: GPU has fallen off the bus.", K.GPU_DRIVER_ERROR),
    ("NVLink: fatal error detected on link 4", K.NVLINK_ERROR),
    ("Xid 74: NVLink failed on link 2", K.NVLINK_ERROR),
    ("NCCL WARN Timeout: collective timed out after 1800 s", K.NCCL_TIMEOUT),
    ("the gpu driver crashed", K.GPU_DRIVER_ERROR),
    # torch's C10D_NCCL_CHECK_TIMEOUT (NCCLUtils.hpp), and the abort that quotes it
    ("torch.distributed.DistBackendError: NCCL timeout in: ProcessGroupNCCL.cpp:1691", K.NCCL_TIMEOUT),
    ("RuntimeError: NCCL communicator was aborted on rank 3. Original reason for failure was: NCCL timeout",
     K.NCCL_TIMEOUT),
    ("NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, DBE (double bit error) ECC error", K.ECC_ERROR),
])
def test_faults_are_still_named(text: str, kind: K) -> None:
    assert match(text) is kind
