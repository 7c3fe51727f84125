"""The few c10d pieces the runtime uses, typed.

The runtime builds process groups directly (one set per epoch, under a fresh store prefix) rather than
through ``torch.distributed.init_process_group``: a job-wide default group dies with any rank. torch's
type stubs put the collective methods on ``ProcessGroup`` and not on the backends we construct, so
groups are typed by :class:`CommGroup`, the protocol of what we call on them.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllreduceOptions,
    HashStore,
    PrefixStore,
    ProcessGroupGloo,
    ReduceOp,
    TCPStore,
)

# c10d's key-value store of a task's rendezvous (the store sidecar); not unicron.kernel.etcd.Store
from torch._C._distributed_c10d import Store as RendezvousStore

__all__ = [
    "CPU", "CommGroup", "HashStore", "PrefixStore", "RendezvousStore", "TCPStore", "Work", "allreduce_max", "broadcast_flat",
    "broken_group",
    "ensure_torch_distributed", "group_keys", "new_group", "solo_group",
]

CPU = torch.device("cpu")
"""Where a rank's model and collective tensors live with gloo (``CommSettings.device``)."""


class Work(Protocol):
    def wait(self) -> Any: ...


class CommGroup(Protocol):
    def rank(self) -> int: ...

    def size(self) -> int: ...

    def abort(self) -> None: ...

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = ..., /) -> Work: ...

    def broadcast(self, tensor: torch.Tensor, root: int, /) -> Work: ...

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], /) -> Work: ...


def new_group(
    backend: str, store: RendezvousStore, prefix: str, rank: int, size: int, timeout_s: float
) -> CommGroup:
    """A process group of ``size`` ranks rendezvousing under ``prefix`` in ``store``."""
    scoped = PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":  # pragma: no cover - needs GPUs
        from torch._C._distributed_c10d import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return cast(CommGroup, ProcessGroupNCCL(scoped, rank, size, opts))
    return cast(CommGroup, ProcessGroupGloo(scoped, rank, size, timeout))


def group_keys(backend: str, prefix: str, rank: int) -> list[str]:
    """The store keys group member ``rank`` writes when a group rendezvouses under ``prefix``, for its
    owner to delete once nobody builds that group any more (each holds this rank's addresses for every
    peer: ~8 bytes a peer, so a group's keys grow as size²). gloo: one per device,
    ``<prefix>/<device>/<rank>``; the devices are ``GLOO_SOCKET_IFNAME``'s interfaces, else one (as
    torch's ``ProcessGroupGloo`` constructor reads it). NCCL writes one small unique id per
    communicator, not per rank: none listed."""
    if backend != "gloo":
        return []
    ifnames = os.environ.get("GLOO_SOCKET_IFNAME", "")
    devices = len(ifnames.split(",")) if len(ifnames) > 1 else 1
    return [f"{prefix}/{i}/{rank}" for i in range(devices)]


def broadcast_flat(
    group: CommGroup, root: int, tensors: Sequence[torch.Tensor], device: torch.device = CPU
) -> None:
    """Broadcast ``tensors`` from group index ``root`` into the others' ``tensors`` (same shapes and
    dtypes), one flat buffer per dtype on ``device`` (the group's: NCCL sends CUDA tensors only, and
    a state mixes devices, e.g. Adam's step counters stay on the CPU)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        ts = by_dtype[dtype]
        flat = torch.cat([t.reshape(-1).to(device) for t in ts]) if group.rank() == root else torch.empty(
            sum(t.numel() for t in ts), dtype=dtype, device=device
        )
        group.broadcast(flat, root).wait()
        offset = 0
        for t in ts:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def allreduce_max(group: CommGroup, tensor: torch.Tensor) -> None:
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MAX  # type: ignore[assignment]
    group.allreduce([tensor], opts).wait()


_SOLO: CommGroup | None = None
_BROKEN: CommGroup | None = None


def ensure_torch_distributed() -> None:
    """Megatron's helpers treat an uninitialised torch.distributed as "no groups at all" (``None``);
    give the process a private one-rank default group. It never communicates: the runtime's real
    groups are built per epoch, because a job-wide default group dies with any rank."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)


def solo_group() -> CommGroup:
    """A one-rank group for the parallel dimensions this runtime does not split (pp, cp, ...)."""
    global _SOLO
    ensure_torch_distributed()
    if _SOLO is None:
        _SOLO = new_group("gloo", HashStore(), "unicron-solo", 0, 1, 60.0)
    return _SOLO


def broken_group() -> CommGroup:
    """Placeholder that takes a released group's place (in the model and in
    :class:`~unicron.runtime.membership.Groups`) until the next epoch's group is bound."""
    global _BROKEN
    ensure_torch_distributed()
    if _BROKEN is None:
        _BROKEN = new_group("gloo", HashStore(), "unicron-broken", 0, 1, 60.0)
    return _BROKEN
