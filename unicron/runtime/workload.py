"""A small real workload for the control-plane tests and the detection benchmark.

A multi-process torch.distributed (gloo) loop: each iteration sleeps for a jittered compute time
and all-reduces a tensor, reporting every iteration and any exception to the agent through
:class:`unicron.kernel.client.AgentClient`. With ``--tp N`` consecutive ranks form tensor-parallel
groups that all-reduce halfway through the compute, inside the compute phase, as Megatron's layers do
(a hung rank's partners then wait there, reporting no collective phase). The full Megatron training runtime is ``unicron train``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import time

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from unicron.kernel import protocol
from unicron.kernel.client import AgentClient


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m unicron.runtime.workload")
    p.add_argument("--iterations", type=int, default=0, help="0: run until stopped")
    p.add_argument("--iter-time", type=float, default=0.1, help="mean seconds of 'compute' per iteration")
    p.add_argument("--jitter", type=float, default=0.2, help="uniform +- fraction of --iter-time")
    p.add_argument("--tp", type=int, default=1, help="ranks per tensor-parallel group (consecutive ranks)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    client = AgentClient.from_env().connect()
    client.install_excepthook()
    if os.environ.get("UNICRON_EXTERNAL_STORE") == "1":
        # The agent hosts the store (a sidecar that outlives any rank); ranks are its clients.
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=120))
        # Every rank must agree on the prefix: take rank 0's (published under a fixed key).
        key = f"workload/g{os.environ.get('UNICRON_GENERATION', '0')}/prefix"
        if int(os.environ["RANK"]) == 0:
            store.set(key, prefix_name := f"p{time.time_ns()}")
        else:
            prefix_name = store.get(key).decode()
        prefix = PrefixStore(prefix_name, store)
        dist.init_process_group("gloo", store=prefix, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group("gloo", init_method="env://")
    rank = int(os.environ.get("RANK", "0"))
    rng = random.Random(rank)
    tp_group = _tp_group(rank, dist.get_world_size(), args.tp)
    x, y = torch.ones(1024), torch.ones(16)
    step = 0
    while args.iterations == 0 or step < args.iterations:
        with client.iteration(step):
            compute_s = args.iter_time * (1 + rng.uniform(-args.jitter, args.jitter))
            time.sleep(compute_s / 2)
            if tp_group is not None:
                dist.all_reduce(y, group=tp_group)
            time.sleep(compute_s / 2)
            with client.phase(protocol.PHASE_COLLECTIVE):
                dist.all_reduce(x)
            x.div_(dist.get_world_size())
        step += 1
    dist.destroy_process_group()
    client.close()
    return 0


def _tp_group(rank: int, world: int, tp: int) -> dist.ProcessGroup | None:
    """This rank's tensor-parallel group (every rank creates every group, in the same order)."""
    if tp <= 1:
        return None
    if world % tp:
        raise SystemExit(f"--tp {tp} does not divide the world size {world}; pick a divisor")
    groups: list[dist.ProcessGroup] = [dist.new_group(list(range(first, first + tp))) for first in range(0, world, tp)]
    return groups[rank // tp]


if __name__ == "__main__":
    raise SystemExit(main())
