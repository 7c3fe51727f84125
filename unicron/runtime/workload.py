"""A small real workload for the control-plane tests and the detection benchmark.

A multi-process torch.distributed (gloo) loop: each iteration sleeps for a jittered compute time
and all-reduces a tensor, reporting every iteration and any exception to the agent through
:class:`unicron.kernel.client.AgentClient`. The full Megatron training runtime is ``unicron train``.
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
    rng = random.Random(int(os.environ.get("RANK", "0")))
    x = torch.ones(1024)
    step = 0
    while args.iterations == 0 or step < args.iterations:
        with client.iteration(step):
            time.sleep(args.iter_time * (1 + rng.uniform(-args.jitter, args.jitter)))
            with client.phase(protocol.PHASE_COLLECTIVE):
                dist.all_reduce(x)
            x.div_(dist.get_world_size())
        step += 1
    dist.destroy_process_group()
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
