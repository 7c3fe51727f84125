"""The few c10d pieces the runtime uses, typed.

The runtime builds process groups directly (one set per epoch, under a fresh store prefix) rather than
through ``torch.distributed.init_process_group``: a job-wide default group dies with any rank. torch's
type stubs put the collective methods on ``ProcessGroup`` and not on the backends we construct, so
groups are typed by :class:`CommGroup`, the protocol of what we call on them.
"""

from __future__ import annotations

import datetime
from typing import Any, Protocol, cast

import torch
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
    "CommGroup", "HashStore", "PrefixStore", "RendezvousStore", "TCPStore", "Work", "allreduce_max", "new_group",
]


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


def allreduce_max(group: CommGroup, tensor: torch.Tensor) -> None:
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MAX  # type: ignore[assignment]
    group.allreduce([tensor], opts).wait()
